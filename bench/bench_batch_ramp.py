"""A fixed recipe batch against ``--batch-ramp`` on real images: best top-1 and wall time side by side.

For each packaged dataset (`timm_ext.packaged_data`) and model, the time-to-accuracy bench's recipe
(`bench_time_to_accuracy.RECIPES` and `RECIPE`: SGD, cosine, lr-base 0.4, seed 42) trains twice per repeat with the
same micro-batch and accumulation, both with ``--log-noise-scale`` so both pay for the measurement: once at the
fixed global batch, once with ``--batch-ramp`` growing the accumulation as B_simple grows. The pair alternates
which runs first. The table gives the best top-1, wall time and the global batch of each epoch
(``noise_scale.csv``).

On one device a larger accumulation trains the same samples at the same micro-batch, so the ramp can only save the
optimizer steps it skips; the comparison is about what the fewer, larger updates cost or gain in accuracy. The
small datasets here have few updates per epoch: ``--ramp-args`` passes the ramp's own flags (e.g. a lower
``--batch-ramp-min-updates``) where the default update guard leaves no room to grow.

    python bench/bench_batch_ramp.py                                  # digits and mnist5k, test_resnet
    python bench/bench_batch_ramp.py --epochs 2 --recipes digits      # a quick check that it runs
"""
import argparse
import csv
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'bench'))

from bench_time_to_accuracy import RECIPE, RECIPES, run  # noqa: E402
from common import write_result  # noqa: E402
from timm_ext.packaged_data import write_image_folder  # noqa: E402


def epoch_batches(run_dir: Path) -> List[int]:
    """The global batch each epoch trained with, from the run's noise_scale.csv."""
    with open(run_dir / 'noise_scale.csv', newline='') as f:
        return [int(row['global_batch']) for row in csv.DictReader(f)]


def table(results: List[Dict]) -> str:
    """The markdown table of all runs."""
    lines = ['| dataset | model | run | repeat | best top-1 % | wall s | global batch per epoch |',
             '|---|---|---|---|---:|---:|---|']
    for r in results:
        batches = ' '.join(str(b) for b in r['batches'])
        lines.append(f"| {r['dataset']} | {r['model']} | {r['run']} | {r['repeat']} | {r['top1']:.1f} | "
                     f"{r['wall_s']:.1f} | {batches} |")
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--recipes', nargs='+', default=['digits', 'mnist5k'], choices=list(RECIPES))
    parser.add_argument('--models', nargs='+', default=['test_resnet'])
    parser.add_argument('--epochs', type=int, default=None, help="override the recipe's epochs (a quick check)")
    parser.add_argument('--micro-batch', type=int, default=16, help='-b of both runs')
    parser.add_argument('--accum', type=int, default=2, help='--grad-accum-steps of both runs (>= 2: B_simple)')
    parser.add_argument('--ramp-args', default='', help="more flags of the ramp run, e.g. '--batch-ramp-factor 2'")
    parser.add_argument('--repeats', type=int, default=1, help='fixed/ramp pairs per recipe and model')
    parser.add_argument('--workers', type=int, default=2, help='-j/--workers of every run')
    parser.add_argument('--output', default=str(REPO / 'bench' / 'results' / 'batch_ramp.json'))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix='ramp-'))
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
    train = [sys.executable, str(REPO / 'train.py')]
    variants = {'fixed': [], 'ramp': ['--batch-ramp', *shlex.split(args.ramp_args)]}
    results: List[Dict] = []
    for name in args.recipes:
        dataset, classes, epochs = RECIPES[name]
        epochs = args.epochs or epochs
        data = work / dataset
        if not data.exists():
            write_image_folder(dataset, data)
        for model in args.models:
            recipe = [str(data), '--model', model, '--num-classes', str(classes), '--epochs', str(epochs),
                      '-j', str(args.workers), '-b', str(args.micro_batch), '--grad-accum-steps', str(args.accum),
                      '--log-noise-scale', *RECIPE]
            for repeat in range(args.repeats):
                order = list(variants) if repeat % 2 == 0 else list(variants)[::-1]  # alternate who goes first
                for variant in order:
                    tag = f'{variant}-{name}-{model}-{repeat}'
                    got = run([*train, *recipe, *variants[variant]], work / 'runs', tag, env)
                    results.append({'dataset': name, 'model': model, 'run': variant, 'repeat': repeat,
                                    'epochs': epochs, 'top1': got['top1'], 'wall_s': got['wall_s'],
                                    'batches': epoch_batches(work / 'runs' / tag)})
                    print(f'{name:8s} {model:11s} {variant:5s} #{repeat}: {got["wall_s"]:6.1f} s '
                          f'{got["top1"]:5.1f}% batches {results[-1]["batches"]}', flush=True)
                write_result(args.output, {'args': vars(args), 'results': results})
    print(table(results))
    print(json.dumps({'output': args.output}))


if __name__ == '__main__':
    main()
