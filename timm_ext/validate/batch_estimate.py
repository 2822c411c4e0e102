"""validate.py's batch from the memory estimate: where `--retry` starts, and `--estimate`'s plan on any machine.

The forward pass validate.py runs is traced on fake tensors (`timm_ext.memory_model.estimate`, step 'validate': the weights
alone resident, `inference_mode`, the run's AMP, dtype, layout and input size, the prefetcher's next batch held), and
its predicted peak gives the largest batch within a budget. `--retry` (and bulk mode) then starts its pass at the
largest size of validate's decay grid under that (when the asked `-b` is larger), predicted with no headroom at all
(`steps_down`): an estimate that is a little high costs one step down of the pass, which continues from the first
unfinished sample, while a margin would cost the whole pass's throughput wherever the estimate is right. The
headroom (`timm_ext.memory_model.headroom`; `EVAL_HEADROOM` off CUDA) is kept for plans that cannot step down:
`--estimate`'s printed batch. `--estimate` prints the batch and the command
without data, weights or the device, so `--device cuda --gpu a100-80gb` plans that card from a laptop
(`timm_ext.memory_model.cards`). A budget is what the caching allocator may use, as the probe's cap is.
"""
import argparse
from dataclasses import dataclass
from typing import List, Optional

from timm.data import resolve_data_config
from timm.models import get_pretrained_cfg

from ..batch_decay import decay_batch_step
from ..memory import MemoryBudget, format_bytes, parse_budget
from ..memory_model.devices import onednn_runs
from ..memory_model.estimate import MemoryEstimate, estimate_memory, run_device
from ..memory_model.headroom import Headroom, estimate_headroom
from ..train.args import parse_args as parse_train_args

__all__ = ['EVAL_HEADROOM', 'STEPPING_DOWN', 'EvalBatchEstimate', 'estimate_eval_batch', 'start_batch']

# off CUDA: the pass steps down on an OOM from where it stopped, so a small margin is enough; a CUDA plan's headroom
# is the model's measured error on timm's GPU tables (`timm_ext.memory_model.headroom`)
EVAL_HEADROOM = 0.05
# a pass that steps down on an out-of-memory error starts at the prediction itself
STEPPING_DOWN = Headroom(0.0, 'none: the pass steps down the decay grid on an out-of-memory error, so it starts at '
                              'the prediction itself')
TRACE_BATCHES = (32, 64, 128)


@dataclass(frozen=True)
class EvalBatchEstimate:
    """The largest forward-only batch predicted within a budget.

    Attributes:
        batch_size: The largest batch predicted within the budget less the headroom (0: not even 1).
        budget: The bytes the budget names (a named card's memory as CUDA reports it, or a size as given).
        usable: What the caching allocator may use of it.
        estimate: The traced estimate behind it.
        headroom: The share of `usable` left free, and where that figure came from ('' off CUDA: `EVAL_HEADROOM`).
    """
    batch_size: int
    budget: int
    usable: int
    estimate: MemoryEstimate
    headroom: Headroom = Headroom(EVAL_HEADROOM, '')

    def lines(self, budget_text: str) -> List[str]:
        card, software = self.estimate.device.card, self.estimate.device.software
        read = ''  # how a named card's budget was read
        if card is not None and self.budget == card.reported_bytes:
            read = (f' ({format_bytes(self.budget)} as CUDA reports it, less '
                    f'{format_bytes(card.context(software).nbytes)} of CUDA context)')
        elif card is not None:
            read = (f' (the caching allocator\'s, of the {format_bytes(card.allocator_bytes_for(software))} '
                    f'{card.name} leaves it)')
        return [f'Estimate (no real forward ran): {self.estimate.describe}, traced on fake tensors in '
                f'{self.estimate.seconds:.1f} s; for {self.estimate.device.name}.',
                f'Assumed: {self.estimate.device.assumptions}.',
                *filter(None, [self.estimate.device.software_line]),
                *([f'Headroom {self.headroom.fraction:.1%}: {self.headroom.origin}.'] if self.headroom.origin else []),
                f'Budget {budget_text}{read}: {format_bytes(self.usable)} to plan in; headroom '
                f'{self.headroom.fraction:.1%}: the largest batch predicted is {self.batch_size} '
                f'({format_bytes(self.estimate.peak(max(1, self.batch_size)))} at its peak).',
                *self.estimate.notes]


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
    if args.torchcompile:  # validate.py compiles the model as train.py does
        argv += ['--torchcompile', args.torchcompile] + (['--torchcompile-mode', args.torchcompile_mode]
                                                         if args.torchcompile_mode else [])
    train_args, _ = parse_train_args(argv)
    train_args.model_kwargs = dict(args.model_kwargs)
    train_args.gpu = getattr(args, 'gpu', None)  # the card planned for (`estimate_memory` reads it)
    train_args.software = getattr(args, 'software', None)  # and the software
    train_args.distributed, train_args.world_size, train_args.rank, train_args.local_rank = False, 1, 0, 0
    return train_args


def estimate_eval_batch(args: argparse.Namespace, model_name: str, device_type: str,
                        budget_text: Optional[str] = None, steps_down: bool = False) -> EvalBatchEstimate:
    """The largest batch validate.py's forward is predicted to run within `budget_text`: what the caching allocator
    may use (default: all of the card `args.gpu` names, or all the device here can still give).

    `steps_down`: the batch starts a pass that steps down on an out-of-memory error (`--retry`, bulk mode), so no
    headroom is taken (`STEPPING_DOWN`); else the measured headroom of the device's plans.

    Raises:
        EstimateError: The forward cannot be traced.
        BudgetError: The budget cannot be read, is a fraction of a device that is neither here nor named, or is more
            than the named card leaves the caching allocator.
    """
    budget = parse_budget(budget_text) if budget_text else None
    # before the trace: a budget that cannot be read here, or that the card cannot give, fails at once
    num_bytes, usable = run_device(args, device_type).plan_in(budget or MemoryBudget(fraction=1.0), budget_text or '')
    estimate = estimate_memory(_estimate_args(args, model_name), device_type, onednn_runs(device_type),
                               TRACE_BATCHES, step_kind='validate')
    if steps_down:
        headroom = STEPPING_DOWN
    else:
        headroom = estimate_headroom('validate') if device_type == 'cuda' else Headroom(EVAL_HEADROOM, '')
    largest = estimate.largest_batch(usable * (1 - headroom.fraction))
    return EvalBatchEstimate(largest, num_bytes, usable, estimate, headroom)


def start_batch(asked: int, predicted: int) -> int:
    """Where the pass starts: the asked batch, or the largest size of validate's decay grid within the prediction
    (at least 1) when the asked one is predicted not to fit."""
    size = asked
    while size > max(1, predicted):
        size = decay_batch_step(size)
    return max(1, size)
