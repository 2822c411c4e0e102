#!/usr/bin/env python3
"""Does the probe's choice hold in the program that trains, and how close does it come to train.py's own limit?

For each configuration (model, input, CPU budget):

1. `tune_batch.py --select max --mem-budget BUDGET --dry-run --no-cache`: the probe's chosen micro-batch, its trials,
   and the train command it writes (with the extension flags a CPU budget adds).
2. hold: that train command, `--hold-epochs` epochs (default 3) with evaluation and checkpoints, in `--hold-runs`
   fresh processes (default 2), under the same budget set once train.py's stack is built (the cap harness
   `tests/train/oom_cap_train.py`, as a cap that comes after the start: a container, a ulimit in the job script).
3. train.py's own limit: the largest batch that trains two epochs under the same cap (the second trains with the first
   evaluation's shapes resident, the trial's warm-up), by bisection from the choice (one fresh process a size), with
   the same flags.

The figure of merit is choice / limit (the target is 0.90 or more, in at most 3 trials, and every hold run must end).

    python bench/bench_probe_holds.py                 # resnet18 112 px 1 GiB and two tiny models (~15 min on 2 cores)
    python bench/bench_probe_holds.py --quick         # the two tiny models
Results are printed and saved to bench/results/bench_probe_holds.json.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'bench'))

from common import write_result  # noqa: E402
from timm_ext.synthetic_data import make_image_folder  # noqa: E402
from timm_ext.tune.tuned_config import planned_command  # noqa: E402

CAP_HARNESS = REPO / 'tests' / 'train' / 'oom_cap_train.py'
CONFIGS = [
    # (name, train.py flags, budget in MiB, image size of the generated data)
    ('resnet18 112px sgd', ['--model', 'resnet18', '--img-size', '112'], 1024, 112),
    ('test_vit 64px adamw', ['--model', 'test_vit', '--model-kwargs', 'img_size=64', '--img-size', '64',
                             '--opt', 'adamw'], 96, 64),
    ('test_convnext 64px sgd+ema', ['--model', 'test_convnext', '--img-size', '64', '--model-ema'], 128, 64),
]
COMMON = ['--device', 'cpu', '--num-classes', '3', '-j', '0', '--epochs', '1', '--warmup-epochs', '0', '--sched',
          'cosine']


def _env() -> dict:
    return {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}


def tune(data: Path, flags: List[str], budget_mib: int, work: Path) -> Tuple[int, int, List[str]]:
    """(chosen micro-batch, trials run, the extension flags of its train command)."""
    config = work / 'tuned.yaml'
    done = subprocess.run([sys.executable, str(REPO / 'tune_batch.py'), '--data-dir', str(data), *COMMON, *flags,
                           '--select', 'max', '--mem-budget', f'{budget_mib}MiB', '--dry-run', '--no-cache',
                           '--tuned-config', str(config)], capture_output=True, text=True, env=_env(), cwd=work)
    if done.returncode != 0:
        raise SystemExit(f'tune_batch.py failed: {done.stderr.strip().splitlines()[-1:]}')
    trials = json.loads((work / 'tuned.trials.json').read_text())['trials']
    command = planned_command(config.read_text())
    extras = command[command.index('-c') + 2:] if '-c' in command else []
    return yaml.safe_load(config.read_text())['batch_size'], len(trials), extras


def trains(data: Path, flags: List[str], extras: List[str], batch: int, budget_mib: int, epochs: int,
           work: Path) -> Tuple[bool, str]:
    """Whether train.py at `batch` runs `epochs` epochs (eval and checkpoints) under the cap, in a fresh process."""
    out = Path(tempfile.mkdtemp(dir=work))
    done = subprocess.run([sys.executable, str(CAP_HARNESS), '--data-dir', str(data), *COMMON, *flags, *extras,
                           '-b', str(batch), '--epochs', str(epochs), '--output', str(out), '--experiment', 'run'],
                          capture_output=True, text=True, env={**_env(), 'OOM_CAP_MB': str(budget_mib)}, cwd=work)
    last = (done.stderr.strip().splitlines() or [''])[-1][:160]
    return done.returncode == 0, last


def largest_that_trains(data: Path, flags: List[str], extras: List[str], start: int, budget_mib: int,
                        work: Path) -> int:
    """train.py's largest batch that trains two epochs under the cap: grow x1.25 from `start` to a failure, then
    bisect (start itself is assumed to hold; the hold runs check it)."""
    fit, fail = start, None
    while fail is None:
        size = max(fit + 1, int(fit * 1.25))
        ok, _ = trains(data, flags, extras, size, budget_mib, 2, work)
        fit, fail = (size, None) if ok else (fit, size)
    while fail - fit > 1:
        size = (fit + fail) // 2
        ok, _ = trains(data, flags, extras, size, budget_mib, 2, work)
        fit, fail = (size, fail) if ok else (fit, size)
    return fit


def run_config(name: str, flags: List[str], budget_mib: int, img: int, hold_runs: int, hold_epochs: int,
               work: Path) -> dict:
    started = time.perf_counter()
    choice_data = work / 'data'
    chosen, trials, extras = tune(choice_data, flags, budget_mib, work)
    print(f'{name}: probe chose {chosen} in {trials} trials; train flags {extras}', flush=True)
    holds = [trains(choice_data, flags, extras, chosen, budget_mib, hold_epochs, work) for _ in range(hold_runs)]
    for ok, last in holds:
        print(f'  hold {hold_epochs} epochs at {chosen}: {"held" if ok else "FAILED: " + last}', flush=True)
    limit = largest_that_trains(choice_data, flags, extras, chosen, budget_mib, work)
    print(f'  train.py holds up to {limit}: choice {chosen / limit:.2f} of it', flush=True)
    return dict(name=name, budget_mib=budget_mib, chosen=chosen, trials=trials, extras=extras,
                held=sum(ok for ok, _ in holds), hold_runs=hold_runs, train_limit=limit,
                share=round(chosen / limit, 3), seconds=round(time.perf_counter() - started, 1))


def data_for(work: Path, img: int, per_class: int) -> None:
    """A generated ImageFolder (3 classes) whose training split is larger than any batch the budget holds."""
    make_image_folder(work / 'data', size=img, per_class=per_class)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='the two tiny models only')
    parser.add_argument('--hold-runs', type=int, default=2)
    parser.add_argument('--hold-epochs', type=int, default=3)
    parser.add_argument('--output', default=str(REPO / 'bench' / 'results' / 'bench_probe_holds.json'))
    args = parser.parse_args(argv)
    rows = []
    for name, flags, budget_mib, img in CONFIGS[1:] if args.quick else CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            data_for(work, img, 120 if budget_mib >= 512 else 80)
            rows.append(run_config(name, flags, budget_mib, img, args.hold_runs, args.hold_epochs, work))
    print('\n| configuration | budget | probe choice (trials) | held | train.py limit | choice / limit |')
    print('| --- | --- | --- | --- | --- | --- |')
    for r in rows:
        print(f'| {r["name"]} | {r["budget_mib"]} MiB | {r["chosen"]} ({r["trials"]}) | {r["held"]}/{r["hold_runs"]} '
              f'| {r["train_limit"]} | {r["share"]:.2f} |')
    write_result(args.output, dict(rows=rows))


if __name__ == '__main__':
    main()
