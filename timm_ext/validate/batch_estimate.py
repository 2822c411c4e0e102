"""validate.py's batch from the memory estimate: where `--retry` starts, and `--estimate`'s plan on any machine.

The forward pass validate.py runs is traced on fake tensors (`timm_ext.memory_model.estimate`, step 'validate': the weights
alone resident, `inference_mode`, the run's AMP, dtype, layout and input size, the prefetcher's next batch held), and
its predicted peak gives the largest batch within a budget. `--retry` then starts its pass at the largest size of
validate's decay grid under that (when the asked `-b` is larger): an estimate that is a little high costs one step
down of the pass, which continues from the first unfinished sample. `--estimate` prints the batch and the command
without data, weights or the device, so `--device cuda --mem-budget 80GiB` plans an 80 GB card from a laptop.
"""
import argparse
from dataclasses import dataclass
from typing import List, Optional

import torch
from timm.data import resolve_data_config
from timm.models import get_pretrained_cfg

from ..batch_decay import decay_batch_step
from ..memory import format_bytes, parse_budget, physical_memory
from ..memory_model.devices import device_model, onednn_runs
from ..memory_model.estimate import MemoryEstimate, estimate_memory
from ..train.args import parse_args as parse_train_args

__all__ = ['EVAL_HEADROOM', 'EvalBatchEstimate', 'estimate_eval_batch', 'start_batch']

EVAL_HEADROOM = 0.05  # the pass steps down on an OOM from where it stopped: a small margin is enough
TRACE_BATCHES = (32, 64, 128)


@dataclass(frozen=True)
class EvalBatchEstimate:
    """The largest forward-only batch predicted within a budget.

    Attributes:
        batch_size: The largest batch predicted within the budget less the headroom (0: not even 1).
        budget: The budget in bytes (a CUDA card's memory as CUDA reports it).
        usable: What the allocator may use of it.
        estimate: The traced estimate behind it.
    """
    batch_size: int
    budget: int
    usable: int
    estimate: MemoryEstimate

    def lines(self, budget_text: str) -> List[str]:
        usable = self.usable
        return [f'Estimate (no real forward ran): {self.estimate.describe}, traced on fake tensors in '
                f'{self.estimate.seconds:.1f} s; for {self.estimate.device.name}.',
                f'Assumed: {self.estimate.device.assumptions}.',
                f'Budget {budget_text}: {format_bytes(usable)} to plan in; headroom {EVAL_HEADROOM:.0%}: the largest '
                f'batch predicted is {self.batch_size} '
                f'({format_bytes(self.estimate.peak(max(1, self.batch_size)))} at its peak).',
                *([f'Replay: {self.estimate.replay_note}.'] if self.estimate.replay_note else [])]


def _estimate_args(args: argparse.Namespace, model_name: str) -> argparse.Namespace:
    """train.py's namespace for the traced forward: validate's model, input size (its test size unless
    --use-train-size), classes, precision and layout."""
    cfg = get_pretrained_cfg(model_name)
    data_config = resolve_data_config(vars(args), pretrained_cfg=cfg.to_dict() if cfg else None,
                                      use_test_size=not args.use_train_size)
    argv = ['--model', model_name, '--input-size', *map(str, data_config['input_size']), '--device', 'cpu',
            '--amp-dtype', args.amp_dtype]
    argv += ['--amp'] * args.amp + ['--channels-last'] * args.channels_last + ['--no-prefetcher'] * args.no_prefetcher
    if args.num_classes is not None:
        argv += ['--num-classes', str(args.num_classes)]
    if args.model_dtype:
        argv += ['--model-dtype', args.model_dtype]
    train_args, _ = parse_train_args(argv)
    train_args.model_kwargs = dict(args.model_kwargs)
    train_args.distributed, train_args.world_size, train_args.rank, train_args.local_rank = False, 1, 0, 0
    return train_args


def estimate_eval_batch(args: argparse.Namespace, model_name: str, device_type: str,
                        budget_text: Optional[str] = None) -> EvalBatchEstimate:
    """The largest batch validate.py's forward is predicted to run within `budget_text` (default: the device's
    memory, which must then be here).

    Raises:
        EstimateError: The forward cannot be traced.
        BudgetError: The budget cannot be read, or is a fraction of a device that is not here.
    """
    budget = parse_budget(budget_text) if budget_text else None
    device = device_model(device_type)
    if budget is not None:  # before the trace: a budget that cannot be read here fails at once
        num_bytes, usable = device.plan_in(budget, budget_text)
    estimate = estimate_memory(_estimate_args(args, model_name), device_type, onednn_runs(device_type),
                               TRACE_BATCHES, step_kind='validate')
    if budget is None:  # the device here: its memory as CUDA reports it, less the context
        num_bytes = physical_memory(torch.device(device_type))
        usable = estimate.device.usable(num_bytes)
    largest = estimate.largest_batch(usable * (1 - EVAL_HEADROOM))
    return EvalBatchEstimate(largest, num_bytes, usable, estimate)


def start_batch(asked: int, predicted: int) -> int:
    """Where the pass starts: the asked batch, or the largest size of validate's decay grid within the prediction
    (at least 1) when the asked one is predicted not to fit."""
    size = asked
    while size > max(1, predicted):
        size = decay_batch_step(size)
    return max(1, size)
