"""Elastic resume: --resume on another world size keeps the checkpoint's global batch, LR and place in the epoch.

Pure planning first (`timm_ext.train.elastic`), then train.py on gloo ranks: 2 ranks -> 1 rank -> 2 ranks, the last
resume inside an epoch, each run resumed with the previous run's own args.yaml as a user would; then a layout the user
sets.
"""
import csv
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, train_in_process
from timm_ext.train import checkpoint as ckpt
from timm_ext.train.elastic import (
    BatchLayout, describe_change, device_note, elastic_lr, layout_flags_set_anew, plan_elastic_resume, resume_updates,
    tune_hint,
)
from timm_ext.launch import Topology

TWO_RANKS = BatchLayout(16, 2, 1, 'gpu-a')


def test_fewer_ranks_accumulate_more_for_the_same_global_batch():
    plan = plan_elastic_resume(TWO_RANKS, 1, 'gpu-a', 16, 1)
    assert (plan.now.micro_batch, plan.now.accum_steps, plan.now.global_batch) == (16, 2, 32)
    assert plan.exact and plan.layout_changed and not plan.global_changed and not plan.device_changed
    back = plan_elastic_resume(plan.now, 2, 'gpu-a', 16, 2)
    assert (back.now.micro_batch, back.now.accum_steps) == (16, 1)


def test_more_ranks_than_the_global_batch_allows_at_the_old_micro_batch_shrink_it():
    plan = plan_elastic_resume(BatchLayout(16, 1, 1), 4, '', 16, 1)
    assert (plan.now.micro_batch, plan.now.accum_steps, plan.now.global_batch) == (4, 1, 16)
    assert 'micro-batch 16 -> 4' in plan.reason


def test_no_exact_split_is_the_nearest_global_batch_and_says_so():
    plan = plan_elastic_resume(BatchLayout(8, 2, 1), 3, '', 8, 1)
    assert not plan.exact and plan.global_changed
    assert 'nearest' in plan.reason
    assert elastic_lr(plan, 0.1, 0.5, 'linear') == pytest.approx(0.1 * plan.now.global_batch / 16)  # by the rule


def test_a_new_value_set_by_the_user_wins_and_an_unchanged_one_does_not():
    same = {'batch_size': 16, 'grad_accum_steps': 1}
    assert layout_flags_set_anew(['batch_size', 'grad_accum_steps'], same, TWO_RANKS) == ()
    assert layout_flags_set_anew(['batch_size'], {'batch_size': 8, 'grad_accum_steps': 1}, TWO_RANKS) == (
        '-b/--batch-size',)
    assert layout_flags_set_anew([], {'batch_size': 8, 'grad_accum_steps': 1}, TWO_RANKS) == ()  # a default, not set
    plan = plan_elastic_resume(TWO_RANKS, 1, 'gpu-a', 8, 1, ('-b/--batch-size',))
    assert (plan.now.micro_batch, plan.now.accum_steps) == (8, 1) and plan.global_changed
    assert elastic_lr(plan, 0.1, 0.025, 'linear') == 0.025  # the user's layout: train.py's LR for it
    line = describe_change(plan, 0.1, 0.025, 3, 0, 0)
    assert '-b/--batch-size set for this run win' in line and 'global batch 32 -> 8, LR 0.1 -> 0.025' in line


def test_position_in_the_epoch_is_kept_in_samples():
    assert resume_updates(6, 32, 32) == 6
    assert resume_updates(3, 32, 16) == 6
    assert resume_updates(3, 16, 32) == 1  # half an update of the new layout is trained again, not skipped


def test_device_change_names_both_devices_and_the_probe_command():
    plan = plan_elastic_resume(TWO_RANKS, 2, 'gpu-b', 16, 1)
    assert plan.device_changed and not plan.layout_changed
    hint = tune_hint('run/args.yaml', 32, 2)
    assert hint == 'python tune_batch.py -c run/args.yaml --target-global-batch 32 --nproc 2 --dry-run'
    note = device_note(plan, hint)
    assert 'gpu-a -> gpu-b' in note and hint in note
    two_nodes = Topology('2', '1', rdzv_backend='c10d', rdzv_endpoint='head:29400')
    assert tune_hint(None, 32, 2, two_nodes) == ('python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 '
                                                 '--rdzv-backend=c10d --rdzv-endpoint=head:29400 tune_batch.py '
                                                 '--target-global-batch 32 --dry-run')


def test_layout_is_read_from_the_checkpoint_args_and_device_name():
    import argparse
    state = {'args': argparse.Namespace(batch_size=16, world_size=2, grad_accum_steps=3), 'device_name': 'gpu-a'}
    assert ckpt.batch_layout(state) == BatchLayout(16, 2, 3, 'gpu-a')
    assert ckpt.batch_layout({'state_dict': {}}) is None
    assert ckpt.batch_layout({'args': argparse.Namespace(batch_size=8)}) == BatchLayout(8, 1, 1, '')
    assert ckpt.saved_lr(state) is None and ckpt.saved_lr({'args': argparse.Namespace(lr=0.5)}) == 0.5


# ---- train.py on gloo ranks ---------------------------------------------------------------------------------------

