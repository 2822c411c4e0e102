"""tune_batch.py's decisions: probe (or reuse) the micro-batch, choose the global batch, plan the run and eval batch.

`plan_tuned_run` is the whole decision, with no training: every object the probe builds is local to it and released
when it returns. Under `--select auto` a global batch the recipe sets is kept and only its split is probed; with none
set, stock's -b 128 is the recipe, and a bigger one is judged only when the run is long enough for that to pay
(`choose_by_time`: `timm_ext.tune.critical_batch` measures B_noise, `timm_ext.tune.batch_choice` decides). A
`--train-img-sizes` schedule gets a batch per size (`tune_schedule`, `timm_ext.tune.img_sizes`), and the eval step a
batch of its own when its few trials pay (`plan_eval_batch`). `report_lines` is the report and the YAML's header.
"""
import argparse
import dataclasses
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from timm.models import safe_model_name

from ..atomic_files import atomic_text
from ..memory import MemoryBudget, device_name, format_bytes, free_memory, parse_budget, physical_memory
from ..probe.cache import ProbeCache, probe_key
from ..memory_model.devices import onednn_runs
from ..memory_model.estimate import EstimateError, estimate_memory
from ..peer_wait import peer_wait
from ..probe.grids import BatchGrid, SplitGrid, default_grid
from ..probe.selection import select_batch_size
from ..probe.table import format_trial, trials_to_json
from ..probe.train_probe import ProbeOutcome, budget_after_warmup, compile_run_graphs, probe_train_batch
from ..probe.trial import TrainTrialSetup, build_train_trial
from ..train.setup import SetupError, batch_multiple, build_datasets
from .batch_choice import (
    MAX_TUNE_SHARE, GlobalBatchChoice, NoiseEstimate, batch_warnings, choose_global_batch, format_candidates,
    scaled_schedule, speeds_by_micro_batch, tuning_pays, updates_per_epoch,
)
from .critical_batch import (
    ESTIMATE_ACCUM, ESTIMATE_MICRO_BATCH, ESTIMATE_WINDOWS, estimate_samples, measure_noise_scale,
)
from .img_sizes import (
    EQUALISE, KEPT, RECIPE, SizeResult, check_kept_fits, plan_schedule, probe_schedule, schedule_inputs,
    schedule_mode, shape_cache_note, size_trial_args,
)
from .plan import RunPlan, plan_global_batch, plan_run
from .untried import untried_reason

__all__ = [
    'ProbeRequest', 'Spent', 'TunedRun', 'lazy_estimate', 'default_config_path', 'probe_or_reuse',
    'recipe_global_batch', 'choose_by_time', 'untried_run',
    'time_bigger_batches', 'plan_tuned_run', 'ramp_micro_limit', 'tune_schedule', 'plan_eval_batch', 'worth_a_plot',
    'report_lines', 'shown_report', 'summary_lines', 'EVAL_PROBE_MODES',
]

TIMED_STEPS = 3  # timed updates per trial after the warm-up update; the fastest counts
RETIME_ROUNDS = 2  # --select throughput: interleaved rounds re-timing the close sizes (see select_batch_size)
SEARCH_TRIALS = 6  # trials judging bigger batches may take (doublings up to B_noise), for whether judging pays
EVAL_MAX_FACTOR = 8  # the eval probe tries up to this many training micro-batches (x2 steps: about 3 trials)
EVAL_PROBE_TRIALS = 3  # what the eval probe is budgeted at, for judging whether it pays
EVAL_PROBE_MODES = ('auto', 'on', 'off')  # --eval-probe: judged by its cost, always, never
Prior = Tuple[float, float]  # the estimate's peak line: bytes at batch 0, bytes per sample
FORWARD_SHARE = 1 / 3  # an eval forward takes about this share of a training step's time (forward + backward)


def default_config_path(args: argparse.Namespace) -> str:
    size = args.img_size or (args.input_size[-1] if args.input_size else 'default')
    return os.path.join('output', 'tune', f'{safe_model_name(args.model)}-{size}.yaml')


