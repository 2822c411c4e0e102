"""The realization rules of a compiled graph (`timm_ext.memory_model.inductor_fusion`), each against its source."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from timm_ext.memory_model.inductor_fusion import op_kind, plan_buffers

aten = torch.ops.aten


def _plans(fn, *shapes, device_type='cuda'):
    """Plans by op name (the first node of each op), for `fn` traced on fake tensors of `shapes`."""
    graph = make_fx(fn, tracing_mode='fake')(*[torch.randn(s) for s in shapes]).graph
    plans = plan_buffers(graph, device_type)
    named = {}
    for node, plan in plans.items():
        if node.op == 'call_function':
            named.setdefault(str(node.target).removeprefix('aten.'), plan)
    return named, plans


def test_op_kinds_follow_the_lowering_registry():
    """torch/_inductor/kernel/mm.py and conv.py lower mm and convolution to extern kernels; lowering.py registers add
    with make_pointwise, sum as a reduction (Tag.reduction), falls back on CPU flash attention, and views alias."""
    assert op_kind(aten.mm.default) == 'extern'
    assert op_kind(aten.convolution.default) == 'extern'
    assert op_kind(aten._scaled_dot_product_flash_attention_for_cpu.default) == 'extern'
    assert op_kind(aten.add.Tensor) == 'pointwise'
    assert op_kind(aten.sum.dim_IntList) == 'reduction'
    assert op_kind(aten.permute.default) == 'view'
    assert op_kind(aten._unsafe_view.default) == 'view'


def test_a_pointwise_chain_is_inlined_into_the_output():
    """GraphLowering.run_node: a single-user pointwise node stays a loop body; the graph output is realized."""
    named, _ = _plans(lambda x: torch.relu(x * 2 + 1), (8, 8))
    assert not named['mul.Tensor'].realized and not named['add.Tensor'].realized
    assert named['relu.default'].realized
    assert named['relu.default'].ops == 3  # the inlined body: mul, add, relu


def test_an_extern_kernel_realizes_its_input_and_a_reduction_its_output():
    """ExternKernel.realize_input realizes what mm reads; lowering.make_reduction realizes a reduction."""
    named, _ = _plans(lambda x, w: torch.mm(x.sin(), w).sum(1) * 3, (8, 8), (8, 8))
    assert named['sin.default'].realized and named['mm.default'].realized
    assert named['sum.dim_IntList'].realized


def test_reuse_realizes_a_node_with_many_reads():
    """StorageBox.should_realize_on_reuse: with two users, a body reading more than config.realize_reads_threshold
    (4) buffers is realized; one reading fewer is recomputed in each user."""
    def many(a, b, c, d, e):
        y = a + b + c + d + e
        return y.sum(0), y.amax(0)

    def few(a, b):
        y = a + b
        return y.sum(0), y.amax(0)
    assert _plans(many, *[(8, 8)] * 5)[0]['add.Tensor'].realized is False  # the first add reads two
    last_add = [p for n, p in _plans(many, *[(8, 8)] * 5)[1].items() if n.name == 'add_3'][0]
    assert last_add.realized and len(last_add.reads) == 5
    assert not _plans(few, (8, 8), (8, 8))[0]['add.Tensor'].realized


def test_the_thresholds_are_torch_inductor_config():
    """The threshold is read from torch._inductor.config at planning time, not copied."""
    from torch._inductor import config

    def fn(a, b, c):
        y = a + b + c
        return y.sum(0), y.amax(0)
    node = lambda plans: [p for n, p in plans.items() if n.name == 'add_1'][0]  # noqa: E731
    assert not node(_plans(fn, *[(8, 8)] * 3)[1]).realized
    with config.patch(realize_reads_threshold=2):
        assert node(_plans(fn, *[(8, 8)] * 3)[1]).realized


def test_accumulated_reads_realize_on_cuda_sooner_than_on_cpu():
    """StorageBox.has_exceeded_max_reads: more than _realize_acc_reads_threshold_default (8) reads on CUDA, more than
    realize_cpu_acc_reads_threshold (12) on the CPU, realize a body even with a single user."""
    def fn(*xs):
        y = xs[0]
        for x in xs[1:]:
            y = y + x
        return torch.mm(y.t(), xs[0])
    ninth = lambda plans: [p for n, p in plans.items() if n.name == 'add_7'][0]  # noqa: E731 (reads 9 inputs)
    cuda, cpu = ninth(_plans(fn, *[(8, 8)] * 10)[1]), ninth(_plans(fn, *[(8, 8)] * 10, device_type='cpu')[1])
    assert cuda.realized and len(cuda.reads) == 9
    assert not cpu.realized


def test_a_heavy_op_reused_is_realized_on_the_cpu_only():
    """should_realize_on_reuse's CPU rule: a reused body with exp (a 'heavy op') is realized."""
    def fn(x):
        y = x.exp()
        return y.sum(0), y.amax(0)
    assert _plans(fn, (8, 8), device_type='cpu')[0]['exp.default'].realized
    assert not _plans(fn, (8, 8))[0]['exp.default'].realized


def test_a_realized_node_takes_the_buffer_its_last_reader_frees():
    """config.inplace_buffers: relu writes into mm's output of the same size, which nothing reads afterwards."""
    named, _ = _plans(lambda x, w: torch.mm(torch.relu(torch.mm(x, w)), w), (8, 8), (8, 8))
    relu = named['relu.default']
    assert relu.realized and relu.inplace_of is not None and relu.inplace_of.target is aten.mm.default
    # a smaller output (a reduction) cannot take its input's buffer
    assert _plans(lambda x, w: torch.mm(x, w).sum(1), (8, 8), (8, 8))[0]['sum.dim_IntList'].inplace_of is None


def _conv_graph(channels: int):
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module
    model = torch.nn.Sequential(torch.nn.Conv2d(3, channels, 3), torch.nn.Conv2d(channels, channels, 1),
                                torch.nn.Conv2d(channels, channels, 3))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=keep))(torch.randn(2, 3, 16, 16))
    torch._dynamo.reset()
    return graphs[0]


def test_layout_optimization_copies_the_image_and_the_spatial_weights_to_channels_last():
    """GraphLowering.decide_layout_opt (its batch taken static, as train.py compiles): on the CPU with oneDNN it
    optimizes any graph with a convolution; on CUDA it skips one whose convolutions all have 64 channels or fewer.
    The copies: the image (3 channels) and the 3x3 weights; a 1x1 weight is the same in both layouts."""
    from timm_ext.memory_model.inductor_fusion import channels_last_inputs
    graph = _conv_graph(128)
    with torch.backends.mkldnn.flags(enabled=True):
        copies = channels_last_inputs(graph, 'cpu', inference=True)
    copied = [tuple(a.meta['val'].shape) for inputs in copies.values() for a in inputs]
    assert (2, 3, 16, 16) in copied and (128, 3, 3, 3) in copied and (128, 128, 3, 3) in copied
    assert (128, 128, 1, 1) not in copied
    assert channels_last_inputs(graph, 'cuda', inference=False)  # 128 channels: not all small
    assert not channels_last_inputs(_conv_graph(32), 'cuda', inference=False)
