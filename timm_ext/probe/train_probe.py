"""The training probe: the largest training batch under a memory cap, searched, chosen and agreed across ranks.

`probe_train_batch` puts the pieces together for a training trial (`timm_ext.probe.trial`): the budget resolved after
a first step, the cap in force while trials run, each trial measured (`timm_ext.probe.measure`) and agreed across ranks
(`timm_ext.probe.rank_agreement`), the search aimed at the headroom's limit (`timm_ext.probe.search`), re-timing for a
throughput choice (`timm_ext.probe.retime`), and the choice (`timm_ext.probe.selection`). A compiled CPU trial that had
to compile under the cap runs again once an uncapped run compiled its graphs (`compiled_first`), and train.py's own
graphs are compiled once the run is planned (`compile_run_graphs`; `timm_ext.probe.compiled_trials` says why).
"""
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch

from ..memory import MemoryBudget, MemoryCap, PeakMeter, device_name, format_bytes, memory_cap
from .grids import BatchGrid, default_grid
from .forked import isolate_trials
from .measure import measured_trial
from .rank_agreement import agree_across_ranks, smallest_over_ranks
from .retime import retime_trials
from .search import search_batch_size
from .selection import Selection, headroom_accept, select_batch_size
from .table import ERROR, Trial, TrialError, TrialFn
from .trial import TrainTrialSetup
from .trial_host import TrialHost, hosted_trials, uncapped_trial
from .compiled_trials import compiled_first

__all__ = ['ProbeOutcome', 'probe_train_batch', 'check_step_runs', 'budget_after_warmup', 'compile_run_graphs']


@dataclass
class ProbeOutcome:
    """A finished probe.

    Attributes:
        selection: The chosen batch and why, with the trial table.
        budget: The budget in bytes.
        describe: What was probed (model, input, precision, optimizer).
        device_name: The device's name.
        cached: Read from the probe cache (no trials ran).
        compile_seconds: Wall seconds the probe spent compiling: the uncapped compile runs before the trials and
            what each trial spent in torch.compile (loading graphs, mostly); None for a probe that compiled nothing.
    """
    selection: Selection
    budget: int
    describe: str
    device_name: str
    cached: bool = False
    compile_seconds: Optional[float] = None

    @property
    def trials(self) -> List[Trial]:
        return self.selection.trials


def probe_train_batch(
        setup: TrainTrialSetup,
        budget: Union[MemoryBudget, int],
        headroom: float = 0.1,
        select: str = 'max',
        throughput_tol: float = 0.05,
        start: int = 2,
        max_batch: Optional[int] = None,
        grid: Optional[BatchGrid] = None,
        timed_steps: int = 1,
        on_trial: Optional[Callable[[Trial], None]] = None,
        retime_rounds: int = 2,
        prior: Union[None, Tuple[float, float], Callable[[], Optional[Tuple[float, float]]]] = None,
) -> ProbeOutcome:
    """Probe the largest training batch under a memory cap and choose one.

    The cap is in force only while trials run and is lifted however the probe ends. Under an initialized process
    group every rank must call this together: each trial's outcome is agreed across ranks, and the final size is
    the minimum over ranks.

    Args:
        setup: The training trial (`build_train_trial`).
        budget: The memory budget (`timm_ext.memory.parse_budget`), resolved after the first step; or its bytes,
            resolved by the caller (`budget_after_warmup`).
        headroom: Fraction of the budget the chosen batch must leave free, judged on measured peak memory.
        select: 'max' or 'throughput' (see `select_batch_size`).
        throughput_tol: Tolerance of the throughput choice.
        start: First batch size tried.
        max_batch: Largest batch worth trying (dataset size, --max-batch).
        grid: The sizes trials may take (default: multiples of the device's `default_batch_multiple`).
        timed_steps: Timed updates per trial after the warm-up update.
        on_trial: Called with each trial as it completes.
        retime_rounds: Throughput choice: interleaved rounds that time the close sizes, and the grid sizes the
            search skipped between them, again (`retime_trials`).
        prior: The memory estimate's peak line in this budget's units, to aim the first trial and calibrate
            (`search_batch_size`); or a callable giving it, asked only where it can change a trial. A callable asked
            under the CPU cap traces in a child of its own (`timm_ext.memory_model.estimate.in_child`), which lifts the cap.

    Raises:
        BudgetError: The budget is larger than the device.
        NothingFitsError / TrialError: see `select_batch_size`; the message names the budget and the run.
    """
    device = setup.device
    with hosted_trials(setup) as host:  # CPU trials of a process that cannot fork them: in a fresh interpreter
        isolate = host is not None or isolate_trials(device)  # CPU trials in forked processes, CUDA trials here
        if not isolate:
            check_step_runs(setup, start)  # on CUDA this first update also sets up kernels and library workspaces
        compile_runs: Optional[List[float]] = [] if isolate and setup.batch_dynamic is not None else None
        # resolved after that first update: what it took outside the allocator is no longer free for the budget
        budget_bytes = budget if isinstance(budget, int) else budget.resolve(device)
        context = f'{setup.describe}, budget {format_bytes(budget_bytes)} on {device_name(device)}'
        with memory_cap(device, budget_bytes) as cap:
            budget_bytes = cap.budget  # the cap in force (a CPU hard limit can hold it lower)
            trial = agree_across_ranks(_capped_trial(setup, host, cap, timed_steps, isolate, compile_runs))
            # every rank must judge and aim alike, so the headroom is taken of the smallest budget of any rank
            accept = headroom_accept(smallest_over_ranks(budget_bytes, device, 'memory budget'), headroom)
            grid = grid or default_grid(device.type)
            trials = search_batch_size(trial, start, max_batch, grid, accept=accept, on_trial=on_trial,
                                       peak_limit=accept.limit, prior=prior)
            if select == 'throughput':
                trials += retime_trials(trial, trials, throughput_tol, retime_rounds, accept, on_trial, grid)
        if isolate and not any(t.accepted for t in trials):
            # a forked check warms nothing here, so it is spent only when no capped trial fit (every rank alike)
            check_step_runs(setup, start, host)
        selection = select_batch_size(trials, select, throughput_tol, context)
        # outcomes were agreed trial by trial, so this only guards against a rank that chose differently
        chosen = smallest_over_ranks(selection.batch_size, device, 'chosen batch')
        if chosen != selection.batch_size:
            pick = next(t for t in trials if t.batch_size == chosen)
            selection = Selection(pick.batch_size, 'smallest choice over ranks', pick, trials)
    in_trials = [t.compile_s for t in trials if t.compile_s is not None]
    compiled_s = sum(compile_runs or []) + sum(in_trials) if in_trials or compile_runs else None
    return ProbeOutcome(selection, budget_bytes, setup.describe, device_name(device), compile_seconds=compiled_s)