RUN = ['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu', '--workers', '0',
       '--log-interval', '1', '--epochs', '3', '--sched-on-updates', '--recovery-interval', '1', '--opt', 'adamw',
       '--checkpoint-hist', '5']


def start_training(ranks: int, data, out, exp, *extra) -> subprocess.Popen:
    launcher = [sys.executable] + (['-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={ranks}']
                                   if ranks > 1 else [])
    return subprocess.Popen(
        [*launcher, str(REPO_ROOT / 'train.py'), '--data-dir', str(data), '--output', str(out), '--experiment', exp,
         *RUN, *map(str, extra)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'})


def finished(proc: subprocess.Popen) -> str:
    """The log of a training run, once it has finished successfully."""
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 0, stderr[-3000:]
    return stderr


def train(ranks: int, data, out, exp, *extra) -> str:
    """The log of a finished run on `ranks` gloo ranks under torchrun; one rank runs train.py's main in this
    process (an interpreter start less: the rank count, not the process, is what these runs vary)."""
    if ranks > 1:
        return finished(start_training(ranks, data, out, exp, *extra))
    result = train_in_process('--data-dir', data, '--output', out, '--experiment', exp, *RUN, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def lr_by_epoch(run) -> dict:
    with open(run / 'summary.csv') as f:
        return {int(row['epoch']): float(row['lr']) for row in csv.DictReader(f)}


def layout(path) -> tuple:
    state = ckpt.load_training_checkpoint(path)
    groups = state['optimizer']['param_groups']
    steps = {int(s['step']) for s in state['optimizer']['state'].values()}
    return ckpt.batch_layout(state), state['args'].lr, groups[0]['initial_lr'], steps


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo ranks under torchrun')
def test_two_ranks_then_one_then_two_keep_global_batch_lr_and_schedule(image_folder, tmp_path):
    # 24 images, global batch 8: 3 updates per epoch in every layout (2 x 4 x 1 and 1 x 4 x 2)
    train(2, image_folder, tmp_path, 'two', '-b', '4')
    one_log = train(1, image_folder, tmp_path, 'one', '-c', tmp_path / 'two' / 'args.yaml',
                    '--resume', tmp_path / 'two' / 'checkpoint-0.pth.tar')
    # a layout the user sets anew wins and the LR follows its global batch; resumed inside epoch 2 after 2 updates
    # of 8 samples, which are 1 of the 2 updates of 16 its epochs now have
    user_log = train(1, image_folder, tmp_path, 'user', '-c', tmp_path / 'two' / 'args.yaml', '--resume',
                     tmp_path / 'two' / 'recovery-2-1.pth.tar', '-b', '8', '--grad-accum-steps', '2')
    assert ('Elastic resume: the checkpoint trained 4 x 2 ranks x 1 accum = global batch 8, this run 4 x 1 rank x 2 '
            'accum = global batch 8; re-planned for its 1 rank(s): accumulation 1 -> 2; same global batch') in one_log
    assert 'device changed' not in one_log
    # back to 2 ranks inside epoch 2, from the 1-rank run's recovery checkpoint after 2 of its 3 updates
    again_log = train(2, image_folder, tmp_path, 'again', '-c', tmp_path / 'one' / 'args.yaml',
                      '--resume', tmp_path / 'one' / 'recovery-2-1.pth.tar')
    assert 'this run 4 x 2 ranks x 1 accum = global batch 8; re-planned' in again_log
    assert 'epoch 2 continues after 16 samples' in again_log
    assert 'Resuming epoch 2 at update 2/3' in again_log

    two, one, again = (layout(tmp_path / name / 'last.pth.tar') for name in ('two', 'one', 'again'))
    assert [x[0].global_batch for x in (two, one, again)] == [8, 8, 8]
    assert (one[0].world_size, one[0].accum_steps, again[0].world_size, again[0].accum_steps) == (1, 2, 2, 1)
    assert two[1] == one[1] == again[1] and two[2] == one[2] == again[2]  # the same LR and scheduler base
    assert two[3] == one[3] == again[3] == {9}  # 3 epochs x 3 updates: nothing skipped, nothing repeated
    # the per-update schedule is where the uninterrupted 2-rank run had it at every epoch end
    reference = lr_by_epoch(tmp_path / 'two')
    for name in ('one', 'again'):
        got = lr_by_epoch(tmp_path / name)
        assert got == pytest.approx({e: reference[e] for e in got}, rel=1e-9), name

    # the user's layout: adamw, sqrt rule from lr_base 0.1 at 256
    assert ('-b/--batch-size and --grad-accum-steps set for this run win over the re-plan; global batch 8 -> 16, '
            'LR 0.0176777 -> 0.025 by the run\'s rule') in user_log
    moved = "epoch 2 continues after 16 samples (update 2 of the checkpoint's layout is update 1 of this one)"
    assert moved in user_log
    assert 'Resuming epoch 2 at update 1/2: skipping 2 batches already trained' in user_log
    got, lr, initial_lr, steps = layout(tmp_path / 'user' / 'last.pth.tar')
    assert got.global_batch == 16 and lr == pytest.approx(0.025) and initial_lr == pytest.approx(0.025)
    assert steps == {9}  # 8 updates in the checkpoint, then the last one of epoch 2

