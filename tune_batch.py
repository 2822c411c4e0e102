#!/usr/bin/env python3
"""Choose the batch that reaches the recipe's result soonest, plan accumulation and LR, write a config, and train.

    python tune_batch.py --data-dir /data/imagenet --model resnet50 --amp --mem-budget 0.9
    python tune_batch.py -c recipe.yaml --target-global-batch 4096 --nproc 8 --dry-run

Takes every train.py flag (the same parser definition) plus the batch-tuning group below. Steps: probe the
largest micro-batch under the memory budget with real training steps (`timm_ext.probe.trial`), plan accumulation
for the wanted global batch and the LR (`timm_ext.tune.plan`), write a YAML config that train.py (ours or stock)
reads with `-c`, print a report and the train command, then train unless `--dry-run`: in this process, once
everything the probe built is released (the imports are paid once; the probe's model, optimizer and allocator cache
are gone). With `--nproc N` the probe runs on N ranks under torchrun (each rank probes; they agree on the smallest),
and once they have exited this process becomes distributed_train.sh (`timm_ext.tune.handover`). Started by torchrun
itself (several nodes, say), it probes and plans on every rank and prints the train command with the topology it was
started under (`timm_ext.launch`), for each node to run.

The global batch is an optimisation choice, not a memory one (`--select auto`, the default): a global batch the
recipe sets is kept exactly; with none set, stock's -b 128 is the recipe, and a bigger one is chosen only when the
run is long enough to pay for measuring the gradient noise scale (`timm_ext.tune.critical_batch`) and the bigger batch is
predicted to reach the recipe's result clearly sooner, the run lengthened to match (`timm_ext.tune.batch_choice`).

A `--train-img-sizes` schedule gets a batch per size (`timm_ext.tune.img_sizes`): each size probed and written as
`train_batch_sizes` (a stock key), each the largest that fits, with the LR of the schedule's average batch as timm
computes it; `--train-batch-sizes` the recipe sets are kept (each checked with one trial), and a recipe's `-b` or
`--target-global-batch` stays the batch at every size, as in stock.

The evaluation between epochs keeps no activations for a backward pass, so several times the training micro-batch
fits: when the run evaluates long enough for a few forward-only trials to pay (`plan_eval_batch`), they find the
largest eval batch within the same budget and the YAML sets `validation_batch_size` (a stock key).
"""
import argparse
import copy
import dataclasses
import functools
import importlib.util
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from timm import utils
from timm.models import safe_model_name

from timm_ext.arg_checks import TRAIN_DOMAINS, TUNE_DOMAINS, writable_file_problem
from timm_ext.tune.batch_choice import (
    MAX_TUNE_SHARE, GlobalBatchChoice, NoiseEstimate, batch_warnings, choose_global_batch, format_candidates,
    scaled_schedule, speeds_by_micro_batch, tuning_pays, updates_per_epoch,
)
from timm_ext.atomic_files import atomic_text
from timm_ext.tune.critical_batch import (
    ESTIMATE_ACCUM, ESTIMATE_MICRO_BATCH, ESTIMATE_WINDOWS, estimate_samples, measure_noise_scale,
)
from timm_ext.cuda_backends import configure_cuda_backends
from timm_ext.distributed import DeviceError, check_device, init_device
from timm_ext.errors import TimmExtError, report
from timm_ext.tune.handover import exec_training
from timm_ext.launch import current_topology
from timm_ext.memory import (
    MemoryBudget, device_name, format_bytes, free_memory, parse_budget, physical_memory,
)
from timm_ext.probe.search import (
    SELECT_MODES, BatchGrid, NothingFitsError, default_grid, die_with_parent, format_table, format_trial,
    select_batch_size, trials_to_json,
)
from timm_ext.probe.cache import ProbeCache, probe_key
from timm_ext.probe.trial import (
    ProbeOutcome, TrainTrialSetup, build_train_trial, nothing_fits_advice, probe_train_batch,
)
from timm_ext.train.args import EXTENSIONS_GROUP, build_parser, config_keys, given_dests, group_dests, parse_args
from timm_ext.train.setup import SetupError, batch_multiple, build_datasets, check_arg_combinations, check_inputs
from timm_ext.tune.plan import (
    RunPlan, config_values, extension_flags, plan_global_batch, plan_run, shell_line, train_command,
    tuned_config_text,
)
from timm_ext.tune.img_sizes import (
    EQUALISE, KEPT, RECIPE, SizeResult, check_kept_fits, format_size_table, plan_schedule, probe_schedule,
    schedule_inputs, schedule_mode, shape_cache_note, size_trial_args,
)
from timm_ext.tune.plot import write_probe_plot

