"""train.py's `--torchcompile` step traced as inductor runs it: its graphs, what they save, what their kernels write.

`compiled_for_trace` compiles the task's model (`task.compile`, as train.py does) with a backend that does what
inductor does before code generation, on the trace's fake tensors: TorchDynamo captures the graphs (graph breaks
included), AOTAutograd traces them with inductor's decompositions (`torch._inductor.decomposition.
select_decomp_table`) and splits forward from backward with inductor's partitioner (`torch._inductor.compile_fx.
partition_fn`, the min-cut rematerialization that decides what the forward saves and honours `torch._functorch.
config.activation_memory_budget`); an eval forward gets the inference graph. Each graph then runs as `BufferRun`:
node by node on fake tensors, a node's output counted only where inductor writes it to memory
(`timm_ext.memory_model.inductor_fusion.plan_buffers`), each buffer freed after its last reader, the graph's inputs
released as inductor's generated code releases them. The trace's trackers (`LiveBytes`, `EventLog`, `KernelSizes`)
ignore compilation and see what the graphs run, so the event log, the CUDA kernels' workspaces and the allocator
replay treat a compiled step as an eager one.

Modelled: the inductor backend; backends that run their graphs with aten ops (eager, aot_eager and its variants) run
as themselves. Not modelled, and said in the plan (`unmodelled`): CUDA graphs (`--torchcompile-mode` reduce-overhead
and max-autotune; planned without them, as the probe runs), the scheduler's reordering for peak memory, and the
backends that need a device or an outside compiler (cudagraphs, tvm, ...: planned as eager). What CUDA graphs would
change, as torch 2.14.1's CUDA graph trees allocate (`torch/_inductor/cudagraph_trees.py`): one `CUDAGraphTreeManager`
per device holds one memory pool (`graph_pool_handle`) that every graph of the step warms up and records into, forward,
backward and the graphs between graph breaks alike; each input that is not a parameter, a buffer or an earlier graph's
output gets a static copy in that pool (`_allocate_and_copy_recording_inputs`), refilled at every replay; and the pool
keeps its segments, and the last replay's outputs, from one step to the next, outside what the caching allocator
lends the rest of the step.
"""
import contextlib
from typing import Dict, Iterator, List

import torch
from torch import fx
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .inductor_fusion import channels_last_inputs, plan_buffers
from .kernel_limits import COMPILED_TENSOR, KernelSizes
from .live_bytes import LiveBytes

__all__ = ['compiled_for_trace', 'unmodelled', 'is_compile_error', 'BufferRun']

_GRAPH_MODES = ('reduce-overhead', 'max-autotune')
# backends that compile for a device or an outside compiler, which fake tensors cannot run: planned as eager
_DEVICE_BACKENDS = ('cudagraphs', 'tvm', 'openxla', 'openxla_eval', 'ts', 'aot_ts', 'onnxrt')


def unmodelled(backend: str, mode: str) -> List[str]:
    """What of a `--torchcompile backend --torchcompile-mode mode` step the trace does not model, a phrase each."""
    if backend != 'inductor':
        return [f'the {backend} backend (planned as eager)'] if backend in _DEVICE_BACKENDS else []
    notes = ['the scheduler reordering kernels for peak memory']
    if mode in _GRAPH_MODES:
        notes.insert(0, f'{mode}\'s CUDA graphs (planned without them, as the probe runs; CUDA graph trees, '
                        'torch/_inductor/cudagraph_trees.py, record every graph of the step into one memory pool per '
                        'device, with a static copy of each input that is no parameter, buffer or earlier graph\'s '
                        'output, and the pool keeps its segments and the last outputs between steps)')
    return notes


def is_compile_error(error: BaseException) -> bool:
    """Whether an error came from TorchDynamo or the backend compiling (not from an op the fake tensors ran)."""
    import torch._dynamo.exc
    return isinstance(error, torch._dynamo.exc.TorchDynamoException)


