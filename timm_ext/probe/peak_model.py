"""The fitted peak model: peak memory as a line in the batch size, from the trials measured so far.

The aimed search (`timm_ext.probe.search`) asks it for the largest grid size predicted under the limit.
"""
import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from .grids import BatchGrid
from .table import Trial

__all__ = ['PeakModel']


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
        `prior` line and no measured size above the largest fit, the prior's line through that fit."""
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
            # the estimate through the largest fit: steadier than a slope between sampled peaks close together. Its
            # slope is the traced activations' and held where the fit measured less than predicted (the estimate's
            # fixed part was high: test_vit 64 px measured 70 MiB where 91 were predicted, at the traced slope);
            # where it measured more, the slope is scaled up with it, the cautious reading of the two
            slope = prior[1] * max(1.0, peaks[anchor] / (prior[0] + prior[1] * anchor))
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
