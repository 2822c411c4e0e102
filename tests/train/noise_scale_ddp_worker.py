"""Run under `torchrun --nproc_per_node=2`: the noise scale of TrainLoop under DDP against the closed form.

Linear regression on Gaussian data at fixed weights (SGD with lr 0), see tests/test_noise_scale_train.py. Each rank
draws its own samples; a window is 2 micro-batches of 8 per rank. Two modes, one after the other: DDP's own
all-reduce in the window's last backward, and OOM recovery's explicit all-reduce after it. Rank 0 writes
{mode: [grad_sq, trace_sigma, b_simple, pairs]} as JSON to the path given as the first argument.
"""
import datetime
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.task import ClassificationTask

from timm_ext.distributed import end_process_group, exit_process
from timm_ext.train.noise_scale import NoiseScaleEstimator
from timm_ext.train.loop import LoopConfig, TrainLoop

DIM, SIGMA, MICRO, ACCUM, WINDOWS = 8, 1.0, 8, 2, 400


class HalfSquaredError(nn.Module):
    def forward(self, output, target):
        return 0.5 * (output.squeeze(1) - target).pow(2).mean()


def main(report_path: str) -> None:
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=240))  # a lost peer fails the test
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w_true = torch.randn(DIM)
    delta = torch.randn(DIM)
    delta = delta / delta.norm()
    report = {}
    for mode in ('ddp_sync', 'explicit_allreduce'):
        model = nn.Linear(DIM, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_((w_true + delta)[None])
        task = ClassificationTask(model, HalfSquaredError(), verbose=False)
        task.prepare_distributed(device_ids=None)
        loop = TrainLoop(task, torch.optim.SGD(model.parameters(), lr=0.0), LoopConfig(
            device=torch.device('cpu'), accum_steps=ACCUM, batch_size=MICRO, world_size=world, rank=rank,
            log_interval=10 ** 9, log_noise_scale=True, oom_recover=mode == 'explicit_allreduce'))
        loop.noise.estimator = NoiseScaleEstimator(0.999)
        gen = torch.Generator().manual_seed(100 + rank)
        batches = []
        for _ in range(WINDOWS * ACCUM):
            x = torch.randn(MICRO, DIM, generator=gen)
            batches.append((x, x @ w_true + SIGMA * torch.randn(MICRO, generator=gen)))
        loop.train_one_epoch(0, batches)
        summary = loop.noise_scale_summary()
        report[mode] = [summary.grad_sq, summary.trace_sigma, summary.b_simple, summary.pairs]
    if rank == 0:
        with open(report_path, 'w') as f:
            json.dump(report, f)
    end_process_group()  # all ranks wait here, then the group goes (a rank leaving early aborts gloo)


if __name__ == '__main__':
    main(sys.argv[1])
    exit_process(0)  # gloo's threads can outlive the group (DDP holds them): never finalize the interpreter around them
