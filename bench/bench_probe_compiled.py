#!/usr/bin/env python3
"""The compiled probe on the CPU: what it compiles, what that costs against one compile of the step, and whether its
choice holds in train.py --torchcompile under the same cap.

For each configuration (model, input, CPU budget), with a fresh inductor cache (TORCHINDUCTOR_CACHE_DIR) of its own:

1. one compile: a fresh process builds the run's trial (`build_train_trial`) and runs its warm-up once (an update
   and the eval pass: the training graphs and the eval graph), cold; its wall seconds are one compile of the step.
2. `tune_batch.py --torchcompile --select max --mem-budget BUDGET --dry-run --no-cache` in a second fresh cache:
   its whole-process wall seconds, its Spent line, each trial's graphs compiled and loaded, and the graphs the whole
   probe compiled (inductor's FX graph cache entries it wrote).
3. hold: train.py --torchcompile at the chosen batch, `--hold-epochs` epochs (default 2) with evaluation and
   checkpoints, in `--hold-runs` fresh processes (default 2), under the same budget set once train.py's stack is
   built (`tests/train/oom_cap_train.py`, as bench/bench_probe_holds.py); with the graphs each run compiled itself
   (new cache entries: 0 when it loaded what the probe compiled for it).

    python bench/bench_probe_compiled.py            # test_resnet 32 px, test_vit 32 px (each compile takes minutes)
Results are printed and saved to bench/results/bench_probe_compiled.json.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'bench'))

from bench_probe_holds import COMMON, data_for, trains  # noqa: E402
from common import write_result  # noqa: E402
from timm_ext.tune.tuned_config import planned_command  # noqa: E402

CONFIGS = [
    # (name, train.py flags, budget in MiB, image size of the generated data)
    # budgets that leave the limit well inside the 300-image split (the compiled step's fixed part is 110-140 MiB:
    # the graphs loaded, dynamo's and inductor's heap)
    ('test_resnet 32px sgd', ['--model', 'test_resnet', '--img-size', '32', '--torchcompile'], 170, 32),
    ('test_vit 32px adamw', ['--model', 'test_vit', '--model-kwargs', 'img_size=32', '--img-size', '32',
                             '--opt', 'adamw', '--torchcompile'], 150, 32),
]
ONE_COMPILE = '''
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from timm_ext.probe.trial import build_train_trial
from timm_ext.train.args import parse_args
args, _ = parse_args(sys.argv[2:])
args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
setup = build_train_trial(args, torch.device('cpu'))
setup.batch_dynamic.enabled = False  # train.py's own graphs: static
started = time.perf_counter()
setup.warmup(8)
print(time.perf_counter() - started)
'''


def graph_entries(cache: Path) -> int:
    """Graphs in an inductor cache: the FX graph cache's entries (one per compiled graph and guard range)."""
    return sum(1 for p in (cache / 'fxgraph').rglob('*') if p.is_file()) if (cache / 'fxgraph').is_dir() else 0


def one_compile(flags: List[str], cache: Path, work: Path) -> float:
    """Seconds of one cold compile of the step: the trial's warm-up (training and eval graphs) in a fresh cache."""
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TORCHINDUCTOR_CACHE_DIR': str(cache)}
    done = subprocess.run([sys.executable, '-c', ONE_COMPILE, str(REPO), '--data-dir', str(work / 'data'), *COMMON,
                           *flags], capture_output=True, text=True, env=env, cwd=work)
    if done.returncode != 0:
        raise SystemExit(f'one compile failed: {done.stderr.strip().splitlines()[-1:]}')
    return float(done.stdout.strip().splitlines()[-1])


