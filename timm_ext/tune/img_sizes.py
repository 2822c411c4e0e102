"""A multi-size schedule (`--train-img-sizes`): one batch per size, each as large as fits, and the LR of their average.

timm's scheduled loader trains each batch at one of several resolutions, at the batch `--train-batch-sizes` gives for
it (else `-b` at every size), and scales the LR to the sampler's `average_batch_size` (the batches weighted by
`--train-size-probs`, averaged over the epochs of a progressive schedule). A batch that fits the largest size wastes
most of the memory at the smaller ones, so tune_batch.py probes each size with real training trials and writes
`train_batch_sizes`, memory-equalised: each the largest batch that fits at its size.

What the recipe sets is kept (`schedule_mode`): `--train-batch-sizes` as given (one trial each checks it fits), and
a `-b` or `--target-global-batch` set by the recipe is the batch at every size, as in stock timm, planned as without
a schedule (`--select max` still equalises over a `-b`: it asks for the largest batch that fits).
`--grad-accum-steps` is kept either way and multiplies every size's batch.

On CPU, oneDNN caches each input shape's kernels with their buffers, so in one process the sizes of a schedule add up
(`shape_cache_note`); a batch that fits at its size alone then fits in the mix with that cache off.

The largest size is probed first, from `--probe-start`; each smaller size starts from the batch found at the next
larger one scaled by their pixel ratio (`scaled_start`): the same activation memory, with the same fixed memory
(weights, optimizer state), so the start lands near that size's limit and the aimed search settles from there.
"""
import argparse
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from timm.data import ScheduledBatchSampler

from ..errors import UsageError
from ..lr import resolve_lr
from ..memory import format_bytes
from ..probe.grids import BatchGrid
from ..probe.train_probe import ProbeOutcome
from ..train.trial_steps import schedule_inputs
from ..train.setup import with_values
from .plan import RunPlan

__all__ = [
    'EQUALISE', 'KEPT', 'RECIPE', 'SizeResult', 'schedule_mode', 'schedule_inputs', 'size_trial_args',
    'scaled_start', 'probe_schedule', 'average_batch', 'plan_schedule', 'format_size_table', 'check_kept_fits',
    'shape_cache_note',
]

# Probes the training batch at an input (C, H, W), from a start, up to a limit
ProbeAt = Callable[[Tuple[int, int, int], int, int], ProbeOutcome]

EQUALISE = 'equalise'  # no batch set by the recipe: each size gets the largest batch that fits
KEPT = 'kept'  # --train-batch-sizes given: kept, each checked with one trial
RECIPE = 'recipe'  # -b or --target-global-batch set: that batch at every size, as stock timm trains it


def schedule_mode(args: argparse.Namespace, given: Set[str]) -> Optional[str]:
    """How tune_batch.py treats the run's `--train-img-sizes` (None: the run has no schedule).

    Raises:
        UsageError: A combination the schedule cannot honour (one line, exit 2).
    """
    if not getattr(args, 'train_img_sizes', None):
        return None
    if 'train_batch_sizes' in given:
        if args.target_global_batch:
            raise UsageError('--target-global-batch sets one batch for every size; with --train-batch-sizes drop it')
        return KEPT
    if args.target_global_batch or ('batch_size' in given and args.select != 'max'):
        return RECIPE  # --select max asks for the largest batch that fits: at each size, whatever -b says
    if args.select in ('critical', 'throughput'):
        raise UsageError(f'--select {args.select} chooses one batch for every size; with --train-img-sizes use '
                         f'--select auto or max (each size then gets the largest batch that fits)')
    return EQUALISE


def size_trial_args(args: argparse.Namespace, input_size: Sequence[int]) -> argparse.Namespace:
    """A copy of train.py's arguments whose trial runs at `input_size` alone (the caller's namespace is untouched)."""
    return with_values(args, train_img_sizes=None, train_batch_sizes=None, input_size=list(input_size), img_size=None)


def scaled_start(found: int, found_pixels: int, pixels: int, grid: BatchGrid, max_batch: int) -> int:
    """The first batch tried at a size of `pixels` per image, from the batch `found` at `found_pixels`: the same
    activation memory (batch x pixels) at the same fixed memory; on the grid, within the limit."""
    aim = max(1, math.floor(found * found_pixels / max(pixels, 1)))
    return max(1, min(grid.snap(aim), max_batch))


@dataclass(frozen=True)
class SizeResult:
    """One size's probe: its input, the batch it trains at, the probe behind it."""
    input_size: Tuple[int, int, int]
    batch: int
    outcome: ProbeOutcome

    @property
    def label(self) -> str:
        return 'x'.join(map(str, self.input_size[1:]))


