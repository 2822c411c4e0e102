"""--batch-ramp: the rule on synthetic B_simple values, the LR and schedule it moves, and a short run with a resume."""
import csv
import io
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from timm.scheduler import create_scheduler_v2

from conftest import REPO_ROOT, train_in_process
from timm_ext.train.checkpoint import load_training_checkpoint
from timm_ext.synthetic_data import make_image_folder
from timm_ext.train.batch_ramp import (
    MAX_GROWTH, BatchRamp, RampChange, RampState, RecipeClock, describe_ramp_change, lr_factor, plan_ramp, ramp_cap,
    split_global, with_noise_scale,
)
from timm_ext.train.args import build_parser
from timm_ext.train.elastic import BatchLayout
from timm_ext.train.noise_monitor import NoiseScaleSummary

LAYOUT = BatchLayout(micro_batch=8, world_size=2, accum_steps=2)  # global batch 32, 16 samples per accumulation step


# ---- the noise scale the ramp needs -------------------------------------------------------------------------------

def _ramp_args(*flags):
    return build_parser().parse_args(['--batch-ramp', *flags])


@pytest.mark.parametrize('flags,world_size,layout,words', [
    (['-b', '8'], 1, (4, 2), 'global batch 8)'),  # split: the global batch stays
    (['-b', '3'], 1, (1, 3), 'global batch 3)'),  # no 2-way split of 3: the 3-way one
    (['-b', '1'], 1, (1, 2), 'global batch 1 -> 2; the LR follows'),  # nothing to split: the batch doubles
    (['-b', '6', '--mixup', '0.5'], 1, (2, 3), 'global batch 6)'),  # mixup: an even micro-batch (3 x 2 would be odd)
    (['-b', '8', '--grad-accum-steps', '2'], 1, (8, 2), 'turned on.'),  # two batch sizes already
    (['-b', '8'], 2, (8, 1), 'turned on.'),  # two ranks give the two sizes
])
def test_ramp_turns_the_noise_scale_on_with_the_accumulation_it_needs(flags, world_size, layout, words):
    args = _ramp_args(*flags)
    ramped, line = with_noise_scale(args, world_size)
    assert ramped.log_noise_scale and (ramped.batch_size, ramped.grad_accum_steps) == layout
    assert words in line and '\n' not in line
    assert not args.log_noise_scale and args.batch_size == int(flags[1])  # a copy: the parsed args stay as given


def test_noise_scale_left_alone_without_the_ramp_or_when_on():
    plain = build_parser().parse_args(['-b', '8'])
    assert with_noise_scale(plain, 1) == (plain, None)
    on = _ramp_args('-b', '8', '--log-noise-scale', '--grad-accum-steps', '2')
    assert with_noise_scale(on, 1) == (on, None)


def test_batch_ramp_alone_trains_with_the_noise_scale_on(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=32)
    flags = ('--val-split', '', '--model', 'test_vit', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
             '--workers', '0', '-b', '8', '--lr', '0.05', '--epochs', '1', '--batch-ramp')
    log, _ = _train(data, tmp_path, 'alone', flags)
    lines = [line for line in log.splitlines() if '--log-noise-scale turned on' in line]
    assert len(lines) == 1 and '-b 8 -> 4 x 2 accumulation (global batch 8)' in lines[0], log[-2000:]
    run = tmp_path / 'alone'
    assert [r['global_batch'] for r in _rows(run / 'noise_scale.csv')] == ['8']
    saved = (run / 'args.yaml').read_text()
    assert 'log_noise_scale: true' in saved and 'grad_accum_steps: 2' in saved and 'batch_size: 4' in saved


# ---- the rule ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('b_simple', [math.nan, -5.0, 0.0, math.inf])
def test_no_estimate_keeps_the_layout(b_simple):
    assert plan_ramp(b_simple, LAYOUT, factor=1.0, cap=100) is None


