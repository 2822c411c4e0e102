"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018), from gradients a run already has.

For a batch of B samples the expected squared gradient norm is `E|G_B|² = |G|² + tr(Σ) / B`. Two batch sizes give
two equations, solved for the true squared gradient norm |G|² and the per-sample gradient variance tr(Σ). Training
already has two sizes for free:

* gradient accumulation: each micro-batch's gradient (the change it made to the accumulating `.grad`) is a small
  batch, the window's accumulated gradient the big one (`AccumGradNorms`);
* DDP: each rank's local gradient before the all-reduce is a small batch, the averaged one the big one
  (`LocalGradNormHook`, a DDP communication hook).

`NoiseScaleEstimator` keeps bias-corrected EMAs of both terms; their ratio estimates the critical batch size, beyond
which a bigger batch buys little progress per sample. Values stay tensors (no host sync) until read.
"""
import math
from typing import Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

__all__ = ['NoiseScaleEstimator', 'AccumGradNorms', 'LocalGradNormHook', 'two_batch_estimates']

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
        g_sq, trace_sigma = two_batch_estimates(small_sq, b_small, big_sq, b_big)
        keep = self.ema_decay
        self._g_sq = keep * self._g_sq + (1 - keep) * g_sq
        self._trace_sigma = keep * self._trace_sigma + (1 - keep) * trace_sigma
        self._weight = keep * self._weight + (1 - keep)
        self.num_updates += 1

    @property
    def g_sq(self) -> float:
        """EMA of the true gradient's squared norm |G|² (nan before the first update)."""
        return float(self._g_sq) / self._weight if self._weight else math.nan

    @property
    def trace_sigma(self) -> float:
        """EMA of the per-sample gradient variance tr(Σ) (nan before the first update)."""
        return float(self._trace_sigma) / self._weight if self._weight else math.nan

    @property
    def b_simple(self) -> float:
        """tr(Σ) / |G|²: the critical batch size estimate (nan until defined and positive)."""
        g_sq, trace_sigma = self.g_sq, self.trace_sigma
        return trace_sigma / g_sq if g_sq > 0 and trace_sigma > 0 else math.nan


def _grads(params: List[torch.nn.Parameter]) -> List[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _sq_norm(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.stack([n.float() for n in torch._foreach_norm(tensors)]).pow(2).sum()


class AccumGradNorms:
    """Squared gradient norms of each micro-batch and of the whole accumulation window, with no extra passes.

    Call `after_micro_batch(num_samples)` after each micro-batch's backward and `end_window(estimator)` before the
    optimizer step (before clipping, unscaling or zeroing). Each micro-batch's gradient is read as the change it
    made to `.grad`; the cost is one gradient-sized copy and two norms per micro-batch.

    The loss of each micro-batch is expected to be weighted by its samples / the window's samples (a true mean), so
    a micro-batch's own mean gradient is its change to `.grad` divided by that weight.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        self._snapshot: Optional[List[torch.Tensor]] = None
        self._micro: List[Tuple[torch.Tensor, int]] = []  # (squared norm of the change to .grad, samples)

    def after_micro_batch(self, num_samples: int) -> None:
        """Record the gradient the micro-batch just back-propagated added to `.grad`."""
        grads = _grads(self.params)
        if self._snapshot is None:
            self._micro.append((_sq_norm(grads), num_samples))
            self._snapshot = [g.detach().clone() for g in grads]
        else:
            self._micro.append((_sq_norm(torch._foreach_sub(grads, self._snapshot)), num_samples))
            torch._foreach_copy_(self._snapshot, grads)

    def end_window(self, estimator: NoiseScaleEstimator, grad_scale: float = 1.0) -> None:
        """Feed the window's (micro-batch, window) pairs to `estimator` and start a new window.

        Args:
            estimator: Where the estimates go.
            grad_scale: The AMP loss scale the gradients carry (1.0 without a GradScaler).
        """
        micro, self._micro, self._snapshot = self._micro, [], None
        window_samples = sum(n for _, n in micro)
        if len(micro) < 2:
            return  # a window of one micro-batch has only one batch size
        scale_sq = float(grad_scale) ** 2
        big_sq = _sq_norm(_grads(self.params)) / scale_sq
        for delta_sq, samples in micro:
            weight = samples / window_samples
            estimator.update(delta_sq / scale_sq / weight ** 2, samples, big_sq, window_samples)


class LocalGradNormHook:
    """A DDP communication hook that notes each rank's local squared gradient norm before the all-reduce.

    Register with `ddp_model.register_comm_hook(hook, LocalGradNormHook.__call__)` (or `hook.register(ddp_model)`);
    after the synchronising backward, `end_window(estimator, local_samples)` pairs the local norm (local samples)
    with the averaged gradient's norm (local samples x world size).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], process_group=None):
        self.params = [p for p in params if p.requires_grad]
        self.process_group = process_group
        self._local_sq: Number = 0.0

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp_model.register_comm_hook(self, LocalGradNormHook.__call__)

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        self._local_sq = self._local_sq + torch.linalg.vector_norm(buffer, dtype=torch.float32).square()
        group = self.process_group or dist.group.WORLD
        buffer.div_(dist.get_world_size(group))
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def end_window(self, estimator: NoiseScaleEstimator, local_samples: int, grad_scale: float = 1.0) -> None:
        """Feed the (local, global) pair of the last synchronised backward to `estimator`."""
        world_size = dist.get_world_size(self.process_group)
        local_sq, self._local_sq = self._local_sq, 0.0
        if world_size < 2:
            return
        scale_sq = float(grad_scale) ** 2
        big_sq = _sq_norm(_grads(self.params)) / scale_sq
        estimator.update(local_sq / scale_sq, local_samples, big_sq, local_samples * world_size)