def _capped_trial(setup: TrainTrialSetup, host: Optional[TrialHost], cap: MemoryCap, timed_steps: int, isolate: bool,
                  compile_runs: Optional[List[float]]) -> TrialFn:
    """The probe's trial under `cap`: in the trial host, a fork or this process; a compiled CPU trial that compiled is
    run again after an uncapped run of its size (`compiled_first`, the seconds appended to `compile_runs`)."""
    device = setup.device
    if host is not None:
        trial: TrialFn = host.trial(cap.budget, timed_steps)
    else:
        trial = measured_trial(
            setup.step, device, PeakMeter(device, cap.baseline), warmup_steps=1, timed_steps=timed_steps,
            capped=True, before=setup.reset, isolate=isolate, warmup=setup.warmup,
            benchmark_warmup=device.type == 'cuda' and torch.backends.cudnn.enabled and torch.backends.cudnn.benchmark)
    if compile_runs is None:
        return trial
    return compiled_first(trial, _uncapped(setup, host, warm_up=True), compile_runs)


def _uncapped(setup: TrainTrialSetup, host: Optional[TrialHost], warm_up: bool = False,
              batch_dynamic: bool = True) -> TrialFn:
    """`uncapped_trial` where the probe's trials run: in the trial host, else forked where the process can."""
    if host is not None:
        return host.trial(None, warm_up=warm_up, batch_dynamic=batch_dynamic)
    return uncapped_trial(setup, isolate_trials(setup.device), warm_up, batch_dynamic)


def compile_run_graphs(setup: TrainTrialSetup, train_batch: int, eval_batch: Optional[int]) -> float:
    """Compile the graphs train.py will run, static, into inductor's disk cache, uncapped, in a fork of their own.

    The trials loaded graphs whose batch dimension is dynamic; train.py compiles its training graph for its one batch
    (dynamo marks a dimension dynamic only once it has seen it change, as the eval pass's smaller last batch does).
    Under a cap, a train.py that compiled its graphs itself would hold the compile's heap besides what a trial
    measured; compiled here, it loads them as the trials did. The order is train.py's first epoch: an update at
    `train_batch`, the eval pass at `eval_batch` (None: no eval pass) in shapes, an update.

    Returns:
        Its wall seconds.
    """
    started = time.perf_counter()
    run = setup.eval_trials(train_batch) if eval_batch is not None and setup.eval_step is not None else setup
    with hosted_trials(run) as host:
        _uncapped(run, host, warm_up=True, batch_dynamic=False)(eval_batch if run is not setup else train_batch)
    return time.perf_counter() - started


def check_step_runs(setup: TrainTrialSetup, start: int = 2, host: Optional[TrialHost] = None,
                    warm_up: bool = False) -> None:
    """One uncapped trial at a tiny batch (all ranks together): a step that fails without any cap is the run's own
    failure, not an out-of-memory. On CUDA it also loads the step's kernels and library handles. With `warm_up` it
    runs the trial's whole warm-up (`uncapped_trial`).

    Raises:
        TrialError: The step fails; one line naming the run.
    """
    uncapped = agree_across_ranks(_uncapped(setup, host, warm_up))
    check = uncapped(min(start, 2))
    if check.status == ERROR:
        raise TrialError(f'a training step fails before any memory cap ({setup.describe} on '
                         f'{device_name(setup.device)}): {check.error}', [check])


def budget_after_warmup(setup: TrainTrialSetup, budget: MemoryBudget) -> int:
    """The budget in bytes as trials will see it: on CUDA resolved after one step has run (`check_step_runs`), since
    that step's kernels and library handles take memory outside the allocator that a fraction must not count."""
    if setup.device.type == 'cuda':
        check_step_runs(setup)
    return budget.resolve(setup.device)
