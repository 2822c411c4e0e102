#!/usr/bin/env python3
"""Find the largest batch that fits, plan accumulation and the LR, write a train.py config, and train.

    python tune_batch.py --data-dir /data/imagenet --model resnet50 --amp --mem-budget 0.9
    python tune_batch.py -c recipe.yaml --target-global-batch 4096 --nproc 8 --dry-run

Takes every train.py flag (the same parser definition) plus the batch-tuning group below. Steps: probe the
largest micro-batch under the memory budget with real training steps (`timm_ext.probe_train`), plan accumulation
for the wanted global batch and the LR (`timm_ext.tune_plan`), write a YAML config that train.py (ours or stock)
reads with `-c`, print a report and the train command, then run it unless `--dry-run`. With `--nproc N` the probe
runs on N ranks under torchrun (each rank probes; they agree on the smallest) and training is launched through
distributed_train.sh. With `--select critical` a short warm-up of the run at the probed micro-batch estimates the
gradient noise scale, and the global batch nearest to it is planned instead (`timm_ext.critical_batch`).
"""
import argparse
import copy
import functools
import logging
import os
import subprocess
import sys
from typing import List, Optional

import torch
import torch.distributed as dist
from timm import utils
from timm.models import safe_model_name

from timm_ext.arg_checks import TRAIN_DOMAINS, TUNE_DOMAINS, writable_file_problem
from timm_ext.checkpoint import atomic_text
from timm_ext.critical_batch import DEFAULT_WARMUP_UPDATES, measure_noise_scale, plan_critical
from timm_ext.distributed import DeviceError, init_device
from timm_ext.memory import BudgetError, MemoryBudget, device_name, format_bytes, parse_budget, physical_memory
from timm_ext.oom_recovery import OomRecoveryError
from timm_ext.probe import (
    SELECT_MODES, BatchGrid, DecayGrid, MultipleGrid, NothingFitsError, ProbeError, die_with_parent, format_table,
    format_trial, select_batch_size, trials_to_json,
)
from timm_ext.probe_cache import ProbeCache, probe_key
from timm_ext.probe_train import (
    ProbeOutcome, TrainTrialSetup, build_train_trial, nothing_fits_advice, probe_train_batch,
)
from timm_ext.train_args import EXTENSIONS_GROUP, build_parser, parse_args
from timm_ext.train_setup import SetupError, UsageError, build_datasets, check_arg_combinations, check_inputs
from timm_ext.tune_plan import config_values, extension_flags, plan_run, shell_line, train_command, tuned_config_text

_logger = logging.getLogger('tune_batch')

TUNE_GROUP = 'Batch tuning (tune_batch.py)'
SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
TIMED_STEPS = 3  # timed updates per trial after the warm-up update; the fastest counts
RETIME_ROUNDS = 2  # --select throughput: interleaved rounds re-timing the close sizes (see select_batch_size)