_logger = logging.getLogger('tune_batch')

TUNE_GROUP = 'Batch tuning (tune_batch.py)'
SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
TIMED_STEPS = 3  # timed updates per trial after the warm-up update; the fastest counts
RETIME_ROUNDS = 2  # --select throughput: interleaved rounds re-timing the close sizes (see select_batch_size)
SEARCH_TRIALS = 6  # trials judging bigger batches may take (doublings up to B_noise), for whether judging pays
EVAL_MAX_FACTOR = 8  # the eval probe tries up to this many training micro-batches (x2 steps: about 3 trials)
EVAL_PROBE_TRIALS = 3  # what the eval probe is budgeted at, for judging whether it pays
FORWARD_SHARE = 1 / 3  # an eval forward takes about this share of a training step's time (forward + backward)
SELECTIONS = ('auto', 'critical') + SELECT_MODES


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
    group.add_argument('--select', default='auto', choices=SELECTIONS,
                       help="auto: keep the recipe's global batch (-b x ranks x --grad-accum-steps, or "
                            "--target-global-batch) at its fastest split; when the recipe sets none, a bigger one "
                            "only if the run is long enough to measure the noise scale and a bigger batch is predicted "
                            "to reach the result clearly sooner (the run lengthened to match). critical: judge a "
                            "bigger global batch that way even when the recipe sets one. max: the largest micro-batch "
                            "that fits. throughput: the fastest micro-batch for the recipe's global batch")
    group.add_argument('--throughput-tol', type=float, default=0.05, metavar='FRAC',
                       help='how far below the best samples/s still counts as best (--select throughput)')
    group.add_argument('--batch-multiple', type=int, default=None, metavar='N',
                       help='the fine step of the probe: it tries only multiples of N (default: 8 on CUDA, '
                            'for tensor cores; 1 on CPU)')
    group.add_argument('--max-batch', type=int, default=None, metavar='N',
                       help='largest micro-batch worth trying (the dataset size per rank is always a limit)')
    group.add_argument('--probe-start', type=int, default=2, metavar='N',
                       help='first micro-batch tried; its measured peak aims the next trial at the budget')
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
        given = given_dests(argv, parser)
        schedule_mode(args, given)  # a schedule it cannot honour is refused before any probe
        check_inputs(args)
        if args.nproc > 1 and 'WORLD_SIZE' not in os.environ:
            return relaunch_under_torchrun(parser, args, sys.argv[1:] if argv is None else argv)
        return tune(parser, args, given)
    except TimmExtError as e:
        return report(prog, e)
    except KeyboardInterrupt:
        print(f'{prog}: interrupted; the memory cap is lifted and nothing was cached or written', file=sys.stderr)
        return 130


def relaunch_under_torchrun(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: List[str]) -> int:
    """Probe on `--nproc` ranks (torchrun, --dry-run), then launch training from here through distributed_train.sh."""
    try:  # each rank would refuse a missing GPU alone, and torchrun would add its own traceback
        if args.device.split(':', 1)[0] == 'cuda':
            check_device(args.device, local_rank=args.nproc - 1)
    except DeviceError as e:
        return report(parser.prog, e)
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
        args, parser, group_dests(parser, EXTENSIONS_GROUP)))
    return exec_training(command)  # the probe ranks have exited; this process becomes the launcher


def default_config_path(args: argparse.Namespace) -> str:
    size = args.img_size or (args.input_size[-1] if args.input_size else 'default')
    return os.path.join('output', 'tune', f'{safe_model_name(args.model)}-{size}.yaml')


