#!/usr/bin/env python3
"""validate.py --retry (every sample computed once) against stock timm's decay-and-rerun and a plain run, under one
real memory cap.

All run in fresh processes under `prlimit --data=CAP` (RLIMIT_DATA, so allocations past the cap raise PyTorch's
"DefaultCPUAllocator: can't allocate memory"), on the same generated image set and the same random-init checkpoint:

- ours:  `validate.py --retry -b 1024`.
- plain: `validate.py -b N` (no --retry) at the size N ours ended at, stock's warm-up forward included.
- stock: the policy of timm's validate.py `--retry`, re-implemented here (`--stock-policy` mode of this file): build
  the model, load the checkpoint, build dataset and loader, warm up at the batch size, evaluate; on a RuntimeError
  that `timm.utils.check_batch_size_retry` accepts, step down with `timm.utils.decay_batch_step` and start over.

The cap is the import footprint of a process (measured here) plus `--budget-mib`. Prints and writes (JSON) the
wall times, the ratios ours / stock (target <= 0.75) and ours / plain (target <= 1), the top-1 of each, the sizes
each tried and the cap.

    python bench/bench_validate_retry.py                       # resnet50, 224 px, 128 images, -b 1024
    python bench/bench_validate_retry.py --model test_resnet --img-size 64 --budget-mib 300   # a quick smoke run
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

REPO = Path(__file__).resolve().parent.parent


def vm_data() -> int:
    """This process's RLIMIT_DATA-counted size (VmData), in bytes."""
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmData'))


def stock_policy(args) -> dict:
    """Stock validate.py --retry: everything is rebuilt and rerun at each smaller batch size."""
    import torch
    from timm.data import create_dataset, create_loader, resolve_data_config
    from timm.models import create_model, load_checkpoint
    from timm.utils import AverageMeter, accuracy, check_batch_size_retry, decay_batch_step

    def run_everything(batch_size: int) -> float:
        model = create_model(args.model, num_classes=args.num_classes)
        load_checkpoint(model, args.checkpoint)
        config = resolve_data_config({'img_size': args.img_size}, model=model, use_test_size=True)
        model = model.to('cpu').eval()
        dataset = create_dataset(root=args.data_dir, name='', split='validation')
        loader = create_loader(dataset, input_size=config['input_size'], batch_size=batch_size, use_prefetcher=True,
                               interpolation=config['interpolation'], mean=config['mean'], std=config['std'],
                               num_workers=args.workers, crop_pct=config['crop_pct'],
                               crop_mode=config['crop_mode'], device=torch.device('cpu'))
        top1 = AverageMeter()
        with torch.inference_mode():
            model(torch.randn((batch_size,) + tuple(config['input_size'])))  # stock's warm-up batch
            for images, target in loader:
                output = model(images)
                top1.update(accuracy(output, target, topk=(1,))[0].item(), images.shape[0])
        return top1.avg

    batch_size, tried, error = args.batch_size, [], ''
    while batch_size:
        tried.append(batch_size)
        try:
            return {'top1': round(run_everything(batch_size), 4), 'batch_size': batch_size, 'tried': tried}
        except RuntimeError as e:
            error = str(e).splitlines()[0]
            print(f'batch size {batch_size} failed: {error[:120]}', file=sys.stderr, flush=True)
            if not check_batch_size_retry(str(e)):
                break
        batch_size = decay_batch_step(batch_size)
    return {'error': error, 'tried': tried}


def result_of(proc) -> dict:
    """The JSON after '--result' in a run's stdout; exits with the run's stderr when there is none."""
    if '--result\n' not in proc.stdout:
        sys.exit(f'run failed (exit {proc.returncode}): {proc.stderr[-1500:]}')
    return json.loads(proc.stdout.split('--result\n', 1)[1])


