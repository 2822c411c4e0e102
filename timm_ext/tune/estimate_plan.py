"""tune_batch.py --estimate: the micro-batch, accumulation and LR from the memory estimate alone, on any machine.

No real trial runs and the device need not be here: `--device cuda --gpu h100-80gb` plans a run on that card from a
laptop (`timm_ext.memory_model.cards`: its memory as CUDA reports it less the CUDA context, its compute capability).
A budget (`--mem-budget`) is what the caching allocator may use, as the probe's cap is. For each budget the largest
micro-batch the estimate (`timm_ext.memory_model.estimate`) puts under budget x (1 - headroom) is planned as the
probe's would be (`timm_ext.tune.plan.plan_run`): the recipe's global batch kept at its split, or with `--select max`
the largest micro-batch, on `--nproc` x `--nnodes` ranks. A plan that accumulates is held to the
peak of a micro-batch after a window's first, which starts with the gradients resident. train.py's evaluation between
epochs is estimated too (forward only, the optimizer state resident): its largest batch within the same limit, up to
`EVAL_MAX_FACTOR` micro-batches, becomes `validation_batch_size`. Several budgets give a "what fits where" table; the
first budget's plan is the one written as the YAML config and train command. The memory savers' table
(`timm_ext.tune.savers`) follows where the first budget's plan accumulates, where nothing fits, or when `--savers`
asks for it; the update and the evaluation are traced side by side (`timm_ext.memory_model.trace_pool`).
"""
import argparse
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import torch

from ..errors import UsageError
from ..memory import MemoryBudget, default_headroom, format_bytes, parse_budget
from ..memory_model.allocator_config import allocator_config
from ..memory_model.cards import find_card
from ..memory_model.nccl import NCCL_ASSUMPTION, nccl_buffer_bytes
from ..memory_model.devices import MODELLED_DEVICE_TYPES, onednn_runs
from ..memory_model.estimate import EstimateError, MemoryEstimate, run_device
from ..memory_model.headroom import estimate_headroom
from ..memory_model.trace_pool import estimate_each
from ..memory_model.versions import run_software
from ..probe.grids import default_grid
from ..probe.table import NothingFitsError
from ..train.input_checks import resume_problem
from ..train.setup import SetupError
from .plan import RunPlan, plan_run
from .savers import PlanFor, PricedSaver, nothing_fits_advice, price_savers, saver_trace_calls, savers_table
from .tuner import EVAL_MAX_FACTOR, recipe_global_batch

__all__ = ['EstimatedPlan', 'EstimatedRun', 'check_estimate_inputs', 'parse_budgets', 'plan_from_estimate',
           'estimate_report', 'probe_savers', 'plan_with_estimate']

TABLE_SIZES = 5  # rows of the per-batch table, up to the first budget's micro-batch
EVAL_TRACE_BATCHES = (32, 64, 128)  # a forward holds a few activations a sample: wider sizes, the same fit


@dataclass(frozen=True)
class EstimatedPlan:
    """One budget's plan from the estimate.

    Attributes:
        budget_text: The budget as given (the card's name where `--gpu` alone gives it).
        budget: The bytes it names: a size as given, or a named card's memory as CUDA reports it.
        usable: What the caching allocator may use of it (a named card's CUDA context taken off).
        micro_batch: The largest micro-batch predicted within the headroom, on the grid (0: nothing fits).
        plan: The accumulation and LR plan (None when nothing fits).
        eval_batch: train.py's eval batch (`validation_batch_size`); None: train.py's default, the micro-batch.
    """
    budget_text: str
    budget: int
    usable: int
    micro_batch: int
    plan: Optional[RunPlan]
    eval_batch: Optional[int] = None


def check_estimate_inputs(args: argparse.Namespace) -> None:
    """Refuse what --estimate can tell is wrong here, before it traces anything: the device name itself is the
    parser's (`timm_ext.arg_checks.DeviceName`); a device type no memory model covers; a --resume file that cannot be
    resumed from (`timm_ext.train.input_checks.resume_problem`, as the probe checks it). The data and the device
    itself may be on the machine the plan is for, so neither is looked for.

    Raises:
        UsageError: The device type has no memory model; the allocator setting (PYTORCH_CUDA_ALLOC_CONF...) is
            refused by torch or not modelled (`timm_ext.memory_model.allocator_config.allocator_config`).
        SetupError: The --resume file is missing, a folder, unreadable or another model's.
    """
    device_type = args.device.split(':', 1)[0]
    if device_type not in MODELLED_DEVICE_TYPES:
        raise UsageError(f'--device {args.device}: --estimate models {" and ".join(MODELLED_DEVICE_TYPES)} memory '
                         f'only; pass --device cuda or cpu, or drop --estimate to probe on the {device_type} device')
    if device_type == 'cuda':  # the allocator options the run starts with: its torch's reading, or one line
        allocator_config(software=run_software(getattr(args, 'software', None))[0])
    problem = resume_problem(args)
    if problem:
        raise SetupError(problem)