def probe_schedule(inputs: Sequence[Tuple[int, int, int]], probe_at: ProbeAt, first_start: int, grid: BatchGrid,
                   max_batch: int, multiple: int, wanted: Optional[Sequence[int]] = None) -> List[SizeResult]:
    """The largest fitting batch at every size: the largest size from `first_start`, then each smaller one from the
    batch above it scaled by pixels (`scaled_start`); with `wanted` (given --train-batch-sizes) one trial of each.

    Args:
        inputs: The schedule's (C, H, W), in its order.
        probe_at: Probes the training batch at an input, from a start, up to a limit (`--select max`).
        first_start: The start at the largest size (`--probe-start`).
        grid: The probe's grid (for the scaled starts).
        max_batch: The largest batch any size may take (`--max-batch`, the dataset per rank).
        multiple: Every batch a multiple of this (mixup/cutmix: even).
        wanted: The batch asked at each size: probed from it down, so one that fits costs one trial.

    Returns:
        One result per input, in the schedule's order (a size listed twice is probed once).
    """
    order = sorted(range(len(inputs)), key=lambda i: inputs[i][1] * inputs[i][2], reverse=True)
    found: Dict[Tuple[int, int, int], SizeResult] = {}
    above: Optional[Tuple[int, int]] = None  # (batch, pixels) of the last size probed
    for index in order:
        size = inputs[index]
        pixels = size[1] * size[2]
        if size in found:
            continue
        if wanted is not None:
            start = limit = wanted[index]
        else:
            limit = max_batch
            start = first_start if above is None else scaled_start(above[0], above[1], pixels, grid, max_batch)
        outcome = probe_at(size, start, limit)
        batch = outcome.selection.batch_size
        found[size] = SizeResult(size, max(multiple, batch - batch % multiple), outcome)
        above = (found[size].batch, pixels)
    return [found[size] for size in inputs]


def check_kept_fits(results: Sequence[SizeResult], wanted: Sequence[int]) -> None:
    """Refuse given `--train-batch-sizes` that the probe found do not fit (the run would run out of memory).

    Raises:
        UsageError: One line naming each size whose batch does not fit and what does.
    """
    short = [f'{want} at {r.label} (fits {r.batch})' for r, want in zip(results, wanted) if r.batch < want]
    if short:
        raise UsageError(f'--train-batch-sizes do not fit the budget: {", ".join(short)}; lower them, or drop '
                         f'--train-batch-sizes and tune_batch.py chooses each')


def average_batch(args: argparse.Namespace, batches: Sequence[int]) -> float:
    """The schedule's average batch exactly as timm's scheduled sampler computes it for the LR rule (its choice
    weights, and a progressive schedule's mean over `--epochs`)."""
    progressive = args.train_size_schedule == 'progressive'
    sampler = ScheduledBatchSampler(
        range(1), batch_sizes=list(batches), choice_weights=args.train_size_probs, num_batches=1,
        choice_schedule=args.train_size_schedule, schedule_epochs=args.epochs if progressive else None,
        schedule_spread=args.train_size_schedule_spread, schedule_random_mix=args.train_size_random_mix)
    return sampler.average_batch_size


def plan_schedule(args: argparse.Namespace, batches: Sequence[int], world_size: int, batch_size: int,
                  how: str) -> Tuple[RunPlan, float]:
    """The plan of a scheduled run: `batches` per size with `--grad-accum-steps` as given, and the LR train.py will
    compute for the schedule's average batch (an explicit `--lr` is kept).

    Args:
        args: train.py's arguments.
        batches: The batch at each size, in the schedule's order.
        world_size: Ranks.
        batch_size: The -b to write (train.py's eval batch when no validation_batch_size is set).
        how: Where the batches come from (for the plan's reason).

    Returns:
        (the plan, whose global_batch is the average's rounded; the average batch)
    """
    average = average_batch(args, batches)
    accum = args.grad_accum_steps
    choice = resolve_lr(args.lr, args.lr_base, args.lr_base_size, args.lr_base_scale, args.opt, average, world_size,
                        accum)
    global_avg = average * world_size * accum
    reason = (f'train_batch_sizes {list(batches)} ({how}); average batch {average:g} (timm\'s scheduled sampler), '
              f'x {world_size} rank(s) x {accum} accumulation = {global_avg:g} samples per update on average, the '
              f'global batch the LR rule scales to')
    lr_reason = choice.message + (' ' + choice.hint if choice.hint else '')
    # an LR from --lr-base is left for train.py to compute: it reaches the same value from the same average
    return RunPlan(batch_size, accum, world_size, max(1, round(global_avg)), None, None, choice.lr,
                   args.lr or None, choice.scale, reason, lr_reason), average


def format_size_table(results: Sequence[SizeResult], wanted: Optional[Sequence[int]] = None) -> str:
    """The per-size report: size, batch, trials, peak of the chosen trial (and the batch the recipe gave)."""
    head = f'  {"size":>9} {"batch":>6} {"trials":>6} {"peak":>10}' + (f' {"given":>6}' if wanted else '')
    rows = [head]
    for i, result in enumerate(results):
        peak = result.outcome.selection.trial.peak_bytes
        cached = ' (cached)' if result.outcome.cached else ''
        row = (f'  {result.label:>9} {result.batch:>6} {len(result.outcome.trials):>6} '
               f'{format_bytes(peak) if peak else "-":>10}')
        rows.append(row + (f' {wanted[i]:>6}' if wanted else '') + cached)
    return '\n'.join(rows)


def shape_cache_note(device: torch.device) -> List[str]:
    """The report's warning for a schedule on CPU, where oneDNN's per-shape cache makes the sizes add up (none when
    the cache is off, or on other devices)."""
    if device.type != 'cpu' or os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY') == '0':
        return []
    return ['Note: on CPU oneDNN caches kernels and their buffers per input shape, so the sizes of a schedule add up '
            'in one process; each batch fits at its size alone. Train with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 (and '
            'probe with it, to probe what training then uses).']
