"""Gradient accumulation: the windows of an epoch, their loss weights, and the plan for a wanted global batch.

An epoch of `n` micro-batches with `k` accumulation steps makes exactly ceil(n / k) optimizer updates. Each window
is a true mean over its samples: a micro-batch's loss is weighted by its samples over the window's samples, so a
shorter last window (or a last micro-batch with fewer samples) weighs every sample the same as a full window does.
"""
import math
from dataclasses import dataclass
from typing import List

__all__ = ['MIN_UPDATES', 'accumulation_windows', 'AccumPlan', 'plan_accumulation']

# the fewest optimizer updates a plan should leave a run: fewer is warned about (tune_batch.py), and neither a bigger
# global batch (`timm_ext.tune.batch_choice`) nor --batch-ramp's growth (`timm_ext.train.batch_ramp`) may go below it
MIN_UPDATES = 200


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{name} must be an integer >= {minimum}, got {value!r}')


def accumulation_windows(num_batches: int, accum_steps: int) -> List[range]:
    """Split `num_batches` micro-batch indices into consecutive windows of `accum_steps` (the last may be shorter).

    Example: `accumulation_windows(14, 8)` -> [range(0, 8), range(8, 14)]: two updates, not three.
    """
    _check_int('num_batches', num_batches, minimum=0)
    _check_int('accum_steps', accum_steps)
    return [range(start, min(start + accum_steps, num_batches)) for start in range(0, num_batches, accum_steps)]


@dataclass(frozen=True)
class AccumPlan:
    """How to build a global batch: `micro_batch` per rank, `accum_steps` micro-batches per update.

    Attributes:
        micro_batch: Samples per forward/backward on each rank.
        accum_steps: Micro-batches accumulated per optimizer update.
        world_size: Number of ranks.
        global_batch: micro_batch * world_size * accum_steps.
        target_global: The global batch that was asked for.
        exact: True when global_batch == target_global.
        reason: Why this split, to follow the split itself (which the caller states): "exactly (...)" or "no split
            of ... ; this is the nearest (...)".
    """
    micro_batch: int
    accum_steps: int
    world_size: int
    global_batch: int
    target_global: int
    exact: bool
    reason: str


def plan_accumulation(target_global: int, world_size: int, max_micro_batch: int, multiple: int = 1) -> AccumPlan:
    """Choose (micro-batch, accumulation) for a wanted global batch on `world_size` ranks.

    Only micro-batches of at least half the largest usable one are considered: a split that is exact only with
    tiny micro-batches (a prime global batch would need micro-batch 1) wastes the device. Among those, an exact
    split with the largest micro-batch wins; if none exists, the global batch nearest to the target (ties: the
    larger micro-batch) is returned with `exact=False`, and the caller rescales the LR.

    Args:
        target_global: Samples per optimizer update wanted (e.g. a recipe's batch_size x GPUs x accum).
        world_size: Number of ranks.
        max_micro_batch: Largest micro-batch that fits on one rank (from the probe).
        multiple: Every micro-batch must be a multiple of this (2 under mixup, see `train_setup.batch_multiple`).
    """
    _check_int('target_global', target_global)
    _check_int('world_size', world_size)
    _check_int('max_micro_batch', max_micro_batch)
    _check_int('multiple', multiple)
    usable = min(max_micro_batch, math.ceil(target_global / world_size))
    usable = max(multiple, usable - usable % multiple)
    candidates = range(usable, max(multiple, math.ceil(usable / 2)) - 1, -multiple)

    def plan(micro_batch: int, accum_steps: int, reason: str) -> AccumPlan:
        global_batch = micro_batch * world_size * accum_steps
        return AccumPlan(micro_batch, accum_steps, world_size, global_batch, target_global,
                         global_batch == target_global, reason)

    for micro_batch in candidates:
        if target_global % (micro_batch * world_size) == 0:
            accum_steps = target_global // (micro_batch * world_size)
            return plan(micro_batch, accum_steps,
                        f'exactly (largest micro-batch <= {max_micro_batch} that divides it).')

    def distance(micro_batch: int) -> tuple:
        accum_steps = max(1, round(target_global / (micro_batch * world_size)))
        return abs(micro_batch * world_size * accum_steps - target_global), -micro_batch, accum_steps

    best = min(candidates, key=distance)
    accum_steps = distance(best)[2]
    got = best * world_size * accum_steps
    return plan(best, accum_steps,
                f'no split of global batch {target_global} over {world_size} ranks uses a micro-batch between '
                f'{candidates[-1]} and {usable}; this is the nearest ({(got - target_global) / target_global:+.1%}), '
                f'so the LR must be rescaled to it.')
