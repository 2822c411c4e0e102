#!/usr/bin/env python3
"""Benchmark the batch probe under a real memory cap against an oracle and two descents.

The cap is RLIMIT_DATA on CPU (`--device cpu`, tiny test models) or CUDA's per-process memory fraction
(`--device cuda`, real models; prepared, not yet run on a GPU).

For each configuration (model, input size, budget):

* oracle: every decay-grid size (1, 2, 3, 4, 6, 8, 12, ...) tried alone in a fresh process under the same cap,
  ascending until two sizes in a row fail; the true largest fit is the largest size that fit.
* probe: `timm_ext.probe.train_probe.probe_train_batch` (aimed at the budget from measured peaks, settled on the
  device's default grid), with tune_batch.py's default headroom (`--headroom`). `bench/bench_peer_probe.py`
  compares it with the peers and an integer oracle.
* timm-style decay: descend the decay grid from 1024 (1024, 768, 512, ...) until a size fits.
* Accelerate-style: start at 1024 and retry at int(0.9 x size) until a size fits.
* hold check: the probe's choice trained in `--hold-runs` fresh processes (default 10) under the same cap,
  `--hold-updates` real updates each (default 3); the table says how many held.

All searches use the same trial (one warm-up and one timed training update, forked on CPU), so the table
compares search strategies: trials and wall time side by side, the probe's choice as a share of the oracle, and
whether it took at most ceil(log2(found / start)) + 4 trials. `--throughput` adds a full timed sweep of the fitting
grid sizes and checks that `--select throughput` picks a size within 5% of the sweep's best samples/s.

On CPU one size's speed differs between processes by a median of 3-9% (the same in every round of one process,
different in the next process), as much as the tolerance. So the reference is not one process: the sweep
runs without a cap (the cap decides what fits, not how fast it runs) in `--sweep-procs` fresh processes, each timing
every size in `--sweep-rounds` interleaved rounds; a size's reference speed is the mean of its per-process medians.
The throughput probe itself runs `--throughput-runs` times, each in a fresh process, alternating with the sweep
processes, and every choice it makes is checked.

    python bench/bench_probe.py                # all configurations, ~5 minutes on 2 cores
    python bench/bench_probe.py --quick        # one configuration
    python bench/bench_probe.py --throughput --throughput-runs 5   # and the throughput check, ~15 minutes
    python bench/bench_probe.py --device cuda --quick --throughput  # the same judged on a GPU
Results are printed and saved to bench/results/bench_probe.json.
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import run_json_worker  # noqa: E402  (bench/common.py)

CONFIGS = [
    # (name, train.py flags, budget): CPU, under RLIMIT_DATA
    ('test_vit 64px adamw', ['--model', 'test_vit', '--model-kwargs', 'img_size=64', '--img-size', '64',
                             '--opt', 'adamw'], '96MiB'),
    ('test_resnet 64px sgd', ['--model', 'test_resnet', '--img-size', '64'], '160MiB'),
    ('test_convnext 64px sgd+ema', ['--model', 'test_convnext', '--img-size', '64', '--model-ema'], '128MiB'),
]
CUDA_CONFIGS = [
    # CUDA, under a per-process memory fraction (prepared for a GPU session; not yet run)
    ('resnet50 224px sgd amp', ['--model', 'resnet50', '--img-size', '224', '--amp'], '8GiB'),
    ('vit_small_patch16_224 adamw amp', ['--model', 'vit_small_patch16_224', '--opt', 'adamw', '--amp'], '8GiB'),
]
START = 2
DESCENT_START = 1024


def setup_trial(flags):
    """train.py's arguments for `flags` (which name the device; 10 classes) and the training trial built from them."""
    import torch
    from timm_ext.distributed import init_device
    from timm_ext.probe.trial import build_train_trial
    from timm_ext.train.args import parse_args
    torch.set_num_threads(1)
    args, _ = parse_args([*flags, '--num-classes', '10'])
    return build_train_trial(*init_device(args))


def capped_trial(setup, cap, timed_steps=1):
    """The probe's trial under `cap`: one warm-up and `timed_steps` timed updates, forked on CPU."""
    from timm_ext.memory import PeakMeter
    from timm_ext.probe.measure import measured_trial
    return measured_trial(setup.step, setup.device, PeakMeter(setup.device, cap.baseline), warmup_steps=1,
                          timed_steps=timed_steps, capped=True, before=setup.reset,
                          isolate=setup.device.type == 'cpu')