class BufferRun:
    """Run an AOTAutograd graph on fake tensors, counting only the buffers inductor writes (boxed: takes a list).

    Args:
        graph_module: The forward, backward or inference graph.
        device_type: The device whose lowering thresholds decide the fusion ('cuda' or 'cpu').
    """
    def __init__(self, graph_module: fx.GraphModule, device_type: str, inference: bool = False,
                 backward: bool = False):
        self._boxed_call = True  # an instance attribute: the wrappers AOTAutograd puts around it copy `__dict__`
        self.graph = graph_module.graph
        self.plans = plan_buffers(self.graph, device_type)
        # the backward receives the forward's copies as they were saved
        self.channels_last = {} if backward else channels_last_inputs(graph_module, device_type, inference)
        self.inputs = [n for n in self.graph.nodes if n.op == 'placeholder']
        self.last_reader: Dict[fx.Node, List[fx.Node]] = {}
        seen = set()
        for node in reversed(self.graph.nodes):
            for a in node.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    self.last_reader.setdefault(node, []).append(a)

    def __call__(self, args: list):
        env = dict(zip(self.inputs, args))
        args.clear()  # the inputs (saved activations in the backward) go as the graph stops reading them
        held: Dict[fx.Node, dict] = {}  # the buffers an inlined node reads, alive while it is
        trackers = _active(LiveBytes)
        largest = 0
        for node in self.graph.nodes:
            if node.op == 'output':
                for kernels in _active(KernelSizes):
                    kernels.note(COMPILED_TENSOR, largest)
                return fx.node.map_arg(node.args[0], env.__getitem__)
            if node.op == 'call_function':
                for a in self.channels_last.get(node, ()):  # layout optimization: the input copied to channels-last
                    if not env[a].is_contiguous(memory_format=torch.channels_last):
                        # a buffer of the copy's size read in its place (and saved where the input is), its layout
                        # kept: the graph's views were traced on the contiguous one
                        env[a] = torch.empty_like(env[a])
                plan = self.plans[node]
                writes = plan.realized and plan.inplace_of is None
                with _not_filing(trackers) if not writes else contextlib.nullcontext():
                    out = node.target(*fx.node.map_arg(node.args, env.__getitem__),
                                      **fx.node.map_arg(node.kwargs, env.__getitem__))
                env[node] = out
                if isinstance(out, torch.Tensor):
                    largest = max(largest, out.numel())
                if plan.inplace_of is not None or not plan.realized:
                    reads = {}  # the realized buffers it reads, directly or through the inlined nodes it reads
                    for a in node.all_input_nodes:
                        reads.update(held.get(a, {}))  # an in-place input brings the buffer it writes
                        if self.plans[a].realized:
                            reads[a] = env[a]
                    # an inlined node keeps what it reads alive; one written in place keeps the buffer it took
                    held[node] = reads if plan.inplace_of is None else {plan.inplace_of: reads[plan.inplace_of]}
            for a in self.last_reader.get(node, ()):
                env.pop(a, None)
                held.pop(a, None)
        raise ValueError('a graph without an output node')


def _active(cls: type) -> list:
    """The dispatch modes of a class on the current stack."""
    return [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, cls)]


@contextlib.contextmanager
def _not_filing(trackers: List[LiveBytes]) -> Iterator[None]:
    for tracker in trackers:
        tracker.filing = False
    try:
        yield
    finally:
        for tracker in trackers:
            tracker.filing = True


def _backend(device_type: str):
    """A torch.compile backend: inductor up to code generation, each graph run by `BufferRun`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    def compiler(graph_module: fx.GraphModule, example_inputs) -> BufferRun:
        return BufferRun(graph_module, device_type)

    def backward_compiler(graph_module: fx.GraphModule, example_inputs) -> BufferRun:
        return BufferRun(graph_module, device_type, backward=True)

    def inference_compiler(graph_module: fx.GraphModule, example_inputs) -> BufferRun:
        return BufferRun(graph_module, device_type, inference=True)
    return aot_autograd(fw_compiler=compiler, bw_compiler=backward_compiler, inference_compiler=inference_compiler,
                        partition_fn=partition_fn, decompositions=select_decomp_table())


@contextlib.contextmanager
def compiled_for_trace(task: torch.nn.Module, backend: str, device_type: str) -> Iterator[None]:
    """Compile `task` (train.py's `task.compile`) for the trace: inductor as `BufferRun`s, a backend that runs its
    graphs with aten ops (eager, aot_eager...) as itself, one that needs a device or an outside compiler not at all."""
    import torch._dynamo
    if backend in _DEVICE_BACKENDS:
        yield
        return
    torch._dynamo.reset()
    task.compile(backend=_backend(device_type) if backend == 'inductor' else backend)
    # one graph for every traced batch: the warm-up's batch would compile a graph of its own, the next batch a
    # dynamic one (automatic dynamic shapes), and a dynamic graph traces the bytes of static ones (measured within
    # 0.3% on resnet18, convnext_atto, vit_small and efficientnet_b0)
    hooks = [m.register_forward_pre_hook(_batch_dynamic) for m in task.modules()
             if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        torch._dynamo.reset()


def _batch_dynamic(module: torch.nn.Module, args: tuple) -> None:
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
        torch._dynamo.mark_dynamic(args[0], 0)
