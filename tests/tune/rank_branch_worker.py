"""Run under `torchrun --nproc_per_node=2`: `choose_by_time` on ranks whose trials take different wall times.

The probe itself is replaced by a trial of fixed speed that takes 1 s longer on rank 0, so rank 0 alone would find
judging a bigger batch too dear for the run, and rank 1 alone would go on to the noise-scale estimate and its
collectives (here it raises instead, so a wrong branch fails at once rather than hanging). Each rank writes
`<report>.<rank>.json` with the lines of its decision.
"""
import json
import sys
import time

import torch.distributed as dist

from timm_ext.distributed import end_process_group, exit_process, init_device
from timm_ext.probe.selection import Selection
from timm_ext.probe.table import FIT, Trial
from timm_ext.probe.train_probe import ProbeOutcome
from timm_ext.train.args import parse_args
from timm_ext.tune import tuner

SPEED = 1000.0  # samples/s of every trial (the agreed figure is the same on all ranks)
# 0.05 x (this run's 220 s of training) = 11 s: rank 1's ~8 s of judging pays, rank 0's ~14 s does not
TRAIN_SAMPLES = 220_000


class TimedRequest(tuner.ProbeRequest):
    def run(self, select, max_batch, start=None):
        time.sleep(1.0 if self.args.rank == 0 else 0.0)
        trial = Trial(max_batch, FIT, peak_bytes=1, ms_per_step=max_batch / SPEED * 1000, samples_per_s=SPEED)
        return ProbeOutcome(Selection(max_batch, 'fits', trial, [trial]), 1 << 30, 'timed stub', 'cpu')


def entered_estimate(*_args, **_kwargs):
    raise RuntimeError('entered the noise-scale estimate (its collectives) on this rank')


def main(report_path: str) -> None:
    sys.path.insert(0, '.')
    import tune_batch
    args, _ = parse_args(['--model', 'test_resnet', '--device', 'cpu', '--epochs', '1', '--select', 'auto'],
                         parser=tune_batch.build_tune_parser())
    args, device = init_device(args)
    tuner.measure_noise_scale = entered_estimate
    request = TimedRequest(args, None, device, None, 1 << 30, None, args.world_size, '')
    recipe, set_by = tuner.recipe_global_batch(args, set(), args.world_size)
    tuned = tuner.choose_by_time(request, recipe, set_by, TRAIN_SAMPLES, recipe // args.world_size)
    with open(f'{report_path}.{args.rank}.json', 'w') as f:
        json.dump({'rank': args.rank, 'lines': tuned.lines}, f)
    dist.barrier()
    end_process_group()  # all ranks wait here, then the group goes (a rank leaving early aborts gloo)


if __name__ == '__main__':
    main(sys.argv[1])
    exit_process(0)  # gloo's threads can outlive the group (DDP holds them): never finalize the interpreter around them
