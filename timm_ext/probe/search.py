"""Find the largest batch that fits: a search over real trials that aims at the memory limit, the table, the choice.

A trial runs one batch size for real (a training step, or an eval forward) and reports a :class:`Trial`: fit or
OOM (or another error), peak memory, ms per step and samples/s. :func:`search_batch_size` fits peak memory as a
linear function of the batch size to the trials so far (:class:`PeakModel`), aims each next trial at the largest
size predicted under the limit (budget x (1 - headroom)), and settles on the grid's fine step (`--batch-multiple`)
between the largest accepted size and the smallest one that was not; without a limit it grows x2, then bisects. It
knows nothing of models, so any trial can use it. With `start == max_batch` it probes down from an asked size.
:func:`select_batch_size` turns the table into a choice: the largest size that fits within the headroom, or the
smallest one within a tolerance of the best throughput. One timing per size is easily misled on a shared machine,
so before a throughput choice :func:`retime_trials` times the sizes that could win again, in interleaved rounds;
the best is the fastest median, and a smaller size counts as within the tolerance only if its slowest timing is.

Under torchrun, wrap the trial with :func:`agree_across_ranks`: each rank runs it, then one collective shares every
rank's outcome, so a rank that OOMs alone reports it instead of leaving the others waiting, and every rank takes
the same (the worst) outcome, hence the same path through the search and the same answer.
"""
import ctypes
import json
import logging
import math
import os
import signal
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..batch_decay import batch_descent, decay_batch_step
from ..errors import TimmExtError
from ..memory import PeakMeter, device_broken, format_bytes, free_memory, free_memory_after_failure
from ..oom import is_oom

__all__ = [
    'Trial', 'TrialFn', 'BatchGrid', 'DecayGrid', 'MultipleGrid', 'SplitGrid', 'ProbeError', 'NothingFitsError',
    'TrialError',
    'Selection', 'HeadroomAccept', 'PeakModel', 'MAX_GROWTH', 'SETTLE_TOL', 'default_batch_multiple', 'default_grid',
    'search_batch_size', 'select_batch_size', 'headroom_accept', 'agree_across_ranks', 'format_trial',
    'format_table', 'trials_to_json', 'measured_trial', 'SELECT_MODES', 'retime_candidates', 'retime_trials',
    'timing_spread', 'die_with_parent', 'call_forked', 'run_forked',
]

_logger = logging.getLogger(__name__)

SELECT_MODES = ('max', 'throughput')
FIT, OOM, ERROR = 'fit', 'oom', 'error'


@dataclass
class Trial:
    """One batch size, tried for real.

    Attributes:
        batch_size: Samples per step (per rank).
        status: 'fit', 'oom' or 'error' (a failure that is not out-of-memory).
        peak_bytes: Peak memory of the step in the budget's units (see `timm_ext.memory.PeakMeter`); None if
            unknown or the step failed.
        ms_per_step: Wall time of one timed step in milliseconds (fits only).
        samples_per_s: batch_size / step time (x world size under DDP), fits only.
        error: One line naming the failure ('' for a fit).
        accepted: Set by the search: the trial fits and is within the headroom.
        retime: 0 for the search's trial of the size, k for its k-th re-timing round (`retime_trials`).
    """
    batch_size: int
    status: str
    peak_bytes: Optional[int] = None
    ms_per_step: Optional[float] = None
    samples_per_s: Optional[float] = None
    error: str = ''
    accepted: Optional[bool] = None
    retime: int = 0

    @property
    def fits(self) -> bool:
        return self.status == FIT

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> 'Trial':
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


TrialFn = Callable[[int], Trial]


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


class ProbeError(TimmExtError):
    """The probe could not choose a batch size; the message is one line. `trials` holds the table so far."""

    def __init__(self, message: str, trials: Sequence[Trial] = ()):
        super().__init__(message)
        self.trials = list(trials)


class NothingFitsError(ProbeError):
    """Not even the smallest size fits the budget."""


class TrialError(ProbeError):
    """A trial failed with an error that is not out-of-memory; probing stopped there."""