@dataclass
class ProbeRequest:
    """What every probe of one tune_batch.py run shares: the run's trial, the device and budget, where to report."""
    args: argparse.Namespace
    setup: TrainTrialSetup
    device: torch.device
    budget: MemoryBudget
    budget_bytes: int
    grid: BatchGrid
    world_size: int
    trials_path: str
    phase: str = 'train'  # or 'eval': the evaluation forward (`TrainTrialSetup.eval_trials`)
    seconds_per_trial: Optional[float] = None  # wall time of one trial in the last probe run here (not cached)

    def cache_key(self, select: str, max_batch: int, start: int) -> Dict[str, Any]:
        """The probe cache's key for this request probed with these settings."""
        settings = dict(budget=self.budget_bytes, headroom=self.args.mem_headroom, grid=repr(self.grid), start=start,
                        max_batch=max_batch, timed_steps=TIMED_STEPS)
        if select == 'throughput':  # the table then holds re-timings of the sizes the tolerance made close
            settings.update(retime_rounds=RETIME_ROUNDS, throughput_tol=self.args.throughput_tol)
        if self.phase != 'train':
            settings.update(phase=self.phase)
        return probe_key(self.args, self.setup.input_size, device_name(self.device), physical_memory(self.device),
                         self.world_size, settings)

    def is_cached(self, select: str, max_batch: int, start: int) -> bool:
        """Whether this process's cache holds the outcome (rank 0's answer is the one that counts under DDP)."""
        return not self.args.no_cache and ProbeCache().get(self.cache_key(select, max_batch, start)) is not None

    def run(self, select: str, max_batch: int, start: Optional[int] = None) -> ProbeOutcome:
        started = time.perf_counter()
        outcome = probe_or_reuse(self, select, max_batch, start or self.args.probe_start)
        if not outcome.cached:
            self.seconds_per_trial = (time.perf_counter() - started) / max(1, len(outcome.trials))
        return outcome


def probe_or_reuse(request: ProbeRequest, probe_select: str, max_batch: int, start: int) -> ProbeOutcome:
    """The probe's outcome for this request: from the cache when an identical one was probed, else probed now.

    Trials are printed live (rank 0) and the table is kept up to date at `request.trials_path` while probing.
    """
    args, setup, device, budget_bytes = request.args, request.setup, request.device, request.budget_bytes
    primary = args.rank == 0
    key = request.cache_key(probe_select, max_batch, start)
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
        return ProbeOutcome(selection, budget_bytes, setup.describe, device_name(device), cached=True)
    if primary:
        sizes = f'size {start}' if start >= max_batch else f'sizes {start}..{max_batch}'
        print(f'Probe: {setup.describe}; budget {format_bytes(budget_bytes)} ({request.budget}) on '
              f'{device_name(device)}, headroom {args.mem_headroom:.0%}, {sizes}.')
        os.makedirs(os.path.dirname(os.path.abspath(request.trials_path)), exist_ok=True)
    table = []
    prefix = '  ' if request.phase == 'train' else f'  {request.phase} '

    def on_trial(trial):
        table.append(trial)
        if primary:
            print(prefix + format_trial(trial, budget_bytes), flush=True)
            atomic_text(trials_to_json(table, request=key, complete=False), request.trials_path)

    try:
        outcome = probe_train_batch(setup, request.budget, args.mem_headroom, probe_select, args.throughput_tol,
                                    start, max_batch, request.grid, TIMED_STEPS, on_trial, RETIME_ROUNDS)
    except NothingFitsError as e:
        raise NothingFitsError(f'{e}; {nothing_fits_advice(args)}', e.trials) from None
    if primary:
        cache_file = cache.put(key, outcome.trials) if not args.no_cache else None
        atomic_text(trials_to_json(outcome.trials, request=key, complete=True), request.trials_path)
        if cache_file:
            print(f'Probe: {len(outcome.trials)} trials; cached in {cache_file}; table in {request.trials_path}.')
    return outcome