def worker_oracle(flags, budget, size):
    """One grid size in this fresh process: cap, one trial (warm-up + timed update), report."""
    from timm_ext.memory import memory_cap, parse_budget
    setup = setup_trial(flags)
    with memory_cap(setup.device, parse_budget(budget).resolve(setup.device)) as cap:
        trial = capped_trial(setup, cap)(size)
    print(json.dumps(trial.to_dict()))


def worker_updates(flags, budget, batch_size, updates):
    """`updates` real training updates at `batch_size` in this fresh process, under the cap (set after the build)."""
    from timm_ext.memory import memory_cap, parse_budget
    from timm_ext.oom import is_oom
    setup = setup_trial(flags)
    result = {'holds': True, 'updates': updates}
    with memory_cap(setup.device, parse_budget(budget).resolve(setup.device)):
        setup.reset()
        for done in range(updates):
            try:
                setup.step(batch_size)
            except Exception as e:  # report, do not retry: the question is whether the size holds
                result = {'holds': False, 'updates': done, 'oom': is_oom(e, cpu_capped=True),
                          'error': f'{type(e).__name__}: {" ".join(str(e).split())[:200]}'}
                break
    print(json.dumps(result))


def hold_check(flags, budget, batch_size, runs=10, updates=3, timeout=900):
    """The promise, checked: `batch_size` run in `runs` fresh processes under the same cap, `updates` real updates
    each; how many held, and how each other one ended (a crash under the cap counts as not holding)."""
    ends = []
    for _ in range(runs):
        try:
            ends.append(run_worker('updates', flags, budget, batch_size, updates, timeout=timeout))
        except RuntimeError as e:  # the process died (oneDNN can take SIGSEGV under a cap)
            ends.append({'holds': False, 'error': ' '.join(str(e).split())[-200:]})
    failures = [end.get('error', '') for end in ends if not end['holds']]
    return {'batch_size': batch_size, 'held': runs - len(failures), 'runs': runs, 'updates': updates,
            'failures': failures}


def worker_search(flags, budget, method, select='max', timed_steps=1, headroom=None):
    """One search strategy in this fresh process; reports found size, trials and search wall time."""
    from timm_ext.batch_decay import batch_descent
    from timm_ext.memory import default_headroom, memory_cap, parse_budget
    from timm_ext.probe.train_probe import probe_train_batch
    setup = setup_trial(flags)
    budget = parse_budget(budget)
    headroom = default_headroom(setup.device) if headroom is None else headroom
    start = time.perf_counter()
    if method == 'probe':
        out = probe_train_batch(setup, budget, headroom=headroom, select=select, start=START, max_batch=DESCENT_START,
                                timed_steps=timed_steps)
        found, trials = out.selection.batch_size, out.trials
    else:
        trials = []
        with memory_cap(setup.device, budget.resolve(setup.device)) as cap:
            trial = capped_trial(setup, cap)
            size, found = DESCENT_START, None
            sizes = iter(batch_descent(DESCENT_START)) if method == 'decay' else None
            while found is None and size >= 1:
                size = next(sizes, 0) if method == 'decay' else size
                if size < 1:
                    break
                result = trial(size)
                trials.append(result)
                if result.fits:
                    found = size
                elif method == 'x0.9':
                    size = int(size * 0.9)
    seconds = time.perf_counter() - start
    print(json.dumps({'found': found, 'trials': [t.to_dict() for t in trials], 'seconds': seconds}))


def worker_sweep(flags, sizes, rounds):
    """Time every given size in `rounds` interleaved rounds (all sizes once per round), in one process, uncapped, with
    the probe's trial (one warm-up and three timed updates, forked on CPU); reports each size's samples/s per round."""
    from timm_ext.probe.measure import measured_trial
    setup = setup_trial(flags)
    trial = measured_trial(setup.step, setup.device, warmup_steps=1, timed_steps=3, before=setup.reset,
                           isolate=setup.device.type == 'cpu')
    timings = {size: [] for size in sizes}
    for _ in range(rounds):
        for size in sizes:
            timings[size].append(trial(size).samples_per_s)
    print(json.dumps(timings))


def run_worker(*argv, timeout=900):
    return run_json_worker(__file__, argv, REPO, timeout)


