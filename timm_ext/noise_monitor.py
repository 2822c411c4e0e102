"""The gradient noise scale during training (``--log-noise-scale``): which gradients to pair, summaries, the CSV.

Two batch sizes come for free (`timm_ext.noise_scale`): on one process, each micro-batch against the accumulated
window; under DDP, each rank's micro-batches and its local window gradient against the gradient averaged over all
ranks (local window samples x world size). No extra forward or backward pass: per micro-batch one gradient-sized
copy and a norm, per window a norm or two.
"""
import csv
import io
import math
import os
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from .checkpoint import atomic_text
from .distributed import reduce_mean
from .noise_scale import AccumGradNorms, LocalGradNormHook, NoiseScaleEstimator, _grads, _sq_norm

__all__ = ['NoiseScaleMonitor', 'NoiseScaleSummary', 'write_noise_scale_row', 'noise_scale_problem', 'CSV_FIELDS']

CSV_FIELDS = ('epoch', 'b_simple', 'grad_sq', 'trace_sigma', 'pairs', 'global_batch')


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

    The loop calls `after_backward` after each backward, `before_allreduce` before it averages gradients itself
    (DDP with OOM recovery), `end_window` before the optimizer touches the gradients, `reset_window` when it throws
    a window's gradients away.

    Args:
        params: The trainable parameters.
        world_size: Number of ranks.
        ddp_module: The DDP wrapper when DDP's own all-reduce runs (a comm hook then notes the local gradient).
        ema_decay: EMA decay per batch pair.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], world_size: int = 1,
                 ddp_module: Optional[torch.nn.Module] = None, ema_decay: float = 0.99):
        self.params = [p for p in params if p.requires_grad]
        self.world_size = world_size
        self.estimator = NoiseScaleEstimator(ema_decay)
        self._micro = AccumGradNorms(self.params)
        self._hook: Optional[LocalGradNormHook] = None
        if world_size > 1 and ddp_module is not None:
            self._hook = LocalGradNormHook(self.params)
            self._hook.register(ddp_module)
        self._local_sq: Optional[torch.Tensor] = None
        self._pieces = 0

    def after_backward(self, num_samples: int, synced: bool) -> None:
        """Note a micro-batch's gradient; a synchronising backward's own change is lost in the average."""
        self._pieces += 1
        if not synced:
            self._micro.after_micro_batch(num_samples)

    def before_allreduce(self) -> None:
        """Note this rank's window gradient before the loop averages it over ranks."""
        self._local_sq = _sq_norm(_grads(self.params))

    def reset_window(self) -> None:
        self._micro.reset()
        self._local_sq, self._pieces = None, 0

    def end_window(self, window_samples: int, grad_scale: float = 1.0) -> None:
        """Pair this window's gradients. ``grad_scale``: what `.grad` carries on top of the true mean."""
        pieces, self._pieces = self._pieces, 0
        if self.world_size == 1:
            self._micro.end_window(self.estimator, grad_scale)
            return
        big_samples = window_samples * self.world_size
        if self._hook is not None:
            self._micro.end_window(self.estimator, grad_scale, window_samples, big_samples)
            self._hook.end_window(self.estimator, window_samples, grad_scale)
            return
        if pieces > 1:  # one piece: its gradient is the local window's, paired below
            self._micro.end_window(self.estimator, grad_scale, window_samples, big_samples)
        else:
            self._micro.reset()
        local_sq, self._local_sq = self._local_sq, None
        if local_sq is not None:
            scale_sq = float(grad_scale) ** 2
            big_sq = _sq_norm(_grads(self.params)) / scale_sq
            self.estimator.update(local_sq / scale_sq, window_samples, big_sq, big_samples)

    def summary(self, device: torch.device) -> NoiseScaleSummary:
        """The current estimate, averaged over ranks under DDP (a collective: every rank calls it)."""
        est = self.estimator
        grad_sq, trace_sigma, pairs = est.g_sq, est.trace_sigma, est.num_updates
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
