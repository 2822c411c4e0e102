"""The gradient noise scale during training (``--log-noise-scale``): which gradients to pair, summaries, the CSV.

Two batch sizes come for free (`timm_ext.train.noise_scale` has the estimator): on one process, each micro-batch against
the accumulated window; under DDP, each rank's micro-batches (its local gradients, before any all-reduce) against the
gradient averaged over all ranks (window samples x world size). No extra forward or backward pass, and no copy of
the gradients: a hook on each parameter takes the norm of the gradient a micro-batch adds as backward produces it
(one read of memory that is being written anyway), and each window adds one norm of the accumulated gradient.
"""
import csv
import io
import math
import os
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple, Union

import torch

from ..atomic_files import atomic_text
from ..distributed import reduce_mean
from .noise_scale import NoiseScaleEstimator, grads_of, squared_norm, two_batch_estimates

__all__ = ['NoiseScaleMonitor', 'NoiseScaleSummary', 'write_noise_scale_row', 'min_accum_steps', 'noise_scale_problem',
           'CSV_FIELDS']

CSV_FIELDS = ('epoch', 'b_simple', 'grad_sq', 'trace_sigma', 'pairs', 'global_batch')


def min_accum_steps(log_noise_scale: bool, world_size: int) -> int:
    """The fewest accumulation steps a plan may give the run: 2 for ``--log-noise-scale`` on one process, which
    needs two batch sizes in each update (`noise_scale_problem`), else 1."""
    return 2 if log_noise_scale and noise_scale_problem(1, world_size, 'samples') else 1


def noise_scale_problem(accum_steps: int, world_size: int, loss_weighting: str) -> Optional[str]:
    """Why ``--log-noise-scale`` cannot work with these settings, or None when it can."""
    if accum_steps < 2 and world_size < 2:
        return ('--log-noise-scale compares gradient norms at two batch sizes, and a run with one process and no '
                'accumulation has only one; pass --grad-accum-steps 2 or more, or train on 2+ processes')
    if loss_weighting != 'samples':
        return ('--log-noise-scale needs every sample to weigh the same in the loss; it does not work with the '
                'variable-batch loss scales of --naflex-loader or --train-img-sizes')
    return None


@dataclass(frozen=True)
class NoiseScaleSummary:
    """The estimate so far: EMAs of |G|² and tr(Σ), their ratio B_simple (samples), and the pairs behind them."""
    grad_sq: float
    trace_sigma: float
    b_simple: float
    pairs: int

    def message(self, global_batch: int) -> str:
        if math.isnan(self.b_simple):
            return (f'Gradient noise scale: no positive estimate yet ({self.pairs} batch pairs; |G|² '
                    f'{self.grad_sq:.3g}, tr(Σ) {self.trace_sigma:.3g})')
        return (f'Gradient noise scale B_simple ≈ {self.b_simple:.1f} samples (|G|² {self.grad_sq:.3g}, '
                f'tr(Σ) {self.trace_sigma:.3g}, {self.pairs} batch pairs); global batch {global_batch} is '
                f'{global_batch / self.b_simple:.2g}x of it')


