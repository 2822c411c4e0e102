"""The compiled step on fake tensors (`timm_ext.memory_model.compiled_step`): what its graphs hold, against eager."""
import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from timm_ext.memory_model.compiled_step import compiled_for_trace, is_compile_error, unmodelled
from timm_ext.memory_model.live_bytes import LiveBytes

BATCH, WIDTH, HIDDEN = 32, 64, 256


class _Task(nn.Module):
    """What `compiled_for_trace` needs of timm's task: `compile` wraps the trainable module, as ClassificationTask's."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.trainable_module = module

    def compile(self, backend, mode=None):
        self.trainable_module = torch.compile(self.trainable_module, backend=backend, mode=mode)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)) * 2 + 1)


def _forward_peak(compiled: bool) -> int:
    """The activations' peak of a forward without gradients (weights excluded)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _Mlp()
        task = _Task(model)
        with compiled_for_trace(task, 'inductor', 'cuda') if compiled else contextlib.nullcontext():
            tracker = LiveBytes(model.parameters(), [*model.parameters()])
            x = torch.randn(BATCH, WIDTH)
            with tracker, torch.no_grad():
                tracker.reset_peak()
                task.trainable_module(x)
            return tracker.peak['activations']


def test_a_compiled_forward_holds_one_hidden_buffer_where_eager_holds_two():
    """Eager: gelu's output lives next to fc1's, then the product next to it. Compiled: gelu, * 2 and + 1 fuse into
    one kernel that reads fc1's output and writes it in place (inplace_buffers), which fc2 then reads."""
    hidden, out = BATCH * HIDDEN * 4, BATCH * WIDTH * 4
    assert _forward_peak(compiled=False) == 2 * hidden
    assert _forward_peak(compiled=True) == hidden + out


def test_a_compiled_update_files_its_gradients_and_frees_what_the_forward_saved():
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _Mlp()
        task = _Task(model)
        with compiled_for_trace(task, 'inductor', 'cuda'):
            tracker = LiveBytes(model.parameters(), [*model.parameters()])
            with tracker:
                task.trainable_module(torch.randn(BATCH, WIDTH)).sum().backward()
                assert tracker.peak['activations'] > 0
            assert tracker.live['gradients'] == sum(p.numel() * 4 for p in model.parameters())
            assert tracker.live['activations'] == 0 and tracker.live['temporaries'] == 0


class _FixedBatch(nn.Module):
    """A model whose code fixes the batch: the reshape's literal size specializes TorchDynamo's batch symbol."""

    def forward(self, x):
        return (x * 2).reshape(BATCH, -1).sum(1)


def test_a_model_that_fixes_the_batch_is_specialized_not_refused():
    """The batch is marked dynamic so that one graph serves every traced batch; a model whose code fixes it got
    "ConstraintViolationError: Constraints violated (L['x'].size()[0])" (resnet18's compiled plan priced at 64 px)
    where TorchDynamo in the run specializes the graph and goes on."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        task = _Task(_FixedBatch())
        with compiled_for_trace(task, 'inductor', 'cuda'):
            for batch in (BATCH, 2 * BATCH):
                assert task.trainable_module(torch.randn(batch, WIDTH)).shape == (BATCH,)


def test_the_plan_names_what_a_compiled_step_does_not_model():
    assert unmodelled('eager', None) == []
    assert unmodelled('aot_eager', None) == []  # its graphs run on the fake tensors as they are
    assert unmodelled('tvm', None) == ['the tvm backend (planned as eager)']
    graphs = unmodelled('inductor', 'reduce-overhead')
    assert 'CUDA graph' in graphs[0] and len(graphs) == len(unmodelled('inductor', None)) + 1


def test_a_backend_that_fails_to_compile_is_told_apart_from_an_op_fake_tensors_refuse():
    """A real compile failure (torch's relu_compile_error_TESTING_ONLY backend refuses graphs with torch.relu): the
    estimate names the compile in its one line (`is_compile_error`)."""
    class Relu(nn.Module):
        def forward(self, x):
            return torch.relu(x) + 1
    with FakeTensorMode(allow_non_fake_inputs=True):
        task = _Task(Relu())
        with compiled_for_trace(task, 'relu_compile_error_TESTING_ONLY', 'cpu'):
            with pytest.raises(Exception) as failed:
                task.trainable_module(torch.randn(4, 4))
    assert is_compile_error(failed.value)
    assert not is_compile_error(RuntimeError('an op fake tensors cannot run'))


def test_a_torch_without_torch_compile_is_refused_in_one_line():
    """torch.compile arrived in torch 2.0 (release_history.TORCH_COMPILE): a plan of 1.13 cannot compile."""
    from timm_ext.memory_model.compiled_step import compile_problem
    from timm_ext.memory_model.versions import parse_software
    problem = compile_problem('inductor', parse_software('torch=1.13.1'))
    assert problem.startswith('--torchcompile: torch 1.13.1 has no torch.compile') and '\n' not in problem
    assert compile_problem('inductor', parse_software('torch=2.0.1')) is None
    assert compile_problem(None, parse_software('torch=1.13.1')) is None


def _compiled_trace(step_kind: str, *flags: str):
    """A compiled AMP step of train.py traced in this process for an RTX 4090 at 32 px, batches 2 and 4."""
    from timm_ext.memory_model import estimate
    from timm_ext.train.args import parse_args
    args, _ = parse_args(['--img-size', '32', '--device', 'cuda', '--amp', '--torchcompile', '--num-classes', '10',
                          *flags])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    args.gpu = 'rtx4090'
    return estimate._trace(args, estimate.run_device(args, 'cuda'), (2, 4), step_kind)


def test_an_evaluation_trace_compiles_the_forward_alone(monkeypatch):
    """train.py's evaluation is traced after one warm-up update, there for the optimizer state it leaves. Run eager,
    it leaves the same state; run compiled, it compiled the training forward and backward a second time (beside the
    training trace's own), which cost a compiled resnet50 plan 47.5 s where it now takes 41.5 s."""
    import torch._inductor.compile_fx as compile_fx

    graphs = []
    inner = compile_fx.compile_fx_inner
    monkeypatch.setattr(compile_fx, 'compile_fx_inner', lambda gm, *a, **k: graphs.append(gm) or inner(gm, *a, **k))
    traced = _compiled_trace('eval', '--model', 'test_resnet')
    assert len(graphs) == 1  # the inference graph
    assert traced.peak(4) > 0


def test_a_compiled_update_with_stochastic_depth_lowers_for_the_card():
    """Stochastic depth's `bernoulli` stays whole when AOTAutograd decomposes on CPU tensors, and CUDA lowering
    refused it ("this should be handled in decomps unless config.fallback_random"): FasterNet, FocalNet and
    EfficientFormer-V2 failed the compiled zoo's training trace."""
    assert _compiled_trace('train', '--model', 'test_vit', '--drop-path', '0.1').peak(4) > 0
