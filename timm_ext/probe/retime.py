"""Timing the close sizes again before a throughput choice, in interleaved rounds.

One timing per size is easily misled on a shared machine, so before a throughput choice `retime_trials` times the
sizes that could win again, in interleaved rounds (A, B, C, A, B, C, ...); `timm_ext.probe.selection` then ranks
them by their median and slowest timings.
"""
import logging
from typing import Callable, List, Optional, Sequence

from .grids import BatchGrid
from .table import ERROR, Trial, TrialFn, record_trial

__all__ = ['retime_candidates', 'retime_trials']

_logger = logging.getLogger(__name__)


def retime_candidates(trials: Sequence[Trial], throughput_tol: float, grid: Optional[BatchGrid] = None,
                      margin: float = 2.0, max_sizes: int = 4) -> List[int]:
    """The sizes worth timing (again) before a throughput choice, ascending; at most `max_sizes`.

    First the accepted sizes whose first timing is within `margin` x `throughput_tol` of the best first timing, the
    fastest first: a single disturbed timing can move any of them across the tolerance. Then, in the slots left,
    `grid` sizes the search never tried between the next smaller size it tried and the largest close one (the
    doubling skips 48 between 32 and 64, which may be the best or the smallest within the tolerance); they fit if
    memory grows with the batch, and their re-timing trials check that. Empty when fewer than two sizes qualify
    (nothing to compare) or the search stopped on an error.
    """
    if any(t.status == ERROR for t in trials):
        return []
    speeds = {t.batch_size: t.samples_per_s for t in trials if t.accepted and t.samples_per_s and not t.retime}
    if not speeds:
        return []
    floor = (1 - margin * throughput_tol) * max(speeds.values())
    close = sorted((b for b, s in speeds.items() if s >= floor), key=lambda b: speeds[b], reverse=True)[:max_sizes]
    if grid is not None:
        below = [b for b in speeds if b < min(close)]
        tried = {t.batch_size for t in trials}
        untried = [b for b in grid.between(max(below, default=min(close)), max(close)) if b not in tried]
        close += sorted(untried, reverse=True)[:max_sizes - len(close)]  # the larger ones, nearer the fast sizes
    return sorted(close) if len(close) > 1 else []


def retime_trials(
        run_trial: TrialFn,
        trials: Sequence[Trial],
        throughput_tol: float,
        rounds: int = 2,
        accept: Optional[Callable[[Trial], bool]] = None,
        on_trial: Optional[Callable[[Trial], None]] = None,
        grid: Optional[BatchGrid] = None,
        max_sizes: int = 4,
) -> List[Trial]:
    """Time the `retime_candidates` of a search (again), in `rounds` interleaved rounds (A, B, C, A, B, C, ...), so
    that a slow spell of the machine hits every size alike rather than one.

    At most `rounds` x `max_sizes` extra trials. Each is marked with its round (`Trial.retime`) and accepted as in
    the search; a size that stops fitting within the headroom is not timed again (nor chosen, see
    `select_batch_size`). A non-OOM failure stops the re-timing (it is the last trial returned).

    Returns:
        The re-timing trials, in the order run (append them to the search's table).
    """
    sizes = retime_candidates(trials, throughput_tol, grid, max_sizes=max_sizes)
    extra: List[Trial] = []
    if not sizes or rounds < 1:
        return extra
    _logger.info('Throughput: timing batch sizes %s (again) in %d interleaved rounds (at most %d extra trials).',
                 sizes, rounds, rounds * len(sizes))
    for round_index in range(1, rounds + 1):
        for size in list(sizes):
            trial = run_trial(size)
            trial.retime = round_index
            record_trial(trial, accept, extra, on_trial)
            if trial.status == ERROR:
                return extra
            if not trial.accepted:
                sizes.remove(size)
    return extra
