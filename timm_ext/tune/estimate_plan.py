"""tune_batch.py --estimate: the micro-batch, accumulation and LR from the memory estimate alone, on any machine.

No real trial runs and the device need not be here: `--device cuda --mem-budget 80GiB` plans a CUDA run on a laptop.
For each budget the largest micro-batch the estimate (`timm_ext.probe.estimate`) puts under budget x (1 - headroom)
is planned as the probe's would be (`timm_ext.tune.plan.plan_run`): the recipe's global batch kept at its split, or
with `--select max` the largest micro-batch, on `--nproc` x `--nnodes` ranks. Several budgets give a "what fits
where" table; the first budget's plan is the one written as the YAML config and train command.
"""
import argparse
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import torch

from ..memory import BudgetError, MemoryBudget, default_headroom, format_bytes, parse_budget
from ..probe.device_memory import onednn_runs
from ..probe.estimate import MemoryEstimate, estimate_memory
from ..probe.search import NothingFitsError, default_grid
from ..probe.trial import nothing_fits_advice
from .plan import RunPlan, plan_run
from .tuner import recipe_global_batch

__all__ = ['EstimatedPlan', 'EstimatedRun', 'parse_budgets', 'plan_from_estimate', 'estimate_report',
           'plan_with_estimate']

TABLE_SIZES = 5  # rows of the per-batch table, up to the first budget's micro-batch


@dataclass(frozen=True)
class EstimatedPlan:
    """One budget's plan from the estimate.

    Attributes:
        budget_text: The budget as given.
        budget: Its bytes (the card's memory on CUDA).
        micro_batch: The largest micro-batch predicted within the headroom, on the grid (0: nothing fits).
        plan: The accumulation and LR plan (None when nothing fits).
    """
    budget_text: str
    budget: int
    micro_batch: int
    plan: Optional[RunPlan]


def parse_budgets(text: str, device_type: str) -> List[Tuple[str, int]]:
    """The comma-separated budgets of --mem-budget in bytes; a fraction needs the device to be here.

    Raises:
        BudgetError: A budget is not a size, or a fraction of a device that is not here.
    """
    budgets = []
    for part in [p.strip() for p in text.split(',') if p.strip()]:
        budget: MemoryBudget = parse_budget(part)
        if budget.fraction is not None and device_type == 'cuda' and not torch.cuda.is_available():
            raise BudgetError(f"--mem-budget {part}: a fraction of a GPU needs the GPU; give the card's memory as a "
                              f"size, e.g. '80GiB'")
        # a size is the planned machine's, not this one's: only a fraction is taken of the device here
        budgets.append((part, budget.num_bytes or budget.resolve(torch.device(device_type))))
    return budgets


def plan_from_estimate(args: argparse.Namespace, device_type: str, estimate: MemoryEstimate,
                       budgets: List[Tuple[str, int]], world_size: int, recipe_global: int) -> List[EstimatedPlan]:
    """Each budget's largest micro-batch under the headroom and its plan (see the module doc)."""
    grid = default_grid(device_type, args.batch_multiple)
    plans = []
    for text, num_bytes in budgets:
        limit = estimate.device.usable(num_bytes) * (1 - args.mem_headroom)
        largest = estimate.largest_batch(limit)
        if args.max_batch:
            largest = min(largest, args.max_batch)
        micro = grid.snap(largest) if largest >= 1 else 0
        if micro < 1 or micro > largest:
            plans.append(EstimatedPlan(text, num_bytes, 0, None))
            continue
        target = args.target_global_batch if args.select == 'max' else recipe_global
        plans.append(EstimatedPlan(text, num_bytes, micro, plan_run(args, micro, world_size, target)))
    return plans


def estimate_report(estimate: MemoryEstimate, plans: List[EstimatedPlan], headroom: float,
                    nodes: int, nproc: int) -> List[str]:
    """The estimate's header, the per-batch table of the first budget, and the 'what fits where' table."""
    first = plans[0]
    top = max(first.micro_batch, 8)
    sizes = sorted({max(1, round(top * k / TABLE_SIZES)) for k in range(1, TABLE_SIZES + 1)})
    ranks = f'{nodes} node(s) x {nproc} process(es)' if nodes > 1 else f'{nproc} process(es)'
    lines = [f'Estimate (no real trial ran): {estimate.describe}, traced on fake tensors in {estimate.seconds:.1f} s; '
             f'for {estimate.device.name}, {ranks}, headroom {headroom:.0%}.',
             f'Assumed: {estimate.device.assumptions}.', '', 'Predicted peak per micro-batch:',
             *estimate.table(sizes, estimate.device.usable(first.budget)), '', 'What fits where:',
             f'{"budget":>10s} {"fits up to":>11s} {"micro-batch":>12s} {"accum":>6s} {"global":>7s} {"LR":>9s} '
             f'{"predicted peak":>15s}']
    for p in plans:
        if p.plan is None:
            lines.append(f'{p.budget_text:>10s}   nothing fits (not even batch 1 within the headroom)')
            continue
        peak = format_bytes(estimate.peak(p.plan.micro_batch))
        lines.append(f'{p.budget_text:>10s} {p.micro_batch:>11d} {p.plan.micro_batch:>12d} {p.plan.accum_steps:>6d} '
                     f'{p.plan.global_batch:>7d} {p.plan.lr:>9.4g} {peak:>15s}')
    return lines


@dataclass(frozen=True)
class EstimatedRun:
    """--estimate's decision: the estimate, one plan a budget (the first is the run's) and the report lines."""
    estimate: MemoryEstimate
    plans: List[EstimatedPlan]
    lines: List[str]


def plan_with_estimate(args: argparse.Namespace, given: Set[str]) -> EstimatedRun:
    """The whole --estimate decision for tune_batch.py's parsed `args` (no device, no data, no trial).

    Raises:
        EstimateError: The step cannot be traced.
        NothingFitsError: Not even batch 1 fits the first budget by the estimate.
        BudgetError: A budget cannot be read here (`parse_budgets`).
    """
    device_type = args.device.split(':', 1)[0]
    world_size = args.nproc * args.nnodes
    budgets = parse_budgets(args.mem_budget or '1.0', device_type)
    if args.mem_headroom is None:
        args.mem_headroom = default_headroom(torch.device(device_type))
    run_args = argparse.Namespace(**{**vars(args), 'distributed': world_size > 1, 'world_size': world_size,
                                     'rank': 0, 'local_rank': 0})
    onednn = onednn_runs(device_type)
    estimate = estimate_memory(run_args, device_type, onednn)
    recipe_global, _ = recipe_global_batch(args, given, world_size)
    plans = plan_from_estimate(run_args, device_type, estimate, budgets, world_size, recipe_global)
    lines = estimate_report(estimate, plans, args.mem_headroom, args.nnodes, args.nproc)
    chosen = plans[0].plan
    if chosen is None:
        print('\n'.join(lines))
        raise NothingFitsError(f'nothing fits {plans[0].budget_text} by the estimate; {nothing_fits_advice(args)}')
    lines += ['', f'Plan for {plans[0].budget_text}: global batch {chosen.global_batch} = {chosen.micro_batch} x '
                  f'{world_size} rank(s) x {chosen.accum_steps}. {chosen.reason}',
              f'LR {chosen.lr:g} ({chosen.lr_rule or "given"}): {chosen.lr_reason}']
    return EstimatedRun(estimate, plans, lines)