def test_grows_to_the_largest_accumulation_within_b_simple_over_factor():
    # B_simple / factor = 100 samples: 6 steps of 16 fit (96), 7 would not
    assert plan_ramp(200.0, LAYOUT, factor=2.0, cap=100) == 6
    assert plan_ramp(200.0, LAYOUT, factor=2.0, cap=4) == 4  # the cap wins
    assert plan_ramp(47.9 * 2, LAYOUT, factor=2.0, cap=100) is None  # 2 steps (32) is all that fits: no change


def test_cap_at_most_doubles_keeps_updates_and_max_global():
    # 120 batches per epoch, 10 epochs: accumulation 3 and 4 still make 400 and 300 updates over the run
    assert ramp_cap(LAYOUT, 120, 10, min_updates=200) == MAX_GROWTH * LAYOUT.accum_steps
    assert ramp_cap(LAYOUT, 120, 10, min_updates=400) == 3  # 4 would leave 300
    assert ramp_cap(LAYOUT, 120, 10, min_updates=10 ** 6) == LAYOUT.accum_steps  # the recipe is already short
    assert ramp_cap(LAYOUT, 120, 10, min_updates=1, max_global=48) == 3  # 16 x 3 = 48
    assert ramp_cap(LAYOUT, 120, 10, min_updates=1, max_global=40) == 2


def test_split_prefers_a_bigger_micro_batch_up_to_the_limit():
    one_rank = BatchLayout(micro_batch=4, world_size=1, accum_steps=2)
    assert split_global(16, one_rank, None) == (4, 4)  # no limit: only the accumulation grows
    assert split_global(16, one_rank, 4) == (4, 4)  # the limit is the micro-batch already
    assert split_global(16, one_rank, 8) == (8, 2)
    assert split_global(16, one_rank, 64) == (8, 2)  # one rank keeps 2 micro-batches a window: B_simple needs them
    assert split_global(32, one_rank, 12) == (8, 4)  # exact: 12 does not divide 32
    assert split_global(24, one_rank, 12, multiple=2) == (12, 2)
    assert split_global(20, one_rank, 9, multiple=2) == (4, 5)  # 5 is odd (mixup), 10 past the limit
    # two ranks measure B_simple across them: a window of one micro-batch is enough
    assert split_global(64, LAYOUT, 32) == (32, 1)
    # below plan_accumulation's window (half the limit) an exact bigger micro-batch still beats more accumulation
    assert split_global(50, BatchLayout(2, 1, 25), 21) == (10, 5)  # 25 and 50 do not fit; 21 down to 11 do not divide


def test_lr_factor_follows_the_run_rule():
    assert lr_factor(32, 64, 'linear') == pytest.approx(2.0)
    assert lr_factor(32, 128, 'sqrt') == pytest.approx(2.0)


def test_state_round_trips_through_a_weights_only_checkpoint():
    state = RampState(4, 2, [RampChange(1, 70.5, 2, 4, 32, 64, 2.0)])
    buffer = io.BytesIO()
    torch.save({'batch_ramp': state.state_dict()}, buffer)
    buffer.seek(0)
    loaded = RampState(1, 1)
    loaded.load_state_dict(torch.load(buffer, weights_only=True)['batch_ramp'])
    assert loaded == state


def test_change_is_one_log_line():
    line = describe_ramp_change(RampChange(3, 200.0, 2, 4, 32, 64, 2.0), 2.0, 'linear', 0.1, 0.2, 50, 25)
    assert '\n' not in line
    for part in ('before epoch 3', 'B_simple ≈ 200.0', 'accumulation 2 -> 4', 'global batch 32 -> 64',
                 '50 -> 25 updates', 'LR x2 by the linear rule (0.1 -> 0.2)'):
        assert part in line, part


# ---- applied to an optimizer and a timm scheduler ---------------------------------------------------------------