def tune(flags: List[str], budget_mib: int, work: Path) -> dict:
    """The compiled probe in a fresh process: choice, wall seconds, Spent line, trials and graphs compiled."""
    config = work / 'tuned.yaml'
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / 'tune_batch.py'), '--data-dir', str(work / 'data'), *COMMON,
                           *flags, '--select', 'max', '--mem-budget', f'{budget_mib}MiB', '--dry-run', '--no-cache',
                           '--tuned-config', str(config)], capture_output=True, text=True,
                          env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}, cwd=work)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        return dict(failed=(done.stderr.strip().splitlines() or [''])[-1][:300], wall_s=round(seconds, 1))
    spent = re.search(r'Spent before training: (.*)\.', done.stdout)
    trials = json.loads((work / 'tuned.trials.json').read_text())['trials']
    command = planned_command(config.read_text())
    return dict(chosen=yaml.safe_load(config.read_text())['batch_size'], wall_s=round(seconds, 1),
                spent=spent.group(1) if spent else None,
                extras=command[command.index('-c') + 2:] if '-c' in command else [],
                trials=[{k: t.get(k) for k in ('batch_size', 'status', 'peak_bytes', 'error', 'compile_s',
                                               'graphs_compiled', 'graphs_loaded')} for t in trials])


def run_config(name: str, flags: List[str], budget_mib: int, img: int, hold_runs: int, hold_epochs: int,
               work: Path) -> dict:
    data_for(work, img, 100)
    reference = one_compile(flags, work / 'cache_one', work)
    print(f'{name}: one compile of the step {reference:.1f} s', flush=True)
    cache = work / 'cache_probe'
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = str(cache)  # the probe's cache, which train.py then reads
    probe = tune(flags, budget_mib, work)
    probe['graphs'] = graph_entries(cache)
    if 'failed' in probe:
        print(f'  tune_batch.py failed: {probe["failed"]}', flush=True)
        return dict(name=name, budget_mib=budget_mib, one_compile_s=round(reference, 1), probe=probe, holds=[],
                    held=0, hold_runs=0)
    print(f'  probe chose {probe["chosen"]} in {len(probe["trials"])} trials, {probe["wall_s"]} s; '
          f'{probe["graphs"]} graphs compiled in all; spent {probe["spent"]}', flush=True)
    for t in probe['trials']:
        peak = f'peak {t["peak_bytes"] / 2 ** 20:.1f} MiB' if t['peak_bytes'] else t['error'][:80]
        compiled = f'compile {t["compile_s"]:.1f} s' if t['compile_s'] is not None else 'compile unknown'
        print(f'    batch {t["batch_size"]}: {t["status"]}, {peak}, {compiled}, {t["graphs_compiled"]} graphs '
              f'compiled, {t["graphs_loaded"]} loaded', flush=True)
    holds = []
    for _ in range(hold_runs):
        before = graph_entries(cache)
        ok, last = trains(work / 'data', flags, probe['extras'], probe['chosen'], budget_mib, hold_epochs, work)
        holds.append(dict(held=ok, graphs_compiled=graph_entries(cache) - before, last=last))
        print(f'  hold {hold_epochs} epochs at {probe["chosen"]}: {"held" if ok else "FAILED: " + last} '
              f'({holds[-1]["graphs_compiled"]} graphs compiled by train.py)', flush=True)
    return dict(name=name, budget_mib=budget_mib, one_compile_s=round(reference, 1), probe=probe, holds=holds,
                held=sum(h['held'] for h in holds), hold_runs=hold_runs)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--only', default=None, help='run only the configurations whose name contains this')
    parser.add_argument('--hold-runs', type=int, default=2)
    parser.add_argument('--hold-epochs', type=int, default=2)
    parser.add_argument('--output', default=str(REPO / 'bench' / 'results' / 'bench_probe_compiled.json'))
    args = parser.parse_args(argv)
    rows = []
    for name, flags, budget_mib, img in CONFIGS:
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(run_config(name, flags, budget_mib, img, args.hold_runs, args.hold_epochs, Path(tmp)))
    print('\n| configuration | budget | one compile | probe choice (trials) | graphs compiled | Spent | held |')
    print('| --- | --- | --- | --- | --- | --- | --- |')
    for r in rows:
        p = r['probe']
        choice = f'{p["chosen"]} ({len(p["trials"])})' if 'failed' not in p else f'failed: {p["failed"][:60]}'
        print(f'| {r["name"]} | {r["budget_mib"]} MiB | {r["one_compile_s"]} s | {choice} | {p["graphs"]} '
              f'| {p.get("spent")} | {r["held"]}/{r["hold_runs"]} |')
    write_result(args.output, dict(rows=rows))


if __name__ == '__main__':
    main()
