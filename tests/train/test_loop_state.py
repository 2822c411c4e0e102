"""TrainLoop.state_dict / load_state_dict through checkpoint.training_state and saved_loop_state (the on-disk keys)."""
import argparse

import torch
import torch.nn as nn
from timm.task import ClassificationTask

from timm_ext.train import checkpoint as ckpt
from timm_ext.train.loop import LoopConfig, TrainLoop

CPU = torch.device('cpu')


def make_loop(**cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    task = ClassificationTask(model, nn.CrossEntropyLoss(), device=CPU, verbose=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainLoop(task, optimizer, LoopConfig(device=CPU, **cfg)), task, optimizer


def batches(n=6, size=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def checkpoint_of(loop, task, optimizer, updates_done=None):
    args = argparse.Namespace(model='mlp', lr=0.1)
    return ckpt.training_state(task, optimizer, args, 0, loop_state=loop.state_dict(), updates_done=updates_done)


def test_loop_state_round_trips_under_the_checkpoint_keys():
    loop, task, optimizer = make_loop(accum_steps=2, batch_size=4, oom_recover=True, log_noise_scale=True)
    loop.train_one_epoch(0, batches())
    loop.splitter.splits = 4
    state = checkpoint_of(loop, task, optimizer, updates_done=2)
    assert state['micro_batch'] == {'batch_size': 4, 'splits': 4, 'micro_batch': 1}
    assert state['noise_scale'] == loop.noise.estimator.state_dict() and state['noise_scale']['num_updates'] > 0
    assert state['updates_done'] == 2 and state['epoch_rng'] is loop.epoch_rng

    fresh, _, _ = make_loop(accum_steps=2, batch_size=4, oom_recover=True, log_noise_scale=True)
    fresh.load_state_dict(ckpt.saved_loop_state(state))
    assert fresh.splitter.splits == 4
    assert fresh.noise.estimator.state_dict() == state['noise_scale']


def test_epoch_checkpoints_and_plain_loops_write_no_loop_keys():
    loop, task, optimizer = make_loop(batch_size=4)
    state = checkpoint_of(loop, task, optimizer)
    assert not {'micro_batch', 'noise_scale', 'updates_done', 'epoch_rng'} & state.keys()
    # a stock checkpoint has none of them: loading it changes nothing
    loop.load_state_dict(ckpt.saved_loop_state({'epoch': 3, 'state_dict': {}}))
    assert loop.splitter is None and loop.epoch_rng is None


def test_a_resumed_epoch_replays_the_saved_rng_and_an_epoch_from_its_start_does_not():
    loop, task, optimizer = make_loop(batch_size=4)
    torch.manual_seed(123)
    saved = ckpt.rng_state()
    torch.manual_seed(999)
    loop.load_state_dict(ckpt.saved_loop_state({'epoch_rng': saved, 'updates_done': 2}))
    loop.train_one_epoch(0, batches(), start_update=2)
    assert torch.equal(loop.epoch_rng['torch'], saved['torch'])

    loop.load_state_dict(ckpt.saved_loop_state({'epoch_rng': saved, 'updates_done': 2}))
    torch.manual_seed(999)
    loop.train_one_epoch(1, batches(), start_update=0)  # --start-epoch: the epoch starts over, with its own RNG
    assert not torch.equal(loop.epoch_rng['torch'], saved['torch'])
    assert ckpt.saved_loop_state({'epoch_rng': saved}, with_epoch_rng=False)['epoch_rng'] is None
