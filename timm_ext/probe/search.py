"""The search over batch sizes: which size to try next, until the largest accepted one is found.

A trial runs one batch size for real and reports a `Trial` (`timm_ext.probe.table`). `search_batch_size` fits peak
memory as a linear function of the batch size to the trials so far (`timm_ext.probe.peak_model.PeakModel`), aims each
next trial at the largest size predicted under the limit (budget x (1 - headroom)), and settles on the grid's fine step
(`--batch-multiple`, `timm_ext.probe.grids`) between the largest accepted size and the smallest one that was not;
without a limit it grows x2, then bisects. It knows nothing of models, so any trial can use it. With
`start == max_batch` it probes down from an asked size. What to choose from its table is `timm_ext.probe.selection`'s.
"""
import math
from typing import Callable, List, Optional, Tuple, Union

from .grids import BatchGrid, DecayGrid
from .peak_model import PeakModel
from .table import ERROR, Trial, TrialFn, record_trial

__all__ = ['search_batch_size', 'SETTLE_TOL', 'MAX_GROWTH']


def search_batch_size(
        run_trial: TrialFn,
        start: int,
        max_batch: Optional[int] = None,
        grid: Optional[BatchGrid] = None,
        accept: Optional[Callable[[Trial], bool]] = None,
        on_trial: Optional[Callable[[Trial], None]] = None,
        peak_limit: Optional[float] = None,
        prior: Union[None, Tuple[float, float], Callable[[], Optional[Tuple[float, float]]]] = None,
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
            estimate's (`timm_ext.memory_model.estimate`): the first trial aims by it, and one measured peak calibrates it
            (scaled to the measurement) until a second size is measured. A callable is asked only when it can change
            a trial: not before an asked size that is tried first (`start >= max_batch`), only once that failed.

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
    if callable(prior) and peak_limit is not None and not (bounds.upper is not None and start >= bounds.upper):
        prior = prior()  # it aims the first trial
    if prior is not None and not callable(prior) and peak_limit is not None:
        aim = PeakModel.from_prior(prior, peak_limit).aim(grid)
        if aim is not None:
            size = aim if bounds.upper is None else min(aim, bounds.upper)
    bisect, aimed = False, False
    while size is not None:
        width, fit_before = bounds.width(), bounds.fit
        trial = record_trial(run_trial(size), accept, trials, on_trial)
        if trial.status == ERROR:
            return trials
        bounds.update(trial)
        if callable(prior) and peak_limit is not None and not trial.accepted:
            prior = prior()  # the asked size did not decide: the rest of the search aims by the prior
        # an aim that left more than half the interval: the model misleads here, so the next step bisects
        bisect = aimed and width is not None and bounds.width() > width // 2
        # a fit the model did not expect (it put the limit at the size before): the next such step is twice as long
        expected = model.aim(grid) if aimed and model is not None else None
        surprise = bounds.fit - fit_before if expected is not None and expected <= fit_before else 0
        line = None if callable(prior) else prior
        # before any measured peak the prior alone aims (it aimed the first trial, or came once that failed)
        model = PeakModel.fit(trials, peak_limit, line) or (
            PeakModel.from_prior(line, peak_limit) if line is not None and peak_limit is not None else None)
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


def _next_size(bounds: _Bounds, model: Optional[PeakModel], bisect: bool, surprise: int,
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


def _grow(bounds: _Bounds, model: Optional[PeakModel], surprise: int, tolerance: float) -> Tuple[int, bool]:
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