def oracle(flags, budget):
    from timm_ext.batch_decay import batch_descent
    grid = sorted(batch_descent(DESCENT_START))
    fits, failures_in_row, table = [], 0, {}
    for size in grid:
        trial = run_worker('oracle', flags, budget, size)
        table[size] = trial['status']
        if trial['status'] == 'fit':
            fits.append(size)
            failures_in_row = 0
        else:
            failures_in_row += 1
            if failures_in_row == 2:
                break
    return (max(fits) if fits else None), table


def grid_steps_between(a, b):
    from timm_ext.batch_decay import batch_descent
    grid = sorted(batch_descent(DESCENT_START))
    return abs(grid.index(a) - grid.index(b))


def throughput_check(flags, budget, true_fit, opts):
    """`--select throughput` in fresh processes against a sweep averaged over fresh processes (see the docstring)."""
    from timm_ext.batch_decay import batch_descent
    grid = sorted(batch_descent(DESCENT_START))
    per_process, runs = [], []
    for index in range(max(opts.sweep_procs, opts.throughput_runs)):
        if index < opts.throughput_runs:
            res = run_worker('search', flags, budget, 'probe', 'throughput', 3, opts.headroom)
            runs.append({'choice': res['found'], 'trials': len(res['trials']), 'seconds': round(res['seconds'], 1),
                         'retimings': sum(1 for t in res['trials'] if t.get('retime')), 'table': res['trials']})
        if index < opts.sweep_procs:
            largest = max([true_fit] + [r['choice'] for r in runs])
            sizes = [s for s in grid if START <= s <= largest]
            timings = run_worker('sweep', flags, sizes, opts.sweep_rounds)
            per_process.append({int(s): statistics.median(v) for s, v in timings.items()})
    sizes = sorted(set.intersection(*(set(p) for p in per_process)))
    reference = {s: statistics.mean(p[s] for p in per_process) for s in sizes}
    # how far one size's speed moves between processes: (max - min) / mean of its per-process medians
    spread = {s: (max(p[s] for p in per_process) - min(p[s] for p in per_process)) / reference[s] for s in sizes}
    for run in runs:
        # a run can choose among the sizes that fit in it; near the cap the boundary moves between processes
        fit_max = max(t['batch_size'] for t in run['table']
                      if all(u['status'] == 'fit' for u in run['table'] if u['batch_size'] == t['batch_size']))
        best = max((s for s in sizes if s <= fit_max), key=reference.get)
        run.update(largest_fit=fit_max, best=best, best_speed=reference[best],
                   vs_best=round(reference.get(run['choice'], 0.0) / reference[best], 3),
                   # the same choice judged by each sweep process alone: how far one process moves the verdict
                   vs_best_per_process=[round(p.get(run['choice'], 0.0) / max(p[s] for s in sizes if s <= fit_max), 3)
                                        for p in per_process])
    ratios = [r['vs_best'] for r in runs]
    print(f'   throughput: reference {opts.sweep_procs} processes x {opts.sweep_rounds} rounds; --select throughput '
          f'chose {[r["choice"] for r in runs]}: {", ".join(f"{x:.1%}" for x in ratios)} of the best that fit in '
          f'the run; one size moves by up to {max(spread.values()):.1%} between processes '
          f'(median {statistics.median(spread.values()):.1%})', flush=True)
    return {'reference': reference, 'process_spread': spread, 'per_process_medians': per_process, 'runs': runs,
            'all_within_5pct': all(x >= 0.95 for x in ratios)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='only the first configuration')
    parser.add_argument('--device', default='cpu', choices=('cpu', 'cuda'),
                        help='cpu: tiny test models under RLIMIT_DATA; cuda: real models under a memory fraction')
    parser.add_argument('--throughput', action='store_true', help='also check --select throughput on a full sweep')
    parser.add_argument('--sweep-rounds', type=int, default=2, metavar='N',
                        help='interleaved timing rounds in each sweep process; each size counts its median')
    parser.add_argument('--sweep-procs', type=int, default=3, metavar='N',
                        help='fresh processes timing the reference sweep; each size counts the mean of their medians')
    parser.add_argument('--throughput-runs', type=int, default=3, metavar='N',
                        help='fresh processes each running --select throughput')
    parser.add_argument('--headroom', type=float, default=None, metavar='FRAC',
                        help="the probe's --mem-headroom (default: tune_batch.py's, 5%% on CPU)")
    parser.add_argument('--hold-runs', type=int, default=10, metavar='N',
                        help="fresh processes that each train the probe's choice under the same cap (0: none)")
    parser.add_argument('--hold-updates', type=int, default=3, metavar='N', help='real updates each of them runs')
    parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        name, *argv = json.loads(opts.worker)
        workers = {'oracle': worker_oracle, 'search': worker_search, 'sweep': worker_sweep, 'updates': worker_updates}
        workers[name](*argv)
        return

    rows = []
    configs = CUDA_CONFIGS if opts.device == 'cuda' else CONFIGS
    for name, model_flags, budget in configs[:1] if opts.quick else configs:
        flags = [*model_flags, '--device', opts.device]
        cap_kind = 'memory fraction' if opts.device == 'cuda' else 'RLIMIT_DATA'
        print(f'== {name}, budget {budget} ({cap_kind})', flush=True)
        true_fit, table = oracle(flags, budget)
        print(f'   oracle (fresh process per grid size): largest fit {true_fit}  {table}', flush=True)
        row = {'config': name, 'budget': budget, 'oracle': true_fit, 'oracle_table': table}
        for method in ('probe', 'decay', 'x0.9'):
            res = run_worker('search', flags, budget, method, 'max', 1, opts.headroom)
            steps = grid_steps_between(res['found'], true_fit) if method == 'decay' else None
            row[method] = {'found': res['found'], 'trials': len(res['trials']), 'seconds': round(res['seconds'], 1),
                           'grid_steps_from_oracle': steps}
            print(f'   {method:>6s}: found {res["found"]:>4d} in {len(res["trials"]):>2d} trials, '
                  f'{res["seconds"]:6.1f} s', flush=True)
        found = row['probe']['found']
        row['probe']['trial_bound'] = math.ceil(math.log2(found / START)) + 4
        # the probe aims at any size (the default grid on CPU is every integer); the oracle tried the decay grid
        row['probe']['share_of_oracle'] = round(found / true_fit, 3) if true_fit else None
        row['probe']['within_trial_bound'] = row['probe']['trials'] <= row['probe']['trial_bound']
        if opts.hold_runs:
            row['probe']['hold'] = hold = hold_check(flags, budget, found, opts.hold_runs, opts.hold_updates)
            print(f'   probe choice {found} held {hold["held"]}/{hold["runs"]} fresh processes '
                  f'({opts.hold_updates} updates each under the cap)', flush=True)
        if opts.throughput:
            row['throughput'] = throughput_check(flags, budget, true_fit, opts)
        rows.append(row)

    print('\n| config | budget | oracle | probe found / trials / s | bound | held | decay from 1024 trials / s '
          '| x0.9 from 1024 trials / s |')
    print('|---|---|---|---|---|---|---|---|')
    for r in rows:
        p, d, a = r['probe'], r['decay'], r['x0.9']
        held = f"{p['hold']['held']}/{p['hold']['runs']}" if 'hold' in p else '-'
        print(f"| {r['config']} | {r['budget']} | {r['oracle']} | {p['found']} / {p['trials']} / {p['seconds']} "
              f"| {p['trial_bound']} | {held} | {d['trials']} / {d['seconds']} | {a['trials']} / {a['seconds']} |")
    if opts.throughput:
        print('\n| config | largest fit in the run | reference best (samples/s at size) | --select throughput chose '
              '| % of reference best | range over single sweep processes | trials (re-timings) | s |')
        print('|---|---|---|---|---|---|---|---|')
        for r in rows:
            for run in r['throughput']['runs']:
                lo, hi = min(run['vs_best_per_process']), max(run['vs_best_per_process'])
                print(f"| {r['config']} | {run['largest_fit']} | {run['best_speed']:.0f} at {run['best']} "
                      f"| {run['choice']} | {run['vs_best']:.1%} | {lo:.1%}-{hi:.1%} "
                      f"| {run['trials']} ({run['retimings']}) | {run['seconds']} |")
    out = REPO / 'bench' / 'results'
    out.mkdir(parents=True, exist_ok=True)
    (out / 'bench_probe.json').write_text(json.dumps(rows, indent=2))


if __name__ == '__main__':
    main()