def parse_budgets(text: str) -> List[Tuple[str, MemoryBudget]]:
    """The comma-separated budgets of --mem-budget, each with its text.

    Raises:
        BudgetError: A budget is not a size or a fraction.
    """
    return [(part, parse_budget(part)) for part in (p.strip() for p in text.split(',')) if part]


def _budgets(args: argparse.Namespace) -> List[Tuple[str, MemoryBudget]]:
    """--mem-budget's budgets; without it, all of the named card (shown by its name) or of the device here."""
    if args.mem_budget:
        return parse_budgets(args.mem_budget)
    return [(find_card(args.gpu).name if getattr(args, 'gpu', None) else '1.0', MemoryBudget(fraction=1.0))]


def plan_from_estimate(args: argparse.Namespace, device_type: str, estimate: MemoryEstimate,
                       budgets: List[Tuple[str, MemoryBudget]], world_size: int, recipe_global: int,
                       eval_estimate: Optional[MemoryEstimate] = None) -> List[EstimatedPlan]:
    """Each budget's largest micro-batch under the headroom, its plan and eval batch (see the module doc)."""
    grid = default_grid(device_type, args.batch_multiple)
    target = args.target_global_batch if args.select == 'max' else recipe_global
    plans = []
    for text, budget in budgets:
        # NCCL's buffers lie outside the allocator, like the context: off a card, not off an allocator's size
        nccl = nccl_buffer_bytes(world_size, getattr(args, 'nnodes', 1)) if device_type == 'cuda' else 0
        num_bytes, usable = estimate.device.plan_in(budget, text, outside=nccl)
        limit = usable * (1 - args.mem_headroom)
        micro = _micro_batch(args, grid, estimate.largest_batch(limit))
        plan = plan_run(args, micro, world_size, target) if micro else None
        if plan is not None and plan.accum_steps > 1:  # a window's later micro-batches start with the gradients
            micro = _micro_batch(args, grid, estimate.largest_batch(limit, accumulating=True))
            plan = plan_run(args, micro, world_size, target) if micro else None
        if plan is None:
            plans.append(EstimatedPlan(text, num_bytes, usable, 0, None))
            continue
        eval_batch = None
        if eval_estimate is not None:
            largest = min(eval_estimate.largest_batch(limit), EVAL_MAX_FACTOR * plan.micro_batch)
            eval_batch = grid.snap(largest) if grid.snap(largest) > plan.micro_batch else None
        plans.append(EstimatedPlan(text, num_bytes, usable, micro, plan, eval_batch))
    return plans


def _micro_batch(args: argparse.Namespace, grid, largest: int) -> int:
    """The largest predicted micro-batch on the grid, within --max-batch (0: not even the grid's smallest fits)."""
    if args.max_batch:
        largest = min(largest, args.max_batch)
    micro = grid.snap(largest) if largest >= 1 else 0
    return micro if 1 <= micro <= largest else 0


