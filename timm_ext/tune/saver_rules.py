"""Savers priced from the run's own trace: each a stated rule on the run's estimate, no trace of its own.

A saver that does not change which ops run, only where or how their bytes live, is read off the run's traced step
(`timm_ext.memory_model.estimate.MemoryEstimate`: its category lines, its CUDA event log, the weights' roles):

* channels-last (`same_layout_bytes`): every tensor keeps its bytes (channels_last permutes strides, not sizes), so
  the lines and the log are the run's. What differs, and how it is taken: the kernel launch limits read the layout,
  and a depthwise convolution's channels-last input takes the channels-last route of the run's release
  (`timm_ext.memory_model.kernel_limits.as_channels_last`); the input's channels-last copy at the start of the step is not modelled
  (one input batch, freed before the forward's peak); where a LayerNorm's permuted input becomes contiguous, CUDA's
  layer_norm copy it needed goes (not modelled: the row keeps the run's copies, an overestimate).
* opt-sgd (`momentum_sgd`): the optimizer state of the run replaced by one momentum buffer per trainable parameter,
  its bytes (timm's SGD: momentum 0.9, nesterov; the buffer is a clone of the first gradient). The run's optimizer
  step's temporaries are kept: single-tensor Adam's and SGD's each hold about one parameter's bytes at a time.
* model-ema-force-cpu (`host_ema`): the EMA copy's weights leave the device; its update then runs on the host (the
  device-side update is in place and allocates nothing).
* the other AMP dtype (`savers.price_savers`): float16 and bfloat16 autocast cast the same ops (autocast's op lists
  are per device, not per dtype; CUDA's float32 list, `timm_ext.memory_model.autocast_casts`, too) to 2-byte
  elements, and float16's loss scaler is left out of every trace, so one trace prices both.

Expandable segments replay the run's own log on an allocator that has them (`savers.price_savers`).
"""
import copy
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from ..memory_model.estimate import MemoryEstimate
from ..memory_model.kernel_limits import as_channels_last
from ..memory_model.predict import CudaReplay

__all__ = ['RuleError', 'same_layout_bytes', 'momentum_sgd', 'host_ema']

MOMENTUM_OP, MOMENTUM_WHERE = 'clone.default', 'step'  # how the SGD momentum buffer's allocation is tagged


class RuleError(ValueError):
    """The run's trace does not hold what the rule reads (no weights' roles, a log whose residents do not start
    with the weights)."""


def _rounding(base: MemoryEstimate, sizes: Sequence[int]) -> int:
    """What the device's allocator adds to these storages (the 'allocator' category)."""
    return sum(base.device.allocated(None, (), n) - n for n in sizes)


def _with_lines(base: MemoryEstimate, category: str, removed: Sequence[int], added: Sequence[int]) -> Dict:
    """The run's lines with `removed` storages taken off `category` and `added` ones put on, at every batch."""
    lines = dict(base.lines)
    intercept, slope = lines[category]
    lines[category] = (intercept - sum(removed) + sum(added), slope)
    at_zero, per_sample = lines['allocator']
    lines['allocator'] = (at_zero - _rounding(base, removed) + _rounding(base, added), per_sample)
    return lines


def _residents(log: dict) -> List[Tuple[dict, list]]:
    """(the part's names, its residents) of each traced batch of a scaled log."""
    return [(log[part]['names'], log[part]['residents']) for part in ('low', 'high')]


def _checked_weights(base: MemoryEstimate) -> List[Tuple[int, str]]:
    """The weights' roles, checked against the log's first residents (the rules' indices are into both)."""
    storages = base.weight_storages
    if not storages:
        raise RuleError('the run\'s trace holds no weights\' roles')
    for names, residents in _residents(base.replay.log) if base.replay is not None else ():
        if len(residents) < len(storages) or any(
                names[r[1]] != 'weights' or r[0] != size for r, (size, _) in zip(residents, storages)):
            raise RuleError('the run\'s log does not start with its weights')
    return storages


def _with_log(base: MemoryEstimate, log: Optional[dict], lines: Dict, **changes) -> MemoryEstimate:
    replay = CudaReplay(log, base.replay.config) if log is not None else None
    return dataclasses.replace(base, lines=lines, replay=replay, **changes)


def same_layout_bytes(base: MemoryEstimate) -> MemoryEstimate:
    """channels-last: the run's bytes; its depthwise convolutions routed as channels-last ones are
    (`timm_ext.memory_model.kernel_limits.as_channels_last`: which release's cuDNN takes them decides their limit)."""
    return dataclasses.replace(base, kernel_sizes=as_channels_last(base.kernel_sizes))


def momentum_sgd(base: MemoryEstimate) -> MemoryEstimate:
    """opt-sgd: the run's optimizer state (its residents in the log; on a device without one, the optimizer
    category at the peak) replaced by one momentum buffer per trainable parameter."""
    momentum = [size for size, role in _checked_weights(base) if role == 'trainable']
    if base.replay is None:
        return _with_log(base, None, _with_lines(base, 'optimizer', [base.lines['optimizer'][0]], momentum))
    log = copy.deepcopy(base.replay.log)
    removed = []
    for names, residents in _residents(log):
        for text in ('optimizer', MOMENTUM_OP, MOMENTUM_WHERE):
            if text not in names:
                names.append(text)
        optimizer = names.index('optimizer')
        state = [i for i, r in enumerate(residents) if r[1] == optimizer]
        removed = [residents[i][0] for i in state]
        at = state[0] if state else len(residents)
        kept = [r for r in residents if r[1] != optimizer]
        buffers = [[size, optimizer, names.index(MOMENTUM_OP), names.index(MOMENTUM_WHERE)] for size in momentum]
        residents[:] = kept[:at] + buffers + kept[at:]
    return _with_log(base, log, _with_lines(base, 'optimizer', removed, momentum))


def host_ema(base: MemoryEstimate) -> MemoryEstimate:
    """model-ema-force-cpu: the run's weights less the EMA copy's (its residents leave the device's log)."""
    storages = _checked_weights(base)
    ema = [i for i, (_, role) in enumerate(storages) if role == 'ema']
    if not ema:
        raise RuleError('the run\'s trace holds no EMA copy')
    moved = [storages[i][0] for i in ema]
    lines = _with_lines(base, 'weights', moved, [])
    left = [(size, role) for size, role in storages if role != 'ema']
    if base.replay is None:
        return _with_log(base, None, lines, weight_storages=left)
    log = copy.deepcopy(base.replay.log)
    for _, residents in _residents(log):
        residents[:] = [r for i, r in enumerate(residents) if i not in set(ema)]
    return _with_log(base, log, lines, weight_storages=left)