def build_tune_parser() -> argparse.ArgumentParser:
    """train.py's parser with the batch-tuning group added."""
    parser = build_parser(description='Probe the largest batch that fits, plan accumulation and LR, then train',
                          prog='tune_batch.py')
    group = parser.add_argument_group(TUNE_GROUP, 'How the batch is probed and the run planned.')
    group.add_argument('--mem-budget', default=None, metavar='SIZE',
                       help="memory the run may use: a size ('12GiB', '500MB') or a fraction of the device ('0.8'); "
                            "on CPU, memory above what the process holds when probing starts (default: all)")
    group.add_argument('--mem-headroom', type=float, default=0.1, metavar='FRAC',
                       help='fraction of the budget the chosen batch leaves free, judged on measured peak memory')
    group.add_argument('--select', default='max', choices=SELECT_MODES + ('critical',),
                       help='max: largest batch that fits; throughput: smallest batch within --throughput-tol of '
                            'the best samples/s measured; critical: a short warm-up at the largest micro-batch '
                            'estimates the gradient noise scale B_simple, and the global batch nearest it is planned')
    group.add_argument('--critical-updates', type=int, default=DEFAULT_WARMUP_UPDATES, metavar='N',
                       help='warm-up updates that estimate B_simple (--select critical)')
    group.add_argument('--throughput-tol', type=float, default=0.05, metavar='FRAC',
                       help='how far below the best samples/s still counts as best (--select throughput)')
    group.add_argument('--batch-multiple', type=int, default=None, metavar='N',
                       help='try only multiples of N between a fit and a failure (default: the decay grid '
                            '..., 64, 96, 128, 192, ...)')
    group.add_argument('--max-batch', type=int, default=None, metavar='N',
                       help='largest micro-batch worth trying (the dataset size per rank is always a limit)')
    group.add_argument('--probe-start', type=int, default=2, metavar='N',
                       help='first micro-batch tried; the probe doubles it until one does not fit')
    group.add_argument('--target-global-batch', type=int, default=None, metavar='N',
                       help="keep a recipe's global batch: micro-batch x ranks x accumulation = N (exactly when a "
                            "split exists, else the nearest, with the LR rescaled)")
    group.add_argument('--nproc', type=int, default=1, metavar='N',
                       help='train on N processes of this node (through distributed_train.sh); each probes')
    group.add_argument('--tuned-config', default=None, metavar='PATH',
                       help='where to write the YAML config (default: ./output/tune/<model>-<img size>.yaml)')
    group.add_argument('--dry-run', action='store_true', default=False,
                       help='probe and plan, write the config and print the command, but do not train')
    group.add_argument('--no-cache', action='store_true', default=False,
                       help='probe again even if an identical request is cached')
    return parser


def _group_dests(parser: argparse.ArgumentParser, title: str) -> List[str]:
    group = next(g for g in parser._action_groups if g.title == title)
    return [a.dest for a in group._group_actions]


