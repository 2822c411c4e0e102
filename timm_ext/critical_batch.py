"""The critical batch size from a short measured warm-up: B_simple, then the global batch to train with.

`measure_noise_scale` trains a few dozen updates of the real run (train.py's builders and loop, real data, the
probed micro-batch with accumulation 4, the LR of the run's first updates) with the noise-scale monitor on
(`timm_ext.noise_monitor`), and returns the B_simple estimate. `plan_critical` turns it into a run plan: the global
batch nearest to B_simple that the accumulation planner can build from micro-batches that fit, its LR by the run's
rule, and report lines saying how far it is from the memory maximum and why.

B_simple (McCandlish et al. 2018) approximates the critical batch: below it, a bigger batch cuts the updates needed
nearly in proportion (no sample wasted); above it, a bigger batch buys little more progress per update. It tends to
grow as training proceeds, so a warm-up estimate is an early, usually low, reading.
"""
import argparse
import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import torch
from timm import utils
from timm.data import resolve_data_config
from timm.optim import create_optimizer_v2, optimizer_kwargs

from .amp import resolve_amp
from .cuda_backends import configure_cuda_backends
from .distributed import ddp_device_ids
from .lr import default_lr_scale, rescale_lr, resolve_lr
from .noise_monitor import NoiseScaleSummary
from .train_loop import LoopConfig, TrainLoop
from .train_setup import (
    build_datasets, build_model, build_task, build_train_loader, build_train_loss, input_img_mode,
    resolve_model_dtype,
)
from .tune_plan import RunPlan, plan_run

__all__ = ['CriticalEstimate', 'measure_noise_scale', 'plan_critical', 'WARMUP_ACCUM', 'DEFAULT_WARMUP_UPDATES']

WARMUP_ACCUM = 4  # micro-batches per warm-up update: 4 small batches against each window of 4x their size
DEFAULT_WARMUP_UPDATES = 32


@dataclass(frozen=True)
class CriticalEstimate:
    """A warm-up's noise-scale reading.

    Attributes:
        summary: B_simple with the EMAs behind it (nan when no positive estimate formed).
        updates: Warm-up updates trained.
        micro_batch: Micro-batch per rank of the warm-up (the probed one).
        accum_steps: Accumulation of the warm-up.
        world_size: Ranks.
        lr: The warm-up's LR (the run's first-update LR).
        seconds: Wall time of the warm-up updates.
    """
    summary: NoiseScaleSummary
    updates: int
    micro_batch: int
    accum_steps: int
    world_size: int
    lr: float
    seconds: float

    @property
    def found(self) -> bool:
        return math.isfinite(self.summary.b_simple)

    def describe(self) -> str:
        s = self.summary
        reading = f'B_simple ≈ {s.b_simple:.0f} samples' if self.found else 'no positive B_simple'
        return (f'{reading} (|G|² {s.grad_sq:.3g}, tr(Σ) {s.trace_sigma:.3g}; {s.pairs} batch pairs from '
                f'{self.updates} warm-up updates of {self.micro_batch} x {self.accum_steps} on {self.world_size} '
                f'rank(s) at LR {self.lr:g}, {self.seconds:.1f} s)')


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


