"""What the probe may choose from its table: the headroom a size must leave, then the largest or the fastest size.

`HeadroomAccept` is the test the search accepts a fit by, so the search finds the boundary of the headroom, not of
the cap. `select_batch_size` turns the table into a choice: the largest accepted size ('max'), or the smallest one
within a tolerance of the best throughput ('throughput'): the best is the fastest median, and a smaller size counts as
within the tolerance only if its slowest timing is.
"""
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .table import ERROR, NothingFitsError, Trial, TrialError

__all__ = ['SELECT_MODES', 'HeadroomAccept', 'headroom_accept', 'Selection', 'timing_spread', 'select_batch_size']

SELECT_MODES = ('max', 'throughput')


@dataclass(frozen=True)
class HeadroomAccept:
    """A search `accept` test: the trial's measured peak leaves `headroom` (a fraction) of `budget` free.

    A fit with unknown peak (no measurement on this platform) is accepted: the cap itself still guards the run.
    `limit` is the peak that test allows, the figure the search aims at (the budget itself at headroom 0).
    """
    budget: Optional[int]
    headroom: float

    def __post_init__(self):
        if not 0 <= self.headroom < 1:
            raise ValueError(f'headroom must be a fraction in [0, 1), got {self.headroom}')

    @property
    def limit(self) -> Optional[float]:
        return None if self.budget is None else self.budget * (1 - self.headroom)

    def __call__(self, trial: Trial) -> bool:
        if self.budget is None or self.headroom == 0 or trial.peak_bytes is None:
            return True
        return trial.peak_bytes <= self.limit


def headroom_accept(budget: Optional[int], headroom: float) -> HeadroomAccept:
    """The headroom test of a budget (see `HeadroomAccept`)."""
    return HeadroomAccept(budget, headroom)


@dataclass
class Selection:
    """The chosen batch size and why.

    Attributes:
        batch_size: The chosen size.
        reason: One sentence for the report.
        trial: The trial of the chosen size.
        trials: The whole table.
        caveat: A warning to show with the choice ('' when none), e.g. timings too noisy for the tolerance.
    """
    batch_size: int
    reason: str
    trial: Trial
    trials: List[Trial] = field(default_factory=list)
    caveat: str = ''


def timing_spread(trials: Sequence[Trial]) -> float:
    """How far timings of one batch size disagree: the largest (slowest - fastest) / median samples/s over the sizes
    timed more than once (0.0 when none was)."""
    timings: Dict[int, List[float]] = {}
    for t in trials:
        if t.fits and t.samples_per_s:
            timings.setdefault(t.batch_size, []).append(t.samples_per_s)
    return max(((max(v) - min(v)) / statistics.median(v) for v in timings.values() if len(v) > 1), default=0.0)


def select_batch_size(trials: Sequence[Trial], select: str = 'max', throughput_tol: float = 0.05,
                      context: str = '') -> Selection:
    """Choose from a search's table: 'max' (largest accepted size) or 'throughput' (smallest accepted size whose
    samples/s is within `throughput_tol` of the best measured).

    A size tried more than once (`retime_trials`) counts as accepted only if every trial of it was. The best size is
    the one with the fastest median; another size is within the tolerance only if its slowest timing is. Rounds
    disagree by a few percent on a shared machine, as much as the tolerance, and a size picked on its median alone
    lands near the edge of the tolerance half the time it is measured again; the slowest timing keeps the choice
    on the safe side, a larger batch.

    Args:
        trials: The search's trials (with `accepted` set).
        select: One of SELECT_MODES.
        throughput_tol: Fraction below the best samples/s still counted as the best (throughput mode).
        context: Words naming the model, input and budget, put into error messages.

    Raises:
        TrialError: The search stopped on a non-OOM failure.
        NothingFitsError: No trial was accepted.
    """
    if select not in SELECT_MODES:
        raise ValueError(f"select must be one of {SELECT_MODES}, got {select!r}")
    if not 0 <= throughput_tol < 1:
        raise ValueError(f'throughput tolerance must be a fraction in [0, 1), got {throughput_tol}')
    where = f' ({context})' if context else ''
    failed = [t for t in trials if t.status == ERROR]
    if failed and {t.batch_size for t in failed} == {1} and not any(t.accepted for t in trials):
        # the search only goes down to 1 when 2 did not fit; a model that cannot train on one sample (BatchNorm in
        # training mode refuses it) has then nothing that fits, which is what the user must hear, not a model error
        raise NothingFitsError(f'nothing fits{where}: batch 2 did not fit and batch 1 cannot train '
                               f'({failed[-1].error})', trials)
    if failed:
        t = failed[-1]
        raise TrialError(f'batch {t.batch_size} failed with an error that is not out-of-memory{where}: {t.error}; '
                         f'probing stopped (not retried)', trials)
    by_size: Dict[int, List[Trial]] = {}
    for t in trials:
        by_size.setdefault(t.batch_size, []).append(t)
    accepted = {b: ts for b, ts in by_size.items() if all(t.accepted for t in ts)}
    if not accepted:
        smallest = min(trials, key=lambda t: t.batch_size) if trials else None
        why = f'batch {smallest.batch_size} ran out of memory' if smallest and not smallest.fits else \
            f'batch {smallest.batch_size} fits but leaves less than the headroom free' if smallest else 'no trial ran'
        raise NothingFitsError(f'nothing fits{where}: {why}', trials)
    largest = accepted[max(accepted)][0]
    if select == 'max':
        return Selection(largest.batch_size, f'largest batch that fits within the headroom ({len(trials)} trials)',
                         largest, list(trials))
    timings = {b: [t.samples_per_s for t in ts if t.samples_per_s] for b, ts in accepted.items()}
    speeds = {b: statistics.median(s) for b, s in timings.items() if s}
    if not speeds:
        return Selection(largest.batch_size, 'no throughput measured; largest batch that fits', largest, list(trials))
    best = max(speeds, key=speeds.get)
    floor = (1 - throughput_tol) * speeds[best]
    chosen = min(b for b in speeds if b == best or min(timings[b]) >= floor)
    if chosen == best:
        timed = f'median of {len(timings[best])} timings' if len(timings[best]) > 1 else 'one timing'
        reason = f'the best throughput measured ({speeds[best]:.1f} samples/s, {timed})'
    else:
        timed = f'slowest of {len(timings[chosen])} timings' if len(timings[chosen]) > 1 else 'one timing'
        reason = (f'smallest batch within {throughput_tol:.0%} of the best throughput measured '
                  f'({min(timings[chosen]):.1f} samples/s, {timed}, vs a median of {speeds[best]:.1f} at batch {best})')
    highest_peak = max(accepted[chosen], key=lambda t: t.peak_bytes or 0)  # the report and headroom quote the worst
    spread = timing_spread(trials)
    caveat = '' if spread <= throughput_tol else (
        f'timings of one batch size disagree by up to {spread:.0%} here, more than the {throughput_tol:.0%} '
        f'tolerance, so sizes that close cannot be ranked reliably on this machine; --select max is the safer choice')
    return Selection(chosen, reason, highest_peak, list(trials), caveat)