@dataclass
class TunedRun:
    """What tuning decided: the probe behind the micro-batch, the plan, the schedule changes and the report."""
    outcome: ProbeOutcome
    plan: RunPlan
    schedule: Dict[str, Any] = field(default_factory=dict)
    lines: List[str] = field(default_factory=list)
    noise: Optional[NoiseEstimate] = None
    choice: Optional[GlobalBatchChoice] = None
    eval_batch: Optional[int] = None
    eval_outcome: Optional[ProbeOutcome] = None
    eval_lines: List[str] = field(default_factory=list)
    sizes: List[SizeResult] = field(default_factory=list)  # a --train-img-sizes schedule's probes, one per size
    size_batches: Optional[List[int]] = None  # the train_batch_sizes the run trains at


def recipe_global_batch(args: argparse.Namespace, given: Set[str], world_size: int) -> Tuple[int, str]:
    """The recipe's global batch, and what set it ('' when nothing did: stock's default -b 128)."""
    if args.target_global_batch:
        return args.target_global_batch, '--target-global-batch'
    flags = [flag for dest, flag in (('batch_size', '-b/--batch-size'), ('grad_accum_steps', '--grad-accum-steps'))
             if dest in given]
    return args.batch_size * world_size * args.grad_accum_steps, ' and '.join(flags)


def choose_by_time(request: ProbeRequest, recipe_global: int, set_by: str, train_samples: int,
                   max_batch: int) -> TunedRun:
    """--select auto / critical: the recipe's global batch at its fastest split, and a bigger one only when the run is
    long enough to pay for measuring it and it is predicted to reach the recipe's result clearly sooner."""
    args, world_size = request.args, request.world_size
    needed = math.ceil(recipe_global / world_size)
    limit = min(max_batch, needed)
    started = time.perf_counter()
    outcome = request.run('max', limit, start=limit)  # one trial when the recipe fits, a probe down when not
    trial_s = time.perf_counter() - started
    plan = plan_run(args, outcome.selection.batch_size, world_size, recipe_global)
    who = f'set by {set_by}' if set_by else "stock train.py's default -b 128"
    one_batch = plan.accum_steps == 1
    if one_batch:
        how = f'fits as one batch of {plan.micro_batch} per rank: one trial, nothing to search for it.'
    else:
        why = (f'the training split holds only {max_batch} samples per rank' if max_batch < needed else
               f'a batch of {needed} per rank does not fit')
        how = f'is built from micro-batches of {plan.micro_batch} x {plan.accum_steps} accumulation: {why}.'
    lines = [f'The recipe\'s global batch {recipe_global} ({who}) {how}']
    if args.select == 'auto' and set_by:
        lines.append('Kept it exactly: --select auto chooses only the micro-batch and accumulation of a global batch '
                     'the recipe sets (--select critical would judge a bigger one).')
        return TunedRun(outcome, plan, lines=lines)
    speed = outcome.selection.trial.samples_per_s or 0.0
    run_s = args.epochs * train_samples / speed if speed else math.inf
    estimate_micro = min(plan.micro_batch, ESTIMATE_MICRO_BATCH)
    per_trial_s = trial_s / max(1, len(outcome.trials))
    # the estimate's small micro-batches run slower than the recipe's: count them at half its speed
    cost_s = SEARCH_TRIALS * per_trial_s + 2 * estimate_samples(estimate_micro, world_size) / max(speed, 1e-9)
    if not one_batch:
        lines.append('A bigger global batch would need more accumulation, which adds no samples/s: kept the recipe\'s.')
        return TunedRun(outcome, plan, lines=lines)
    if args.select == 'auto' and not tuning_pays(run_s, cost_s):
        lines.append(f'Kept it: the run is predicted at ~{run_s:.0f} s of training compute ({speed:.0f} samples/s '
                     f'measured), and judging a bigger batch would cost ~{cost_s:.0f} s, more than '
                     f'{MAX_TUNE_SHARE:.0%} of that; too short for tuning to pay off.')
        return TunedRun(outcome, plan, lines=lines)

    if args.rank == 0:
        print(f'Noise scale: {ESTIMATE_WINDOWS} windows of {ESTIMATE_ACCUM} x {estimate_micro} on the real data.',
              flush=True)
    noise = measure_noise_scale(args, request.device, estimate_micro)
    searched, speeds = time_bigger_batches(request, outcome, plan.micro_batch, speed, max_batch, noise)
    choice = choose_global_batch((plan.micro_batch, plan.accum_steps), speeds, world_size, train_samples,
                                 args.epochs, noise)
    chosen = choice.chosen
    if choice.changed:
        plan = plan_global_batch(args, chosen.micro_batch, chosen.accum_steps, world_size, recipe_global)
    spent = time.perf_counter() - started
    lines += [f'Noise scale: {noise.describe()}.', 'Global batches considered (predicted time to the recipe\'s '
              'result):', format_candidates(choice), f'Choice: {choice.reason}.',
              f'Tuning cost {spent:.1f} s, {spent / max(chosen.predicted_s, 1e-9):.1%} of the predicted run.']
    schedule = scaled_schedule(vars(args), args.epochs, chosen.epochs)
    return TunedRun(searched, plan, schedule, lines, noise, choice)