def estimate_report(estimate: MemoryEstimate, plans: List[EstimatedPlan], headroom: float,
                    nodes: int, nproc: int, eval_estimate: Optional[MemoryEstimate] = None) -> List[str]:
    """The estimate's header, how each budget is read, the per-batch table of the first budget, and the 'what fits
    where' table."""
    first = plans[0]
    top = max(first.micro_batch, 8)
    sizes = sorted({max(1, round(top * k / TABLE_SIZES)) for k in range(1, TABLE_SIZES + 1)})
    ranks = f'{nodes} node(s) x {nproc} process(es)' if nodes > 1 else f'{nproc} process(es)'
    lines = [f'Estimate (no real trial ran): {estimate.describe}, traced on fake tensors in {estimate.seconds:.1f} s; '
             f'for {estimate.device.name}, {ranks}, headroom {headroom:.0%}.',
             f'Assumed: {estimate.device.assumptions}'
             + (f'; {NCCL_ASSUMPTION}.' if nodes * nproc > 1 and estimate.device.name == 'cuda' else '.'),
             *filter(None, [estimate.device.software_line]),
             *_budget_lines(estimate, plans), '',
             'Predicted peak per micro-batch:',
             *estimate.table(sizes, first.usable), '', 'What fits where:',
             f'{"budget":>10s} {"fits up to":>11s} {"micro-batch":>12s} {"accum":>6s} {"global":>7s} {"LR":>9s} '
             f'{"predicted peak":>15s} {"eval batch":>11s}']
    for p in plans:
        if p.plan is None:
            lines.append(f'{p.budget_text:>10s}   nothing fits (not even batch 1 within the headroom)')
            continue
        peak = format_bytes(estimate.peak(p.plan.micro_batch, accumulating=p.plan.accum_steps > 1))
        lines.append(f'{p.budget_text:>10s} {p.micro_batch:>11d} {p.plan.micro_batch:>12d} {p.plan.accum_steps:>6d} '
                     f'{p.plan.global_batch:>7d} {p.plan.lr:>9.4g} {peak:>15s} {p.eval_batch or "-":>11}')
    if eval_estimate is None:
        lines.append('Eval batch: not estimated (the evaluation forward could not be traced); train.py evaluates at '
                     'the micro-batch.')
    elif first.plan is not None:
        eval_batch = first.eval_batch or first.plan.micro_batch
        lines.append(f'Eval batch {eval_batch}: train.py\'s evaluation (forward only, optimizer state resident) '
                     f'predicted at {format_bytes(eval_estimate.peak(eval_batch))}, at most {EVAL_MAX_FACTOR} '
                     f'micro-batches; ' + ('validation_batch_size in the YAML.' if first.eval_batch else
                                          'nothing larger than the micro-batch fits, so the YAML leaves it.'))
    lines += list(dict.fromkeys(note for e in (estimate, eval_estimate) if e is not None for note in e.notes))
    return lines


def _budget_lines(estimate: MemoryEstimate, plans: List[EstimatedPlan]) -> List[str]:
    """How each CUDA budget is read: what the caching allocator may use, of the named card or of the device here."""
    if estimate.device.name != 'cuda':
        return []
    card = estimate.device.card
    lines = []
    for p in plans:
        fraction = 1.0 if card is not None and p.budget_text == card.name else parse_budget(p.budget_text).fraction
        if card is not None and fraction is not None:
            how = (f'{fraction:.0%} of what {card.name} leaves the caching allocator ({format_bytes(p.budget)} as CUDA '
                   f'reports it, less {format_bytes(card.context_bytes)} of CUDA context)')
        elif card is not None:
            how = (f'what the caching allocator may use, of the {format_bytes(card.allocator_bytes)} {card.name} '
                   f'leaves it')
        elif fraction is not None:
            how = f'{fraction:.0%} of what the device here can still give the caching allocator'
        else:
            how = ('what the caching allocator may use, no CUDA context taken off (--gpu NAME plans all of a named '
                   'card)')
        lines.append(f'Budget {p.budget_text}: {how}: {format_bytes(p.usable)} to plan in.')
    return lines


def _planner(args: argparse.Namespace, device_type: str, budget: Tuple[str, MemoryBudget], world_size: int,
             recipe_global: int) -> PlanFor:
    """An estimate's micro-batch and plan under `budget`, planned as the run's own (`plan_from_estimate`)."""
    def plan_for(estimate: MemoryEstimate) -> Tuple[int, Optional[RunPlan]]:
        first = plan_from_estimate(args, device_type, estimate, [budget], world_size, recipe_global)[0]
        return first.micro_batch, first.plan
    return plan_for


def probe_savers(args: argparse.Namespace, given: Set[str], device_type: str, world_size: int,
                 probed: int) -> Tuple[List[str], List[PricedSaver]]:
    """The savers table of a probed run whose recipe's micro-batch does not fit, and its rows.

    The rows are the estimate's (`price_savers`), so the table also gives the estimate's figure for the run as it is
    beside the micro-batch the probe measured (`probed`, 0: none fits): each row reads against that. A step that
    cannot be traced gives a line saying so and no rows.
    """
    onednn = onednn_runs(device_type)
    budget = parse_budgets(args.mem_budget or '1.0')[0]
    recipe_global, _ = recipe_global_batch(args, given, world_size)
    early = saver_trace_calls(args, device_type, onednn)  # traced beside the run's own
    base, *traced = estimate_each([dict(args=args, device_type=device_type, onednn=onednn), *early.values()])
    if isinstance(base, EstimateError):
        return ['', f'Memory savers: not priced ({base}).'], []
    plan_for = _planner(args, device_type, budget, world_size, recipe_global)
    rows = price_savers(args, device_type, onednn, base, plan_for, dict(zip(early, traced)))
    as_is = plan_for(base)
    lines = savers_table(rows, as_is, recipe_global)
    lines.insert(2, f'  The probe measured {probed} for the run as it is, the estimate predicts {as_is[0]}: read each '
                    f'row against that.')
    return lines, rows


