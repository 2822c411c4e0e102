#!/usr/bin/env python3
"""Compiled against eager on the CPU: train.py's own largest batch under an RLIMIT_DATA cap, and the estimate's.

For each model (a convnet, a ViT, a ConvNeXt, at small inputs so a compile stays short) and each mode (eager,
`--torchcompile`):

1. the estimate: `tune_batch.py --estimate --device cpu [--torchcompile] --mem-budget CAP --mem-headroom 0 --select
   max`, its "fits up to" (the largest batch predicted within the budget; `--select max` because the trials below do
   not accumulate, and a plan that accumulates keeps the gradients beside every micro-batch after the first);
2. the real limit: the largest batch at which `train.py [--torchcompile] --steady-cpu-heap` completes `--updates`
   training updates, each trial a fresh process (inductor's on-disk cache fresh too: a cold compile), the cap set as
   `bench/bench_estimate.py` and the probe set it: RLIMIT_DATA = the data segment when the first epoch starts (model,
   optimizer and data loader built; nothing compiled yet) + CAP. An uncapped trial at batch `PROFILE_BATCH` gives the
   search its start (what stays after an update is fixed, the rest grows with the batch); from there x`SEARCH_STEP` to
   a failure, then bisected to within 2%. The epoch stops after `--updates` updates and the run ends before evaluation;
3. what each trial held: the data segment above the cap's zero at the end of each compile (before the step it compiled
   runs), its peak during the compiles, during each update and after each update, the process's threads (RLIMIT_DATA
   counts each one's stack: 8 MiB by default), and where a failed trial failed (inside a compile or in a step) with
   its error; and a least-squares line (fixed + per sample) through the held trials' peaks and the estimate's.

`--step-check`: a training step outside train.py, eager, compiled, and compiled with the batch dimension marked dynamic
(`torch._dynamo.mark_dynamic`): the peak of live bytes from torch.profiler's memory events, the data segment's peak,
and what the compiles keep after the steps.

    python bench/bench_compile_cpu.py                          # three families, eager and compiled (~1 h on 2 cores)
    python bench/bench_compile_cpu.py --models resnet18 --modes compiled
    python bench/bench_compile_cpu.py --step-check             # a step eager, compiled, compiled with a dynamic batch
Results are printed and saved to bench/results/bench_compile_cpu.json. Memory figures only: nothing is timed.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'bench'))

from common import write_result  # noqa: E402
from timm_ext.synthetic_data import make_image_folder  # noqa: E402

MODELS = {
    # name: (train.py flags, budget in MiB)
    'resnet18': (['--model', 'resnet18', '--img-size', '96'], 512),
    'vit_tiny_patch16_224': (['--model', 'vit_tiny_patch16_224', '--model-kwargs', 'img_size=96', '--img-size', '96'],
                             512),
    'convnext_atto': (['--model', 'convnext_atto', '--img-size', '96'], 512),
}
IMG = 32  # the generated images' side: train.py's transforms resize them to the model's input
COMMON = ['--device', 'cpu', '--num-classes', '3', '-j', '0', '--epochs', '1', '--warmup-epochs', '0', '--sched',
          'cosine', '--steady-cpu-heap']
MODES = {'eager': [], 'compiled': ['--torchcompile']}
# the text of an allocation that the cap refused, in the forms it takes (ATen, Python, C++, a child's errno)
# (a thread's stack is private writable memory, which RLIMIT_DATA counts: a new thread fails under the cap too)
OUT_OF_MEMORY = re.compile(r"can't allocate memory|MemoryError|bad_alloc|Cannot allocate memory|out of memory|"
                           r"Errno 12|memory exhausted|can't start new thread", re.IGNORECASE)
PROFILE_BATCH = 16  # the uncapped trial that shows what a process holds, and where the search starts
MAX_BATCH = 256  # the generated data holds `--updates` batches up to this size
SEARCH_STEP = 1.15  # the search's growth factor before it brackets the limit
RESULT_ENV = 'BENCH_COMPILE_RESULT'  # the worker's JSON file
MiB = 1 << 20


def _env(**extra: str) -> dict:
    return {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', **extra}


def estimated(data: Path, flags: List[str], budget_mib: int, work: Path) -> dict:
    """tune_batch.py --estimate's largest batch within the budget, no headroom ('fits': None when nothing fits), and
    its predicted peaks ('peaks_mib': batch -> MiB)."""
    done = subprocess.run(['nice', '-n', '10', sys.executable, str(REPO / 'tune_batch.py'), '--data-dir', str(data),
                           *COMMON, *flags, '--estimate', '--mem-budget', f'{budget_mib}MiB', '--mem-headroom', '0',
                           '--select', 'max',
                           '--tuned-config', str(work / 'estimate.yaml')],
                          capture_output=True, text=True, env=_env(), cwd=work)
    fits = fits_up_to(done.stdout, budget_mib)
    if fits is None and 'nothing fits' not in done.stdout + done.stderr:
        raise SystemExit(f'tune_batch.py --estimate failed: {(done.stderr or done.stdout).strip()[-600:]}')
    return dict(fits=fits, peaks_mib=predicted_peaks(done.stdout))


def fits_up_to(report: str, budget_mib: int) -> Optional[int]:
    """The "fits up to" of the budget's row in an --estimate report's "What fits where" table."""
    found = re.search(rf'^\s*{budget_mib}MiB\s+(\d+)\s', report, re.MULTILINE)
    return int(found.group(1)) if found else None


def predicted_peaks(report: str) -> Dict[int, float]:
    """batch -> predicted peak (MiB) from an --estimate report's "Predicted peak per micro-batch" table (its last
    columns: the peak, then its share of the budget)."""
    units = {'B': 1 / MiB, 'KiB': 1 / 1024, 'MiB': 1.0, 'GiB': 1024.0}
    table = report.split('Predicted peak per micro-batch:', 1)[-1].split('\n\n', 1)[0]
    peaks = {}
    for line in table.splitlines():
        found = re.match(r'^\s*(\d+)\s.*\s([\d.]+) (B|KiB|MiB|GiB)\s+\d+%$', line)
        if found:
            peaks[int(found.group(1))] = round(float(found.group(2)) * units[found.group(3)], 2)
    return peaks


def trial(data: Path, flags: List[str], batch: int, budget_mib: Optional[int], updates: int, work: Path) -> dict:
    """One fresh train.py at `batch` under the cap (None: uncapped): the worker's record, with 'holds'."""
    out = Path(tempfile.mkdtemp(dir=work))
    result = out / 'result.json'
    cap = {} if budget_mib is None else {'BENCH_CAP_MIB': str(budget_mib)}
    done = subprocess.run(['nice', '-n', '10', sys.executable, __file__, '--train-worker', str(updates), '--',
                           '--data-dir', str(data), *COMMON, *flags, '-b', str(batch), '--output', str(out),
                           '--experiment', 'run'],
                          capture_output=True, text=True, cwd=work,
                          env=_env(**cap, **{RESULT_ENV: str(result), 'TORCHINDUCTOR_CACHE_DIR': str(out / 'ind')}))
    record = json.loads(result.read_text()) if result.exists() else {}
    record.update(batch=batch, holds=done.returncode == 0 and record.get('updates_done') == updates)
    if not record['holds']:
        record['last_line'] = (done.stderr.strip().splitlines() or [''])[-1][:300]  # what train.py said
        record['error'] = record.get('error') or record['last_line']
        record['out_of_memory'] = bool(OUT_OF_MEMORY.search(record['error'] + done.stderr[-3000:]))
    return record


