#!/usr/bin/env python3
"""train.py's evaluation at the training micro-batch (stock: no --validation-batch-size) against the eval batch
tune_batch.py writes (`validation_batch_size`), in one process on the same model, split and loader settings.

The stack is train.py's own (`timm_ext.train.stack.build_training_stack` from train.py's parser), the evaluation
`TrainLoop.evaluate`, the eval loaders `timm_ext.train.setup.build_eval_loader` with and without the tuned size.
Rounds alternate the two (after one warm-up pass each), so a slow phase of a shared machine hits both; the result
is the median of the per-round time ratios, and both passes must give the same top-1 / top-5 (loss within 1e-6).

    python bench/bench_eval_batch.py                                  # resnet18, 64 px, 1024 images, -b 32 vs 256
    python bench/bench_eval_batch.py --eval-batch 128 --images 512    # another tuned size
    python bench/bench_eval_batch.py --model test_resnet --img-size 32 --images 96 --rounds 1   # a smoke run
"""
import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without `pip install .`

from common import sync, write_result  # noqa: E402  (bench/common.py)
from timm_ext.distributed import init_device  # noqa: E402
from timm_ext.synthetic_data import SHAPES, make_image_folder  # noqa: E402
from timm_ext.train.args import parse_args  # noqa: E402
from timm_ext.train.loop import LoopConfig, TrainLoop  # noqa: E402
from timm_ext.train.setup import build_eval_loader  # noqa: E402
from timm_ext.train.stack import build_training_stack  # noqa: E402


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='resnet18')
    parser.add_argument('--img-size', type=int, default=64)
    parser.add_argument('-b', '--batch-size', type=int, default=32, help='the training micro-batch (stock eval batch)')
    parser.add_argument('--eval-batch', type=int, default=256, help='the tuned validation_batch_size')
    parser.add_argument('--images', type=int, default=1024, help='validation images (over the generated classes)')
    parser.add_argument('--rounds', type=int, default=5, help='timed rounds, each one pass at both sizes')
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--threads', type=int, default=0, help='torch intra-op threads on CPU (0: torch default)')
    parser.add_argument('--output', default='output/bench/eval_batch.json')
    return parser


def timed_pass(loop: TrainLoop, model, loader, loss_fn, device) -> tuple:
    sync(device)
    start = time.perf_counter()
    metrics = loop.evaluate(model, loader, loss_fn)
    sync(device)
    return time.perf_counter() - start, metrics


def main() -> int:
    opts = bench_parser().parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data = make_image_folder(tmp, size=opts.img_size, per_class=max(1, opts.images // len(SHAPES)))
        args, _ = parse_args(['--data-dir', str(data), '--model', opts.model, '--img-size', str(opts.img_size),
                              '--num-classes', str(len(SHAPES)), '-b', str(opts.batch_size), '--device', opts.device,
                              '--workers', str(opts.workers)])
        args, device = init_device(args)
        args.prefetcher = not args.no_prefetcher
        stack = build_training_stack(args, device, ema=False, compile_model=False)
        tuned_args = copy.deepcopy(args)
        tuned_args.validation_batch_size = opts.eval_batch
        data_stack = stack.data
        loaders = {
            'stock': data_stack.loader_eval,
            'tuned': build_eval_loader(tuned_args, data_stack.dataset_eval, stack.data_config, device,
                                       stack.model_dtype, stack.model),
        }
        loop = TrainLoop(stack.task, stack.optimizer, LoopConfig(device=device, prefetcher=args.prefetcher,
                                                                 model_dtype=stack.model_dtype,
                                                                 log_interval=10 ** 9),
                         amp_autocast=stack.amp.autocast)
        model, loss_fn = stack.task.get_eval_model(), torch.nn.CrossEntropyLoss().to(device)
        metrics = {name: timed_pass(loop, model, loader, loss_fn, device)[1] for name, loader in loaders.items()}
        times = {name: [] for name in loaders}
        for _ in range(opts.rounds):
            for name, loader in loaders.items():
                seconds, got = timed_pass(loop, model, loader, loss_fn, device)
                times[name].append(seconds)
                metrics[name] = got
    ratios = [t / s for s, t in zip(times['stock'], times['tuned'])]
    same = (metrics['stock']['top1'] == metrics['tuned']['top1'] and metrics['stock']['top5'] ==
            metrics['tuned']['top5'] and abs(metrics['stock']['loss'] - metrics['tuned']['loss']) <= 1e-6)
    result = dict(model=opts.model, img_size=opts.img_size, images=len(data_stack.dataset_eval),
                  train_batch=opts.batch_size, eval_batch=opts.eval_batch, device=str(device),
                  stock_s=statistics.median(times['stock']), tuned_s=statistics.median(times['tuned']),
                  median_ratio=statistics.median(ratios), ratios=ratios, same_results=same, metrics=metrics)
    write_result(opts.output, result)
    print(f'{opts.model} {opts.img_size}px, {result["images"]} images on {device}: eval at -b {opts.batch_size} '
          f'{result["stock_s"]:.3f} s, at {opts.eval_batch} {result["tuned_s"]:.3f} s; tuned/stock time '
          f'{result["median_ratio"]:.3f} (median of {opts.rounds} rounds); same results: {same}')
    return 0 if same else 1


if __name__ == '__main__':
    sys.exit(main())
