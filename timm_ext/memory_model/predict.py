"""The CUDA answer of a memory estimate: a traced step's logs replayed on the caching allocator at any batch.

`CudaReplay` holds the step's log at two traced batch sizes, lined up (`timm_ext.memory_model.events.ScaledLog`), and
answers what `timm_ext.memory_model.estimate.MemoryEstimate` asks on CUDA: the least memory a batch needs
(`least_memory`), and the largest batch a budget holds (`largest_batch`). Results are memoized: a table and a plan
ask the same batches more than once.
"""
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

from . import replay as replays
from .allocator import Block, CachingAllocator
from .allocator_config import allocator_config
from .events import ScaledLog
from .live_bytes import CATEGORIES
from .versions import PINNED, Software

# what a replayed block is filed under: the trace's categories of tensors, and the kernels' own workspaces (the
# CPU model's allocator and library categories never reach a CUDA replay)
STEP_CATEGORIES = tuple(name for name in CATEGORIES if name not in ('allocator', 'library'))

__all__ = ['CudaReplay', 'run_config', 'trace_logs']


def run_config(compute_capability: Optional[Tuple[int, int]] = None,
               software: Software = PINNED) -> replays.ReplayConfig:
    """How the user's run replays: the allocator options as the environment sets them
    (`timm_ext.memory_model.allocator_config.allocator_config`), on a card of `compute_capability` (None: not known),
    with the rules of `software`."""
    return replays.ReplayConfig(allocator=allocator_config(software=software), compute_capability=compute_capability,
                                software=software)


@dataclass
class CudaReplay:
    """A step's log at any batch, and how the run replays it.

    Attributes:
        log: `ScaledLog.to_json()` of the step; where the logs of two batch sizes did not line up event by event,
            {'traced': {batch: step log}}: a batch not traced is traced on its own (`retrace`).
        config: The replay's settings (`timm_ext.memory_model.replay.ReplayConfig`); `run_config()` when not given.
    """
    log: dict
    config: replays.ReplayConfig = field(default_factory=run_config)
    retrace: Optional[Callable[[int], dict]] = field(default=None, repr=False)  # the step log of a batch, traced
    _scaled: Optional[ScaledLog] = field(default=None, repr=False)
    _least: Dict[Tuple[int, bool], int] = field(default_factory=dict, repr=False)
    _split: Dict[Tuple[int, bool], Dict[str, int]] = field(default_factory=dict, repr=False)
    _largest: Dict[tuple, int] = field(default_factory=dict, repr=False)

    @property
    def scaled(self) -> ScaledLog:
        if self._scaled is None:
            self._scaled = ScaledLog.from_json(self.log)
        return self._scaled

    @property
    def aligned(self) -> bool:
        """Whether one scaled log answers every batch (else each batch asked is traced on its own)."""
        return 'traced' not in self.log

    @property
    def traced_batches(self) -> List[int]:
        """The batches traced on their own (none where the log scales)."""
        return [] if self.aligned else sorted(int(b) for b in self.log['traced'])

    def log_at(self, batch_size: int) -> dict:
        """The step's log at `batch_size` (at least 1): scaled, or traced at that batch.

        Raises:
            LookupError: The logs did not line up, the batch was not traced and nothing can trace it.
        """
        batch = max(1, batch_size)
        if self.aligned:
            return self.scaled.at(batch)
        traced = self.log['traced']
        if str(batch) not in traced:
            if self.retrace is None:
                raise LookupError(f'the step was traced at {self.traced_batches} only, and its logs do not scale')
            traced[str(batch)] = self.retrace(batch)
        return traced[str(batch)]

    def _config(self, accumulating: bool) -> replays.ReplayConfig:
        return replace(self.config, accumulating=self.config.accumulating or accumulating)

    def least_memory(self, batch_size: int, accumulating: bool = False) -> int:
        """The least allocator capacity at which `batch_size` runs (bytes, a multiple of 2 MiB)."""
        key = (batch_size, accumulating)
        if key not in self._least:
            self._least[key] = replays.least_memory(self.log_at(batch_size), self._config(accumulating))
        return self._least[key]

    def split(self, batch_size: int, accumulating: bool = False) -> Dict[str, int]:
        """What the least memory of `batch_size` holds at the replay's peak: the allocated blocks by category
        (the trace's categories, 'workspace' for the kernels' own), and 'segments', the rest of the segments."""
        key = (batch_size, accumulating)
        if key not in self._split:
            least = self.least_memory(batch_size, accumulating)
            allocator = replays.replay(self.log_at(batch_size), least, self._config(accumulating),
                                       allocator_type=_SplitAtPeak)
            self._split[key] = {**dict.fromkeys(STEP_CATEGORIES, 0), **allocator.split_at_peak,
                                'segments': least - allocator.peak_allocated}
        return self._split[key]

    def save_snapshot(self, batch_size: int, capacity: int, path: str, describe: str,
                      accumulating: bool = False) -> List[str]:
        """Write the predicted memory snapshot of `batch_size` in `capacity` bytes (`timm_ext.memory_model.snapshot`);
        the report's lines."""
        from .snapshot import save_predicted_snapshot
        return save_predicted_snapshot(self.log_at(batch_size), capacity, self._config(accumulating), path,
                                       f'{describe}, batch {batch_size}')

    def largest_batch(self, capacity: float, guess: int, accumulating: bool = False,
                      limit: Optional[int] = None) -> int:
        """The largest batch that runs in `capacity` bytes of allocator memory (0: not even 1), searched from
        `guess` (memoized with it: the savers' rules share the run's replay)."""
        key = (int(capacity), guess, accumulating, limit)
        if key not in self._largest:
            self._largest[key] = replays.largest_batch(self.log_at, int(capacity), guess,
                                                       self._config(accumulating), limit)
        return self._largest[key]


class _SplitAtPeak(CachingAllocator):
    """An allocator that keeps its allocated bytes by category (a block's tag starts with it) at its peak."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._by_category: Dict[str, int] = {}
        self.split_at_peak: Dict[str, int] = {}

    def malloc(self, nbytes: int, tag: object = None) -> Block:
        block = super().malloc(nbytes, tag)
        category = tag[0] if tag else 'other'
        self._by_category[category] = self._by_category.get(category, 0) + block.size
        if self.allocated >= self.peak_allocated:
            self.split_at_peak = dict(self._by_category)
        return block

    def free(self, block: Block) -> None:
        category = block.tag[0] if block.tag else 'other'
        self._by_category[category] -= block.size
        super().free(block)


def trace_logs(steps: Dict[int, Tuple[int, int]], events: list, names: list, order: list) -> dict:
    """The scaled log of the last two traced batch sizes, from an `EventLog`'s events and each step's (start, end);
    where the two do not line up, both logs as traced (`CudaReplay.log`).

    Args:
        steps: Batch size -> the step's (start, end) in `events`.
        order: The (start, end) of every traced step in order, the warm-up included (the step before a step is what
            it frees the leftovers of).
    """
    from .events import AlignmentError, step_log
    low_batch, high_batch = sorted(steps)[-2:]
    logs = {}
    for batch in (low_batch, high_batch):
        start, end = steps[batch]
        i = order.index((start, end))
        previous = order[i - 1][0] if i else start
        logs[batch] = step_log(events, names, start, end, previous)
    try:
        return ScaledLog(logs[low_batch], low_batch, logs[high_batch], high_batch).to_json()
    except AlignmentError:
        return dict(traced={str(batch): log for batch, log in logs.items()})