@dataclass(frozen=True)
class EstimatedRun:
    """--estimate's decision: the estimate, one plan a budget (the first is the run's) and the report lines."""
    estimate: MemoryEstimate
    plans: List[EstimatedPlan]
    lines: List[str]

    @property
    def eval_batch(self) -> Optional[int]:
        """The first budget's `validation_batch_size` (None: train.py's default)."""
        return self.plans[0].eval_batch


def plan_with_estimate(args: argparse.Namespace, given: Set[str]) -> EstimatedRun:
    """The whole --estimate decision for tune_batch.py's parsed `args` (no device, no data, no trial).

    Raises:
        EstimateError: The step cannot be traced.
        NothingFitsError: Not even batch 1 fits the first budget by the estimate.
        BudgetError: A budget cannot be read here (`parse_budgets`), or is more than the named card (`--gpu`) leaves
            the caching allocator.
    """
    device_type = args.device.split(':', 1)[0]
    world_size = args.nproc * args.nnodes
    budgets = _budgets(args)
    device = run_device(args, device_type)
    for text, budget in budgets:  # one that cannot be read here, or that the card cannot give, fails before the trace
        device.plan_in(budget, text if args.mem_budget else '')
    headroom_origin = ''
    if args.mem_headroom is None and device_type == 'cuda':  # the model's measured error on timm's GPU tables
        measured = estimate_headroom('train')
        args.mem_headroom, headroom_origin = measured.fraction, f'Headroom {measured.fraction:.1%}: {measured.origin}.'
    elif args.mem_headroom is None:
        args.mem_headroom = default_headroom(torch.device(device_type))
    run_args = argparse.Namespace(**{**vars(args), 'distributed': world_size > 1, 'world_size': world_size,
                                     'rank': 0, 'local_rank': 0})
    onednn = onednn_runs(device_type)
    # the update and train.py's evaluation traced side by side, with the savers' traces where --savers asks already
    early = saver_trace_calls(run_args, device_type, onednn) if getattr(args, 'savers', False) else {}
    estimate, eval_estimate, *traced = estimate_each([
        dict(args=run_args, device_type=device_type, onednn=onednn),
        dict(args=run_args, device_type=device_type, onednn=onednn, batches=EVAL_TRACE_BATCHES, step_kind='eval'),
        *early.values()])
    if isinstance(estimate, EstimateError):
        raise estimate
    if isinstance(eval_estimate, EstimateError):  # the plan stands without it: train.py evaluates at the micro-batch
        eval_estimate = None
    recipe_global, _ = recipe_global_batch(args, given, world_size)
    plans = plan_from_estimate(run_args, device_type, estimate, budgets, world_size, recipe_global, eval_estimate)
    lines = estimate_report(estimate, plans, args.mem_headroom, args.nnodes, args.nproc, eval_estimate)
    lines[1:1] = [headroom_origin] if headroom_origin else []
    chosen, savers = plans[0].plan, []
    if getattr(args, 'savers', False) or chosen is None or chosen.accum_steps > 1:  # the table where it can help
        savers = price_savers(run_args, device_type, onednn, estimate,
                              _planner(run_args, device_type, budgets[0], world_size, recipe_global),
                              dict(zip(early, traced)))
        lines += savers_table(savers, (plans[0].micro_batch, plans[0].plan), recipe_global)
    if chosen is None:
        print('\n'.join(lines))
        advice, details = nothing_fits_advice(savers)
        error = NothingFitsError(f'nothing fits {plans[0].budget_text} by the estimate; {advice}')
        error.details = details
        raise error
    lines += ['', f'Plan for {plans[0].budget_text}, {world_size} rank(s): {chosen.split_line()}',
              f'LR: {chosen.lr_reason}']
    return EstimatedRun(estimate, plans, lines)