def timed(cmd, env) -> tuple:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    return time.perf_counter() - start, proc


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='resnet50')
    p.add_argument('--img-size', type=int, default=224)
    p.add_argument('--images', type=int, default=128, help='validation images generated (4 classes)')
    p.add_argument('-b', '--batch-size', type=int, default=1024)
    p.add_argument('--budget-mib', type=int, default=6144, help='memory above the import footprint')
    p.add_argument('--workers', type=int, default=0)
    p.add_argument('--out', default=str(REPO / 'bench' / 'results' / 'validate_retry.json'))
    # internal: the stock policy, run in the capped child process
    p.add_argument('--stock-policy', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--data-dir', help=argparse.SUPPRESS)
    p.add_argument('--checkpoint', help=argparse.SUPPRESS)
    p.add_argument('--num-classes', type=int, default=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stock_policy:
        print('--result\n' + json.dumps(stock_policy(args)))
        return

    import torch
    from timm.models import create_model
    sys.path.insert(0, str(REPO))
    from timm_ext.synthetic_data import make_image_folder

    env = {**os.environ, 'PYTHONPATH': str(REPO)}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_image_folder(Path(tmp) / 'data', size=64, per_class=args.images // 4,
                                 classes=('circle', 'square', 'cross', 'disc'), splits=('validation',))
        checkpoint = Path(tmp) / f'{args.model}.pth.tar'
        torch.manual_seed(0)
        torch.save({'arch': args.model, 'state_dict': create_model(args.model, num_classes=4).state_dict()},
                   checkpoint)
        footprint = subprocess.run(
            [sys.executable, '-c', 'import torch, timm, timm_ext.validate.evaluate, sys; sys.path.insert(0, "bench"); '
                                   'from bench_validate_retry import vm_data; print(vm_data())'],
            capture_output=True, text=True, env=env, cwd=REPO, check=True)
        cap = int(footprint.stdout.strip()) + args.budget_mib * 2 ** 20
        prlimit = ['prlimit', f'--data={cap}']

        def common(batch_size):
            return ['--data-dir', str(data), '--checkpoint', str(checkpoint), '-b', str(batch_size),
                    '--img-size', str(args.img_size), '--workers', str(args.workers)]

        ours_s, ours = timed(prlimit + [sys.executable, 'validate.py', '--model', args.model, '--retry',
                                        '--device', 'cpu', '--num-classes', '4', *common(args.batch_size)], env)
        stock_s, stock = timed(prlimit + [sys.executable, __file__, '--stock-policy', '--model', args.model,
                                          *common(args.batch_size)], env)
        ended_at = result_of(ours).get('batch_size')
        plain_s, plain = timed(prlimit + [sys.executable, 'validate.py', '--model', args.model, '--device', 'cpu',
                                          '--num-classes', '4', *common(ended_at)], env)

    ours_result, stock_result, plain_result = result_of(ours), result_of(stock), result_of(plain)
    probe_line = next((line for line in ours.stderr.splitlines() if 'Batch-size probe' in line), '')
    report = {
        'model': args.model, 'img_size': args.img_size, 'images': args.images, 'asked_batch_size': args.batch_size,
        'cap_bytes': cap, 'budget_mib': args.budget_mib, 'workers': args.workers,
        'ours': {'wall_s': round(ours_s, 2), 'top1': ours_result.get('top1'),
                 'batch_size': ours_result.get('batch_size'), 'probe': probe_line.split(': ', 1)[-1],
                 'continued_after_oom': re.findall(r'Batch size (\d+) ran out of memory', ours.stderr)},
        'stock': {'wall_s': round(stock_s, 2), 'top1': stock_result.get('top1'),
                  'batch_size': stock_result.get('batch_size'), 'tried': stock_result.get('tried'),
                  'error': stock_result.get('error')},
        'plain': {'wall_s': round(plain_s, 2), 'top1': plain_result.get('top1'), 'batch_size': ended_at},
        'time_ratio': round(ours_s / stock_s, 3),
        'ratio_vs_plain': round(ours_s / plain_s, 3),
        'targets_met': {'vs_stock_le_0.75': ours_s <= 0.75 * stock_s, 'vs_plain_le_1': ours_s <= plain_s},
        'same_top1': ours_result.get('top1') == stock_result.get('top1') == plain_result.get('top1'),
    }
    print(json.dumps(report, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + '\n')


if __name__ == '__main__':
    main()
