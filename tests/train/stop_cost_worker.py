"""Run under `torchrun --nproc_per_node=2`: what the stop flag costs a DDP epoch, and that a signal still stops it.

A 10-update epoch (log every 4) counts, per update, the Python-level all-reduces and the host reads of device values
(`aten._local_scalar_dense`, behind every `.item()`, `float()` and `bool()` of a tensor: on CUDA each one is a sync).
A second epoch sends SIGTERM to rank 1 alone at update 1; both ranks must stop after the same update. Each rank
writes `<report>.<rank>.json`.
"""
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.task import ClassificationTask
from torch.utils._python_dispatch import TorchDispatchMode

from timm_ext.distributed import end_process_group, exit_process
from timm_ext.train.loop import LoopConfig, TrainLoop
from timm_ext.train.stop_signal import StopOnSignal, TrainingStopped


class HostReads(TorchDispatchMode):
    """Counts reads of device values into Python."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def main(report_path: str) -> None:
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    task = ClassificationTask(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), nn.CrossEntropyLoss(), verbose=False)
    task.prepare_distributed(device_ids=None)
    stop = StopOnSignal().install()
    loop = TrainLoop(task, torch.optim.SGD(task.parameters(), lr=0.1),
                     LoopConfig(device=torch.device('cpu'), batch_size=2, world_size=world, rank=rank,
                                log_interval=4), stop=stop)
    batches = [(torch.randn(2, 12), torch.randint(0, 3, (2,))) for _ in range(10)]
    counts = {'all_reduce': 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        counts['all_reduce'] += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    per_update, reads, signal_at = [], HostReads(), [None]
    real_stop_check = loop._stop_if_asked

    def after_update(epoch, update_idx, *args):
        if update_idx == signal_at[0]:
            os.kill(os.getpid(), signal.SIGTERM)
        before = (counts['all_reduce'], reads.reads)
        try:
            real_stop_check(epoch, update_idx, *args)
        finally:
            per_update.append((counts['all_reduce'], reads.reads, before))

    loop._stop_if_asked = after_update
    with reads:
        loop.train_one_epoch(0, batches)
    costs, last = [], (0, 0)
    for all_reduces, host_reads, _ in per_update:
        costs.append([all_reduces - last[0], host_reads - last[1]])
        last = (all_reduces, host_reads)
    per_update.clear()
    signal_at[0] = 1 if rank == 1 else None
    stopped = None
    try:
        loop.train_one_epoch(1, batches)
    except TrainingStopped as e:
        stopped = str(e)
    stop.restore()
    with open(f'{report_path}.{rank}.json', 'w') as f:
        json.dump({'costs': costs, 'stopped': stopped}, f)
    end_process_group()  # all ranks wait here, then the group goes (a rank leaving early aborts gloo)


if __name__ == '__main__':
    main(sys.argv[1])
    exit_process(0)  # gloo's threads can outlive the group (DDP holds them): never finalize the interpreter around them