@dataclass
class Spent:
    """Wall seconds tune_batch.py spent deciding, by what for: 'probe' (trials of the micro-batch and eval batch),
    'estimate' (the memory estimate's trace), 'judging' (the noise scale and the trials of bigger global batches),
    and with torch.compile 'compile' (the probe's compiles and its trials' loading of the graphs)."""
    seconds: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(('probe', 'estimate', 'judging'), 0.0))
    phase: str = 'probe'  # what a probe run now counts as

    @contextmanager
    def judging(self) -> Iterator[None]:
        """Count the wall time of the block, its probes included, as judging."""
        started, before = time.perf_counter(), dict(self.seconds)
        self.phase = 'judging'
        try:
            yield
        finally:
            self.phase = 'probe'
            # what the block's probes counted is in the block's own time: count the block once
            self.seconds['judging'] = before['judging'] + time.perf_counter() - started - sum(
                self.seconds[what] - before.get(what, 0.0) for what in self.seconds if what not in ('judging', 'probe'))

    def line(self) -> str:
        """One line: what deciding cost before training, each part or 'none'."""
        parts = [f'{what} {s:.1f} s' if s > 0 else f'{what} none' for what, s in self.seconds.items()]
        return f'Spent before training: {", ".join(parts)}.'


def lazy_estimate(args: argparse.Namespace, device: torch.device, spent: Spent) -> Callable[[], Optional[Prior]]:
    """The probe's prior, traced on the first call only (`seed_estimate`): a probe whose first trial decides (the
    recipe's batch checked once) never asks for it."""
    box: List[Optional[Prior]] = []

    def prior() -> Optional[Prior]:
        if not box:
            started = time.perf_counter()
            box.append(seed_estimate(args, device))
            spent.seconds['estimate'] += time.perf_counter() - started
        return box[0]
    return prior


@dataclass
class ProbeRequest:
    """What every probe of one tune_batch.py run shares: the run's trial, the device and budget, where to report."""
    args: argparse.Namespace
    setup: Optional[TrainTrialSetup]  # None once a schedule's probes released it (`tune_schedule`)
    device: torch.device
    budget: MemoryBudget
    budget_bytes: int
    grid: BatchGrid
    world_size: int
    trials_path: str
    phase: str = 'train'  # or 'eval': the evaluation forward (`TrainTrialSetup.eval_trials`)
    seconds_per_trial: Optional[float] = None  # wall time of one trial in the last probe run here (not cached)
    prior: Optional[Callable[[], Optional[Prior]]] = None  # the estimate's peak line at this input (`lazy_estimate`)
    told: Set[str] = field(default_factory=set)  # header facts a probe of this run printed (shared by its copies)
    spent: Spent = field(default_factory=Spent)  # shared by its copies

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
        started, estimate_s = time.perf_counter(), self.spent.seconds['estimate']
        outcome = probe_or_reuse(self, select, max_batch, start or self.args.probe_start)
        elapsed = time.perf_counter() - started - (self.spent.seconds['estimate'] - estimate_s)  # a trace it asked for
        if outcome.compile_seconds is not None:
            self.spent.seconds['compile'] = self.spent.seconds.get('compile', 0.0) + outcome.compile_seconds
            elapsed -= outcome.compile_seconds
        self.spent.seconds[self.spent.phase] += elapsed
        if not outcome.cached:
            self.seconds_per_trial = elapsed / max(1, len(outcome.trials))
        return outcome