def search_batch_size(
        run_trial: TrialFn,
        start: int,
        max_batch: Optional[int] = None,
        grid: Optional[BatchGrid] = None,
        accept: Optional[Callable[[Trial], bool]] = None,
        on_trial: Optional[Callable[[Trial], None]] = None,
        peak_limit: Optional[float] = None,
        prior: Optional[Tuple[float, float]] = None,
) -> List[Trial]:
    """Find the largest accepted size on `grid`: aim at `peak_limit` when given, else grow x2 then bisect.

    With `peak_limit`, the measured peaks of the trials so far fit a linear model of peak memory in the batch size
    (`PeakModel`), and the next trial is the largest grid size the model puts at or under the limit: the search aims
    instead of walking, then settles on the grid between the largest accepted size and the smallest one that was
    not. An aimed trial that does not halve that interval is followed by one bisection step, so a misleading model
    costs at most about twice a bisection's trials. Without a limit (or a measured peak) the search grows x2 from
    `start` until the first failure, then bisects on the grid.

    Args:
        run_trial: Runs one batch size and reports it; must catch its own OOMs (status 'oom').
        start: First size to try (snapped down onto the grid). With `start >= max_batch` the search probes down from
            `max_batch` and tries that size first, so an asked size that fits costs one trial.
        max_batch: Largest size worth trying (dataset size, --max-batch, validate's asked size), None: no limit.
        grid: The sizes the search may try (default: timm's decay grid).
        accept: Whether a fitting trial counts as a fit for the search; the headroom test goes here so the search
            finds the boundary of the headroom, not of the cap. Default: every fit counts.
        on_trial: Called with each trial as soon as it is done (live logging, saving the table).
        peak_limit: The peak the chosen size may reach, in the trials' units (`HeadroomAccept.limit`); None: no aim.
        prior: A predicted peak line (bytes at batch 0, bytes per sample) in the trials' units, e.g. the memory
            estimate's (`timm_ext.probe.estimate`): the first trial aims by it, and one measured peak calibrates it
            (scaled to the measurement) until a second size is measured.

    Returns:
        Every trial in the order run. The search stops at the first trial with status 'error' (it is the last
        entry); without any accepted trial nothing fits.
    """
    if start < 1:
        raise ValueError(f'start batch size must be >= 1, got {start}')
    if max_batch is not None and max_batch < 1:
        raise ValueError(f'max batch size must be >= 1, got {max_batch}')
    grid = grid or DecayGrid()
    bounds = _Bounds(grid, grid.upper(max_batch) if max_batch is not None else None)
    trials: List[Trial] = []
    model: Optional[PeakModel] = None
    size: Optional[int] = grid.snap(start)
    if bounds.upper is not None and start >= bounds.upper:
        size = bounds.upper  # a probe down from the asked size tries that size first
    if prior is not None and peak_limit is not None:
        aim = PeakModel.from_prior(prior, peak_limit).aim(grid)
        if aim is not None:
            size = aim if bounds.upper is None else min(aim, bounds.upper)
    bisect, aimed = False, False
    while size is not None:
        width, fit_before = bounds.width(), bounds.fit
        trial = _record(run_trial(size), accept, trials, on_trial)
        if trial.status == ERROR:
            return trials
        bounds.update(trial)
        # an aim that left more than half the interval: the model misleads here, so the next step bisects
        bisect = aimed and width is not None and bounds.width() > width // 2
        # a fit the model did not expect (it put the limit at the size before): the next such step is twice as long
        expected = model.aim(grid) if aimed and model is not None else None
        surprise = bounds.fit - fit_before if expected is not None and expected <= fit_before else 0
        model = PeakModel.fit(trials, peak_limit, prior)
        size, aimed = _next_size(bounds, model, bisect, surprise, SETTLE_TOL if peak_limit is not None else 0.0)
    return trials


# An aimed search stops once the largest fit is this close below the smallest failure: on CPU the boundary itself
# moves by a few percent between processes, so finer steps there buy trials, not batch
SETTLE_TOL = 0.05
# Most an aimed trial may grow the largest fit: guards against a peak measured far too low at a tiny batch
MAX_GROWTH = 32


class _Bounds:
    """What the trials so far say: the largest accepted size and the smallest one that was not (None: none yet)."""

    def __init__(self, grid: BatchGrid, upper: Optional[int]):
        self.grid, self.upper = grid, upper
        self.fit, self.fail = 0, None

    def update(self, trial: Trial) -> None:
        if trial.accepted:
            self.fit = max(self.fit, trial.batch_size)
        else:
            self.fail = trial.batch_size if self.fail is None else min(self.fail, trial.batch_size)

    def candidates(self) -> List[int]:
        return self.grid.between(self.fit, self.fail)

    def width(self) -> Optional[int]:
        """Grid sizes left strictly between the bounds; None while no failure bounds the search."""
        return None if self.fail is None else len(self.candidates())