class NoiseScaleMonitor:
    """Feeds a `NoiseScaleEstimator` from a training window's gradients.

    The loop calls `before_backward` / `after_backward` around each micro-batch's backward (with the weight its mean
    loss had), `end_window` before the optimizer touches the gradients (after any all-reduce), and `reset_window`
    when it throws a window's gradients away.

    Args:
        params: The trainable parameters (hooks are registered on them until `close`).
        world_size: Number of ranks.
        ema_decay: EMA decay per batch pair.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], world_size: int = 1, ema_decay: float = 0.99):
        self.params = [p for p in params if p.requires_grad]
        self.world_size = world_size
        self.estimator = NoiseScaleEstimator(ema_decay)
        # per window: the mean (|G|², tr(Σ)) of its pairs, as device tensors; kept only on request (`keep_windows`)
        self.windows: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
        self._parts: List[torch.Tensor] = []  # norms of the current backward's parameter gradients
        self._micro: List[Tuple[torch.Tensor, int, float]] = []  # (squared norm, samples, loss weight)
        self._handles = [p.register_hook(self._note_grad) for p in self.params]

    def _note_grad(self, grad: torch.Tensor) -> None:
        # the gradient this backward adds for one parameter, before it is accumulated (and before DDP averages it)
        self._parts.append(torch.linalg.vector_norm(grad, dtype=torch.float32))

    def keep_windows(self) -> None:
        """Also keep each window's own estimate in `windows`, for a spread (tune_batch's short measurement)."""
        self.windows = []

    def before_backward(self) -> None:
        self._parts = []  # drop anything another backward (e.g. inside an optimizer step) left

    def after_backward(self, num_samples: int, weight: float) -> None:
        """Record the micro-batch just back-propagated: ``num_samples`` samples, mean loss scaled by ``weight``."""
        if self._parts:
            self._micro.append((torch.stack(self._parts).square().sum(), num_samples, weight))
        self._parts = []

    def reset_window(self) -> None:
        self._parts, self._micro = [], []

    def end_window(self, window_samples: int, amp_scale: Union[float, torch.Tensor] = 1.0, correction: float = 1.0,
                   check_finite: bool = False) -> None:
        """Pair this window's gradients and feed the estimator.

        Args:
            window_samples: Samples this rank trained in the window (every rank the same).
            amp_scale: The AMP loss scale every gradient carries (1.0 without a GradScaler; the scaler's device
                tensor, so that reading it costs no host sync).
            correction: What the optimizer update multiplies `.grad` by to make it the window's mean.
            check_finite: Skip the window when the gradients overflowed (float16 AMP). Decided on the device, except
                when each window is kept (`keep_windows`), which reads one value on the host.
        """
        micro, self._micro = self._micro, []
        if not micro or (self.world_size == 1 and len(micro) == 1):
            return  # one process, one micro-batch: the window is the micro-batch, one batch size only
        big_sq = squared_norm(grads_of(self.params)) / (amp_scale / correction) ** 2
        valid = torch.isfinite(big_sq) if check_finite else None
        if valid is not None and self.windows is not None and not valid.item():
            return
        amp_sq = amp_scale ** 2
        big_samples = window_samples * self.world_size
        pairs = [two_batch_estimates(sq / (amp_sq * weight * weight), samples, big_sq, big_samples)
                 for sq, samples, weight in micro]
        for g_sq, trace_sigma in pairs:
            self.estimator.add_estimates(g_sq, trace_sigma, None if self.windows is not None else valid)
        if self.windows is not None:
            self.windows.append((sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)))

    def close(self) -> None:
        """Remove the parameter hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def summary(self, device: torch.device) -> NoiseScaleSummary:
        """The current estimate, averaged over ranks under DDP (a collective: every rank calls it)."""
        est = self.estimator
        grad_sq, trace_sigma, pairs = est.g_sq, est.trace_sigma, est.pairs
        if self.world_size > 1:
            values = reduce_mean(torch.tensor([grad_sq, trace_sigma, pairs], dtype=torch.float64, device=device),
                                 self.world_size)
            grad_sq, trace_sigma = values[:2].tolist()
            pairs = round(values[2].item() * self.world_size)
        b_simple = trace_sigma / grad_sq if grad_sq > 0 and trace_sigma > 0 else math.nan
        return NoiseScaleSummary(grad_sq, trace_sigma, b_simple, pairs)


def write_noise_scale_row(path: os.PathLike, epoch: int, summary: NoiseScaleSummary, global_batch: int) -> None:
    """Add an epoch's row to ``noise_scale.csv``, replacing rows of this epoch and later (a resumed run)."""
    rows = []
    if os.path.exists(path):
        with open(path, newline='') as f:
            rows = [r for r in csv.DictReader(f) if int(r['epoch']) < epoch]
    rows.append({'epoch': epoch, 'b_simple': summary.b_simple, 'grad_sq': summary.grad_sq,
                 'trace_sigma': summary.trace_sigma, 'pairs': summary.pairs, 'global_batch': global_batch})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator='\n')
    writer.writeheader()
    writer.writerows(rows)
    atomic_text(out.getvalue(), path)