def largest_that_holds(data: Path, flags: List[str], start: int, budget_mib: int, updates: int,
                       work: Path) -> Tuple[int, List[dict]]:
    """train.py's largest batch under the cap: from `start`, x`SEARCH_STEP` up (or down) to a change, then bisected
    to within 2%. A failure that is not the cap's (no out-of-memory text) ends the search with an error."""
    fit, fail, size, trials = 0, None, max(1, start), []
    while size and (fail is None or fail - fit > max(1, fit // 50)):
        record = trial(data, flags, size, budget_mib, updates, work)
        trials.append(record)
        print(f'    b={size}: {"holds" if record["holds"] else "fails in " + str(record.get("failed_in"))} '
              f'(peak {record.get("peak_mib")} MiB)', flush=True)
        if not record['holds'] and not record['out_of_memory']:
            raise SystemExit(f'train.py failed at batch {size} without running out of memory: {record["error"]}')
        if record['holds']:
            fit = size
        else:
            fail = size
        if fail is None:
            size = min(MAX_BATCH, max(size + 1, int(size * SEARCH_STEP)))
            if size == fit:  # the data's limit: the loader holds no more
                break
        elif fit == 0:
            size = int(size / SEARCH_STEP) if size > 1 else 0
        else:
            size = (fit + fail) // 2
    return fit, trials


def start_guess(profile: dict, profile_batch: int, budget_mib: int) -> int:
    """A first batch for the search from an uncapped trial: what stays after an update is fixed, the rest of its
    peak grows with the batch (the compiles' state is in what stays)."""
    fixed = profile['windows'][-1]['after_mib']
    per_sample = max(1e-3, (profile['peak_mib'] - fixed) / profile_batch)
    return max(1, min(MAX_BATCH, int((budget_mib - fixed) / per_sample)))


def held_before_step(profile: dict) -> Dict[str, Optional[float]]:
    """From an uncapped trial: the data segment above the epoch's start once the first compile ended (before the
    step it compiled ran), the compiles' own peak, and what stays after the last update (MiB)."""
    compiles = [w for w in profile['windows'] if w['window'].startswith('compile')]
    return dict(epoch_start_mib=profile['baseline_mib'],
                after_first_compile_mib=compiles[0]['after_mib'] if compiles else 0.0,
                compile_peak_mib=max((w['peak_mib'] for w in compiles), default=0.0),
                after_updates_mib=profile['windows'][-1]['after_mib'], step_peak_mib=profile['peak_mib'],
                threads=profile['windows'][-1].get('threads'))


def run_model(name: str, modes: List[str], updates: int, work: Path) -> List[dict]:
    """Both searches and both estimates of one model, under its budget."""
    flags, budget_mib = MODELS[name]
    data = work / 'data'
    make_image_folder(data, size=IMG, per_class=-(-MAX_BATCH * updates // 3), splits=('train',))
    make_image_folder(data, size=IMG, per_class=4, splits=('validation',))  # built by train.py, never read here
    rows = []
    for mode in modes:
        mode_flags = [*flags, *MODES[mode]]
        estimate = estimated(data, mode_flags, budget_mib, work)
        predicted = estimate['fits']
        profile = trial(data, mode_flags, PROFILE_BATCH, None, updates, work)
        if not profile['holds']:
            raise SystemExit(f'{name} {mode}: the uncapped trial failed: {profile["error"]}')
        held = held_before_step(profile)
        print(f'{name} {mode}: estimate {predicted} under {budget_mib} MiB; uncapped b={PROFILE_BATCH}: {held}',
              flush=True)
        limit, trials = largest_that_holds(data, mode_flags, start_guess(profile, PROFILE_BATCH, budget_mib),
                                           budget_mib, updates, work)
        failures = sorted({f'{t["failed_in"]}: {t["error"][:120]}' for t in trials if not t['holds']})
        error = None if predicted is None or not limit else round(100 * (predicted - limit) / limit, 1)
        real_line = line_through({t['batch']: t['peak_mib'] for t in trials if t['holds']})
        rows.append(dict(model=name, mode=mode, flags=mode_flags, budget_mib=budget_mib, real_limit=limit,
                         estimated=predicted, error_pct=error, real_line=real_line,
                         estimate_line=line_through(estimate['peaks_mib']), held=held, failures=failures,
                         trials=trials, profile=profile))
        print(f'{name} {mode}: train.py holds {limit}, the estimate says {predicted} ({error}%)', flush=True)
    return rows


def line_through(points: Dict[int, float]) -> Optional[Dict[str, float]]:
    """The least-squares line through (batch, MiB) points: what stays whatever the batch, and MiB a sample."""
    if len(points) < 2:
        return None
    mean_b, mean_v = sum(points) / len(points), sum(points.values()) / len(points)
    slope = sum((b - mean_b) * (v - mean_v) for b, v in points.items()) / sum((b - mean_b) ** 2 for b in points)
    return dict(fixed_mib=round(mean_v - slope * mean_b, 1), per_sample_mib=round(slope, 3))


class _Windows:
    """The data segment above the cap's zero, window by window: its sampled peak and where it ended."""

    def __init__(self, baseline: int):
        from timm_ext.memory import PeakMeter
        self.baseline = baseline
        self.meter = PeakMeter('cpu', baseline)
        self.rows: List[dict] = []
        self.meter.reset()

    def close(self, name: str) -> None:
        from timm_ext.memory import data_and_stack
        peak = self.meter.peak() or 0
        self.rows.append(dict(window=name, peak_mib=_mib(peak), after_mib=_mib(data_and_stack() - self.baseline),
                              threads=_threads()))
        self.meter.reset()


class _FirstBatches:
    """A loader cut to its first `count` batches (train.py's epoch is as long as its loader)."""

    def __init__(self, loader, count: int):
        self.loader, self.count = loader, count

    def __len__(self) -> int:
        return min(self.count, len(self.loader))

    def __iter__(self):
        batches = iter(self.loader)
        return (next(batches) for _ in range(len(self)))


def train_worker(updates: int, train_argv: List[str]) -> None:
    """Run train.py (this process) with its first epoch cut to `updates` updates, capped at its start when
    BENCH_CAP_MIB is set; write the windows' figures to $BENCH_COMPILE_RESULT and end before evaluation."""
    import resource
    import runpy
    from torch._dynamo.callback import on_compile_end, on_compile_start
    from timm_ext.memory import data_and_stack
    from timm_ext.train.loop import TrainLoop

    state: Dict[str, object] = dict(phase='setup', compiles=0, updates_done=0)
    original_epoch, original_update = TrainLoop.train_one_epoch, TrainLoop.optimizer_update

    def on_start(args) -> None:
        if isinstance(state.get('windows'), _Windows):
            state['windows'].close(f'before compile {state["compiles"]}')
        state['phase'] = f'compile {state["compiles"]} ({args.callback_trigger.name.lower()})'

    def on_end(args) -> None:
        failed = sys.exc_info()[0] is not None  # the compile is ending on an exception: it failed there
        if failed:
            state['failed_in'] = state['phase']
        if isinstance(state.get('windows'), _Windows):
            state['windows'].close(f'{state["phase"]}{" (failed)" if failed else ""}')
        state['compiles'] += 1
        state['phase'] = f'update {state["updates_done"]}'

    def update(self, *args, **kwargs):
        original_update(self, *args, **kwargs)
        state['windows'].close(f'update {state["updates_done"]}')
        state['updates_done'] += 1
        state['phase'] = f'update {state["updates_done"]}'

    def epoch(self, epoch_idx, loader, start_update=0):
        baseline = data_and_stack()
        state.update(baseline_mib=_mib(baseline), phase='update 0')
        if 'BENCH_CAP_MIB' in os.environ:
            limit = baseline + int(float(os.environ['BENCH_CAP_MIB']) * MiB)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
        state['windows'] = _Windows(baseline)
        try:
            original_epoch(self, epoch_idx, _FirstBatches(loader, updates), start_update)
        except BaseException as e:
            state['error'] = f'{type(e).__name__}: {" ".join(str(e).split())[:300]}'
            state.setdefault('failed_in', state['phase'])
            raise
        finally:
            _write_record(state)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the updates are what is measured: no evaluation, no checkpoint

    on_compile_start(on_start)
    on_compile_end(on_end)
    TrainLoop.train_one_epoch, TrainLoop.optimizer_update = epoch, update
    sys.argv = [str(REPO / 'train.py'), *train_argv]
    runpy.run_path(str(REPO / 'train.py'), run_name='__main__')


def _write_record(state: Dict[str, object]) -> None:
    windows = state.pop('windows', None)
    rows = windows.rows if isinstance(windows, _Windows) else []
    if isinstance(windows, _Windows) and state.get('error') and not str(state['failed_in']).startswith('compile'):
        windows.close(f'{state["failed_in"]} (failed)')  # the window the failure ended (a compile's closed at it)
    record = {**state, 'windows': rows, 'peak_mib': max((r['peak_mib'] for r in rows), default=None)}
    Path(os.environ[RESULT_ENV]).write_text(json.dumps(record, indent=1))


STEP_MODES = ('eager', 'static', 'dynamic')  # the step worker's: no compile, a static batch, a dynamic batch dim


def step_worker(name: str, batch: int, mode: str) -> dict:
    """Training steps of `name` (SGD with momentum, cross-entropy; one thread, the steady heap, no cap) in `mode`
    (`STEP_MODES`): peak live bytes of the third step from torch.profiler's memory events (the rise over the step's
    start), the data segment's sampled peak over a fourth, what stays after them above the data segment before the
    first step (the compiles' state beside the momentum) and what `torch._dynamo.reset()` gives back of it."""
    import gc
    import timm
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    from timm_ext.memory import PeakMeter, data_and_stack, steady_cpu_heap

    torch.set_num_threads(1)
    steady_cpu_heap()
    flags, _ = MODELS[name]
    img = int(flags[flags.index('--img-size') + 1])
    model = timm.create_model(name, num_classes=3, **(dict(img_size=img) if '--model-kwargs' in flags else {}))
    optimizer = torch.optim.SGD(model.train().parameters(), lr=0.01, momentum=0.9)
    run = model if mode == 'eager' else torch.compile(model)

    def step() -> None:
        x, y = torch.randn(batch, 3, img, img), torch.randint(0, 3, (batch,))
        if mode == 'dynamic':
            torch._dynamo.mark_dynamic(x, 0)
        F.cross_entropy(run(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = data_and_stack()
    step()
    step()  # the optimizer state exists from here
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # each allocation and free the CPU allocator reported, in time order (the op-level events sum their children's)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == '[memory]')
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    del prof, events
    gc.collect()
    meter = PeakMeter('cpu', data_and_stack())
    meter.reset()
    step()
    record = dict(model=name, batch=batch, mode=mode, profiler_peak_mib=_mib(peak),
                  vmdata_peak_mib=_mib(meter.peak() or 0), after_steps_mib=_mib(data_and_stack() - start),
                  graphs=torch._dynamo.utils.counters['stats']['unique_graphs'], threads=_threads())
    torch._dynamo.reset()
    gc.collect()
    record['after_dynamo_reset_mib'] = _mib(data_and_stack() - start)
    return record


def _mib(num_bytes: float) -> float:
    return round(num_bytes / MiB, 1)


def _threads() -> int:
    """This process's threads: each one's stack is private writable memory that RLIMIT_DATA counts (its size is the
    stack limit, 8 MiB by default, whether or not it is touched)."""
    return len(os.listdir('/proc/self/task'))


def step_check(names: List[str], batch: int) -> List[dict]:
    """`step_worker` in each of `STEP_MODES` for each model, each in a fresh process (a cold inductor cache)."""
    rows = []
    for name in names:
        for mode in STEP_MODES:
            done = subprocess.run(['nice', '-n', '10', sys.executable, __file__, '--step-worker', name, str(batch),
                                   mode], capture_output=True, text=True,
                                  env=_env(TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp()))
            if done.returncode != 0:
                raise SystemExit(f'{name} {mode} failed: {done.stderr.strip()[-600:]}')
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    return rows


def print_tables(rows: List[dict]) -> None:
    print('\n| model | mode | budget | train.py holds | estimate | estimate error | where trials above it failed |')
    print('| --- | --- | --- | --- | --- | --- | --- |')
    for r in rows:
        where = '; '.join(sorted({f.split(':')[0] for f in r['failures']}))
        print(f'| {r["model"]} | {r["mode"]} | {r["budget_mib"]} MiB | {r["real_limit"]} | {r["estimated"]} | '
              f'{r["error_pct"]:+.1f}% | {where} |')
    print('\n| model | mode | train.py peaks: fixed + per sample | the estimate\'s: fixed + per sample |')
    print('| --- | --- | --- | --- |')
    for r in rows:
        real, est = (r.get(key) or dict(fixed_mib='?', per_sample_mib='?') for key in ('real_line', 'estimate_line'))
        print(f'| {r["model"]} | {r["mode"]} | {real["fixed_mib"]} MiB + {real["per_sample_mib"]} MiB x b | '
              f'{est["fixed_mib"]} MiB + {est["per_sample_mib"]} MiB x b |')
    print(f'\n| model | mode | data segment at the epoch start | held after the first compile (before its step) | '
          f'compiles\' peak | held after the updates | peak (b={PROFILE_BATCH}) | threads |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- |')
    for r in rows:
        h = r['held']
        print(f'| {r["model"]} | {r["mode"]} | {h["epoch_start_mib"]} MiB | {h["after_first_compile_mib"]} MiB | '
              f'{h["compile_peak_mib"]} MiB | {h["after_updates_mib"]} MiB | {h["step_peak_mib"]} MiB | '
              f'{h.get("threads")} |')


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['--train-worker']:  # --train-worker UPDATES -- TRAIN.PY ARGS
        train_worker(int(argv[1]), argv[3:])
        return 0
    if argv[:1] == ['--step-worker']:  # --step-worker MODEL BATCH MODE
        print(json.dumps(step_worker(argv[1], int(argv[2]), argv[3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', nargs='+', choices=list(MODELS), default=list(MODELS))
    parser.add_argument('--modes', nargs='+', choices=list(MODES), default=list(MODES))
    parser.add_argument('--updates', type=int, default=3, help='training updates a trial must complete')
    parser.add_argument('--step-check', action='store_true',
                        help='only: a step of each model eager, compiled and compiled with a dynamic batch dim')
    parser.add_argument('--step-batch', type=int, default=32)
    parser.add_argument('--output', default=str(REPO / 'bench' / 'results' / 'bench_compile_cpu.json'))
    args = parser.parse_args(argv)
    if args.step_check:
        rows = step_check(args.models, args.step_batch)
        write_result(str(Path(args.output).with_name('bench_compile_cpu_steps.json')), dict(rows=rows))
        return 0
    rows = []
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            rows += run_model(name, args.modes, args.updates, Path(tmp))
        write_result(args.output, dict(rows=rows, updates=args.updates))
    print_tables(rows)
    return 0


if __name__ == '__main__':
    sys.exit(main())
