#!/usr/bin/env python3
"""Step-time cost of --oom-recover under DDP when no OOM happens: plain DDP against recovery armed, same ranks.

Run it under torchrun (2 gloo ranks on CPU, or NCCL ranks on GPUs with --device cuda):

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/bench_oom_recover_ddp.py
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/bench_oom_recover_ddp.py --accum 1
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/bench_oom_recover_ddp.py \\
        --device cuda --model resnet50 --img-size 224 -b 64

Two `TrainLoop`s per rank train copies of one model, each wrapped in its own DDP, on the same synthetic batches:
plain (DDP's reducer all-reduces the gradient buckets during the window's last backward) and with OOM recovery
armed (every backward local, one status all-reduce and host sync per window, then the gradients all-reduced in
25 MiB buckets after the backward, without overlap). Their epochs alternate, each rank in the same order; the cost
is the median ratio of each recovery epoch to the plain epoch next to it, as rank 0 measures it (every epoch ends
in a collective, so the ranks keep the same pace). Rank 0 prints the figures and writes them as JSON.
"""
import logging
import os
import statistics
import sys
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.task import ClassificationTask

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without `pip install .`
from timm_ext.distributed import ddp_device_ids, end_process_group  # noqa: E402
from timm_ext.train.loop import LoopConfig, TrainLoop  # noqa: E402

from common import loop_bench_parser, synthetic_batches, timed_epoch, write_result  # noqa: E402  (bench/common.py)

ARMS = ('plain', 'oom_recover')


def make_loop(args, device: torch.device, oom_recover: bool) -> TrainLoop:
    """A DDP-wrapped loop on a fresh copy of the model (the same weights in both arms)."""
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=10).to(device)
    task = ClassificationTask(model, nn.CrossEntropyLoss(), device=device, verbose=False)
    task.prepare_distributed(device_ids=ddp_device_ids(device))
    return TrainLoop(task, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), LoopConfig(
        device=device, accum_steps=args.accum, batch_size=args.batch_size, prefetcher=True, log_interval=10 ** 6,
        world_size=dist.get_world_size(), rank=dist.get_rank(), oom_recover=oom_recover))


def main() -> None:
    parser = loop_bench_parser(__doc__.split('\n\n')[0], batches=16, accum=4, repeats=11,
                               output=str(REPO / 'bench' / 'results' / 'oom_recover_ddp_overhead.json'))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == 'cuda':
        device = torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))  # torchrun's: one GPU per rank
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)  # the loop's log lines are not part of the measurement
    torch.manual_seed(dist.get_rank())  # each rank its own data, as a distributed sampler gives
    batches = synthetic_batches(args, device)
    loops = {name: make_loop(args, device, name == 'oom_recover') for name in ARMS}

    for name in ARMS:
        timed_epoch(loops[name], 0, batches, device)  # warm-up: allocator, kernels, DDP buckets, optimizer state
    times = {name: [] for name in ARMS}
    for i in range(args.repeats):
        for name in ARMS[i % 2:] + ARMS[:i % 2]:  # alternate which arm runs first
            times[name].append(timed_epoch(loops[name], i + 1, batches, device))
    if dist.get_rank() == 0:
        report(args, device, times, sum(p.numel() for p in loops['plain'].params))
    end_process_group()  # all ranks wait here, then the group goes (a rank leaving early aborts gloo)


def report(args, device: torch.device, times: dict, params: int) -> None:
    ratios = [r / p for r, p in zip(times['oom_recover'], times['plain'])]
    ratio = statistics.median(ratios)
    world = dist.get_world_size()
    result = {
        'model': args.model, 'params': params, 'device': str(device), 'backend': dist.get_backend(),
        'world_size': world, 'batch_size': args.batch_size, 'img_size': args.img_size, 'batches': args.batches,
        'accum': args.accum, 'threads': args.threads, 'repeats': args.repeats, 'times_s': times,
        'median_s': {name: statistics.median(t) for name, t in times.items()},
        'pair_ratios': ratios, 'ratio': ratio, 'overhead_pct': 100 * (ratio - 1),
    }
    print(f"{args.model} ({params / 1e6:.2f}M params) {args.img_size}px, micro-batch {args.batch_size} x "
          f"{args.batches}, accum {args.accum}, {world} {dist.get_backend()} ranks on {device.type}, "
          f"{args.repeats} alternating epochs per arm")
    for name, label in zip(ARMS, ('plain DDP', '--oom-recover, idle')):
        print(f"  {label + ':':20s} median {result['median_s'][name] * 1e3:8.1f} ms/epoch")
    print(f"  recovery / plain, median of alternating pairs: {ratio:.4f} ({100 * (ratio - 1):+.2f}%)")
    write_result(args.output, result)


if __name__ == '__main__':
    main()
