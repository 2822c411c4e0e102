"""OOM recovery under DDP, one rank of a 2-process gloo run (a test harness, started by tests/test_oom_recovery_ddp.py).

    torchrun --nproc_per_node=2 tests/oom_recovery_ddp_worker.py OUT_PREFIX

Writes OUT_PREFIX.<rank>.json with what the test checks:
    buckets: the bucketed gradient all-reduce on gradients of mixed dtype, layout and size (means and collectives).
    agreements: status all-reduces in a 2-window, accumulation-4 epoch with OOM recovery armed and no OOM.
    buffers: a BatchNorm's running mean seen at each forward (after DDP's buffer broadcast), two windows of two.
    lone_oom: rank 0 alone runs out of memory (a real RLIMIT_DATA cap) at the second batch of a window; the final
        weights, and the same update trained on one process from both ranks' batches for reference.
"""
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.task import ClassificationTask

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_oom_recovery import Wide, wide_batches  # noqa: E402
from timm_ext.distributed import end_process_group, exit_process  # noqa: E402
from timm_ext.train import oom_replay as oom_replay_module  # noqa: E402
from timm_ext.memory import memory_cap  # noqa: E402
from timm_ext.train.oom_recovery import GradientAllReduce  # noqa: E402
from timm_ext.train.loop import LoopConfig, TrainLoop  # noqa: E402

CPU = torch.device('cpu')
MB = 2 ** 20


def bucketed_allreduce(rank: int) -> dict:
    torch.manual_seed(0)
    shapes = [((4, 3, 2, 2), torch.float32), ((7,), torch.float32), ((300,), torch.float32), ((5,), torch.float64),
              ((2, 2), torch.float32), ((3,), torch.float32)]
    params = [nn.Parameter(torch.randn(shape, dtype=dtype)) for shape, dtype in shapes]
    params[0].data = params[0].data.contiguous(memory_format=torch.channels_last)  # a channels_last conv weight
    bases = [torch.randn_like(p) for p in params]
    expected = [base * 1.5 for base in bases]  # the mean of 1x and 2x
    expected[4] = bases[4]  # unused on rank 0: (0 + 2x) / 2
    reduce = GradientAllReduce(params, 2, bucket_bytes=64)  # 16 float32: several buckets, larger gradients alone
    buffered = sum(b.numel() for pair in reduce._buffers.values() for b in pair)  # the flat buffers it holds
    for p, base in zip(params, bases):
        p.grad = base * (rank + 1)  # randn_like kept the parameter layouts
    if rank == 0:
        params[4].grad = None
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: (calls.append(tensor.numel()), real(tensor, *a, **k))[1]
    try:
        reduce()
    finally:
        dist.all_reduce = real
    return {
        'max_error': max((p.grad.double() - e.double()).abs().max().item() for p, e in zip(params, expected)),
        'collectives': len(calls),
        'buckets': len(reduce.buckets),
        'params': len(params),
        'buffered': buffered,
        'largest_copied_bucket': max(sum(p.numel() for p in b) for b in reduce.buckets
                                     if len(b) > 1 or not b[0].is_contiguous()),
        'channels_last_kept': params[0].grad.is_contiguous(memory_format=torch.channels_last),
    }


def ddp_loop(model: nn.Module, **cfg) -> TrainLoop:
    task = ClassificationTask(model, nn.CrossEntropyLoss(), device=CPU, verbose=False)
    task.prepare_distributed(device_ids=None)
    return TrainLoop(task, torch.optim.SGD(model.parameters(), lr=0.5),
                     LoopConfig(device=CPU, world_size=2, rank=dist.get_rank(), oom_recover=True, **cfg))


def rank_batches(rank: int, count: int, size: int, features: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(size, features, generator=g) + rank, torch.randint(0, 3, (size,), generator=g))
            for _ in range(count)]


def agreements_per_epoch(rank: int) -> int:
    torch.manual_seed(0)
    loop = ddp_loop(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), accum_steps=4, batch_size=4)
    calls = []
    real = oom_replay_module.agree_status
    oom_replay_module.agree_status = lambda *a: (calls.append(a[0]), real(*a))[1]
    try:
        loop.train_one_epoch(0, rank_batches(rank, 8, 4, 6))
    finally:
        oom_replay_module.agree_status = real
    return len(calls)


def buffers_at_each_forward(rank: int) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    seen = []
    model[1].register_forward_pre_hook(lambda module, inputs: seen.append(module.running_mean.tolist()))
    ddp_loop(model, accum_steps=2, batch_size=4).train_one_epoch(0, rank_batches(rank, 4, 4, 6))
    return seen


def lone_oom(rank: int) -> dict:
    sizes = [2, 4]  # one window; on rank 0 a batch of 4 does not fit under the cap (~650 MB), 2 does (~330 MB)
    batches = {r: wide_batches(sizes, seed=10 + r) for r in (0, 1)}
    model = Wide()
    loop = ddp_loop(model, accum_steps=2, batch_size=4)
    if rank == 0:
        with memory_cap(CPU, 450 * MB):
            loop.train_one_epoch(0, batches[0])
    else:
        loop.train_one_epoch(0, batches[1])
    reference = Wide()
    single = TrainLoop(ClassificationTask(reference, nn.CrossEntropyLoss(), device=CPU, verbose=False),
                       torch.optim.SGD(reference.parameters(), lr=0.5), LoopConfig(device=CPU, accum_steps=4,
                                                                                   batch_size=4))
    single.train_one_epoch(0, batches[0] + batches[1])  # one window of all 12 samples: the same mean
    return {
        'micro_batch': loop.splitter.micro_batch,
        'max_diff': max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())),
    }


def main() -> None:
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=240))  # a lost peer fails the test
    rank = dist.get_rank()
    torch.set_num_threads(1)
    report = {
        'buckets': bucketed_allreduce(rank),
        'agreements': agreements_per_epoch(rank),
        'buffers': buffers_at_each_forward(rank),
        'lone_oom': lone_oom(rank),
    }
    Path(f'{sys.argv[1]}.{rank}.json').write_text(json.dumps(report))
    end_process_group()  # all ranks wait here, then the group goes (a rank leaving early aborts gloo)


if __name__ == '__main__':
    main()
    exit_process(0)  # gloo's threads can outlive the group (DDP holds them): never finalize the interpreter around them
