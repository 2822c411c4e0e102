"""Run under `torchrun --nproc_per_node=2`: every rank probes the same training run, rank 1 under a smaller budget.

Rank 1 runs out of memory at sizes rank 0 still fits; the per-trial agreement must turn that into an OOM for both
(no rank left waiting) and both must choose the same, smaller batch. Each rank writes `<report>.<rank>.json`.
"""
import json
import resource
import sys

import torch

from timm_ext.distributed import end_process_group, exit_process, init_device
from timm_ext.memory import parse_budget
from timm_ext.probe.train_probe import probe_train_batch
from timm_ext.probe.trial import build_train_trial
from timm_ext.train.args import parse_args


def main(report_path: str, budget_rank0: str, budget_rank1: str) -> None:
    torch.set_num_threads(1)
    args, _ = parse_args(['--model', 'test_vit', '--model-kwargs', 'img_size=64', '--img-size', '64',
                          '--device', 'cpu', '--num-classes', '3'])
    args, device = init_device(args)  # torchrun variables: gloo process group on CPU
    before = resource.getrlimit(resource.RLIMIT_DATA)
    budget = parse_budget(budget_rank0 if args.rank == 0 else budget_rank1)
    outcome = probe_train_batch(build_train_trial(args, device), budget, headroom=0.0, start=4, max_batch=256)
    report = {
        'rank': args.rank,
        'world_size': args.world_size,
        'chosen': outcome.selection.batch_size,
        'trials': [t.to_dict() for t in outcome.trials],
        'restored': resource.getrlimit(resource.RLIMIT_DATA) == before,
    }
    with open(f'{report_path}.{args.rank}.json', 'w') as f:
        json.dump(report, f)
    end_process_group()  # all ranks wait here, then the group goes (a rank leaving early aborts gloo)


if __name__ == '__main__':
    main(*sys.argv[1:])
    exit_process(0)  # gloo's threads can outlive the group (DDP holds them): never finalize the interpreter around them
