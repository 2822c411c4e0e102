"""What the savers priced without a trace of their own read from the run's traced step, besides its bytes.

* FLOPs: `torch.utils.flop_counter.FlopCounterMode` registers module hooks (its `ModuleTracker`) that would add ops to
  the event log, so counting with it costs a step of its own. `FlopCount` applies the same formulas (the module's
  `flop_registry`, keyed by each op's overload packet and called with the op's arguments and `out_val`, as
  `FlopCounterMode._count_flops` calls them) from a plain dispatch mode that creates no tensor, so it runs inside a
  traced step: the event log sees the same ops with it or without it.
* The weights' roles (`weight_storages`): which stored bytes are parameters the optimizer steps, the EMA copy, or
  buffers, in the order the trace files them (`timm_ext.memory_model.live_bytes.LiveBytes`: one entry a storage).
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils.flop_counter import flop_registry

from .live_bytes import TraceMode

__all__ = ['FlopCount', 'weight_storages']


class FlopCount(TraceMode):
    """The total FLOPs (`total`) of the ops run while the mode is active.

    FlopCounterMode also tries `func.decompose` on an op it has no formula for; an op that reaches a dispatch mode
    after autograd has no implicit decomposition left in the steps traced here, so the totals agree (a test compares
    them).
    """

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def weight_storages(weights: Sequence[torch.Tensor], trainable: Sequence[torch.Tensor],
                    ema: Optional[torch.nn.Module]) -> List[Tuple[int, str]]:
    """(bytes, role) of each storage of `weights` once, in order, as the trace files them: 'ema' (in `ema`),
    'trainable' (in `trainable`) or 'fixed'."""
    ema_keys = {id(t.untyped_storage()) for t in [*ema.parameters(), *ema.buffers()]} if ema is not None else set()
    trainable_keys = {id(p.untyped_storage()) for p in trainable}
    seen, storages = set(), []
    for tensor in weights:
        storage = tensor.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            role = 'ema' if id(storage) in ema_keys else 'trainable' if id(storage) in trainable_keys else 'fixed'
            storages.append((storage.nbytes(), role))
    return storages
