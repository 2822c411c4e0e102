"""When tune_batch.py plans the recipe's own batch with no trial: where a trial could decide nothing worth its time.

A trial answers two questions: does the micro-batch fit, and how fast does it run (which says whether judging a bigger
global batch can pay). Without a `--mem-budget` on the CPU, the first is the whole machine's memory, and train.py's
own first update answers it for free: tune_batch.py adds ``--oom-recover``, so an update that runs out of memory is
split into smaller micro-batches with the same samples and the same result (one process only: under DDP idle recovery
costs a collective a window). The second needs no speed when the recipe sets its global batch (``--select auto`` keeps
it), or when judging cannot pay at any speed: measuring the noise scale alone trains more samples than
`MAX_TUNE_SHARE` of the run (digits, 8 epochs: 4,096 samples against 5% of 11,504). A trial there is pure cost,
three to four updates of the recipe's batch, plus building the trial's model: about a second on a ten-second run.

On CUDA the trial stays: a card's memory is small beside the batches people ask for, and the YAML, which stock
train.py reads without ``--oom-recover``, must hold the split that fits.
"""
import argparse
import math
from typing import Optional

import torch

from .batch_choice import MAX_TUNE_SHARE
from .critical_batch import ESTIMATE_MICRO_BATCH, estimate_samples

__all__ = ['untried_reason']


def untried_reason(args: argparse.Namespace, device: torch.device, world_size: int, recipe_global: int, set_by: str,
                   train_samples: int, max_batch: int) -> Optional[str]:
    """Why the recipe's batch can train with no trial (the report's line), or None when a trial must run.

    Args:
        args: tune_batch.py's arguments.
        device: The device the run trains on.
        world_size: Ranks the run trains on.
        recipe_global: The recipe's global batch (`recipe_global_batch`).
        set_by: What set it ('' for stock's default -b 128).
        train_samples: Samples of the training split.
        max_batch: The largest micro-batch the split (and --max-batch) allows per rank.
    """
    needed = math.ceil(recipe_global / world_size)
    asks_a_trial = (args.mem_budget is not None or args.select != 'auto' or args.batch_ramp or args.eval_probe == 'on'
                    or getattr(args, 'train_img_sizes', None))
    if device.type != 'cpu' or world_size != 1 or asks_a_trial or needed > max_batch:
        return None
    if set_by:
        why = f'--select auto keeps the global batch {set_by} sets'
    else:
        measured = 2 * estimate_samples(min(needed, ESTIMATE_MICRO_BATCH), world_size)
        if measured <= MAX_TUNE_SHARE * args.epochs * train_samples:
            return None  # judging a bigger batch may pay: the trial's speed decides
        why = (f'judging a bigger global batch cannot pay: measuring the noise scale alone trains {measured} samples, '
               f'more than {MAX_TUNE_SHARE:.0%} of the run\'s {args.epochs * train_samples}')
    return (f'No trial: no --mem-budget on the CPU (the machine\'s memory), and {why}; train.py\'s first update is '
            f'the trial (--oom-recover splits it, same samples, if it runs out of memory).')