def time_bigger_batches(request: ProbeRequest, recipe: ProbeOutcome, micro_batch: int, speed: float,
                        max_batch: int, noise: NoiseEstimate) -> Tuple[ProbeOutcome, Dict[int, float]]:
    """Samples/s of the micro-batches a bigger global batch could use: doublings of the recipe's, up to the top of
    the B_noise range (beyond it `batch_choice` would refuse them anyway) and what fits, one trial each.

    Returns:
        The recipe's probe outcome with every trial added (for the report), and the measured samples/s per
        micro-batch (the recipe's included).
    """
    speeds = {micro_batch: speed}
    trials = list(recipe.trials)
    multiple = batch_multiple(request.args)
    size = micro_batch * 2
    limit = min(max_batch, int(noise.high / request.world_size) if noise.found and math.isfinite(noise.high) else 0)
    while size <= limit:
        outcome = request.run('max', size, start=size)  # one trial when it fits, a probe down when not
        trials += outcome.trials
        speeds.update({m: s for m, s in speeds_by_micro_batch(outcome.trials).items() if m % multiple == 0})
        if outcome.selection.batch_size < size:
            break  # the memory limit: nothing bigger fits
        size *= 2
    selection = dataclasses.replace(recipe.selection, trials=trials)
    return dataclasses.replace(recipe, selection=selection), speeds