def _check_tune_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rules between tune_batch's flags (each flag's own range is checked by the parser: TUNE_DOMAINS)."""
    if args.select == 'critical' and args.target_global_batch:
        parser.error('argument --select critical: it chooses the global batch itself; drop --target-global-batch')
    problem = writable_file_problem('--tuned-config', args.tuned_config or default_config_path(args))
    if problem:
        parser.error(problem)


def main(argv: Optional[List[str]] = None) -> int:
    utils.setup_default_logging()
    if 'TORCHELASTIC_RUN_ID' in os.environ:  # a probing rank: end with its launcher, as its trials end with it
        die_with_parent(os.getppid())
    parser = build_tune_parser()
    args, _ = parse_args(argv, parser=parser, domains={**TRAIN_DOMAINS, **TUNE_DOMAINS})
    _check_tune_args(parser, args)
    prog = parser.prog
    try:
        # everything train.py would refuse, before any probe (ranks under torchrun read the world from the environment)
        check_arg_combinations(args, world_size=None if 'WORLD_SIZE' in os.environ else args.nproc)
        check_inputs(args)
        if args.nproc > 1 and 'WORLD_SIZE' not in os.environ:
            return relaunch_under_torchrun(parser, args, sys.argv[1:] if argv is None else argv)
        return tune(parser, args)
    except (UsageError, BudgetError) as e:
        print(f'{prog}: error: {e}', file=sys.stderr)
        return 2
    except (SetupError, DeviceError, ProbeError, OomRecoveryError) as e:
        print(f'{prog}: error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f'{prog}: interrupted; the memory cap is lifted and nothing was cached or written', file=sys.stderr)
        return 130


def relaunch_under_torchrun(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: List[str]) -> int:
    """Probe on `--nproc` ranks (torchrun, --dry-run), then launch training from here through distributed_train.sh."""
    config_path = args.tuned_config or default_config_path(args)
    # the ranks learn the world size from torchrun; an '--nproc' token would also trip torchrun's own parser
    rank_argv, skip = [], False
    for token in argv:
        if skip or token == '--nproc' or token.startswith('--nproc='):
            skip = token == '--nproc'
            continue
        rank_argv.append(token)
    probe_cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={args.nproc}',
                 os.path.join(SCRIPT_DIR, 'tune_batch.py'), *rank_argv, '--dry-run', '--tuned-config', config_path]
    rc = subprocess.call(probe_cmd, preexec_fn=functools.partial(die_with_parent, os.getpid()))
    if rc != 0 or args.dry_run:
        return rc
    command = train_command(sys.executable, SCRIPT_DIR, config_path, args.nproc, extension_flags(
        args, parser, _group_dests(parser, EXTENSIONS_GROUP)))
    return subprocess.call(command)


def default_config_path(args: argparse.Namespace) -> str:
    size = args.img_size or (args.input_size[-1] if args.input_size else 'default')
    return os.path.join('output', 'tune', f'{safe_model_name(args.model)}-{size}.yaml')


def probe_or_reuse(args: argparse.Namespace, setup: TrainTrialSetup, device: torch.device, budget: MemoryBudget,
                   budget_bytes: int, grid: BatchGrid, probe_select: str, world_size: int, max_batch: int,
                   trials_path: str) -> ProbeOutcome:
    """The probe's outcome for this request: from the cache when an identical one was probed, else probed now.

    Trials are printed live (rank 0) and the table is kept up to date at `trials_path` while probing.
    """
    primary = args.rank == 0
    settings = dict(budget=budget_bytes, headroom=args.mem_headroom, grid=repr(grid), start=args.probe_start,
                    max_batch=max_batch, timed_steps=TIMED_STEPS)
    if probe_select == 'throughput':  # the table then holds re-timings of the sizes the tolerance made close
        settings.update(retime_rounds=RETIME_ROUNDS, throughput_tol=args.throughput_tol)
    key = probe_key(args, setup.input_size, device_name(device), physical_memory(device), world_size, settings)
    cache = ProbeCache()
    cached = None if args.no_cache else cache.get(key)
    if args.distributed:  # rank 0's cache decides for all, so every rank takes the same path
        box = [cached if primary else None]
        dist.broadcast_object_list(box, src=0)
        cached = box[0]

    context = f'{setup.describe}, budget {format_bytes(budget_bytes)} on {device_name(device)}'
    if cached is not None:
        if primary:
            print(f'Probe: cached result for this request ({cache.path(key)}); no trials run.')
        try:
            selection = select_batch_size(cached, probe_select, args.throughput_tol, context)
        except NothingFitsError as e:
            raise NothingFitsError(f'{e}; {nothing_fits_advice(args)}', e.trials) from None
        outcome = ProbeOutcome(selection, budget_bytes, setup.describe, device_name(device))
    else:
        if primary:
            print(f'Probe: {setup.describe}; budget {format_bytes(budget_bytes)} ({budget}) on '
                  f'{device_name(device)}, headroom {args.mem_headroom:.0%}, sizes {args.probe_start}..{max_batch}.')
            os.makedirs(os.path.dirname(os.path.abspath(trials_path)), exist_ok=True)
        table = []

        def on_trial(trial):
            table.append(trial)
            if primary:
                print('  ' + format_trial(trial, budget_bytes), flush=True)
                atomic_text(trials_to_json(table, request=key, complete=False), trials_path)

        try:
            outcome = probe_train_batch(setup, budget, args.mem_headroom, probe_select, args.throughput_tol,
                                        args.probe_start, max_batch, grid, TIMED_STEPS, on_trial, RETIME_ROUNDS)
        except NothingFitsError as e:
            raise NothingFitsError(f'{e}; {nothing_fits_advice(args)}', e.trials) from None
        if primary:
            cache_file = cache.put(key, outcome.trials) if not args.no_cache else None
            atomic_text(trials_to_json(outcome.trials, request=key, complete=True), trials_path)
            if cache_file:
                print(f'Probe: {len(outcome.trials)} trials; cached in {cache_file}; table in {trials_path}.')
    return outcome


def tune(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    train_args = copy.deepcopy(args)  # as parsed: what the config describes (init_device adds runtime fields)
    device = init_device(args)
    world_size = args.world_size if args.distributed else args.nproc
    primary = args.rank == 0
    budget = parse_budget(args.mem_budget or '1.0')
    grid = MultipleGrid(args.batch_multiple) if args.batch_multiple else DecayGrid()
    config_path = args.tuned_config or default_config_path(args)
    probe_select = 'max' if args.select == 'critical' else args.select  # critical starts from the memory maximum
    trials_path = os.path.splitext(config_path)[0] + '.trials.json'

    setup = build_train_trial(args, device)
    dataset_train, _ = build_datasets(copy.deepcopy(args), 'RGB' if setup.input_size[0] == 3 else 'L')
    limits = [len(dataset_train) // max(world_size, 1)]
    if args.max_batch:
        limits.append(args.max_batch)
    max_batch = min(limits)
    if max_batch < 1:
        raise SetupError(f'the training split has fewer samples ({len(dataset_train)}) than ranks ({world_size})')

    budget_bytes = budget.resolve(device)
    outcome = probe_or_reuse(args, setup, device, budget, budget_bytes, grid, probe_select, world_size, max_batch,
                             trials_path)

    plan = plan_run(args, outcome.selection.batch_size, world_size, args.target_global_batch)
    critical_lines = []
    if args.select == 'critical':
        if primary:
            print(f'Critical batch: {args.critical_updates} warm-up updates at micro-batch '
                  f'{outcome.selection.batch_size} x accumulation 4 to estimate B_simple.', flush=True)
        estimate = measure_noise_scale(args, device, outcome.selection.batch_size, args.critical_updates)
        plan, critical_lines = plan_critical(args, estimate, outcome.selection.batch_size, world_size)
    train_dests = [d for d in parser_dests(parser) if d not in _group_dests(parser, TUNE_GROUP)]
    extension_dests = _group_dests(parser, EXTENSIONS_GROUP)
    stock_dests = [d for d in train_dests if d not in extension_dests]
    values = config_values(train_args, parser, stock_dests, plan)
    extras = extension_flags(train_args, parser, extension_dests)
    command = train_command(sys.executable, SCRIPT_DIR, config_path, world_size, extras)
    report = report_lines(outcome, plan, args, budget_bytes, extras) + critical_lines
    if primary:
        print('\n'.join(['', 'Trials:', format_table(outcome.trials, budget_bytes), ''] + report))
        os.makedirs(os.path.dirname(os.path.abspath(config_path)), exist_ok=True)
        atomic_text(tuned_config_text(values, report + ['', 'Train with: ' + shell_line(command)]), config_path)
        print(f'Config: {config_path}')
        print(f'Train command: {shell_line(command)}', flush=True)
    if args.distributed:
        dist.barrier()
        dist.destroy_process_group()
        if primary and not args.dry_run:
            print('Under torchrun tune_batch.py probes and plans only; run the train command above to train.')
        return 0
    if args.dry_run:
        return 0
    return subprocess.call(command)


def parser_dests(parser: argparse.ArgumentParser) -> List[str]:
    return [a.dest for a in parser._actions if a.dest not in (argparse.SUPPRESS, 'help', 'config')]


def report_lines(outcome: ProbeOutcome, plan, args: argparse.Namespace, budget_bytes: int,
                 extras: List[str]) -> List[str]:
    """The short report: probe choice, accumulation, global batch, LR and why (also the config's header)."""
    sel = outcome.selection
    lines = [
        f'tune_batch.py: {outcome.describe}',
        f'Budget {format_bytes(budget_bytes)} on {outcome.device_name}, headroom {args.mem_headroom:.0%}, '
        f'select {args.select}: micro-batch {sel.batch_size} ({sel.reason}; peak '
        f'{format_bytes(sel.trial.peak_bytes)}).',
    ]
    if sel.caveat:
        lines.append(f'Note: {sel.caveat}.')
    if plan.micro_batch != sel.batch_size:
        lines.append(f'Micro-batch {plan.micro_batch} used (<= {sel.batch_size}) to split the global batch exactly.')
    lines += [
        f'Accumulation {plan.accum_steps}, {plan.world_size} rank(s): global batch {plan.global_batch} = '
        f'{plan.micro_batch} x {plan.world_size} x {plan.accum_steps}. {plan.reason}',
        f'LR {plan.lr:g} ({plan.lr_rule or "given"}): {plan.lr_reason}',
    ]
    if extras:
        lines.append(f'Extension flags (our train.py only, on the command line): {" ".join(extras)}')
    return lines


if __name__ == '__main__':
    sys.exit(main())