def probe_or_reuse(request: ProbeRequest, probe_select: str, max_batch: int, start: int) -> ProbeOutcome:
    """The probe's outcome for this request: from the cache when an identical one was probed, else probed now.

    Trials are printed live (rank 0), or all at once when cached, and the table is kept up to date at
    `request.trials_path` while probing: the trial table is printed once.
    """
    args, setup, device, budget_bytes = request.args, request.setup, request.device, request.budget_bytes
    primary = args.rank == 0
    key = request.cache_key(probe_select, max_batch, start)
    cache = ProbeCache()
    cached = None if args.no_cache else cache.get(key)
    if args.distributed:  # rank 0's cache decides for all, so every rank takes the same path
        box = [cached if primary else None]
        with peer_wait("rank 0's probe-cache answer"):
            dist.broadcast_object_list(box, src=0)
        cached = box[0]

    context = f'{setup.describe}, budget {format_bytes(budget_bytes)} on {device_name(device)}'
    prefix = '  ' if request.phase == 'train' else f'  {request.phase} '
    if cached is not None:
        if primary:  # the cached trials, as a probe would have printed them: the table appears once either way
            print(f'Probe: cached result for this request ({cache.path(key)}); no trials run.')
            print('\n'.join(prefix + format_trial(trial, budget_bytes) for trial in cached), flush=True)
        selection = select_batch_size(cached, probe_select, args.throughput_tol, context)
        return ProbeOutcome(selection, budget_bytes, setup.describe, device_name(device), cached=True)
    if primary:
        print(probe_header(request, start, max_batch))
        os.makedirs(os.path.dirname(os.path.abspath(request.trials_path)), exist_ok=True)
    table = []

    def on_trial(trial):
        table.append(trial)
        if primary:
            print(prefix + format_trial(trial, budget_bytes), flush=True)
            atomic_text(trials_to_json(table, request=key, complete=False), request.trials_path)

    # the estimate is of the training step; a throughput choice needs the smaller sizes timed too, not skipped
    prior = request.prior if request.phase == 'train' and probe_select == 'max' else None
    outcome = probe_train_batch(setup, budget_bytes, args.mem_headroom, probe_select, args.throughput_tol,
                                start, max_batch, request.grid, TIMED_STEPS, on_trial, RETIME_ROUNDS, prior)
    if primary:
        cache_file = cache.put(key, outcome.trials) if not args.no_cache else None
        atomic_text(trials_to_json(outcome.trials, request=key, complete=True), request.trials_path)
        if cache_file:
            print(f'Probe: cached in {cache_file}; table in {request.trials_path}.')
    return outcome


def probe_header(request: ProbeRequest, start: int, max_batch: int) -> str:
    """The line a probe starts with: what it runs and within which budget, less what an earlier probe of the same run
    said already (an eval probe names only its forward pass), then the sizes it may try."""
    budget = format_bytes(request.budget_bytes)
    if request.budget.fraction is not None:
        budget += f' ({request.budget})'
    facts = [*request.setup.describe.split('; '),
             f'budget {budget} on {device_name(request.device)}, headroom {request.args.mem_headroom:.0%}']
    new = [fact for fact in facts if fact not in request.told]
    request.told.update(facts)
    sizes = f'size {start}' if start >= max_batch else f'sizes {start}..{max_batch}'
    return f'Probe: {"; ".join(new + [sizes])}.'


@dataclass
class TunedRun:
    """What tuning decided: the probe behind the micro-batch, the plan, the schedule changes and the report."""
    outcome: Optional[ProbeOutcome]  # None: no trial ran (`untried_run`)
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
    ramp_max_micro: Optional[int] = None  # --batch-ramp: the largest micro-batch that fits, for the ramp to grow to
    spent: Optional[Spent] = None  # what deciding cost (`Spent.line`)


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
    # only the micro-batches the plan could split the recipe's batch into are worth a trial: which of them fits
    splits = SplitGrid(tuple(sorted({plan_run(args, m, world_size, recipe_global).micro_batch
                                     for m in range(1, limit + 1)})))
    outcome = dataclasses.replace(request, grid=splits).run('max', limit, start=limit)  # one trial if the recipe fits
    trial_s = time.perf_counter() - started
    plan = plan_run(args, outcome.selection.batch_size, world_size, recipe_global)
    one_batch = plan.accum_steps == 1
    if one_batch:
        how = f'fits as one batch of {plan.micro_batch} per rank: one trial, nothing to search for it.'
    else:
        if max_batch < needed:
            why = f'the training split holds only {max_batch} samples per rank'
        elif outcome.selection.batch_size >= max(splits.sizes):  # the largest split fits: the plan asks for more
            why = '--log-noise-scale on one process needs two batch sizes in every update'
        else:
            why = f'a batch of {needed} per rank does not fit'
        how = f'is built from micro-batches of {plan.micro_batch} x {plan.accum_steps} accumulation: {why}.'
    exact = plan.global_batch == recipe_global
    kept = 'it exactly' if exact else f'the nearest ({plan.global_batch}, see the accumulation line)'
    lines = [recipe_line(recipe_global, set_by, plan, how)]
    if args.select == 'auto' and set_by:
        lines.append(kept_line(plan, recipe_global))
        return TunedRun(outcome, plan, lines=lines)
    speed = outcome.selection.trial.samples_per_s or 0.0
    run_s = args.epochs * train_samples / speed if speed else math.inf
    estimate_micro = min(plan.micro_batch, ESTIMATE_MICRO_BATCH)
    per_trial_s = trial_s / max(1, len(outcome.trials))
    # the estimate's small micro-batches run slower than the recipe's: count them at half its speed
    cost_s = SEARCH_TRIALS * per_trial_s + 2 * estimate_samples(estimate_micro, world_size) / max(speed, 1e-9)
    if not one_batch:
        lines.append('A bigger global batch would need more accumulation, which adds no samples/s: kept '
                     + ('the recipe\'s.' if exact else f'the nearest, {plan.global_batch}.'))
        return TunedRun(outcome, plan, lines=lines)
    if args.select == 'auto' and not rank0_decides(request, tuning_pays(run_s, cost_s)):
        lines.append(f'Kept {"it" if exact else kept}: the run is predicted at ~{run_s:.0f} s of training compute '
                     f'({speed:.0f} samples/s measured), and judging a bigger batch would cost ~{cost_s:.0f} s, '
                     f'more than {MAX_TUNE_SHARE:.0%} of that; too short for tuning to pay off.')
        return TunedRun(outcome, plan, lines=lines)

    if args.rank == 0:
        print(f'Noise scale: {ESTIMATE_WINDOWS} windows of {ESTIMATE_ACCUM} x {estimate_micro} on the real data.',
              flush=True)
    with request.spent.judging():
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