class FakeLoop:
    """What BatchRamp uses of TrainLoop: the noise summary (no estimate before the first epoch) and the setter."""

    def __init__(self, b_simple: float):
        self.b_simple = b_simple
        self.accum_steps = self.batch_size = None
        self.epochs_trained = 0

    def noise_scale_summary(self):
        b_simple = self.b_simple if self.epochs_trained else math.nan
        self.epochs_trained += 1
        return NoiseScaleSummary(1.0, b_simple, b_simple, 10 * self.epochs_trained)

    def set_layout(self, batch_size, accum_steps):
        self.batch_size, self.accum_steps = batch_size, accum_steps


def _schedule(lr, on_updates, updates_per_epoch, epochs=4, warmup_epochs=1):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler, _ = create_scheduler_v2(optimizer, 'cosine', num_epochs=epochs, warmup_epochs=warmup_epochs,
                                       warmup_lr=1e-4, min_lr=1e-3, step_on_epochs=not on_updates,
                                       updates_per_epoch=updates_per_epoch)
    return optimizer, scheduler


def _recipe_lr(lr, on_updates, updates_per_epoch, t, **kwargs):
    """The recipe's LR at step `t` had it started at `lr` (warm-up from the same start, decay to the same floor)."""
    return _schedule(lr, on_updates, updates_per_epoch, **kwargs)[1]._get_lr(t)[0]


def test_per_update_schedule_runs_in_the_recipe_updates():
    # 24 micro-batches per epoch at accumulation 2: the recipe makes 12 updates an epoch, 48 over 4 epochs
    optimizer, scheduler = _schedule(0.1, True, 12)
    ramp = BatchRamp(optimizer, scheduler, BatchLayout(4, 1, 2), 24, 4, factor=1.0, min_updates=1, verbose=False)
    clock = ramp.scheduler
    assert isinstance(clock, RecipeClock)
    loop = FakeLoop(b_simple=1000.0)
    for epoch in range(4):
        ramp.before_epoch(epoch, loop)
        upe = ramp.updates_per_epoch
        for update in range(1, upe + 1):  # as TrainLoop counts: epoch x updates_per_epoch + update
            clock.step_update(epoch * upe + update)
        assert clock.last_update == (epoch + 1) * 12  # the epoch ends where the recipe's does
        growth = ramp.state.accum_steps / 2
        want = _recipe_lr(0.1 * growth, True, 12, (epoch + 1) * 12)
        assert optimizer.param_groups[0]['lr'] == pytest.approx(want)
    assert [c.new_accum for c in ramp.state.history] == [4, 8, 16] and loop.accum_steps == 16
    assert [c.epoch for c in ramp.state.history] == [1, 2, 3]


def test_change_during_per_epoch_warmup_keeps_the_recipe_shape():
    # a change inside the warm-up: the warm-up still ends at the (doubled) base and the decay follows it
    optimizer, scheduler = _schedule(0.1, False, 12, epochs=6, warmup_epochs=3)
    ramp = BatchRamp(optimizer, scheduler, BatchLayout(4, 1, 2), 24, 6, factor=1.0, min_updates=1, verbose=False)
    assert ramp.scheduler is scheduler  # a per-epoch schedule needs no clock: every epoch trains the same samples
    loop = FakeLoop(b_simple=12.0)  # room for accumulation 3 only: 12 samples over micro-batches of 4
    for epoch in range(6):
        changed = ramp.before_epoch(epoch, loop)
        assert changed == (epoch == 1)
        growth = ramp.state.accum_steps / 2
        want = _recipe_lr(0.1 * growth, False, 12, epoch, epochs=6, warmup_epochs=3) if epoch else 1e-4
        assert optimizer.param_groups[0]['lr'] == pytest.approx(want), epoch
        scheduler.step(epoch + 1)
    assert lr_factor(8, 12, 'linear') == ramp.state.history[0].lr_factor == pytest.approx(1.5)


