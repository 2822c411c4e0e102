"""A short, measured estimate of the gradient noise scale B_noise on the real run, for choosing the global batch.

`measure_noise_scale` trains a few accumulation windows of the real run (train.py's builder and loop, real data,
the LR of the run's first updates) with the noise-scale monitor on (`timm_ext.train.noise_monitor`): each
micro-batch's gradient against its window's gives one two-batch estimate of |G|² and tr(Σ) (McCandlish et al. 2018).
The estimate is B_simple = tr(Σ) / |G|² with a bootstrap interval over windows
(`timm_ext.train.noise_scale.bootstrap_noise_scale`), so a noisy reading shows as a wide range. It is read at the start
of training, where B_noise is smallest (it grows as training proceeds, Merrill et al. 2025): a conservative reading for
choosing a bigger batch.

The cost is what the caller asks for (micro-batch x accumulation x windows samples); `timm_ext.tune.batch_choice`
decides whether the run is long enough to pay for it.
"""
import argparse
import math
import time
from typing import Any, Iterator

import torch
from timm import utils

from .batch_choice import NoiseEstimate
from ..cuda_backends import configure_cuda_backends
from ..distributed import reduce_mean
from ..lr import resolve_lr
from ..train.noise_scale import bootstrap_noise_scale
from ..train.loop import LoopConfig, TrainLoop
from ..train.setup import with_values
from ..train.stack import build_training_stack

__all__ = ['measure_noise_scale', 'ESTIMATE_ACCUM', 'ESTIMATE_WINDOWS', 'ESTIMATE_MICRO_BATCH', 'estimate_samples']

ESTIMATE_ACCUM = 4  # micro-batches per window: each is a small batch against the window, 4x its size
ESTIMATE_WINDOWS = 16  # windows measured: enough for a bootstrap interval, few enough to be cheap
ESTIMATE_MICRO_BATCH = 32  # small batches well below typical B_noise make the two sizes differ clearly


def estimate_samples(micro_batch: int, world_size: int) -> int:
    """Samples the estimate trains at `micro_batch` per rank."""
    return micro_batch * world_size * ESTIMATE_ACCUM * ESTIMATE_WINDOWS


class _CyclingBatches:
    """The first `length` batches of a loader, starting it over (as its next epoch) whenever it runs out."""

    def __init__(self, loader: Any, length: int):
        if len(loader) < 1:
            raise ValueError('the training loader yields no batches')
        self.loader = loader
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator:
        served, epoch = 0, 0
        while True:
            sampler = getattr(self.loader, 'sampler', None)
            if hasattr(sampler, 'set_epoch'):
                sampler.set_epoch(epoch)
            for batch in self.loader:
                if served == self.length:
                    return
                served += 1
                yield batch
            epoch += 1


def first_update_lr(args: argparse.Namespace, micro_batch: int, world_size: int, accum_steps: int) -> float:
    """The LR of the run's first updates: --warmup-lr while a warm-up schedule runs, else the run's LR."""
    if getattr(args, 'warmup_epochs', 0) and args.warmup_lr:
        return args.warmup_lr
    return resolve_lr(args.lr, args.lr_base, args.lr_base_size, args.lr_base_scale, args.opt, micro_batch,
                      world_size, accum_steps).lr


def measure_noise_scale(args: argparse.Namespace, device: torch.device, micro_batch: int) -> NoiseEstimate:
    """Train ESTIMATE_WINDOWS windows of ESTIMATE_ACCUM x `micro_batch` on the real data and estimate B_noise.

    `args` is train.py's namespace after `init_device` (rank and world size set); it is not modified. Under DDP
    every rank calls this together, and the per-window estimates are averaged over ranks. torch.compile is skipped:
    it changes speed, not gradients.

    Raises:
        SetupError: The run cannot be built (see `timm_ext.train.setup`).
        OomRecoveryError: Even one sample per step does not fit.
    """
    configure_cuda_backends(device)  # the warm-up trains in the regime of the run it plans
    # sync_bn off: it trains with OOM recovery, which SyncBN's collectives would hang (sync_bn_problem)
    args = with_values(args, batch_size=micro_batch, grad_accum_steps=ESTIMATE_ACCUM, sync_bn=False,
                       prefetcher=not args.no_prefetcher)
    world_size = args.world_size if args.distributed else 1
    utils.random_seed(args.seed, args.rank)
    lr = first_update_lr(args, micro_batch, world_size, ESTIMATE_ACCUM)
    stack = build_training_stack(args, device, lr=lr, with_eval=False, ema=False, compile_model=False)
    task, optimizer, amp, data = stack.task, stack.optimizer, stack.amp, stack.data
    loop = TrainLoop(
        task, optimizer,
        LoopConfig(device=device, accum_steps=ESTIMATE_ACCUM, batch_size=data.reference_batch,
                   clip_grad=args.clip_grad, clip_mode=args.clip_mode, log_interval=10 ** 9,
                   channels_last=args.channels_last, model_dtype=stack.model_dtype, prefetcher=args.prefetcher,
                   world_size=world_size, rank=args.rank, oom_recover=True, log_noise_scale=True),
        amp_autocast=amp.autocast,
        grad_scaler=stack.grad_scaler,
        mixup_fn=data.mixup_fn,
    )
    loop.noise.keep_windows()
    start = time.perf_counter()
    loop.train_one_epoch(0, _CyclingBatches(data.loader_train, ESTIMATE_WINDOWS * ESTIMATE_ACCUM))
    seconds = time.perf_counter() - start
    measured = loop.noise.windows
    loop.noise.close()
    if not measured:  # every window overflowed (float16) or was replayed after an OOM
        return NoiseEstimate(math.nan, math.nan, math.nan, 0, 0, seconds)
    windows = torch.stack([torch.stack([g, t]) for g, t in measured]).double()
    if world_size > 1:
        windows = reduce_mean(windows.to(device), world_size).cpu()
    b_noise, low, high = bootstrap_noise_scale([tuple(row) for row in windows.tolist()])
    samples = len(windows) * ESTIMATE_ACCUM * micro_batch * world_size
    return NoiseEstimate(b_noise, low, high, len(windows), samples, seconds)
