"""Run train.py under a real RLIMIT_DATA cap that starts with a training epoch (a test harness, not a tool).

    OOM_CAP_MB=180 python tests/train/oom_cap_train.py <train.py args>

Environment:
    OOM_CAP_MB: memory the training may take above the process's data segment (VmData + VmStk) at the start of the
        capped epoch. The cap is set there rather than at process start, so it measures the training step only and
        does not depend on how much the imports of this machine's torch build take. The process runs uncapped until
        then, as a run does whose cap comes after its start: only ``--steady-cpu-heap`` (on a tuned train command)
        makes it peak as the probe's trials did.
    OOM_CAP_EPOCH: the first capped epoch (default 0); the cap stays until the process ends.
    OOM_CAP_RANKS: comma-separated ranks to cap (default: every rank).
    OOM_PEAK_FILE: write the peak data segment above the first epoch's start (bytes, sampled, highest over the
        epochs so far) to this file, with a '.<rank>' suffix under DDP.
"""
import os
import resource
import runpy
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from timm_ext.memory import PeakMeter, data_and_stack  # noqa: E402
from timm_ext.train.loop import TrainLoop  # noqa: E402

_train_one_epoch = TrainLoop.train_one_epoch
_meter = []  # the peak meter, then the highest peak seen so far


def capped_train_one_epoch(self, epoch, loader, start_update=0):
    peak_file = os.environ.get('OOM_PEAK_FILE')
    if peak_file and not _meter:
        _meter.extend([PeakMeter('cpu', baseline=data_and_stack()), 0])
        _meter[0].reset()
    ranks = os.environ.get('OOM_CAP_RANKS')
    capped_rank = ranks is None or str(self.cfg.rank) in ranks.split(',')
    if 'OOM_CAP_MB' in os.environ and capped_rank and epoch == int(os.environ.get('OOM_CAP_EPOCH', '0')):
        limit = data_and_stack() + int(float(os.environ['OOM_CAP_MB']) * 2 ** 20)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    try:
        return _train_one_epoch(self, epoch, loader, start_update)
    finally:
        if peak_file:
            suffix = f'.{self.cfg.rank}' if self.cfg.distributed else ''
            _meter[1] = max(_meter[1], _meter[0].peak() or 0)
            Path(peak_file + suffix).write_text(str(_meter[1]))
            _meter[0].reset()


TrainLoop.train_one_epoch = capped_train_one_epoch
sys.argv = [str(REPO_ROOT / 'train.py'), *sys.argv[1:]]
runpy.run_path(str(REPO_ROOT / 'train.py'), run_name='__main__')
