#!/usr/bin/env python3
"""Overhead of train.py's training loop over a bare PyTorch loop, measured side by side in one process.

Both loops train the same model on the same synthetic batches (already on the device): the reference does
`zero_grad(); loss = criterion(model(x), y); loss.backward(); optimizer.step()` per update, accumulating
`--accum` micro-batches when asked; ours runs `timm_ext.train.loop.TrainLoop.train_one_epoch` (timm task, loss
weighting, no_sync bookkeeping, EMA/scheduler hooks, logging at its interval). Epochs of the two alternate, so
drift of the machine hits both; the median of the back-to-back pair ratios is reported.

    python bench/bench_train_overhead.py                       # CPU, resnet18 at 64 px, batch 32
    python bench/bench_train_overhead.py --accum 4 --repeats 9
    python bench/bench_train_overhead.py --device cuda --model resnet50 --img-size 224 -b 64
"""
import statistics
import sys
import time
from pathlib import Path

import timm
import torch
import torch.nn as nn
from timm.task import ClassificationTask

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without `pip install .`
from timm_ext.train.loop import LoopConfig, TrainLoop  # noqa: E402

from common import (  # noqa: E402  (bench/common.py)
    loop_bench_parser, start_loop_bench, sync, synthetic_batches, write_result,
)


def reference_epoch(model, optimizer, criterion, batches, accum: int) -> None:
    """The bare loop: mean loss over each window of `accum` micro-batches, one step per window."""
    model.train()
    for start in range(0, len(batches), accum):
        window = batches[start:start + accum]
        optimizer.zero_grad(set_to_none=True)
        for x, y in window:
            (criterion(model(x), y) / len(window)).backward()
        optimizer.step()


def main() -> None:
    parser = loop_bench_parser(__doc__.split('\n\n')[0], batches=8, accum=1, repeats=15,
                               output=str(REPO / 'bench' / 'results' / 'train_overhead.json'))
    args, device = start_loop_bench(parser)
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=10).to(device)
    criterion = nn.CrossEntropyLoss()
    batches = synthetic_batches(args, device)

    ref_opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    ours_opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    task = ClassificationTask(model, criterion, device=device, verbose=False)
    loop = TrainLoop(task, ours_opt, LoopConfig(
        device=device, accum_steps=args.accum, batch_size=args.batch_size, prefetcher=True, log_interval=50))

    def time_ours(epoch):
        sync(device)
        t0 = time.perf_counter()
        loop.train_one_epoch(epoch, batches)
        sync(device)
        return time.perf_counter() - t0

    def time_reference():
        sync(device)
        t0 = time.perf_counter()
        reference_epoch(model, ref_opt, criterion, batches, args.accum)
        sync(device)
        return time.perf_counter() - t0

    time_ours(0), time_reference()  # warm-up: allocator, kernels, optimizer state
    ours, reference = [], []
    for i in range(args.repeats):
        # alternate which loop goes first so neither always runs on a warmer cache
        if i % 2:
            ours.append(time_ours(i + 1))
            reference.append(time_reference())
        else:
            reference.append(time_reference())
            ours.append(time_ours(i + 1))

    # each pair ran back to back, so its ratio cancels slow drift; the median drops pairs hit by other load
    pair_ratios = [o / r for o, r in zip(ours, reference)]
    ratio = statistics.median(pair_ratios)
    result = {
        'model': args.model, 'device': str(device), 'batch_size': args.batch_size, 'img_size': args.img_size,
        'batches': args.batches, 'accum': args.accum, 'threads': args.threads, 'repeats': args.repeats,
        'reference_s': reference, 'ours_s': ours,
        'reference_median_s': statistics.median(reference), 'ours_median_s': statistics.median(ours),
        'pair_ratios': pair_ratios, 'ratio': ratio, 'overhead_pct': 100 * (ratio - 1),
        'min_ratio': min(ours) / min(reference),
    }
    print(f"{args.model} {args.img_size}px batch {args.batch_size} x {args.batches} micro-batches, accum {args.accum}, "
          f"{device} ({args.threads} thread{'s' * (args.threads > 1)}), {args.repeats} alternating epochs each")
    print(f"  reference loop: median {result['reference_median_s'] * 1e3:8.1f} ms/epoch")
    print(f"  train.py loop:  median {result['ours_median_s'] * 1e3:8.1f} ms/epoch")
    print(f"  ratio ours/reference (median of back-to-back pairs): {ratio:.4f} ({result['overhead_pct']:+.2f}%); "
          f"best epoch vs best epoch: {result['min_ratio']:.4f}")
    write_result(args.output, result)


if __name__ == '__main__':
    main()
