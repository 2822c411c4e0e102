"""The CUDA answer of a memory estimate: a traced step's logs replayed on the caching allocator at any batch.

`CudaReplay` holds the step's log at two traced batch sizes, lined up (`timm_ext.memory_model.events.ScaledLog`), and
answers what `timm_ext.memory_model.estimate.MemoryEstimate` asks on CUDA: the least memory a batch needs
(`least_memory`), and the largest batch a budget holds (`largest_batch`). Results are memoized: a table and a plan
ask the same batches more than once.
"""
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from . import replay as replays
from .allocator import expandable_segments_asked
from .events import ScaledLog

__all__ = ['CudaReplay', 'trace_logs']


@dataclass
class CudaReplay:
    """A step's scaled log and how the run replays it.

    Attributes:
        log: `ScaledLog.to_json()` of the step.
        config: The replay's settings (`timm_ext.memory_model.replay.ReplayConfig`); expandable segments as the
            environment asks when not given.
    """
    log: dict
    config: replays.ReplayConfig = field(
        default_factory=lambda: replays.ReplayConfig(expandable=expandable_segments_asked()))
    _scaled: Optional[ScaledLog] = field(default=None, repr=False)
    _least: Dict[Tuple[int, bool], int] = field(default_factory=dict, repr=False)
    _largest: Dict[tuple, int] = field(default_factory=dict, repr=False)

    @property
    def scaled(self) -> ScaledLog:
        if self._scaled is None:
            self._scaled = ScaledLog.from_json(self.log)
        return self._scaled

    def _config(self, accumulating: bool) -> replays.ReplayConfig:
        return replace(self.config, accumulating=self.config.accumulating or accumulating)

    def least_memory(self, batch_size: int, accumulating: bool = False) -> int:
        """The least allocator capacity at which `batch_size` runs (bytes, a multiple of 2 MiB)."""
        key = (batch_size, accumulating)
        if key not in self._least:
            self._least[key] = replays.least_memory(self.scaled.at(max(1, batch_size)), self._config(accumulating))
        return self._least[key]

    def save_snapshot(self, batch_size: int, capacity: int, path: str, describe: str,
                      accumulating: bool = False) -> List[str]:
        """Write the predicted memory snapshot of `batch_size` in `capacity` bytes (`timm_ext.memory_model.snapshot`);
        the report's lines."""
        from .snapshot import save_predicted_snapshot
        return save_predicted_snapshot(self.scaled.at(max(1, batch_size)), capacity, self._config(accumulating), path,
                                       f'{describe}, batch {batch_size}')

    def largest_batch(self, capacity: float, guess: int, accumulating: bool = False,
                      limit: Optional[int] = None) -> int:
        """The largest batch that runs in `capacity` bytes of allocator memory (0: not even 1), searched from
        `guess` (memoized with it: the savers' rules share the run's replay)."""
        key = (int(capacity), guess, accumulating, limit)
        if key not in self._largest:
            self._largest[key] = replays.largest_batch(self.scaled.at, int(capacity), guess,
                                                       self._config(accumulating), limit)
        return self._largest[key]


def trace_logs(steps: Dict[int, Tuple[int, int]], events: list, names: list, order: list) -> Optional[dict]:
    """The scaled log of the last two traced batch sizes, from an `EventLog`'s events and each step's (start, end);
    None when the two do not line up (the estimate then has no replay).

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
        return None
