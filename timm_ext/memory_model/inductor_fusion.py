"""Which tensors of a compiled graph inductor writes to memory, read from the installed torch's lowering rules.

Inductor turns an AOTAutograd graph into kernels: extern kernels (matmul, convolution, the ops it falls back to) read
and write real buffers, while pointwise ops and the ops feeding a reduction are inlined into the kernel that reads them
and never exist on their own. `plan_buffers` marks each node of a graph the way `torch._inductor.graph.GraphLowering.
run_node` and `torch._inductor.ir.StorageBox` decide it:

* extern: an op lowered in `torch._inductor.kernel` (mm, bmm, addmm, convolution), one in `lowering.fallbacks` or in
  `lowering.needs_realized_inputs`, or one without a lowering: its output is a buffer and its inputs are realized;
* reduction (`torch.Tag.reduction`): its output is realized (`lowering.make_reduction`); what it reads is inlined;
* view: no buffer of its own (it reads its base's);
* pointwise: inlined, unless a graph output reads it, one of several users is an extern kernel, it is read by several
  users and `should_realize_on_reuse`
  holds (more reads than `config.realize_reads_threshold`, a body larger than the opcount threshold, and on CPU a
  heavy op or more users than `config.realize_opusers_threshold`), or it has accumulated more reads than the
  accumulated-reads threshold (`has_exceeded_max_reads`).

An inlined node's realized inputs live as long as the node's readers (`FusedNode.reads`). A realized pointwise or
reduction output may take the buffer of an input of the same size that nothing reads afterwards (`config.
inplace_buffers`; `FusedNode.inplace_of`). Not modelled: the scheduler's reordering for peak memory and its removal of
buffers whose readers all fuse into one kernel (both can only lower the peak).
"""
import contextlib
import operator
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Set

import torch
from torch import fx

__all__ = ['FusedNode', 'plan_buffers', 'op_kind', 'channels_last_inputs']

aten = torch.ops.aten
# lowered as views though their schemas do not say so (torch/_inductor/lowering.py registers them with `view`)
_VIEW_OPS = {aten._unsafe_view.default, aten.reshape.default, operator.getitem}
# ops whose reuse realizes a CPU buffer (torch/_inductor/ir.py, StorageBox.should_realize_on_reuse, `heavy_ops`)
_CPU_HEAVY_OPS = {aten.exp.default, aten.log.default, aten.log10.default, aten.log1p.default, aten.log2.default,
                  aten.sigmoid.default, aten.tanh.default}
# a body this large is realized whatever its users (GraphLowering.run_node: `has_large_inner_fn(threshold=100)`)
_RECURSION_OPCOUNT = 100


@dataclass
class FusedNode:
    """What inductor makes of one graph node.

    Attributes:
        kind: 'extern', 'reduction', 'view', 'pointwise' or 'input' (placeholders).
        realized: Its output is a buffer of its own.
        reads: The realized nodes an inlined node reads (they stay alive while it is read).
        ops: The pointwise ops inlined into it (itself included).
        inplace_of: A realized input whose buffer it takes (same size, read by nothing after it).
    """
    kind: str
    realized: bool = False
    reads: Set[fx.Node] = field(default_factory=set)
    ops: int = 0
    inplace_of: Optional[fx.Node] = None


def op_kind(target: object) -> str:
    """Inductor's treatment of an op: 'view', 'extern', 'reduction' or 'pointwise' (see the module doc)."""
    from torch._inductor import lowering
    if target in _VIEW_OPS or getattr(target, 'is_view', False):
        return 'view'
    lowered = lowering.lowerings.get(target)
    if (lowered is None or target in lowering.fallbacks or target in lowering.needs_realized_inputs
            or getattr(lowered, '__module__', '').startswith('torch._inductor.kernel')):
        return 'extern'
    if torch.Tag.reduction in getattr(target, 'tags', ()):
        return 'reduction'
    return 'pointwise'


