"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018), from gradients a run already has.

For a batch of B samples the expected squared gradient norm is `E|G_B|² = |G|² + tr(Σ) / B`. Two batch sizes give
two equations, solved for the true squared gradient norm |G|² and the per-sample gradient variance tr(Σ). Training
already has two sizes for free (micro-batch vs accumulation window, or one rank vs all ranks):
`timm_ext.train.noise_monitor` pairs them during training. `NoiseScaleEstimator` keeps bias-corrected EMAs of both
terms; their ratio estimates the critical batch size, beyond which a bigger batch buys little progress per sample.
Values stay tensors (no host sync) until read.
"""
import math
import random
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ['NoiseScaleEstimator', 'two_batch_estimates', 'grads_of', 'squared_norm', 'bootstrap_noise_scale']

Number = Union[float, torch.Tensor]


def two_batch_estimates(small_sq: Number, b_small: float, big_sq: Number, b_big: float) -> Tuple[Number, Number]:
    """Unbiased |G|² and tr(Σ) from the squared gradient norms of a small and a big batch (b_small < b_big)."""
    if not 0 < b_small < b_big:
        raise ValueError(f'need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}')
    g_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace_sigma = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g_sq, trace_sigma


class NoiseScaleEstimator:
    """Bias-corrected EMAs of |G|² and tr(Σ), and their ratio B_simple.

    The ratio is taken of the EMAs, not an EMA of ratios: single estimates of |G|² are noisy and can be negative.
    """

    def __init__(self, ema_decay: float = 0.95):
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f'ema_decay must be in [0, 1), got {ema_decay}')
        self.ema_decay = ema_decay
        self._g_sq: Number = 0.0
        self._trace_sigma: Number = 0.0
        self._weight = 0.0  # sum of EMA weights so far, for bias correction
        self.num_updates = 0

    def update(self, small_sq: Number, b_small: float, big_sq: Number, b_big: float) -> None:
        """Add one (small batch, big batch) pair of squared gradient norms."""
        self.add_estimates(*two_batch_estimates(small_sq, b_small, big_sq, b_big))

    def add_estimates(self, g_sq: Number, trace_sigma: Number, valid: Optional[torch.Tensor] = None) -> None:
        """Add one pair's unbiased (|G|², tr(Σ)) estimates (`two_batch_estimates`).

        Args:
            valid: A boolean device tensor: the pair counts only where it is true (a float16 window that overflowed
                does not), decided on the device so the host never waits for it. None: the pair counts.
        """
        keep = self.ema_decay
        g_next = keep * self._g_sq + (1 - keep) * g_sq
        trace_next = keep * self._trace_sigma + (1 - keep) * trace_sigma
        weight_next = keep * self._weight + (1 - keep)
        if valid is None:
            self._g_sq, self._trace_sigma, self._weight = g_next, trace_next, weight_next
            self.num_updates += 1
            return
        self._g_sq = torch.where(valid, g_next, self._g_sq)
        self._trace_sigma = torch.where(valid, trace_next, self._trace_sigma)
        self._weight = torch.where(valid, weight_next, self._weight)
        self.num_updates = self.num_updates + valid.long()

    def state_dict(self) -> Dict[str, float]:
        """The EMAs as plain numbers, for a checkpoint (reads device values once)."""
        return {'g_sq': float(self._g_sq), 'trace_sigma': float(self._trace_sigma), 'weight': float(self._weight),
                'num_updates': self.pairs}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Continue the EMAs of a checkpoint (`state_dict`), so a resumed run does not start them over."""
        self._g_sq, self._trace_sigma = state['g_sq'], state['trace_sigma']
        self._weight, self.num_updates = state['weight'], int(state['num_updates'])

    @property
    def pairs(self) -> int:
        """Pairs counted so far (reads a device value once)."""
        return int(self.num_updates)

    @property
    def g_sq(self) -> float:
        """EMA of the true gradient's squared norm |G|² (nan before the first update)."""
        weight = float(self._weight)
        return float(self._g_sq) / weight if weight else math.nan

    @property
    def trace_sigma(self) -> float:
        """EMA of the per-sample gradient variance tr(Σ) (nan before the first update)."""
        weight = float(self._weight)
        return float(self._trace_sigma) / weight if weight else math.nan

    @property
    def b_simple(self) -> float:
        """tr(Σ) / |G|²: the critical batch size estimate (nan until defined and positive)."""
        g_sq, trace_sigma = self.g_sq, self.trace_sigma
        return trace_sigma / g_sq if g_sq > 0 and trace_sigma > 0 else math.nan


def grads_of(params: Iterable[torch.nn.Parameter]) -> List[torch.Tensor]:
    """The `.grad` tensors of `params` that have one."""
    return [p.grad for p in params if p.grad is not None]


def squared_norm(tensors: List[torch.Tensor]) -> torch.Tensor:
    """Sum of squares over all `tensors`, in float32, as a device tensor (no host sync)."""
    return torch.stack([n.float() for n in torch._foreach_norm(tensors)]).pow(2).sum()


def bootstrap_noise_scale(windows: Sequence[Tuple[float, float]], rounds: int = 200, seed: int = 0,
                          quantiles: Tuple[float, float] = (0.1, 0.9)) -> Tuple[float, float, float]:
    """B_simple from per-window (|G|², tr(Σ)) estimates, with a bootstrap interval over windows.

    The point estimate is the ratio of the means (single |G|² estimates are noisy and can be negative); each
    bootstrap round resamples whole windows. Rounds whose |G|² mean is not positive count as an unbounded B_simple,
    so a noisy estimate shows as a wide (or infinite) high end rather than a falsely narrow one.

    Returns:
        (B_simple, low, high); nan where not positive.
    """
    def ratio(rows: Sequence[Tuple[float, float]]) -> float:
        g_sq = sum(r[0] for r in rows) / len(rows)
        trace = sum(r[1] for r in rows) / len(rows)
        if trace <= 0:
            return math.nan
        return trace / g_sq if g_sq > 0 else math.inf

    if not windows:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    draws = sorted((ratio([rng.choice(windows) for _ in windows]) for _ in range(rounds)),
                   key=lambda v: -math.inf if math.isnan(v) else v)  # a non-positive tr(Σ) counts as the lowest
    pick = lambda q: draws[min(len(draws) - 1, int(q * len(draws)))]
    point = ratio(windows)
    positive = lambda v: v if v > 0 and not math.isnan(v) else math.nan
    return positive(point), positive(pick(quantiles[0])), positive(pick(quantiles[1]))
