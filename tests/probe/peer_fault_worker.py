"""Run under `torchrun --nproc_per_node=2`: tune_batch.py (its argv after the mode) whose rank 1 fails in its first
trial, to see how every rank ends. The mode says how rank 1 fails:

- raise: the training step raises an error that is not out-of-memory (in the trial's fork, batch 4 and above);
- stall: the trial sleeps far past the group's timeout (`--dist-timeout`) before it returns;
- kill: the rank SIGKILLs itself mid-trial;
- exit: the rank exits with status 0 mid-trial, as a rank that ends early.

Rank 1 writes the wall-clock second of its fault into `./fault_at` (stall, kill, exit) before it happens.
"""
import os
import signal
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import tune_batch  # noqa: E402
from timm_ext.distributed import exit_process  # noqa: E402
from timm_ext.probe import train_probe  # noqa: E402
from timm_ext.tune import tuner  # noqa: E402

STALL_S = 120  # far past any timeout a test sets: only the peers' timeout can end this wait


def failing_step(build):
    def build_failing(args, device):
        setup = build(args, device)
        step = setup.step

        def failing(batch_size: int) -> None:
            if batch_size >= 4:
                raise ValueError(f'this step cannot take a batch of {batch_size}')
            step(batch_size)

        setup.step = failing
        return setup
    return build_failing


def failing_trial(capped_trial, mode: str):
    def build_failing(*args, **kwargs):
        trial = capped_trial(*args, **kwargs)

        def run(batch_size: int):
            with open('fault_at', 'w') as f:
                f.write(str(time.time()))
            if mode == 'stall':
                time.sleep(STALL_S)
            elif mode == 'kill':
                os.kill(os.getpid(), signal.SIGKILL)
            elif mode == 'exit':
                sys.exit(0)
            return trial(batch_size)
        return run
    return build_failing


if __name__ == '__main__':
    fault = sys.argv[1]
    if os.environ.get('RANK') == '1':
        if fault == 'raise':
            tuner.build_train_trial = failing_step(tuner.build_train_trial)
        else:
            train_probe._capped_trial = failing_trial(train_probe._capped_trial, fault)
    exit_process(tune_batch.main(sys.argv[2:]))