def _thresholds(device_type: str) -> Dict[str, int]:
    """The realization thresholds `torch._inductor.ir` reads from `torch._inductor.config` for a device."""
    from torch._inductor import config
    cpu = device_type == 'cpu'
    opcount = config.realize_opcount_threshold
    acc_reads = config.realize_acc_reads_threshold
    return dict(reads=config.realize_reads_threshold, opusers=config.realize_opusers_threshold,
                opcount=opcount if opcount is not None else
                config.realize_cpu_opcount_threshold if cpu else config._realize_opcount_threshold_default,
                acc_reads=acc_reads if acc_reads is not None else
                config.realize_cpu_acc_reads_threshold if cpu else config._realize_acc_reads_threshold_default)


def _realize_on_reuse(plan: FusedNode, users: int, heavy: bool, limits: Dict[str, int], cpu: bool) -> bool:
    """`StorageBox.should_realize_on_reuse` for an inlined pointwise node read by `users` nodes."""
    if users <= 1:
        return False
    if cpu and (heavy or (users > limits['opusers'] and plan.ops > max(0, limits['opcount'] - 2))):
        return True
    return plan.ops > limits['opcount'] or len(plan.reads) > limits['reads']


def plan_buffers(graph: fx.Graph, device_type: str) -> Dict[fx.Node, FusedNode]:
    """Mark each node of an AOTAutograd graph realized or inlined, as inductor lowers it for `device_type`."""
    limits, cpu = _thresholds(device_type), device_type == 'cpu'
    plans: Dict[fx.Node, FusedNode] = {}
    heavy: Dict[fx.Node, bool] = {}
    outputs = {a for n in graph.nodes if n.op == 'output' for a in n.all_input_nodes}
    for node in graph.nodes:
        if node.op == 'placeholder':
            plans[node] = FusedNode('input', realized=True)
        if node.op != 'call_function':
            continue
        inputs = [a for a in node.all_input_nodes if a in plans]
        kind = op_kind(node.target)
        plan = plans[node] = FusedNode(kind)
        if kind == 'view':
            continue
        if kind == 'extern':
            for a in inputs:
                _realize(plans, a)
            plan.realized = True
            continue
        for a in inputs:  # an inlined input brings its reads and ops; a realized one is read
            src = _base(plans, a)
            if plans[src].realized:
                plan.reads.add(src)
            else:
                plan.reads |= plans[src].reads
                plan.ops += plans[src].ops
        plan.ops += 1
        heavy[node] = node.target in _CPU_HEAVY_OPS or any(heavy.get(_base(plans, a), False) for a in inputs
                                                           if not plans[_base(plans, a)].realized)
        users = len(node.users)
        read_by_extern = users > 1 and any(u.op == 'call_function' and op_kind(u.target) == 'extern' for u in node.users)
        plan.realized = (kind == 'reduction' or read_by_extern or (node in outputs and bool(plan.reads))
                         or _realize_on_reuse(plan, users, heavy[node], limits, cpu)
                         or len(plan.reads) > limits['acc_reads'] or plan.ops > limits['opcount']
                         or plan.ops > _RECURSION_OPCOUNT)
    for node in outputs:
        _realize(plans, node)
    _settle_reads(graph, plans)
    _plan_inplace(graph, plans)
    return plans


def _base(plans: Dict[fx.Node, FusedNode], node: fx.Node) -> fx.Node:
    """The node whose buffer a view reads (itself when it is no view)."""
    while plans[node].kind == 'view' and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _realize(plans: Dict[fx.Node, FusedNode], node: fx.Node) -> None:
    """Realize a node read by an extern kernel or a graph output (a view realizes its base)."""
    base = _base(plans, node)
    plan = plans[base]
    if not plan.realized and plan.kind != 'view':
        plan.realized = True
        plan.ops = plan.ops or 1


def _settle_reads(graph: fx.Graph, plans: Dict[fx.Node, FusedNode]) -> None:
    """Each node's reads once every realization is known (a node realized by a later reader is read, not inlined,
    by all its readers)."""
    for node in graph.nodes:
        plan = plans.get(node)
        if plan is None or plan.kind in ('input', 'extern'):
            continue
        plan.reads = set()
        for a in node.all_input_nodes:
            src = _base(plans, a)
            plan.reads |= {src} if plans[src].realized else plans[src].reads


