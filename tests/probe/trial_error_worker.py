"""Run under `torchrun --nproc_per_node=2`: tune_batch.py whose training trials fail on rank 1 with an error that is
not out-of-memory (a ValueError from the step at batch 4 and above), to see how both ranks end."""
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import tune_batch  # noqa: E402
from timm_ext.tune import tuner  # noqa: E402

_build = tuner.build_train_trial


def build_failing_on_rank_1(args, device):
    setup = _build(args, device)
    if args.rank == 1:
        step = setup.step

        def failing(batch_size: int) -> None:
            if batch_size >= 4:
                raise ValueError(f'this step cannot take a batch of {batch_size}')
            step(batch_size)

        setup.step = failing
    return setup


if __name__ == '__main__':
    tuner.build_train_trial = build_failing_on_rank_1
    sys.exit(tune_batch.main(sys.argv[1:]))
