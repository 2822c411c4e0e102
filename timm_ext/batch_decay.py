"""Batch-size decay: the grid of sizes to step down when a batch does not fit.

The grid is timm's (`timm.utils.decay_batch_step`): between two powers of two it takes `num_intra_steps` even
steps, e.g. with the default of 2: 1024, 768, 512, 384, 256, 192, ... 4, 3, 2, 1. We keep our own copy so the
probe, validate.py and the OOM handler share one definition, and test it against timm's for every size.
"""
import math
from typing import List

__all__ = ['decay_batch_step', 'batch_descent']


def _check_step_args(num_intra_steps: int) -> None:
    if not isinstance(num_intra_steps, int) or num_intra_steps < 1:
        raise ValueError(f'num_intra_steps must be an integer >= 1, got {num_intra_steps!r}')


def decay_batch_step(batch_size: int, num_intra_steps: int = 2, no_odd: bool = False) -> int:
    """Return the next smaller batch size on the decay grid, or 0 once there is nothing below 1.

    Args:
        batch_size: Current batch size (any integer; sizes <= 1 return 0, the stop value).
        num_intra_steps: Steps between consecutive powers of two (1 halves, 2 gives x0.75 then x0.5, ...).
        no_odd: Never return an odd size (odd sizes are rounded down by one).

    Returns:
        The next batch size to try, 0 when `batch_size` <= 1.
    """
    _check_step_args(num_intra_steps)
    if batch_size <= 1:
        return 0
    # The power of two below `batch_size`. The exponent is found by float floor-division of logarithms, as timm
    # does, because it rounds one power lower at a few sizes (9, 65, 129, 4097, ...); keeping that rounding keeps
    # our grid identical to timm's, which users already know from validate.py.
    power_of_two = int(2 ** (math.log(batch_size - 1) // math.log(2)))
    step = max(power_of_two // num_intra_steps, 1)
    next_size = power_of_two + (batch_size - power_of_two - 1) // step * step
    if no_odd and next_size % 2 == 1:
        next_size -= 1
    return next_size


def batch_descent(start: int, num_intra_steps: int = 2, no_odd: bool = False) -> List[int]:
    """List every batch size a decay from `start` visits: `start` itself, then each step down to the last >= 1.

    Example: `batch_descent(64)` -> [64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1].
    """
    if not isinstance(start, int) or start < 1:
        raise ValueError(f'start (batch size) must be an integer >= 1, got {start!r}')
    sizes = [start]
    while (next_size := decay_batch_step(sizes[-1], num_intra_steps, no_odd)) > 0:
        sizes.append(next_size)
    return sizes