def test_resume_continues_the_ramp_and_a_fresh_optimizer_gets_its_lr():
    optimizer, scheduler = _schedule(0.1, False, 12)
    ramp = BatchRamp(optimizer, scheduler, BatchLayout(4, 1, 2), 24, 4, factor=1.0, min_updates=1, verbose=False)
    loop = FakeLoop(1000.0)
    ramp.before_epoch(0, loop)
    ramp.before_epoch(1, loop)
    saved = ramp.state_dict()
    fresh_opt, fresh_sched = _schedule(0.1, False, 12)
    resumed = BatchRamp(fresh_opt, fresh_sched, BatchLayout(4, 1, 2), 24, 4, factor=1.0, min_updates=1,
                        verbose=False)
    resumed.restore(saved, fresh_optimizer=True)
    assert resumed.state == ramp.state and resumed.updates_per_epoch == 6
    assert fresh_sched.base_values == pytest.approx(scheduler.base_values)
    # an elastic resume on a layout with twice the accumulation keeps the ramp's growth (x2) over it
    elastic = BatchRamp(*_schedule(0.1, False, 6), BatchLayout(2, 1, 4), 24, 4, verbose=False)
    elastic.restore(saved)
    assert elastic.state.accum_steps == 8 and elastic.layout.global_batch == 16


def test_ramp_grows_the_micro_batch_first_and_a_resume_rebuilds_the_loader():
    loads = []

    def reload(micro_batch):  # 96 samples per epoch, incomplete batches dropped
        loads.append(micro_batch)
        return 96 // micro_batch

    def ramp_of(**kwargs):
        return BatchRamp(*_schedule(0.1, False, 12), BatchLayout(4, 1, 2), 24, 4, factor=1.0, min_updates=1,
                         verbose=False, max_micro=8, reload=reload, **kwargs)

    ramp, loop = ramp_of(), FakeLoop(1000.0)
    for epoch in range(3):
        ramp.before_epoch(epoch, loop)
    # 8 -> 16 as 8 x 2 (the limit), 16 -> 32 as 8 x 4: accumulation only once the micro-batch is at the limit
    assert [(c.new_micro, c.new_accum, c.new_global) for c in ramp.state.history] == [(8, 2, 16), (8, 4, 32)]
    assert loads == [8] and (loop.batch_size, loop.accum_steps) == (8, 4) and ramp.updates_per_epoch == 3
    resumed = ramp_of()
    resumed.restore(ramp.state_dict())
    assert loads == [8, 8] and resumed.state == ramp.state and resumed.updates_per_epoch == 3
    # a checkpoint from before the micro-batch could grow continues at the recipe's micro-batch
    old = {'accum_steps': 4, 'recipe_accum': 2, 'history': [
        {k: v for k, v in vars(RampChange(1, 70.0, 2, 4, 8, 16, 2.0)).items() if not k.endswith('_micro')}]}
    resumed = ramp_of()
    resumed.restore(old)
    assert loads == [8, 8] and resumed.layout == BatchLayout(4, 1, 4) and resumed.updates_per_epoch == 6
    with pytest.raises(ValueError, match='reload'):
        BatchRamp(*_schedule(0.1, False, 12), BatchLayout(4, 1, 2), 24, 4, max_micro=8)