def _next_size(bounds: _Bounds, model: Optional['PeakModel'], bisect: bool, surprise: int,
               tolerance: float) -> Tuple[Optional[int], bool]:
    """The next size to try, and whether the model chose it; (None, False) when the search is done (the interval
    holds no grid size, or the largest fit is within `tolerance` of the smallest failure)."""
    if bounds.upper is not None and bounds.fit >= bounds.upper:
        return None, False
    if bounds.fail is not None and bounds.fit >= (1 - tolerance) * bounds.fail:
        return None, False
    if bounds.fail is None:
        return _grow(bounds, model, surprise, tolerance)
    candidates = bounds.candidates()
    if not candidates:
        return None, False
    aim = None if bisect or model is None else model.aim(bounds.grid)
    if aim is None or aim >= bounds.fail:  # no model, a misleading one, or one that a failure contradicts
        if bounds.grid.descend_first and not bounds.fit:
            return candidates[-1], False
        return candidates[(len(candidates) - 1) // 2], False  # bisect: the middle index of the remaining sizes
    return max(aim, candidates[0]), True


def _grow(bounds: _Bounds, model: Optional['PeakModel'], surprise: int, tolerance: float) -> Tuple[int, bool]:
    """The next size above the largest fit while nothing above it has failed: the model's aim, else double it.

    When the model puts the limit at the largest fit, a check goes as far above it as the settle `tolerance` allows
    (at least the next grid size), so a failure there ends the search; after a check that fit anyway (`surprise`:
    what it gained), the next goes twice as far, so a pessimistic model costs log, not linear, steps.
    """
    fit = bounds.fit
    aim = None if model is None else model.aim(bounds.grid)
    if aim is None or (model.one_point and aim < 2 * fit):
        size, aimed = fit * 2, False  # no model, or one point (a lower bound of the limit) that says less than x2
    elif aim <= fit:
        reach = math.floor(fit / (1 - tolerance)) if tolerance else fit
        size, aimed = max(bounds.grid.above(fit), bounds.grid.snap(max(reach, fit + 2 * surprise))), True
    else:  # a line fitted to small sizes extrapolates badly: at most twice the origin line's lower bound
        size, aimed = min(aim, max(2 * fit, 2 * model.lower_bound(fit)), fit * MAX_GROWTH), True
    return (size if bounds.upper is None else min(size, bounds.upper)), aimed


@dataclass(frozen=True)
class PeakModel:
    """Peak memory linear in the batch size, from the measured trials: peak(B) = anchor_peak + slope x (B - anchor).

    The line goes through the largest accepted trial, the nearest below the limit. Once a larger size has a measured
    peak too (a fit over the headroom), the slope is the secant to the nearest such size, so the aim interpolates
    between the two sizes around the limit: on CPU memory per sample grows a little with the batch (the algorithms
    chosen change), and a line fitted to small sizes aims too high there. Before that, the slope is the
    least-squares slope over every measured size (the widest spread damps the sampling noise of each peak).
    With one measured size the line goes through the origin: memory that does not grow with the batch (weights,
    gradients, optimizer state) is >= 0, so that slope is too steep and its aim falls short of the true limit.

    Attributes:
        limit: The peak allowed (budget x (1 - headroom)).
        slope: Bytes per sample.
        anchor: The batch size the line goes through.
        anchor_peak: Its measured peak.
        one_point: Only one size was measured (the aim is then a lower bound of the limit).
        peaks: The highest measured peak of each size.
    """
    limit: float
    slope: float
    anchor: int
    anchor_peak: float
    one_point: bool
    peaks: Dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_prior(cls, prior: Tuple[float, float], limit: float) -> 'PeakModel':
        """A predicted line (bytes at batch 0, bytes per sample) as a model, before any trial."""
        return cls(limit, prior[1], 0, prior[0], False)

    @classmethod
    def fit(cls, trials: Sequence[Trial], limit: Optional[float],
            prior: Optional[Tuple[float, float]] = None) -> Optional['PeakModel']:
        """The model of the search's trials (re-timings left out), None without a limit or a usable slope. With a
        `prior` line and no measured size above the largest fit, the prior scaled through that fit."""
        if limit is None:
            return None
        peaks: Dict[int, int] = {}
        for t in trials:
            if t.fits and t.peak_bytes is not None and not t.retime:
                peaks[t.batch_size] = max(peaks.get(t.batch_size, 0), t.peak_bytes)
        if not peaks:
            return None
        sizes = sorted(peaks)
        accepted = [t.batch_size for t in trials if t.accepted and t.batch_size in peaks]
        anchor = max(accepted) if accepted else sizes[0]
        above = [b for b in sizes if b > anchor]
        if above:  # a measured peak on each side of the limit: the secant between them (regula falsi)
            slope = (peaks[above[0]] - peaks[anchor]) / (above[0] - anchor)
        elif prior is not None and prior[0] + prior[1] * anchor > 0:
            # the estimate scaled through the largest fit: steadier than a slope between sampled peaks close together
            slope = prior[1] * peaks[anchor] / (prior[0] + prior[1] * anchor)
            return cls(limit, slope, anchor, peaks[anchor], False, peaks) if slope > 0 else None
        elif len(sizes) == 1:
            slope = peaks[sizes[0]] / sizes[0]
        else:
            mean_b, mean_p = statistics.fmean(sizes), statistics.fmean(peaks.values())
            slope = sum((b - mean_b) * (peaks[b] - mean_p) for b in sizes) / sum((b - mean_b) ** 2 for b in sizes)
        if not slope > 0:
            return None
        return cls(limit, slope, anchor, peaks[anchor], len(sizes) == 1, peaks)

    def predicted_limit(self) -> float:
        """The batch size at which the predicted peak reaches the limit (not an integer)."""
        return self.anchor + (self.limit - self.anchor_peak) / self.slope

    def lower_bound(self, size: int) -> int:
        """The limit by the line through the origin and `size`'s peak: a lower bound when peak(0) >= 0."""
        return math.floor(size * self.limit / self.peaks[size]) if self.peaks.get(size) else size

    def aim(self, grid: BatchGrid) -> Optional[int]:
        """The largest grid size predicted at or under the limit; None when not even size 1 is."""
        largest = math.floor(self.predicted_limit())
        return grid.snap(largest) if largest >= 1 else None


def _record(trial: Trial, accept: Optional[Callable[[Trial], bool]], trials: List[Trial],
            on_trial: Optional[Callable[[Trial], None]]) -> Trial:
    """Mark `trial` accepted or not, append it to the table and report it."""
    trial.accepted = trial.fits and bool(accept(trial) if accept is not None else True)
    trials.append(trial)
    if on_trial is not None:
        on_trial(trial)
    return trial


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
            _record(trial, accept, extra, on_trial)
            if trial.status == ERROR:
                return extra
            if not trial.accepted:
                sizes.remove(size)
    return extra


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


def _worst(trials: Sequence[Trial]) -> Trial:
    order = {FIT: 0, OOM: 1, ERROR: 2}
    return max(trials, key=lambda t: order[t.status])


def agree_across_ranks(run_trial: TrialFn) -> TrialFn:
    """Wrap a trial so that every rank of the default process group reports the same, combined outcome.

    After each local trial one `all_gather_object` collects all ranks' trials: the status is the worst (an OOM on
    any rank is an OOM for all), the peak and step time are the largest, samples/s counts every rank's samples at
    the slowest rank's pace. Without an initialized group of more than one rank the trial is returned as is.
    """

    def run(batch_size: int) -> Trial:
        local = run_trial(batch_size)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        if local.status == ERROR and dist.get_backend() == 'nccl' and device_broken('cuda'):
            # NCCL's object collectives stage through the broken device: stop here with the error, in one line
            # (torchrun ends the peers waiting for this rank)
            raise TrialError(f'rank {dist.get_rank()}: {local.error}; the device cannot run anything after it',
                             [local])
        gathered: List[Optional[dict]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local.to_dict())
        per_rank = [Trial.from_dict(d) for d in gathered]
        worst = _worst(per_rank)
        if worst.status != FIT:
            rank = per_rank.index(worst)
            return Trial(batch_size, worst.status, error=f'rank {rank}: {worst.error}')
        peaks = [t.peak_bytes for t in per_rank]
        ms = max(t.ms_per_step for t in per_rank)
        return Trial(batch_size, FIT, peak_bytes=None if None in peaks else max(peaks), ms_per_step=ms,
                     samples_per_s=batch_size * len(per_rank) * 1000.0 / ms if ms else None)

    return run


def format_trial(trial: Trial, budget: Optional[int] = None) -> str:
    """One log line for a trial, e.g. 'batch   64: fit   peak 1.20 GiB (60% of budget)  12.3 ms  5203.3 /s'."""
    head = f'batch {trial.batch_size:>6d}: {trial.status:<5s}'
    if not trial.fits:
        return f'{head} {trial.error}'
    share = f' ({trial.peak_bytes / budget:.0%} of budget)' if budget and trial.peak_bytes is not None else ''
    note = '' if trial.accepted is not False else '  [over headroom]'
    note += f'  [re-timing {trial.retime}]' if trial.retime else ''
    speed = f'{trial.ms_per_step:.1f} ms/step, {trial.samples_per_s:.1f} samples/s' if trial.ms_per_step else ''
    return f'{head} peak {format_bytes(trial.peak_bytes)}{share}  {speed}{note}'


def format_table(trials: Sequence[Trial], budget: Optional[int] = None) -> str:
    """The trial table, sorted by batch size (then re-timing round), one line per trial."""
    return '\n'.join(format_trial(t, budget) for t in sorted(trials, key=lambda t: (t.batch_size, t.retime)))


def trials_to_json(trials: Sequence[Trial], **meta) -> str:
    """The table (in the order run) and any metadata as a JSON document."""
    return json.dumps({**meta, 'trials': [t.to_dict() for t in trials]}, indent=2, sort_keys=False)



def _one_line(exc: BaseException) -> str:
    text = ' '.join(str(exc).split())
    return f'{type(exc).__name__}: {text}'[:300]


def _synchronize(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def measured_trial(
        step: Callable[[int], object],
        device: torch.device,
        meter: Optional[PeakMeter] = None,
        warmup_steps: int = 0,
        timed_steps: int = 1,
        capped: bool = False,
        before: Optional[Callable[[], None]] = None,
        isolate: bool = False,
        warmup: Optional[Callable[[int], object]] = None,
        benchmark_warmup: bool = False,
) -> TrialFn:
    """Turn `step(batch_size)`, which runs one batch and raises on failure, into a trial for the search.

    The trial frees memory, resets the peak meter, runs `warmup_steps` then `timed_steps` steps (peak covers all),
    and reports fit, OOM or error. The step time is the fastest timed step, as `timeit` advises: on a shared
    machine the slower ones were disturbed by other work, not made slower by the batch. On a failure the
    traceback's frames are cleared and memory freed before returning, so the next trial starts from the same state
    as the first.

    Args:
        step: Runs one step at a batch size; OOMs and other errors propagate out of it.
        device: Device the step runs on (synchronized around the timing, freed between trials).
        meter: Peak-memory meter (`None`: a meter on `device` with no baseline).
        warmup_steps: Untimed steps first (e.g. one training step that allocates the optimizer state).
        timed_steps: Steps timed for ms/step and samples/s.
        capped: A CPU memory cap is in force: oneDNN primitive-creation failures count as OOM.
        before: Called before each trial (reset gradients, optimizer state, scaler).
        isolate: CPU only: run each trial in a forked copy of this process (see `run_forked`).
        warmup: Runs a warm-up step instead of `step` (e.g. an update and then an eval pass); default `step`.
        benchmark_warmup: Run the warm-up once more before the measured window, then reset (`before`) and free: with
            `cudnn.benchmark` the first step at new shapes runs cuDNN's algorithm search, whose workspaces are sized
            from the free memory, not the cap; the run pays that once, so it stays out of the peak.
    """
    device = torch.device(device)
    meter = meter or PeakMeter(device)
    if isolate and device.type != 'cpu':
        raise ValueError('isolated trials are for CPU devices; CUDA frees its memory in-process')

    def run_here(batch_size: int) -> Trial:
        if before is not None:
            before()
        free_memory(device)
        meter.reset()
        try:
            if benchmark_warmup:
                for _ in range(warmup_steps):
                    (warmup or step)(batch_size)
                if before is not None:
                    before()
                free_memory(device)
                meter.reset()
            for _ in range(warmup_steps):
                (warmup or step)(batch_size)
            _synchronize(device)
            seconds = math.inf
            for _ in range(timed_steps):
                start = time.perf_counter()
                step(batch_size)
                _synchronize(device)
                seconds = min(seconds, time.perf_counter() - start)
            peak = meter.peak()
        except Exception as e:  # every failure is reported as a trial; only OOMs let the search go on
            oom = is_oom(e, cpu_capped=capped and device.type == 'cpu')
            trial = Trial(batch_size, OOM if oom else ERROR, error=_one_line(e))
            traceback.clear_frames(e.__traceback__)  # the frames hold the failed step's activations
        else:
            timed = math.isfinite(seconds) and seconds > 0
            trial = Trial(batch_size, FIT, peak_bytes=peak, ms_per_step=seconds * 1000 if timed else None,
                          samples_per_s=batch_size / seconds if timed else None)
        if before is not None:
            before()
        (free_memory_after_failure if trial.status == ERROR else free_memory)(device)
        return trial

    if isolate:
        return lambda batch_size: run_forked(lambda: run_here(batch_size), batch_size, capped)
    return run_here


_SINGLE_THREAD_NOTE = [False]
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (for a child, right after fork or before exec).

    A parent killed with SIGKILL runs no cleanup, so without this its trial children would run on as orphans, each
    holding memory under the probe's cap. Elsewhere than Linux this does nothing.

    Args:
        parent: The parent's pid, read before the fork: if it has already died, this process exits at once.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def call_forked(fn: Callable[[], object], threads: int = 1) -> Tuple[Optional[object], int]:
    """Run `fn` in a forked child (which dies with this process) and return its JSON-able answer and wait status.

    The answer is None when the child gave none (it died, or `fn` raised). With `threads` > 1 (this process runs
    other threads, whose GNU OpenMP pool does not survive a fork) the child computes with one thread. Interrupted
    while the child runs, this kills it before the interrupt goes on.
    """
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    # a Ctrl-C that lands inside fork's own handlers (logging's lock release) is swallowed there: hold it until after
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = os.fork()
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if pid == 0:  # child: never returns
        status = 0
        try:
            die_with_parent(parent)
            os.close(read_fd)
            if threads > 1:
                torch.set_num_threads(1)
            os.write(write_fd, json.dumps(fn()).encode())
        except BaseException:  # noqa: B036 - the child must exit here whatever happens
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    try:
        chunks = []
        while chunk := os.read(read_fd, 65536):
            chunks.append(chunk)
        _, wait_status = os.waitpid(pid, 0)
        pid = 0
    finally:
        os.close(read_fd)
        if pid:  # interrupted while the child runs: stop it, then let the interrupt through
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return (json.loads(b''.join(chunks)) if chunks else None), wait_status


def run_forked(trial_fn: Callable[[], Trial], batch_size: int, capped: bool) -> Trial:
    """Run `trial_fn` in a forked child process and return its trial (Linux CPU trials).

    Why: on CPU a process does not give memory back between trials. glibc keeps its heap high-water mark and
    oneDNN caches the primitives (with their buffers) of every shape it has run, so under RLIMIT_DATA each trial
    would pay for the ones before it. A fork starts every trial from the same state, exactly as a fresh process
    would, and the rlimit is inherited. oneDNN also does not check every allocation: under a cap a child can die of
    SIGSEGV/SIGBUS; that is reported as out-of-memory when capped (the training probe first runs the same step
    uncapped, so a step that crashes anyway is reported as the run's failure), never as a crash of the caller.

    GNU OpenMP's thread pool does not survive fork; if this process already runs other threads, the child computes
    with one thread.
    """
    threads = len(os.listdir('/proc/self/task'))
    reply, wait_status = call_forked(lambda: trial_fn().to_dict(), threads)
    if threads > 1 and not _SINGLE_THREAD_NOTE[0]:
        _SINGLE_THREAD_NOTE[0] = True
        _logger.info('Probe trials run in forked processes with 1 CPU thread (this process already runs threads).')
    if reply is not None:
        return Trial.from_dict(reply)
    if os.WIFSIGNALED(wait_status):
        sig = signal.Signals(os.WTERMSIG(wait_status)).name
        if capped and os.WTERMSIG(wait_status) in (signal.SIGSEGV, signal.SIGBUS, signal.SIGKILL):
            return Trial(batch_size, OOM, error=f'trial process killed by {sig} under the memory cap')
        return Trial(batch_size, ERROR, error=f'trial process killed by {sig}')
    return Trial(batch_size, ERROR, error=f'trial process exited with status {os.WEXITSTATUS(wait_status)}')
