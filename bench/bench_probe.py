#!/usr/bin/env python3
"""Benchmark the batch probe under a real CPU memory cap (RLIMIT_DATA) against an oracle and two descents.

For each configuration (model, input size, budget):

* oracle: every decay-grid size (1, 2, 3, 4, 6, 8, 12, ...) tried alone in a fresh process under the same cap,
  ascending until two sizes in a row fail; the true largest fit is the largest size that fit.
* probe: `timm_ext.probe_train.probe_train_batch` (grow x2 from 2, then bisect on the grid), headroom 0.
* timm-style decay: descend the decay grid from 1024 (1024, 768, 512, ...) until a size fits.
* Accelerate-style: start at 1024 and retry at int(0.9 x size) until a size fits.

All searches use the same trial (one warm-up and one timed training update in a forked process), so the table
compares search strategies: trials and wall time side by side, and whether the probe is within one grid step of
the oracle with at most ceil(log2(found / start)) + 4 trials. `--throughput` adds a full timed sweep of the fitting
grid sizes and checks that `--select throughput` picks a size within 5% of the sweep's best samples/s. The sweep
times every size in `--sweep-rounds` interleaved rounds and takes each size's median, so the reference is not
itself one noisy timing; the choice is also compared with the first round alone (a single-timing sweep).

    python bench/bench_probe.py                # all configurations, ~5 minutes on 2 cores
    python bench/bench_probe.py --quick        # one configuration
Results are printed and saved to bench/results/bench_probe.json.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = [
    # (name, train.py flags, budget)
    ('test_vit 64px adamw', ['--model', 'test_vit', '--model-kwargs', 'img_size=64', '--img-size', '64',
                             '--opt', 'adamw'], '96MiB'),
    ('test_resnet 64px sgd', ['--model', 'test_resnet', '--img-size', '64'], '160MiB'),
    ('test_convnext 64px sgd+ema', ['--model', 'test_convnext', '--img-size', '64', '--model-ema'], '128MiB'),
]
START = 2
DESCENT_START = 1024


def setup_trial(flags):
    import torch
    from timm_ext.distributed import init_device
    from timm_ext.probe_train import build_train_trial
    from timm_ext.train_args import parse_args
    torch.set_num_threads(1)
    args, _ = parse_args([*flags, '--device', 'cpu', '--num-classes', '10'])
    return build_train_trial(args, init_device(args))


def worker_oracle(flags, budget, size):
    """One grid size in this fresh process: cap, one trial (warm-up + timed update), report."""
    from timm_ext.memory import PeakMeter, memory_cap, parse_budget
    from timm_ext.probe import measured_trial
    setup = setup_trial(flags)
    budget_bytes = parse_budget(budget).resolve('cpu')
    with memory_cap('cpu', budget_bytes) as cap:
        trial = measured_trial(setup.step, setup.device, PeakMeter('cpu', cap.baseline), warmup_steps=1,
                               capped=True, before=setup.reset, isolate=True)(size)
    print(json.dumps(trial.to_dict()))


def worker_search(flags, budget, method, select='max', timed_steps=1):
    """One search strategy in this fresh process; reports found size, trials and search wall time."""
    from timm_ext.batch_decay import batch_descent
    from timm_ext.memory import PeakMeter, memory_cap, parse_budget
    from timm_ext.probe import measured_trial
    from timm_ext.probe_train import probe_train_batch
    setup = setup_trial(flags)
    budget = parse_budget(budget)
    start = time.perf_counter()
    if method == 'probe':
        out = probe_train_batch(setup, budget, headroom=0.0, select=select, start=START, max_batch=DESCENT_START,
                                timed_steps=timed_steps)
        found, trials = out.selection.batch_size, out.trials
    else:
        budget_bytes = budget.resolve('cpu')
        trials = []
        with memory_cap('cpu', budget_bytes) as cap:
            trial = measured_trial(setup.step, setup.device, PeakMeter('cpu', cap.baseline), warmup_steps=1,
                                   capped=True, before=setup.reset, isolate=True)
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


def worker_sweep(flags, budget, sizes, rounds):
    """Time every given size in `rounds` interleaved rounds (all sizes once per round), in one process, under the
    cap; reports one list of trials per round."""
    from timm_ext.memory import PeakMeter, memory_cap, parse_budget
    from timm_ext.probe import measured_trial
    setup = setup_trial(flags)
    with memory_cap('cpu', parse_budget(budget).resolve('cpu')) as cap:
        trial = measured_trial(setup.step, setup.device, PeakMeter('cpu', cap.baseline), warmup_steps=1,
                               timed_steps=3, capped=True, before=setup.reset, isolate=True)
        print(json.dumps([[trial(s).to_dict() for s in sizes] for _ in range(rounds)]))


def run_worker(*argv, timeout=900):
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO)}
    result = subprocess.run([sys.executable, __file__, '--worker', json.dumps(argv)], capture_output=True, text=True,
                            env=env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f'worker {argv[0]} failed: {result.stderr[-2000:]}')
    return json.loads(result.stdout.strip().splitlines()[-1])


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='only the first configuration')
    parser.add_argument('--throughput', action='store_true', help='also check --select throughput on a full sweep')
    parser.add_argument('--sweep-rounds', type=int, default=3, metavar='N',
                        help='interleaved timing rounds of the throughput sweep; each size counts its median')
    parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        name, *argv = json.loads(opts.worker)
        {'oracle': worker_oracle, 'search': worker_search, 'sweep': worker_sweep}[name](*argv)
        return

    rows = []
    for name, flags, budget in CONFIGS[:1] if opts.quick else CONFIGS:
        print(f'== {name}, budget {budget} (RLIMIT_DATA)', flush=True)
        true_fit, table = oracle(flags, budget)
        print(f'   oracle (fresh process per grid size): largest fit {true_fit}  {table}', flush=True)
        row = {'config': name, 'budget': budget, 'oracle': true_fit, 'oracle_table': table}
        for method in ('probe', 'decay', 'x0.9'):
            res = run_worker('search', flags, budget, method)
            steps = grid_steps_between(res['found'], true_fit) if method != 'x0.9' else None
            row[method] = {'found': res['found'], 'trials': len(res['trials']), 'seconds': round(res['seconds'], 1),
                           'grid_steps_from_oracle': steps}
            print(f'   {method:>6s}: found {res["found"]:>4d} in {len(res["trials"]):>2d} trials, '
                  f'{res["seconds"]:6.1f} s', flush=True)
        found = row['probe']['found']
        row['probe']['trial_bound'] = math.ceil(math.log2(found / START)) + 4
        row['probe']['within_one_grid_step'] = row['probe']['grid_steps_from_oracle'] <= 1
        row['probe']['within_trial_bound'] = row['probe']['trials'] <= row['probe']['trial_bound']
        if opts.throughput:
            from timm_ext.batch_decay import batch_descent
            sizes = [s for s in sorted(batch_descent(DESCENT_START)) if s <= true_fit and s >= START]
            rounds = run_worker('sweep', flags, budget, sizes, opts.sweep_rounds)
            timings = {}
            for t in (t for r in rounds for t in r if t['status'] == 'fit'):
                timings.setdefault(t['batch_size'], []).append(t['samples_per_s'])
            sweep = {s: statistics.median(v) for s, v in timings.items()}
            first = {t['batch_size']: t['samples_per_s'] for t in rounds[0] if t['status'] == 'fit'}
            res = run_worker('search', flags, budget, 'probe', 'throughput', 3)
            choice, retimed = res['found'], sum(1 for t in res['trials'] if t.get('retime'))
            ratio = sweep.get(choice, 0) / max(sweep.values())
            ratio_first = first.get(choice, 0) / max(first.values())
            row['throughput'] = {'sweep_median': sweep, 'sweep_rounds': timings, 'choice': choice,
                                 'choice_vs_best': round(ratio, 3), 'choice_vs_best_first_round': round(ratio_first, 3),
                                 'trials': len(res['trials']), 'retimings': retimed,
                                 'seconds': round(res['seconds'], 1), 'probe_table': res['trials']}
            print(f'   throughput: sweep ({opts.sweep_rounds} rounds, median) best {max(sweep.values()):.0f}/s at '
                  f'{max(sweep, key=sweep.get)}; --select throughput chose {choice} in {len(res["trials"])} trials '
                  f'({retimed} re-timings), {res["seconds"]:.1f} s: {ratio:.1%} of best '
                  f'({ratio_first:.1%} of the first round\'s best)', flush=True)
        rows.append(row)

    print('\n| config | budget | oracle | probe found / trials / s | bound | decay from 1024 trials / s '
          '| x0.9 from 1024 trials / s |')
    print('|---|---|---|---|---|---|---|')
    for r in rows:
        p, d, a = r['probe'], r['decay'], r['x0.9']
        print(f"| {r['config']} | {r['budget']} | {r['oracle']} | {p['found']} / {p['trials']} / {p['seconds']} "
              f"| {p['trial_bound']} | {d['trials']} / {d['seconds']} | {a['trials']} / {a['seconds']} |")
    if opts.throughput:
        print('\n| config | --select throughput chose | % of sweep best (median / first round) | trials (re-timings) '
              '| s |')
        print('|---|---|---|---|---|')
        for r in rows:
            t = r['throughput']
            ratios = f"{t['choice_vs_best']:.1%} / {t['choice_vs_best_first_round']:.1%}"
            print(f"| {r['config']} | {t['choice']} | {ratios} | {t['trials']} ({t['retimings']}) | {t['seconds']} |")
    out = REPO / 'bench' / 'results'
    out.mkdir(parents=True, exist_ok=True)
    (out / 'bench_probe.json').write_text(json.dumps(rows, indent=2))


if __name__ == '__main__':
    main()
