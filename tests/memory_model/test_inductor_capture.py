"""Inductor's own pipeline for a named card without a GPU (`fake_cuda`, `inductor_capture`, `wrapper_run`)."""
import pytest
import timm
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.driver import driver as triton_driver

from timm_ext.memory_model import wrapper_run
from timm_ext.memory_model.cards import CARDS, find_card
from timm_ext.memory_model.fake_cuda import device_properties, fake_cuda
from timm_ext.memory_model.inductor_capture import compiling_for_trace, inductor_backend

BATCH = 8


def test_every_card_has_the_properties_inductor_reads():
    for card in CARDS.values():
        props = device_properties(card)
        assert props.multi_processor_count > 0 and (props.major, props.minor) == card.compute_capability
        assert props.shared_memory_per_block_optin <= props.shared_memory_per_multiprocessor
    assert device_properties(find_card('rtx4090')).multi_processor_count == 128  # AD102 as the 4090 ships it


def test_the_fake_card_is_gone_when_the_block_ends():
    queries = (torch.cuda.is_available, torch.cuda.get_device_properties, torch.cuda.get_rng_state)
    driver = triton_driver._active
    with fake_cuda(find_card('h100-80gb')) as props:
        assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        assert torch.cuda.get_device_properties(0) is props
        assert triton_driver.active.get_current_target().arch == 90
    assert (torch.cuda.is_available, torch.cuda.get_device_properties, torch.cuda.get_rng_state) == queries
    assert triton_driver._active is driver
    assert not torch.cuda.is_available()  # this machine has no GPU


class _GraphPeaks(TorchDispatchMode):
    """The peak of the buffers one wrapper call makes (its inputs not counted), as inductor's estimate counts."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in inputs if isinstance(t, torch.Tensor)}
        self.live, self.peak, self.padding = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.inputs and ref.cdata not in self.live:
                    self.live = {k: v for k, v in self.live.items() if not v[1].expired()}
                    self.live[ref.cdata] = (t.untyped_storage().nbytes(), ref)
                    self.padding += t.untyped_storage().nbytes() - t.numel() * t.element_size()
                    self.peak = max(self.peak, sum(v[0] for v in self.live.values()))
        return out


def _inductor_estimate(graph) -> int:
    """torch/_inductor/memory.py's `estimate_peak_memory` over the scheduled nodes of the graph being generated."""
    from torch._inductor.memory import estimate_peak_memory, prepare_planning_info
    from torch._inductor.utils import OrderedSet
    from torch._inductor.virtualized import V
    scheduler = graph.scheduler
    outputs = OrderedSet(graph.get_output_names())
    with V.set_graph_handler(graph):
        prepare_planning_info(scheduler.nodes, scheduler.name_to_buf, scheduler.name_to_fused_node,
                              OrderedSet(graph.graph_inputs.keys()), outputs)
        return estimate_peak_memory(scheduler.nodes, {}, outputs)[0]


@pytest.mark.parametrize('model_name, train', [('test_resnet', True), ('test_convnext', False), ('test_vit', True),
                                               ('test_efficientnet', False)])
def test_the_wrapper_holds_at_most_what_inductors_own_count_says(monkeypatch, model_name, train):
    """Inductor's `estimate_peak_memory` counts each scheduled buffer from its definition to its last use; the
    generated wrapper also reuses a freed buffer for a later one of the same size (`# reuse`), so the run of the
    wrapper holds as much or less, graph by graph (forward, backward). What it counts is each buffer's elements: the
    strides inductor pads on CUDA (`config.comprehensive_padding`) allocate more, which the wrapper's run includes
    (test_resnet's training forward: 16 KiB above the count, none with the padding off)."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V
    counted, held = [], []
    monkeypatch.setattr(GraphLowering, 'save_output_code', staticmethod(lambda code: counted.append(
        _inductor_estimate(V.graph))))
    run = wrapper_run.WrapperRun.__call__

    def measured(self, args):
        with _GraphPeaks(args) as peaks:
            outputs = run(self, args)
        held.append((peaks.peak, peaks.padding))
        return outputs
    monkeypatch.setattr(wrapper_run.WrapperRun, '__call__', measured)
    model = timm.create_model(model_name)
    size = model.pretrained_cfg['input_size'][1:]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, compiling_for_trace():
        model = model.to_empty(device='cpu').train(train)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=inductor_backend(find_card('rtx4090')), dynamic=False)
        with torch.autocast('cpu', dtype=torch.float16), torch.set_grad_enabled(train):
            out = compiled(torch.randn(BATCH, 3, *size))
        if train:
            out.float().sum().backward()
        torch._dynamo.reset()
    assert mode is not None and len(counted) == len(held) == (2 if train else 1)
    for (wrapper, padding), inductor in zip(held, counted):
        assert 0 < wrapper <= inductor + padding


def test_a_process_that_used_a_real_gpu_is_never_patched(monkeypatch):
    """The estimate traces in a child of its own; where it would run in a process holding a CUDA context, the card's
    stand-ins would answer that process's own queries: refused, with nothing patched."""
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: True)
    available = torch.cuda.is_available
    with pytest.raises(RuntimeError, match='has used a real GPU'):
        with fake_cuda(find_card('rtx4090')):
            pass
    assert torch.cuda.is_available is available
