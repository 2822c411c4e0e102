"""The FLOPs of a traced step, counted by `torch.utils.flop_counter.FlopCounterMode` in a step of its own.

The counter attributes FLOPs to modules through `torch.utils.module_tracker.ModuleTracker`, whose forward hooks put an
autograd hook (`register_multi_grad_hook`) on each module input and output that requires grad. Under `torch.no_grad`
(validate.py's forward as the estimate traces it) a view of a weight, such as a class token's `expand` that CaiT's
class-attention blocks take as input, still requires grad yet has no grad_fn, and autograd refuses the hook
(`torch/autograd/graph.py`, `_get_grad_fn_or_grad_acc`: "Expected gradient function to be set"). A forward-only step
is therefore counted with the weights frozen: it asks autograd for nothing, so the count is the same.
"""
import contextlib
from typing import Callable, Iterable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ['step_flops']


@contextlib.contextmanager
def _frozen(weights: Iterable[torch.Tensor]) -> Iterator[None]:
    """`requires_grad` off for `weights` while the block runs, on again after."""
    thawed = [w for w in weights if w.requires_grad]
    for weight in thawed:
        weight.requires_grad_(False)
    try:
        yield
    finally:
        for weight in thawed:
            weight.requires_grad_(True)


def step_flops(step: Callable[[int], None], batch_size: int, frozen: Iterable[torch.Tensor] = ()) -> float:
    """The FLOPs `step(batch_size)` runs, with `frozen` (a forward-only step's weights) not requiring grad meanwhile.

    Run it outside the memory trace: the counter's module hooks would add ops to the tracked logs.
    """
    counter = FlopCounterMode(display=False)
    with counter, _frozen(frozen):
        step(batch_size)
    return counter.get_total_flops()