def recipe_line(recipe_global: int, set_by: str, plan: RunPlan, how: str) -> str:
    """The report's first word on the recipe's global batch: who set it, the nearest one the run takes where it has
    no split, and `how` the plan builds it."""
    who = f'set by {set_by}' if set_by else "stock train.py's default -b 128"
    exact = plan.global_batch == recipe_global
    nearest = '' if exact else f' has no split this run can take; the nearest, global batch {plan.global_batch},'
    return f'The recipe\'s global batch {recipe_global} ({who}){nearest} {how}'


def kept_line(plan: RunPlan, recipe_global: int) -> str:
    """Why --select auto kept a global batch the recipe sets (or its nearest split)."""
    kept = 'it exactly' if plan.global_batch == recipe_global else (
        f'the nearest ({plan.global_batch}, see the accumulation line)')
    return (f'Kept {kept}: --select auto chooses only the micro-batch and accumulation of a global batch the recipe '
            'sets (--select critical would judge a bigger one).')


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
    channels = args.in_chans or (args.input_size[0] if args.input_size else 3)
    dataset_train, dataset_eval = build_datasets(args, 'RGB' if channels == 3 else 'L')  # only their sizes are read
    train_samples = len(dataset_train)
    max_batch = min([train_samples // max(world_size, 1)] + ([args.max_batch] if args.max_batch else []))
    if max_batch < 1:
        raise SetupError(f'the training split has fewer samples ({train_samples}) than ranks ({world_size})')
    recipe_global, set_by = recipe_global_batch(args, given, world_size)
    untried = untried_reason(args, device, world_size, recipe_global, set_by, train_samples, max_batch)
    if untried is not None:
        return untried_run(args, world_size, recipe_global, set_by, untried, train_samples)
    setup = build_train_trial(args, device)
    setup.eval_samples = len(dataset_eval) if dataset_eval is not None else 0  # trials run train.py's eval shapes
    # one resolution for every probe of the run (and its cache keys), after a first step took what it takes outside
    # the allocator
    spent = Spent()
    request = ProbeRequest(args, setup, device, budget, budget_after_warmup(setup, budget), grid, world_size,
                           os.path.splitext(config_path)[0] + '.trials.json', prior=lazy_estimate(args, device, spent),
                           spent=spent)
    del setup  # the request holds it; a schedule's probes release it while they probe the smaller sizes
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
    if args.batch_ramp and 'batch_ramp_max_micro' not in given and tuned.size_batches is None:
        probed_max = tuned.outcome.selection.batch_size if args.select == 'max' else None  # already the largest
        tuned.ramp_max_micro, line = ramp_micro_limit(request, tuned.plan.micro_batch, max_batch, probed_max)
        tuned.lines.append(line)
    epochs = tuned.schedule.get('epochs', args.epochs)
    updates = epochs * updates_per_epoch(train_samples, tuned.plan.micro_batch, world_size, tuned.plan.accum_steps)
    tuned.lines += [f'Warning: {w}.' for w in batch_warnings(tuned.plan.global_batch, updates, tuned.noise)]
    if 'validation_batch_size' in given:
        tuned.eval_lines = [f'Eval batch: --validation-batch-size {args.validation_batch_size} as given; not probed.']
    elif dataset_eval is not None:
        # a schedule's probes released the run's setup (`tune_schedule`): the eval probe builds it again
        setup = request.setup or dataclasses.replace(build_train_trial(args, device), eval_samples=len(dataset_eval))
        eval_request = dataclasses.replace(request, setup=setup.eval_trials(tuned.plan.micro_batch), phase='eval',
                                           trials_path=os.path.splitext(config_path)[0] + '.eval.trials.json')
        tuned.eval_batch, tuned.eval_outcome, tuned.eval_lines = plan_eval_batch(
            eval_request, tuned, len(dataset_eval), epochs, request.seconds_per_trial)
    if request.setup is not None and request.setup.batch_dynamic is not None and tuned.size_batches is None \
            and args.local_rank == 0:  # train.py's own graphs, so that it loads them under its cap as the trials did
        eval_batch = tuned.eval_batch or args.validation_batch_size or tuned.plan.micro_batch
        spent.seconds['compile'] = spent.seconds.get('compile', 0.0) + compile_run_graphs(
            request.setup, tuned.plan.micro_batch, eval_batch if dataset_eval is not None else None)
    tuned.spent = spent
    return tuned


def untried_run(args: argparse.Namespace, world_size: int, recipe_global: int, set_by: str, reason: str,
                train_samples: int) -> TunedRun:
    """The recipe's global batch as one micro-batch a rank, planned with no trial (`timm_ext.tune.untried`): train.py
    runs it with ``--oom-recover``, whose first update is the trial."""
    plan = plan_run(args, math.ceil(recipe_global / world_size), world_size, recipe_global)
    lines = [recipe_line(recipe_global, set_by, plan, f'trains as micro-batches of {plan.micro_batch}.'), reason]
    if set_by:
        lines.append(kept_line(plan, recipe_global))
    updates = args.epochs * updates_per_epoch(train_samples, plan.micro_batch, world_size, plan.accum_steps)
    lines += [f'Warning: {w}.' for w in batch_warnings(plan.global_batch, updates, None)]
    return TunedRun(None, plan, lines=lines, eval_lines=[
        f'Eval batch: not probed (no trial ran); train.py evaluates at the micro-batch {plan.micro_batch}.'])


def seed_estimate(args: argparse.Namespace, device: torch.device) -> Optional[Prior]:
    """The memory estimate's peak line (bytes at batch 0, bytes per sample) that aims the probe's first trial, or
    None (and one line why) when the step cannot be traced; rank 0's under DDP, so every rank aims alike."""
    prior, line = None, ''
    if args.rank == 0:
        try:
            onednn = onednn_runs(device.type)
            estimate = estimate_memory(args, device.type, onednn)
            prior = estimate.line()
            line = (f'Estimate: peak ~ {format_bytes(prior[0])} + {format_bytes(prior[1])} per sample '
                    f'({estimate.device.name}, traced in {estimate.seconds:.1f} s): the probe aims by it.')
        except (EstimateError, ValueError) as e:
            line = f'Estimate: none ({e}); the probe searches without it.'
        print(line, flush=True)
    if args.distributed:
        box = [prior]
        with peer_wait("rank 0's memory estimate"):
            dist.broadcast_object_list(box, src=0)
        prior = box[0]
    return prior


def ramp_micro_limit(request: ProbeRequest, micro_batch: int, max_batch: int,
                     largest: Optional[int] = None) -> Tuple[Optional[int], str]:
    """--batch-ramp: the largest micro-batch that fits (`--batch-ramp-max-micro`), so the ramp can grow the micro-batch,
    faster per sample, before the accumulation; probed upwards from the run's micro-batch, which fits, unless the
    run's probe already found it (`largest`, --select max).

    Returns:
        (the limit, or None when nothing bigger than the run's micro-batch fits; the report line)
    """
    if micro_batch >= max_batch:
        return None, (f'--batch-ramp: the micro-batch {micro_batch} is already the split per rank; the ramp grows '
                      f'the accumulation only.')
    if largest is None:
        largest = request.run('max', max_batch, start=micro_batch).selection.batch_size
    if largest <= micro_batch:
        return None, (f'--batch-ramp: nothing above the micro-batch {micro_batch} fits; the ramp grows the '
                      f'accumulation only.')
    return largest, (f'--batch-ramp: micro-batches up to {largest} fit, passed as --batch-ramp-max-micro {largest}: '
                     f'the ramp grows the micro-batch to it before the accumulation.')


def tune_schedule(request: ProbeRequest, mode: str, max_batch: int, given: Set[str]) -> TunedRun:
    """A --train-img-sizes schedule (`timm_ext.tune.img_sizes`): the batch at each size probed (or the given one
    checked), and the LR of the schedule's average batch."""
    args, largest = request.args, tuple(request.setup.input_size)
    wanted = list(args.train_batch_sizes) if mode == KEPT else None
    base = os.path.splitext(request.trials_path)[0]

    eval_samples = request.setup.eval_samples

    def probe_at(input_size: Tuple[int, int, int], start: int, limit: int) -> ProbeOutcome:
        # the run's own setup where it already trains at this size (probed first); a smaller size gets one of its own,
        # released after, and the largest's goes first: its weights and EMA would count in a CUDA budget
        if tuple(input_size) == largest:
            setup = request.setup
        else:
            request.setup = None
            free_memory(request.device)
            setup = dataclasses.replace(build_train_trial(size_trial_args(args, input_size), request.device),
                                        eval_samples=eval_samples)
        label = 'x'.join(map(str, input_size[1:]))
        prior = request.prior if tuple(input_size) == largest else None  # the estimate was of the largest size
        return dataclasses.replace(request, setup=setup, trials_path=f'{base}.{label}.json', prior=prior).run(
            'max', limit, start)

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


def rank0_decides(request: ProbeRequest, decision: bool) -> bool:
    """Rank 0's `decision` on every rank: a choice taken from wall times (which differ between ranks) and followed by
    collectives must be the same everywhere, or the ranks enter different collectives and wait for ever."""
    box = [decision]
    if request.args.distributed:
        with peer_wait("rank 0's decision whether tuning pays"):
            dist.broadcast_object_list(box, src=0)
    return box[0]


def plan_eval_batch(request: ProbeRequest, tuned: TunedRun, eval_samples: int, epochs: int,
                    seconds_per_trial: Optional[float]) -> Tuple[Optional[int], Optional[ProbeOutcome], List[str]]:
    """The eval batch for `validation_batch_size`: the largest forward-only batch that fits the budget, probed (with
    --eval-probe auto) only when the run's evaluations last long enough for the trials to cost at most MAX_TUNE_SHARE
    of them (a cached outcome costs nothing); --eval-probe on / off decide without the prediction. The trial cost is
    the wall time of the training trials just run, or, when those came from the cache, the measured step time over the
    trial's steps at the largest eval batch.

    Returns:
        (the eval batch, or None to leave train.py's default, the micro-batch; the probe; report lines)
    """
    args, micro = request.args, tuned.plan.micro_batch
    per_rank = math.ceil(eval_samples / request.world_size)
    limit = min(per_rank, EVAL_MAX_FACTOR * micro)
    if limit <= micro:
        return None, None, [f'Eval batch: the validation split ({per_rank} per rank) is one batch of the micro-batch '
                            f'{micro} already; not probed.']
    if args.eval_probe == 'off':
        return None, None, [f'Eval batch: not probed (--eval-probe off); train.py evaluates at the micro-batch '
                            f'{micro}.']
    trial = tuned.outcome.selection.trial
    train_speed = trial.samples_per_s or math.inf
    passes = math.ceil(epochs / args.val_interval)
    eval_s = passes * per_rank / (train_speed / FORWARD_SHARE)
    start = min(2 * micro, limit)
    per_trial = seconds_per_trial or (TIMED_STEPS + 1) * (trial.ms_per_step or 0.0) / 1000 * EVAL_MAX_FACTOR
    cost_s = 0.0 if request.is_cached('max', limit, start) else EVAL_PROBE_TRIALS * per_trial  # a cached one is free
    if args.eval_probe == 'auto' and not rank0_decides(request, tuning_pays(eval_s, cost_s)):
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
        f'resident; peak {format_bytes(outcome.selection.trial.peak_bytes)}): validation_batch_size in the YAML; '
        f'evaluation results do not depend on it.']


def worth_a_plot(tuned: TunedRun) -> bool:
    """A picture only where there is a curve to see: several trials that fit, or several global batches judged (one
    trial of the recipe's batch is one point, and drawing it would cost a short run more than it shows)."""
    fits = {t.batch_size for t in tuned.outcome.trials if t.fits} if tuned.outcome is not None else set()
    return len(fits) > 1 or (tuned.choice is not None and len(tuned.choice.candidates) > 1)


REPORT_HEADER_LINES = 2  # the run probed and its budget: what the live probe's first line already said


def report_lines(tuned: TunedRun, args: argparse.Namespace, extras: List[str]) -> List[str]:
    """The report: probe choice, the global-batch decision, accumulation, LR and why (also the config's header).

    Its first `REPORT_HEADER_LINES` lines say what was probed within which budget: the config needs them, the
    terminal has them already when the probe ran there (`shown_report`).
    """
    outcome, plan = tuned.outcome, tuned.plan
    if outcome is None:
        lines = [f'tune_batch.py: model {args.model}, no trial', f'Budget none asked, on {args.device}.', *tuned.lines]
    else:
        sel = outcome.selection
        lines = [
            f'tune_batch.py: {outcome.describe}',
            f'Budget {format_bytes(outcome.budget)} on {outcome.device_name}, headroom {args.mem_headroom:.0%}.',
            f'Select {args.select}: micro-batch {sel.batch_size} ({sel.reason}; peak '
            f'{format_bytes(sel.trial.peak_bytes)}).',
        ]
        if sel.caveat:
            lines.append(f'Note: {sel.caveat}.')
        lines += tuned.lines
    if outcome is not None and plan.micro_batch != outcome.selection.batch_size and tuned.size_batches is None:
        lines.append(f'Micro-batch {plan.micro_batch} used to build the global batch.')
    if tuned.size_batches is not None:
        lines.append(f'Accumulation {plan.accum_steps} (--grad-accum-steps as given): {plan.reason}.')
    else:
        lines.append(f'Accumulation {plan.accum_steps}, {plan.world_size} rank(s): {plan.split_line()}')
    lines.append(f'LR: {plan.lr_reason}')
    lines += tuned.eval_lines
    if tuned.schedule:
        changes = ', '.join(f'{key} {value}' for key, value in sorted(tuned.schedule.items()))
        lines.append(f'Schedule lengthened to match: {changes}')
    if extras:
        lines.append(f'Extension flags (our train.py only, on the command line): {" ".join(extras)}')
    return lines


def shown_report(tuned: TunedRun, report: List[str]) -> List[str]:
    """The report as the terminal shows it: without the header lines when the probe printed them as it started (a
    cached probe printed only its trials)."""
    return report if tuned.outcome is None or tuned.outcome.cached else report[REPORT_HEADER_LINES:]


def summary_lines(tuned: TunedRun) -> List[str]:
    """The closing block's summary: the layout, the LR and its rule, the eval batch, and the predicted time when one
    was measured (`timm_ext.tune.tuned_config.write_tuned_config` adds the config and the train command)."""
    plan = tuned.plan
    ranks = f'{plan.world_size} rank' + ('s' if plan.world_size != 1 else '')
    lines = ['Summary:', f'  Global batch {plan.global_batch} = micro-batch {plan.micro_batch} x accumulation '
             f'{plan.accum_steps} x {ranks}' + (f' (per size: train_batch_sizes {tuned.size_batches})'
                                                if tuned.size_batches is not None else ''),
             f'  LR {plan.lr:g} ({plan.lr_rule + " rule" if plan.lr_rule else "given"})']
    if tuned.eval_batch is not None:
        lines.append(f'  Eval batch {tuned.eval_batch} (validation_batch_size)')
    else:
        lines.append(f'  Eval batch: train.py\'s own (the micro-batch {plan.micro_batch}, or --validation-batch-size)')
    if tuned.choice is not None:
        lines.append(f'  Predicted time to the recipe\'s result: ~{tuned.choice.chosen.predicted_s:.0f} s of compute')
    if tuned.spent is not None:
        lines.append(f'  {tuned.spent.line()}')
    return lines
