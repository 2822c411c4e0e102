#!/usr/bin/env python3
"""Benchmark tune_batch.py's per-size batches of a --train-img-sizes schedule against a fitted oracle (memory only).

For one model and three sizes under one budget (RLIMIT_DATA on CPU, CUDA's per-process memory fraction on a GPU):

* found: `tune_batch.py --train-img-sizes ... --mem-headroom 0 --no-cache --dry-run` in a fresh process, on a
  generated ImageFolder large enough that the dataset never limits the batch; its `train_batch_sizes` and the trials
  each size took (from the per-size trial tables it writes).
* fitted: at each size, the largest batch that runs a training step (the probe's trial: one warm-up and one timed
  update, of the run's model and optimizer built as train.py builds them) in a fresh process under the same cap,
  found by bisection on integers from the found batch (up by doubling until a failure, then halving the interval).

Headroom is 0 so both find the cap's boundary. Nothing is timed; the figures are batch sizes and trial counts.

    python bench/bench_img_sizes.py                                   # test_resnet 32/48/64 px, 48 MiB, CPU
    python bench/bench_img_sizes.py --model test_vit --budget 96MiB --model-flags=--opt=adamw
Results are printed and saved to bench/results/bench_img_sizes.json.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import run_json_worker  # noqa: E402  (bench/common.py)


def worker_trial(flags: List[str], budget: str, size: int, batch: int) -> None:
    """One training trial at `batch` and input `size` in this fresh process, under the cap; prints the trial."""
    import torch
    from timm_ext.distributed import init_device
    from timm_ext.memory import PeakMeter, memory_cap, parse_budget
    from timm_ext.probe.measure import measured_trial
    from timm_ext.probe.trial import build_train_trial
    from timm_ext.train.args import parse_args
    from timm_ext.tune.img_sizes import size_trial_args
    torch.set_num_threads(1)
    args, _ = parse_args(flags)
    args, device = init_device(args)
    setup = build_train_trial(size_trial_args(args, (3, size, size)), device)
    with memory_cap(device, parse_budget(budget).resolve(device)) as cap:
        trial = measured_trial(setup.step, device, PeakMeter(device, cap.baseline), warmup_steps=1, timed_steps=1,
                               capped=True, before=setup.reset, isolate=device.type == 'cpu')(batch)
    print(json.dumps(trial.to_dict()))


def run_worker(*argv) -> dict:
    return run_json_worker(__file__, argv, REPO)


def fitted(flags: List[str], budget: str, size: int, guess: int) -> Tuple[int, Dict[int, str]]:
    """The largest batch whose trial fits at `size` in a fresh process each, by bisection from `guess`."""
    table: Dict[int, str] = {}

    def fits(batch: int) -> bool:
        table[batch] = run_worker('trial', flags, budget, size, batch)['status']
        return table[batch] == 'fit'

    low, high = 0, None  # largest fit, smallest failure
    if fits(guess):
        low, batch = guess, guess * 2
        while fits(batch):  # up by doubling until a failure
            low, batch = batch, batch * 2
        high = batch
    else:
        high = guess
        while high > 1 and not fits(high // 2):  # down by halving until a fit
            high //= 2
        low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, dict(sorted(table.items()))


def run_tune(flags: List[str], budget: str, sizes: List[int], work: Path) -> Tuple[List[int], Dict[int, int]]:
    """tune_batch.py's train_batch_sizes for the schedule, and the trials it ran at each size."""
    from timm_ext.synthetic_data import make_image_folder
    data = make_image_folder(work / 'data', size=max(sizes), per_class=200, splits=('train',))
    config = work / 'tuned.yaml'
    command = [sys.executable, str(REPO / 'tune_batch.py'), '--data-dir', str(data), *flags, '--num-classes', '3',
               '--img-size', str(max(sizes)), '-j', '0', '--val-split', '', '--train-img-sizes', *map(str, sizes),
               '--mem-budget', budget, '--mem-headroom', '0', '--no-cache', '--dry-run', '--tuned-config', str(config)]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TIMM_EXT_CACHE_DIR': str(work / 'cache')}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f'tune_batch.py failed: {result.stderr[-2000:]}')
    batches = yaml.safe_load(config.read_text())['train_batch_sizes']
    trials = {s: len(json.loads((work / f'tuned.trials.{s}x{s}.json').read_text())['trials']) for s in sizes}
    return batches, trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default='test_resnet')
    parser.add_argument('--model-flags', default='', help='more train.py flags, space-separated')
    parser.add_argument('--sizes', type=int, nargs=3, default=[32, 48, 64])
    parser.add_argument('--budget', default='48MiB')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--output', default=str(REPO / 'bench' / 'results' / 'bench_img_sizes.json'))
    parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        name, *argv = json.loads(opts.worker)
        {'trial': worker_trial}[name](*argv)
        return
    flags = ['--model', opts.model, '--device', opts.device, *opts.model_flags.split()]
    with tempfile.TemporaryDirectory() as tmp:
        batches, trials = run_tune(flags, opts.budget, opts.sizes, Path(tmp))
    oracle_flags = [*flags, '--num-classes', '3']
    rows = []
    for size, found in zip(opts.sizes, batches):
        best, table = fitted(oracle_flags, opts.budget, size, found)
        rows.append({'size': size, 'found': found, 'trials': trials[size], 'fitted': best,
                     'share': round(found / best, 3) if best else None, 'oracle_table': table})
        print(f'{size:>4} px: found {found:>4} in {trials[size]} trials, fitted {best:>4}  {table}', flush=True)
    env_note = f'ONEDNN_PRIMITIVE_CACHE_CAPACITY={os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "default")}'
    print(f'\n{opts.model} {" ".join(flags[4:])} under {opts.budget} on {opts.device} ({env_note}), headroom 0')
    print('| size | found | trials | fitted | found / fitted |\n|---|---|---|---|---|')
    for r in rows:
        share = f"{r['share']:.0%}" if r['share'] is not None else '-'
        print(f"| {r['size']} | {r['found']} | {r['trials']} | {r['fitted']} | {share} |")
    out = Path(opts.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({'model': opts.model, 'flags': flags, 'budget': opts.budget, 'env': env_note,
                               'rows': rows}, indent=2))


if __name__ == '__main__':
    main()
