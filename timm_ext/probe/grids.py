"""The batch sizes a search may try: timm's decay grid, the multiples of `--batch-multiple`, a global batch's splits.

A grid answers four questions the search asks (`snap`, `upper`, `between`, `above`) and says nothing of memory.
`default_grid` is the probe's grid on a device: multiples of 8 on CUDA, every size on CPU.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..batch_decay import batch_descent, decay_batch_step

__all__ = ['BatchGrid', 'DecayGrid', 'MultipleGrid', 'SplitGrid', 'default_batch_multiple', 'default_grid']


class BatchGrid:
    """The batch sizes a search may try. Subclasses say which sizes are on the grid."""

    descend_first = False  # after a failure with no fit and no model: try the next size down, not the middle

    def snap(self, size: int) -> int:
        """The largest grid size <= `size` (at least the smallest grid size)."""
        raise NotImplementedError

    def upper(self, max_batch: int) -> int:
        """The largest size the search may try under a `max_batch` limit: the limit itself, on the grid or not, so an
        asked size (a recipe's batch, validate's -b, a dataset size) is tried before anything smaller."""
        return max_batch

    def between(self, low: int, high: int) -> List[int]:
        """Grid sizes strictly between `low` and `high`, ascending."""
        raise NotImplementedError

    def above(self, size: int) -> int:
        """The smallest grid size larger than `size`."""
        return self.between(size, 2 * size + 2)[0]


@dataclass(frozen=True)
class DecayGrid(BatchGrid):
    """timm's decay grid (`decay_batch_step`): powers of two with `num_intra_steps` even steps between them."""
    num_intra_steps: int = 2
    no_odd: bool = False

    def snap(self, size: int) -> int:
        below = decay_batch_step(size + 1, self.num_intra_steps, self.no_odd)
        return max(below, 2 if self.no_odd else 1)

    def between(self, low: int, high: int) -> List[int]:
        return sorted(s for s in batch_descent(high, self.num_intra_steps, self.no_odd)[1:] if s > low)


@dataclass(frozen=True)
class MultipleGrid(BatchGrid):
    """Every multiple of `multiple` (--batch-multiple), e.g. 8 for tensor-core friendly shapes."""
    multiple: int = 8

    def __post_init__(self):
        if self.multiple < 1:
            raise ValueError(f'batch multiple must be >= 1, got {self.multiple}')

    def snap(self, size: int) -> int:
        return max(self.multiple, size // self.multiple * self.multiple)

    def between(self, low: int, high: int) -> List[int]:
        first = (low // self.multiple + 1) * self.multiple
        return list(range(max(first, self.multiple), high, self.multiple))


@dataclass(frozen=True)
class SplitGrid(BatchGrid):
    """Only the micro-batches a set global batch can be split into (`sizes`): the question is which one fits, and
    after a failure with nothing measured the next size down is the likeliest answer (the sizes are far apart)."""
    sizes: Tuple[int, ...]
    descend_first = True

    def snap(self, size: int) -> int:
        return max([s for s in self.sizes if s <= size] or [min(self.sizes)])

    def upper(self, max_batch: int) -> int:
        return self.snap(max_batch)  # nothing between the largest split and the asked size is a split

    def between(self, low: int, high: int) -> List[int]:
        return sorted(s for s in self.sizes if low < s < high)

    def above(self, size: int) -> int:
        return min([s for s in self.sizes if s > size] or [max(self.sizes)])


# The fine step the search settles with when --batch-multiple is not given: tensor cores want batch (and channel)
# sizes that are multiples of 8 for float16 / bfloat16 matmuls; a CPU has no such preference, so every size counts.
DEFAULT_BATCH_MULTIPLE = {'cuda': 8}
CPU_BATCH_MULTIPLE = 1


def default_batch_multiple(device_type: str) -> int:
    """The default `--batch-multiple` on a device type: 8 on CUDA, 1 elsewhere (CPU)."""
    return DEFAULT_BATCH_MULTIPLE.get(device_type, CPU_BATCH_MULTIPLE)


def default_grid(device_type: str, batch_multiple: Optional[int] = None) -> 'MultipleGrid':
    """The probe's grid: multiples of `batch_multiple`, or of the device's default."""
    return MultipleGrid(batch_multiple or default_batch_multiple(device_type))