def measure_noise_scale(args: argparse.Namespace, device: torch.device, micro_batch: int,
                        updates: int = DEFAULT_WARMUP_UPDATES) -> CriticalEstimate:
    """Train `updates` warm-up updates of the run at `micro_batch` x accumulation 4 and estimate B_simple.

    `args` is train.py's namespace after `init_device` (rank and world size set); it is not modified. Under DDP
    every rank calls this together. torch.compile is skipped: it changes speed, not gradients.

    Raises:
        SetupError: The run cannot be built (see `timm_ext.train_setup`).
        OomRecoveryError: Even one sample per step does not fit.
    """
    configure_cuda_backends(device)  # the warm-up trains in the regime of the run it plans
    args = copy.deepcopy(args)
    args.batch_size, args.grad_accum_steps = micro_batch, WARMUP_ACCUM
    args.sync_bn = False  # it trains with OOM recovery, which SyncBN's collectives would hang (sync_bn_problem)
    args.prefetcher = not args.no_prefetcher
    world_size = args.world_size if args.distributed else 1
    model_dtype = resolve_model_dtype(args)
    amp = resolve_amp(device, args.amp, args.amp_dtype)
    utils.random_seed(args.seed, args.rank)
    model = build_model(args, device, model_dtype)
    data_config = resolve_data_config(vars(args), model=model, verbose=False)
    dataset_train, _ = build_datasets(args, input_img_mode(args, data_config))
    loader, mixup_fn, reference_batch = build_train_loader(args, dataset_train, data_config, device, model_dtype,
                                                           model)
    task = build_task(args, model, build_train_loss(args).to(device=device), device, model_dtype)
    args.lr = first_update_lr(args, micro_batch, world_size, WARMUP_ACCUM)
    optimizer = create_optimizer_v2(task.get_trainable_module(), **optimizer_kwargs(cfg=args), **args.opt_kwargs)
    if args.distributed:
        task.prepare_distributed(device_ids=ddp_device_ids(device))
    loop = TrainLoop(
        task, optimizer,
        LoopConfig(device=device, accum_steps=WARMUP_ACCUM, batch_size=reference_batch, clip_grad=args.clip_grad,
                   clip_mode=args.clip_mode, log_interval=max(1, updates // 4), channels_last=args.channels_last,
                   model_dtype=model_dtype, prefetcher=args.prefetcher, world_size=world_size, rank=args.rank,
                   oom_recover=True, log_noise_scale=True),
        amp_autocast=amp.autocast,
        grad_scaler=torch.amp.GradScaler(device.type) if amp.use_grad_scaler else None,
        mixup_fn=mixup_fn,
    )
    start = time.perf_counter()
    loop.train_one_epoch(0, _CyclingBatches(loader, updates * WARMUP_ACCUM))
    seconds = time.perf_counter() - start
    summary = loop.noise_scale_summary()
    loop.noise.close()
    return CriticalEstimate(summary, updates, micro_batch, WARMUP_ACCUM, world_size, args.lr, seconds)


def plan_critical(args: argparse.Namespace, estimate: CriticalEstimate, max_micro_batch: int,
                  world_size: int) -> Tuple[RunPlan, List[str]]:
    """The run plan for the critical batch, and report lines on it.

    The target is B_simple (at least one sample per rank); `timm_ext.accum.plan_accumulation` builds it exactly or
    as near as it can from micro-batches <= `max_micro_batch`. The LR follows the run's rule: from --lr-base for the
    planned global batch, or an explicit --lr moved from the global batch it was set for (-b x ranks x
    --grad-accum-steps as given). Without a positive estimate the memory maximum is kept, and the report says so.
    """
    lines = [f'Critical batch: {estimate.describe()}.']
    if not estimate.found:
        plan = plan_run(args, max_micro_batch, world_size, None)
        lines.append('The gradient noise swamped the |G|² estimate in this warm-up, so there is no critical batch to '
                     'aim at; kept the memory maximum. More --critical-updates (or a larger micro-batch) sharpen it.')
        return plan, lines

    b_simple = estimate.summary.b_simple
    target = max(world_size, round(b_simple))
    plan = plan_run(argparse.Namespace(**{**vars(args), 'lr': None}), max_micro_batch, world_size, target)
    if args.lr:
        scale = args.lr_base_scale or default_lr_scale(args.opt)
        recipe_global = args.batch_size * world_size * args.grad_accum_steps
        lr = rescale_lr(args.lr, recipe_global, plan.global_batch, scale)
        plan = dataclasses.replace(plan, lr=lr, lr_to_write=lr, lr_rule=scale, lr_reason=(
            f'--lr {args.lr:g} was set for global batch {recipe_global} (-b x ranks x accumulation as given); '
            f'rescaled by the {scale} rule to {lr:g} for global batch {plan.global_batch}'))

    built = 'exactly' if plan.exact else f'the nearest global batch the planner builds to {target}'
    lines.append(f'Proposed global batch {plan.global_batch} = {plan.micro_batch} x {plan.world_size} x '
                 f'{plan.accum_steps} ({built}); LR {plan.lr:g}.')
    memory_max = max_micro_batch * world_size
    ratio = plan.global_batch / memory_max
    if plan.global_batch > memory_max:
        lines.append(
            f'That is {ratio:.1f}x the largest batch one step fits ({max_micro_batch} per rank x {world_size}): up to '
            f'~{b_simple:.0f} samples a bigger batch still cuts the updates needed nearly in proportion, so '
            f'accumulating {plan.accum_steps} micro-batches per update wastes no samples.')
    elif plan.global_batch < memory_max:
        lines.append(
            f'That is {ratio:.2f}x the largest batch one step fits ({max_micro_batch} per rank x {world_size}): beyond '
            f'~{b_simple:.0f} samples a bigger batch buys little more progress per update, so the memory maximum '
            f'would spend samples for little gain; more, smaller updates train further per sample.')
    else:
        lines.append(f'That is the largest batch one step fits ({max_micro_batch} per rank x {world_size}).')
    lines.append('B_simple was read at the start of training and usually grows as training proceeds; follow it with '
                 'train.py --log-noise-scale.')
    return plan, lines
