#!/usr/bin/env python3
"""Step-time cost of --log-noise-scale (and of --oom-recover when no OOM happens), side by side in one process.

Three `TrainLoop`s train copies of one model on the same synthetic batches (already on the device): plain, with the
noise scale (parameter hooks take each gradient's squared norm as backward makes it; one norm of the accumulated
gradient per window), and with OOM recovery armed (batches kept for a replay, a try per micro-batch; one process, so
no status all-reduce). Their epochs alternate in
rotating order so drift of the machine hits all; each arm's cost is the median of its ratios to the plain epoch run
next to it.

    python bench/bench_noise_scale_overhead.py                           # CPU, resnet18 at 64 px, 32 x accum 4
    python bench/bench_noise_scale_overhead.py --model test_vit --img-size 32 -b 16
    python bench/bench_noise_scale_overhead.py --device cuda --model resnet50 --img-size 224 -b 64
"""
import statistics
import sys
from pathlib import Path

import timm
import torch
import torch.nn as nn
from timm.task import ClassificationTask

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without `pip install .`
from timm_ext.train.loop import LoopConfig, TrainLoop  # noqa: E402

from common import (  # noqa: E402  (bench/common.py)
    loop_bench_parser, start_loop_bench, synthetic_batches, timed_epoch, write_result,
)

ARMS = {'plain': {}, 'noise_scale': {'log_noise_scale': True}, 'oom_recover': {'oom_recover': True}}


def main() -> None:
    parser = loop_bench_parser(__doc__.split('\n\n')[0], batches=16, accum=4, repeats=11,
                               output=str(REPO / 'bench' / 'results' / 'noise_scale_overhead.json'))
    args, device = start_loop_bench(parser)
    batches = synthetic_batches(args, device)

    def make_loop(flags) -> TrainLoop:
        torch.manual_seed(0)  # the same weights in every arm; a model each, as the noise scale hooks its parameters
        model = timm.create_model(args.model, num_classes=10).to(device)
        task = ClassificationTask(model, nn.CrossEntropyLoss(), device=device, verbose=False)
        return TrainLoop(task, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), LoopConfig(
            device=device, accum_steps=args.accum, batch_size=args.batch_size, prefetcher=True, log_interval=10 ** 6,
            **flags))

    loops = {name: make_loop(flags) for name, flags in ARMS.items()}
    params = sum(p.numel() for p in loops['plain'].params)

    def timed(name: str, epoch: int) -> float:
        return timed_epoch(loops[name], epoch, batches, device)

    names = list(ARMS)
    for name in names:
        timed(name, 0)  # warm-up: allocator, kernels, optimizer state
    times = {name: [] for name in names}
    for i in range(args.repeats):
        for name in names[i % 3:] + names[:i % 3]:  # rotate the order so no arm always runs on a warmer cache
            times[name].append(timed(name, i + 1))

    result = {
        'model': args.model, 'params': params, 'device': str(device), 'batch_size': args.batch_size,
        'img_size': args.img_size, 'batches': args.batches, 'accum': args.accum, 'threads': args.threads,
        'repeats': args.repeats, 'times_s': times,
        'median_s': {name: statistics.median(t) for name, t in times.items()},
    }
    print(f"{args.model} ({params / 1e6:.2f}M params) {args.img_size}px, micro-batch {args.batch_size} x "
          f"{args.batches}, accum {args.accum}, {device} ({args.threads} thread{'s' * (args.threads > 1)}), "
          f"{args.repeats} rotating epochs per arm")
    print(f"  plain loop: median {result['median_s']['plain'] * 1e3:8.1f} ms/epoch")
    for name in names[1:]:
        ratios = [t / p for t, p in zip(times[name], times['plain'])]
        ratio = statistics.median(ratios)
        result[name] = {'pair_ratios': ratios, 'ratio': ratio, 'overhead_pct': 100 * (ratio - 1),
                        'min_ratio': min(times[name]) / min(times['plain'])}
        print(f"  {name:12s}: median {result['median_s'][name] * 1e3:8.1f} ms/epoch, median pair ratio {ratio:.4f} "
              f"({100 * (ratio - 1):+.2f}%), best vs best {result[name]['min_ratio']:.4f}")
    write_result(args.output, result)


if __name__ == '__main__':
    main()
