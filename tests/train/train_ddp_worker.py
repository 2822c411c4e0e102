"""Run under `torchrun --nproc_per_node=2`: DDP accumulation through TrainLoop vs one big batch on one process.

Each rank trains one window of `accum` micro-batches of `micro` samples (its shard of the global batch) with plain
SGD at lr 1, so the parameter change is minus the averaged gradient. Rank 0 compares it with the gradient of the
whole global batch taken at once, records which backward passes all-reduced (a DDP comm hook counts them) and writes
a JSON report to the path given as the first argument.
"""
import datetime
import json
import sys

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.task import ClassificationTask
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from timm_ext.distributed import end_process_group, exit_process
from timm_ext.train.loop import LoopConfig, TrainLoop


def main(report_path: str, accum: int = 3, micro: int = 2) -> None:
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=240))  # a lost peer fails the test
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    def model():
        torch.manual_seed(0)
        return timm.create_model('test_vit', num_classes=3, img_size=32)

    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(world * accum * micro, 3, 32, 32, generator=g)
    targets = torch.randint(0, 3, (world * accum * micro,), generator=g)

    reference = model()
    nn.CrossEntropyLoss()(reference(inputs), targets).backward()
    want = [-p.grad for p in reference.parameters()]

    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    task = ClassificationTask(net, nn.CrossEntropyLoss(), verbose=False)
    task.prepare_distributed(device_ids=None)
    reduces = []

    def counting_allreduce(state, bucket):
        reduces.append(1)
        return allreduce_hook(state, bucket)

    task.get_trainable_module().register_comm_hook(None, counting_allreduce)
    loop = TrainLoop(task, torch.optim.SGD(net.parameters(), lr=1.0),
                     LoopConfig(device=torch.device('cpu'), accum_steps=accum, batch_size=micro, world_size=world,
                                rank=rank))
    syncs = []

    def recording_forward_backward(input, target, weight, sync, _inner=loop.forward_backward):
        count = len(reduces)
        loss = _inner(input, target, weight, sync)
        syncs.append((sync, len(reduces) - count))
        return loss

    loop.forward_backward = recording_forward_backward
    # this rank's shard: micro-batches rank, rank + world, ... of the global batch (as a DistributedSampler would)
    shard = [(inputs[i * micro:(i + 1) * micro], targets[i * micro:(i + 1) * micro])
             for i in range(rank, world * accum, world)]
    loop.train_one_epoch(0, shard)
    got = [p.detach() - b for p, b in zip(net.parameters(), before)]
    worst = max((a - b).abs().max().item() for a, b in zip(got, want))
    if rank == 0:
        with open(report_path, 'w') as f:
            json.dump({'world': world, 'max_abs_diff': worst, 'syncs': syncs}, f)
    end_process_group()  # all ranks wait here, then the group goes (a rank leaving early aborts gloo)


if __name__ == '__main__':
    main(sys.argv[1])
    exit_process(0)  # gloo's threads can outlive the group (DDP holds them): never finalize the interpreter around them