def test_micro_batch_stays_within_a_rank_epoch():
    # 2 ranks of 12 samples an epoch: global batch 32 as 16 x 2 ranks x 1 would leave the loader no batch
    ramp = BatchRamp(*_schedule(0.1, False, 2), BatchLayout(4, 2, 2), 3, 4, factor=1.0, min_updates=1,
                     verbose=False, max_micro=64, reload=lambda micro_batch: 12 // micro_batch)
    loop = FakeLoop(1000.0)
    ramp.before_epoch(0, loop)
    assert ramp.before_epoch(1, loop) and ramp.layout == BatchLayout(8, 2, 2)


def test_loop_trains_the_next_epoch_with_the_new_accumulation():
    from timm.task import ClassificationTask
    from timm_ext.train.loop import LoopConfig, TrainLoop

    class Updates:  # counts the loop's step_update calls
        def __init__(self):
            self.calls = []

        def step_update(self, num_updates, metric=None):
            self.calls.append(num_updates)

    model = torch.nn.Linear(4, 3)
    task = ClassificationTask(model, torch.nn.CrossEntropyLoss(), device=torch.device('cpu'), verbose=False)
    updates = Updates()
    loop = TrainLoop(task, torch.optim.SGD(model.parameters(), lr=0.1),
                     LoopConfig(device=torch.device('cpu'), accum_steps=2, batch_size=2, log_interval=10 ** 9),
                     lr_scheduler=updates)
    batches = [(torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(8)]
    loop.train_one_epoch(0, batches)
    loop.set_layout(2, 4)
    loop.train_one_epoch(1, batches)
    assert updates.calls == [1, 2, 3, 4, 3, 4] and loop.cfg.accum_steps == 4


@pytest.mark.parametrize('oom_splits', [None, 1, 2])
def test_set_layout_keeps_each_window_a_true_mean(oom_splits):
    # 8 samples as 4 batches of 2 (accumulation 4), and after set_layout(4, 2) as 2 batches of 4: the same update
    from timm.task import ClassificationTask
    from timm_ext.train.loop import LoopConfig, TrainLoop

    torch.manual_seed(0)
    inputs, targets = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def one_update(batch, regrow):
        model = torch.nn.Linear(4, 3)
        torch.nn.init.constant_(model.weight, 0.1)
        torch.nn.init.zeros_(model.bias)
        task = ClassificationTask(model, torch.nn.CrossEntropyLoss(), device=torch.device('cpu'), verbose=False)
        cfg = LoopConfig(device=torch.device('cpu'), accum_steps=4, batch_size=2, log_interval=10 ** 9,
                         oom_recover=oom_splits is not None)
        loop = TrainLoop(task, torch.optim.SGD(model.parameters(), lr=1.0), cfg)
        if oom_splits is not None:
            loop.splitter.splits = oom_splits  # as an OOM of a micro-batch of 2 leaves it: pieces of 1
        if regrow:
            loop.set_layout(batch, 8 // batch)
        loop.train_one_epoch(0, list(zip(inputs.split(batch), targets.split(batch))))
        return model.weight.detach().clone(), loop

    small, _ = one_update(2, regrow=False)
    big, loop = one_update(4, regrow=True)
    assert torch.allclose(small, big, atol=1e-6) and (loop.cfg.batch_size, loop.cfg.accum_steps) == (4, 2)
    if oom_splits is not None:  # pieces no bigger than the OOM left them, or none when there was no OOM
        assert (loop.splitter.batch_size, loop.splitter.micro_batch) == (4, 4 if oom_splits == 1 else 1)


# ---- train.py ------------------------------------------------------------------------------------------------------

# 96 images in micro-batches of 4 against windows of 8: a positive B_simple after every epoch at this LR; a tiny
# factor and update guard let it grow the accumulation at both boundaries (at most doubling: 2 -> 4 -> 8); recovery
# checkpoints every 5 updates: the newest two are recovery-0-9 and recovery-1-4
RAMP_RUN = ('--val-split', '', '--model', 'test_vit', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
            '--workers', '0', '-b', '4', '--grad-accum-steps', '2', '--lr', '0.05', '--epochs', '3',
            '--sched', 'cosine', '--warmup-epochs', '1', '--sched-on-updates', '--log-noise-scale',
            '--batch-ramp', '--batch-ramp-factor', '0.01', '--batch-ramp-min-updates', '1', '--recovery-interval', '5')


def _rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


# cosine over the recipe's 36 updates (12 an epoch): each epoch ends at its recipe point, LR doubled per change
RAMPED_LRS = [growth * 0.05 * 0.5 * (1 + math.cos(math.pi * t / 36)) for growth, t in ((1, 12), (2, 24), (4, 36))]


def _train(data, out, name, flags, *extra):
    """train.py's main into ``out/name``, in this process; returns its stderr and its ramp-change lines."""
    result = train_in_process('--data-dir', data, '--output', out, '--experiment', name, *flags, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr, [line for line in result.stderr.splitlines() if 'Batch ramp before epoch' in line]


def _check_whole_run(run):
    """The uninterrupted run's global batches and LRs; returns its summary rows."""
    assert [r['global_batch'] for r in _rows(run / 'noise_scale.csv')] == ['8', '16', '32']
    rows = _rows(run / 'summary.csv')
    assert [float(r['lr']) for r in rows] == pytest.approx(RAMPED_LRS, abs=1e-9)
    return rows


def _check_resumed(run, rows, inside):
    """A run resumed after epoch 0 (or `inside` epoch 1) trains epochs 1 and 2 as the whole run's `rows` did."""
    resumed_rows, rows = _rows(run / 'summary.csv'), rows[1:]
    assert [(r['epoch'], float(r['lr'])) for r in resumed_rows] == [(r['epoch'], float(r['lr'])) for r in rows]
    whole_epochs = slice(1 if inside else 0, None)  # an epoch resumed inside reports the loss of its remainder
    assert [float(r['train_loss']) for r in resumed_rows[whole_epochs]] == pytest.approx(
        [float(r['train_loss']) for r in rows[whole_epochs]], rel=1e-4)
    assert [r['global_batch'] for r in _rows(run / 'noise_scale.csv')] == ['16', '32']


def test_run_grows_the_batch_and_a_resume_continues_the_ramp(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=32)
    _, changes = _train(data, tmp_path, 'whole', RAMP_RUN)
    assert len(changes) == 2
    assert 'accumulation 2 -> 4' in changes[0] and 'accumulation 4 -> 8' in changes[1]
    run = tmp_path / 'whole'
    rows = _check_whole_run(run)
    state = load_training_checkpoint(run / 'last.pth.tar')['batch_ramp']
    assert state['accum_steps'] == 8 and [c['new_accum'] for c in state['history']] == [4, 8]

    # resumed from the end of epoch 0: the same decision from the checkpoint's B_simple, the same LR and batches
    _, again = _train(data, tmp_path, 'resumed', RAMP_RUN, '--resume', str(run / 'checkpoint-0.pth.tar'))
    assert again == changes
    _check_resumed(tmp_path / 'resumed', rows, inside=False)
    # resumed inside epoch 1 (5 of its 6 updates at accumulation 4 done): no second decision for epoch 1
    _, again = _train(data, tmp_path, 'inside', RAMP_RUN, '--resume', str(run / 'recovery-1-4.pth.tar'))
    assert again == changes[1:]
    _check_resumed(tmp_path / 'inside', rows, inside=True)


# the same run with --batch-ramp-max-micro 8 (and --oom-recover, whose splitter follows the loader): the first change
# doubles the micro-batch instead (24 -> 12 loader batches per epoch), the second, past the limit, the accumulation;
# the global batches, LRs and recovery checkpoints are the accumulation-only run's
MICRO_RUN = (*RAMP_RUN, '--batch-ramp-max-micro', '8', '--oom-recover')


def test_run_grows_the_micro_batch_and_a_resume_rebuilds_its_loader(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=32)
    log, changes = _train(data, tmp_path, 'whole', MICRO_RUN)
    assert len(changes) == 2
    assert 'micro-batch 4 -> 8, accumulation 2 -> 2 (global batch 8 -> 16, 12 -> 6 updates' in changes[0]
    assert 'micro-batch' not in changes[1] and 'accumulation 2 -> 4 (global batch 16 -> 32, 6 -> 3' in changes[1]
    assert 'Train: 1 [   5/6 ' in log and 'Train: 2 [   2/3 ' in log
    run = tmp_path / 'whole'
    rows = _check_whole_run(run)
    state = load_training_checkpoint(run / 'last.pth.tar')['batch_ramp']
    assert (state['micro_batch'], state['accum_steps'], state['recipe_micro']) == (8, 4, 4)
    assert [(c['new_micro'], c['new_accum']) for c in state['history']] == [(8, 2), (8, 4)]

    _, again = _train(data, tmp_path, 'resumed', MICRO_RUN, '--resume', str(run / 'checkpoint-0.pth.tar'))
    assert again == changes  # the first change decided again, from the checkpoint's B_simple
    _check_resumed(tmp_path / 'resumed', rows, inside=False)
    # inside epoch 1, 5 of its 6 updates at micro-batch 8 done: the loader is rebuilt at 8 before the epoch goes on
    log, again = _train(data, tmp_path, 'inside', MICRO_RUN, '--resume', str(run / 'recovery-1-4.pth.tar'))
    assert again == changes[1:]
    assert 'continuing the checkpoint\'s 8 x 1 rank x 2 accum' in log
    assert 'Resuming epoch 1 at update 5/6: skipping 10 batches' in log
    _check_resumed(tmp_path / 'inside', rows, inside=True)


# the same run on 2 gloo ranks without accumulation (B_simple from one rank's batch against all ranks'): every rank
# must take the same decision from the estimate averaged over ranks, or the next epoch's collectives would not match
DDP_RUN = tuple('1' if prev == '--grad-accum-steps' else a for prev, a in zip(('',) + RAMP_RUN, RAMP_RUN))


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo ranks under torchrun')
def test_ranks_take_the_same_decisions_under_ddp(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=32)
    result = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
         str(REPO_ROOT / 'train.py'), '--data-dir', str(data), '--output', str(tmp_path), '--experiment', 'ddp',
         *DDP_RUN], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'})
    assert result.returncode == 0, result.stderr[-3000:]
    changes = [line for line in result.stderr.splitlines() if 'Batch ramp before epoch' in line]
    assert len(changes) == 2 and 'accumulation 1 -> 2' in changes[0] and 'accumulation 2 -> 4' in changes[1]
    run = tmp_path / 'ddp'
    assert [r['global_batch'] for r in _rows(run / 'noise_scale.csv')] == ['8', '16', '32']  # 4 x 2 ranks x accum
    state = load_training_checkpoint(run / 'last.pth.tar')['batch_ramp']
    assert state['accum_steps'] == 4 and [c['new_accum'] for c in state['history']] == [2, 4]


@pytest.mark.parametrize('flags,words', [
    (['--log-noise-scale', '--grad-accum-steps', '2', '--batch-ramp-max', '64'], '--batch-ramp-max only acts'),
    (['--log-noise-scale', '--grad-accum-steps', '2', '--batch-ramp-max-micro', '8'],
     '--batch-ramp-max-micro only acts'),
    (['--batch-ramp', '--log-noise-scale', '--grad-accum-steps', '2', '--batch-ramp-max-micro', '0'],
     '--batch-ramp-max-micro'),
    (['--batch-ramp', '--log-noise-scale'], 'two batch sizes'),
    (['--batch-ramp', '--log-noise-scale', '--grad-accum-steps', '2', '--batch-ramp-factor', '0'],
     '--batch-ramp-factor'),
])
def test_unusable_ramp_flags_are_one_line_errors(image_folder, tmp_path, monkeypatch, capsys, flags, words):
    sys.path.insert(0, str(REPO_ROOT))
    import train as train_script
    monkeypatch.setattr(logging.root, 'handlers', [])
    argv = ['--data-dir', str(image_folder), '--model', 'test_vit', '--device', 'cpu', '--output',
            str(tmp_path / 'out'), *flags]
    try:
        code = train_script.main(argv)
    except SystemExit as e:  # a value outside its domain is refused while parsing, as argparse does
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error' in line.lower()]
    assert 'Traceback' not in err and len(lines) == 1 and words in lines[0], err
    assert not (tmp_path / 'out').exists()