def plan_tuned_run(parser: argparse.ArgumentParser, args: argparse.Namespace, given: Set[str], device: torch.device,
                   world_size: int, config_path: str) -> TunedRun:
    """Probe and decide: the micro-batch, accumulation, global batch, LR and schedule of the run (no training).

    Everything the probe built (model, optimizer, trial closures) is local to this call, so it is released when
    the call returns, before training starts on the same device.
    """
    budget = parse_budget(args.mem_budget or '1.0')
    grid = default_grid(device.type, args.batch_multiple)
    setup = build_train_trial(args, device)
    dataset_train, dataset_eval = build_datasets(args, 'RGB' if setup.input_size[0] == 3 else 'L')
    setup.eval_samples = len(dataset_eval) if dataset_eval is not None else 0  # trials run train.py's eval shapes
    train_samples = len(dataset_train)
    max_batch = min([train_samples // max(world_size, 1)] + ([args.max_batch] if args.max_batch else []))
    if max_batch < 1:
        raise SetupError(f'the training split has fewer samples ({train_samples}) than ranks ({world_size})')
    request = ProbeRequest(args, setup, device, budget, budget.resolve(device), grid, world_size,
                           os.path.splitext(config_path)[0] + '.trials.json')
    recipe_global, set_by = recipe_global_batch(args, given, world_size)
    mode = schedule_mode(args, given)
    if mode in (EQUALISE, KEPT):
        tuned = tune_schedule(request, mode, max_batch, given)
    elif args.select == 'max':
        outcome = request.run('max', max_batch)
        tuned = TunedRun(outcome, plan_run(args, outcome.selection.batch_size, world_size, args.target_global_batch))
    elif args.select == 'throughput':
        outcome = request.run('throughput', min(max_batch, math.ceil(recipe_global / world_size)))
        tuned = TunedRun(outcome, plan_run(args, outcome.selection.batch_size, world_size, recipe_global), lines=[
            f'--select throughput chose the micro-batch for the recipe\'s global batch {recipe_global}; it never '
            f'makes the global batch bigger.'])
    else:
        tuned = choose_by_time(request, recipe_global, set_by, train_samples, max_batch)
    if mode == RECIPE:
        tuned.lines.append(f'--train-img-sizes: the recipe\'s batch ({set_by}) trains at every size, as in stock '
                           f'timm; probed at the largest size, {tuned.outcome.describe}.')
        tuned.lines += shape_cache_note(device)
    epochs = tuned.schedule.get('epochs', args.epochs)
    updates = epochs * updates_per_epoch(train_samples, tuned.plan.micro_batch, world_size, tuned.plan.accum_steps)
    tuned.lines += [f'Warning: {w}.' for w in batch_warnings(tuned.plan.global_batch, updates, tuned.noise)]
    if 'validation_batch_size' in given:
        tuned.eval_lines = [f'Eval batch: --validation-batch-size {args.validation_batch_size} as given; not probed.']
    elif dataset_eval is not None:
        eval_request = dataclasses.replace(request, setup=setup.eval_trials(tuned.plan.micro_batch), phase='eval',
                                           trials_path=os.path.splitext(config_path)[0] + '.eval.trials.json')
        tuned.eval_batch, tuned.eval_outcome, tuned.eval_lines = plan_eval_batch(
            eval_request, tuned, len(dataset_eval), epochs, request.seconds_per_trial)
    return tuned


def tune_schedule(request: ProbeRequest, mode: str, max_batch: int, given: Set[str]) -> TunedRun:
    """A --train-img-sizes schedule (`timm_ext.tune.img_sizes`): the batch at each size probed (or the given one
    checked), and the LR of the schedule's average batch."""
    args, largest = request.args, tuple(request.setup.input_size)
    wanted = list(args.train_batch_sizes) if mode == KEPT else None
    base = os.path.splitext(request.trials_path)[0]

    def probe_at(input_size: Tuple[int, int, int], start: int, limit: int) -> ProbeOutcome:
        # the run's own setup where it already trains at this size; else one for this size, released after
        setup = (request.setup if tuple(input_size) == largest else dataclasses.replace(
                 build_train_trial(size_trial_args(args, input_size), request.device),
                 eval_samples=request.setup.eval_samples))
        label = 'x'.join(map(str, input_size[1:]))
        return dataclasses.replace(request, setup=setup, trials_path=f'{base}.{label}.json').run('max', limit, start)

    results = probe_schedule(schedule_inputs(args, largest[0]), probe_at, args.probe_start, request.grid, max_batch,
                             batch_multiple(args), wanted)
    if wanted is not None:
        check_kept_fits(results, wanted)
    batches = wanted or [r.batch for r in results]
    top = max(results, key=lambda r: r.input_size[1] * r.input_size[2])
    batch_size = args.batch_size if 'batch_size' in given else top.batch
    how = 'as given, each checked to fit' if wanted else 'each the largest that fits at its size'
    plan, _ = plan_schedule(args, batches, request.world_size, batch_size, how)
    lines = [f'Schedule --train-img-sizes {" ".join(r.label for r in results)}: train_batch_sizes {batches} ({how}); '
             f'-b {batch_size} is then only the eval batch train.py falls back to.', *shape_cache_note(request.device)]
    return TunedRun(top.outcome, plan, lines=lines, sizes=results, size_batches=batches)


def eval_probe_pays(request: ProbeRequest, eval_s: float, cost_s: float) -> bool:
    """`tuning_pays` for the eval probe, decided on rank 0 (wall times differ between ranks; all must agree)."""
    pays = [tuning_pays(eval_s, cost_s)]
    if request.args.distributed:
        dist.broadcast_object_list(pays, src=0)
    return pays[0]


def plan_eval_batch(request: ProbeRequest, tuned: TunedRun, eval_samples: int, epochs: int,
                    seconds_per_trial: Optional[float]) -> Tuple[Optional[int], Optional[ProbeOutcome], List[str]]:
    """The eval batch for `validation_batch_size`: the largest forward-only batch that fits the budget, probed only
    when the run's evaluations last long enough for the trials to cost at most MAX_TUNE_SHARE of them (a cached
    outcome costs nothing). The trial cost is the wall time of the training trials just run, or, when those came from
    the cache, the measured step time over the trial's steps at the largest eval batch.

    Returns:
        (the eval batch, or None to leave train.py's default, the micro-batch; the probe; report lines)
    """
    args, micro = request.args, tuned.plan.micro_batch
    per_rank = math.ceil(eval_samples / request.world_size)
    limit = min(per_rank, EVAL_MAX_FACTOR * micro)
    if limit <= micro:
        return None, None, [f'Eval batch: the validation split ({per_rank} per rank) is one batch of the micro-batch '
                            f'{micro} already; not probed.']
    trial = tuned.outcome.selection.trial
    train_speed = trial.samples_per_s or math.inf
    passes = math.ceil(epochs / args.val_interval)
    eval_s = passes * per_rank / (train_speed / FORWARD_SHARE)
    start = min(2 * micro, limit)
    per_trial = seconds_per_trial or (TIMED_STEPS + 1) * (trial.ms_per_step or 0.0) / 1000 * EVAL_MAX_FACTOR
    cost_s = 0.0 if request.is_cached('max', limit, start) else EVAL_PROBE_TRIALS * per_trial  # a cached one is free
    if not eval_probe_pays(request, eval_s, cost_s):
        return None, None, [f'Eval batch: not probed: {passes} evaluations are predicted at ~{eval_s:.1f} s and '
                            f'{EVAL_PROBE_TRIALS} forward-only trials would cost ~{cost_s:.1f} s, more than '
                            f'{MAX_TUNE_SHARE:.0%} of that; train.py evaluates at the micro-batch {micro}.']
    outcome = request.run('max', limit, start=start)
    chosen = outcome.selection.batch_size
    if chosen <= micro:
        return None, outcome, [f'Eval batch: nothing above the micro-batch {micro} fits the budget for evaluation; '
                               f'train.py evaluates at {micro}.']
    return chosen, outcome, [
        f'Eval batch {chosen} = {chosen / micro:.3g} x the micro-batch (forward only, no gradients, optimizer state '
        f'resident; {len(outcome.trials)} trials, peak {format_bytes(outcome.selection.trial.peak_bytes)}): '
        f'validation_batch_size in the YAML; evaluation results do not depend on it.']


def tune(parser: argparse.ArgumentParser, args: argparse.Namespace, given: Set[str]) -> int:
    train_args = copy.deepcopy(args)  # as parsed: what the config describes (init_device adds runtime fields)
    device = init_device(args)
    configure_cuda_backends(device)  # trials time the regime train.py runs in
    world_size = args.world_size if args.distributed else args.nproc
    primary = args.rank == 0
    config_path = args.tuned_config or default_config_path(args)
    tuned = plan_tuned_run(parser, args, given, device, world_size, config_path)
    free_memory(device)

    extension_dests = group_dests(parser, EXTENSIONS_GROUP)
    stock_dests = sorted(config_keys(build_parser()) - set(extension_dests))  # train.py's keys, ours left out
    values = {**config_values(train_args, parser, stock_dests, tuned.plan), **tuned.schedule}
    if tuned.eval_batch is not None:
        values['validation_batch_size'] = tuned.eval_batch
    if tuned.size_batches is not None:
        values['train_batch_sizes'] = tuned.size_batches
    extras = extension_flags(train_args, parser, extension_dests)
    topology = current_topology() if args.distributed else None  # the launch training must repeat
    command = train_command(sys.executable, SCRIPT_DIR, config_path, world_size, extras, topology)
    report = report_lines(tuned, args, extras)
    if primary:
        tables = ['', 'Trials:', format_table(tuned.outcome.trials, tuned.outcome.budget), '']
        if tuned.sizes:
            wanted = tuned.size_batches if 'train_batch_sizes' in given else None
            tables += ['Per size (the trials above are the largest size\'s):', format_size_table(tuned.sizes, wanted),
                       '']
        if tuned.eval_outcome is not None:
            tables += ['Eval trials:', format_table(tuned.eval_outcome.trials, tuned.eval_outcome.budget), '']
        print('\n'.join(tables + report))
        os.makedirs(os.path.dirname(os.path.abspath(config_path)), exist_ok=True)
        atomic_text(tuned_config_text(values, report + ['', 'Train with: ' + shell_line(command)]), config_path)
        print(f'Config: {config_path}')
        if worth_a_plot(tuned):
            plot = write_probe_plot(os.path.splitext(config_path)[0] + '.png', tuned.outcome.trials,
                                    tuned.plan.micro_batch, tuned.choice)
            if plot:
                print(f'Plot: {plot}')
        print(f'Train command: {shell_line(command)}', flush=True)
    multi_node = topology is not None and topology.multi_node
    if multi_node and primary:
        print(f'Run it on each of the {topology.nnodes} nodes as tune_batch.py was (each node prints its own).')
    elif multi_node and args.local_rank == 0:
        print(f'Train command on this node: {shell_line(command)}', flush=True)
    if args.distributed:
        dist.barrier()
        dist.destroy_process_group()
        if primary and not args.dry_run:
            print('Under torchrun tune_batch.py probes and plans only; run the train command above to train.')
        return 0
    if args.dry_run:
        return 0
    # train here: the imports are paid once, and nothing of the probe is alive any more (see plan_tuned_run)
    if args.torchcompile:
        torch._dynamo.reset()  # the probe's compiled graphs would count toward the recompile limit of the same code
    return load_train_script().main(command[2:])


def worth_a_plot(tuned: TunedRun) -> bool:
    """A picture only where there is a curve to see: several trials that fit, or several global batches judged (one
    trial of the recipe's batch is one point, and drawing it would cost a short run more than it shows)."""
    fits = {t.batch_size for t in tuned.outcome.trials if t.fits}
    return len(fits) > 1 or (tuned.choice is not None and len(tuned.choice.candidates) > 1)


def load_train_script():
    """train.py (beside this script) as a module."""
    spec = importlib.util.spec_from_file_location('train', os.path.join(SCRIPT_DIR, 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report_lines(tuned: TunedRun, args: argparse.Namespace, extras: List[str]) -> List[str]:
    """The report: probe choice, the global-batch decision, accumulation, LR and why (also the config's header)."""
    outcome, plan = tuned.outcome, tuned.plan
    sel = outcome.selection
    lines = [
        f'tune_batch.py: {outcome.describe}',
        f'Budget {format_bytes(outcome.budget)} on {outcome.device_name}, headroom {args.mem_headroom:.0%}, '
        f'select {args.select}: micro-batch {sel.batch_size} ({sel.reason}; peak '
        f'{format_bytes(sel.trial.peak_bytes)}).',
    ]
    if sel.caveat:
        lines.append(f'Note: {sel.caveat}.')
    lines += tuned.lines
    if plan.micro_batch != sel.batch_size and tuned.size_batches is None:
        lines.append(f'Micro-batch {plan.micro_batch} used to build the global batch.')
    if tuned.size_batches is not None:
        lines.append(f'Accumulation {plan.accum_steps} (--grad-accum-steps as given): {plan.reason}.')
    else:
        lines.append(f'Accumulation {plan.accum_steps}, {plan.world_size} rank(s): global batch {plan.global_batch} = '
                     f'{plan.micro_batch} x {plan.world_size} x {plan.accum_steps}. {plan.reason}')
    lines.append(f'LR {plan.lr:g} ({plan.lr_rule or "given"}): {plan.lr_reason}')
    lines += tuned.eval_lines
    if tuned.schedule:
        changes = ', '.join(f'{key} {value}' for key, value in sorted(tuned.schedule.items()))
        lines.append(f'Schedule lengthened to match: {changes}')
    if extras:
        lines.append(f'Extension flags (our train.py only, on the command line): {" ".join(extras)}')
    return lines


if __name__ == '__main__':
    sys.exit(main())