def _plan_inplace(graph: fx.Graph, plans: Dict[fx.Node, FusedNode]) -> None:
    """Give a realized pointwise or reduction node an input buffer nothing reads after it (`inplace_buffers`)."""
    from torch._inductor import config
    if not config.inplace_buffers:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_reader: Dict[fx.Node, int] = {}
    outputs: Set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == 'output':
            outputs |= {_base(plans, a) for a in node.all_input_nodes if a in plans}
            continue
        if node not in plans or not plans[node].realized:
            continue
        for a in _read_buffers(plans, node):
            last_reader[a] = order[node]
    taken: Set[fx.Node] = set()
    for node in graph.nodes:
        plan = plans.get(node)
        if plan is None or not plan.realized or plan.kind not in ('pointwise', 'reduction'):
            continue
        for a in sorted(plan.reads, key=order.get):
            if (plans[a].kind not in ('input', 'view') and a not in outputs and a not in taken
                    and last_reader.get(a) == order[node] and _same_bytes(a, node)):
                plan.inplace_of = a
                taken.add(a)
                break


def _same_bytes(a: fx.Node, b: fx.Node) -> bool:
    """Whether two nodes' outputs are known to take the same bytes (sizes may be symbolic)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    va, vb = a.meta.get('val'), b.meta.get('val')
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    return statically_known_true(va.numel() * va.element_size() == vb.numel() * vb.element_size())


def channels_last_inputs(graph_module: fx.GraphModule, device_type: str, inference: bool) -> Dict[fx.Node, List[fx.Node]]:
    """The graph inputs a convolution reads in channels-last when inductor optimizes the layout: convolution node ->
    its input and weight placeholders, copied in channels-last before it (none where the layout is not optimized).

    `GraphLowering.decide_layout_opt` decides, as train.py's run compiles: its batch static (the trace's batch is
    dynamic, which that function would take for a reason to skip), oneDNN as the run has it on the CPU and never on
    CUDA. The generated code then copies each such input (the image, the convolution weights) to channels-last at
    each call, and a training forward saves the copies for the backward.
    """
    from unittest import mock

    from torch._inductor import graph as lowering_graph
    mkldnn = torch.backends.mkldnn.enabled if device_type == 'cpu' else False
    try:
        with mock.patch.object(lowering_graph, 'has_free_symbols', lambda value: False), \
                _mkldnn_enabled(mkldnn):
            optimized = lowering_graph.GraphLowering.decide_layout_opt(graph_module, is_inference=inference)
    except Exception:  # a graph the heuristic cannot read (symbolic FLOPs): inductor keeps the layout
        optimized = False
    if not optimized:
        return {}
    copies: Dict[fx.Node, List[fx.Node]] = {}
    seen: Set[fx.Node] = set()
    for node in graph_module.graph.nodes:
        if node.op == 'call_function' and node.target is aten.convolution.default:
            for a in node.args[:2]:
                if isinstance(a, fx.Node) and a.op == 'placeholder' and a not in seen and _layout_differs(a):
                    seen.add(a)
                    copies.setdefault(node, []).append(a)
    return copies


@contextlib.contextmanager
def _mkldnn_enabled(enabled: bool) -> Iterator[None]:
    """oneDNN on or off while the block runs, nothing else touched (`torch.backends.mkldnn.flags` also sets oneDNN's
    TF32 flag, and setting it in a build without Intel GPU support prints torch's "TF32 acceleration on top of oneDNN"
    UserWarning)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def _layout_differs(node: fx.Node) -> bool:
    """Whether a 4-d tensor's channels-last order differs from its contiguous one (channels and pixels both > 1)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    value = node.meta.get('val')
    return (isinstance(value, torch.Tensor) and value.dim() == 4 and not statically_known_true(value.shape[1] == 1)
            and not statically_known_true(value.shape[2] * value.shape[3] == 1))


def _read_buffers(plans: Dict[fx.Node, FusedNode], node: fx.Node) -> List[fx.Node]:
    """The realized buffers a realized node's kernel reads."""
    plan = plans[node]
    if plan.kind == 'extern':
        return [_base(plans, a) for a in node.all_input_nodes if a in plans]
    return list(plan.reads)
