"""WindowReplay and WindowAttempt alone (one process): replay after an OOM, pieces, the update guard, grow-back."""
import logging

import pytest
import torch
import torch.nn as nn
from timm.task import ClassificationTask

from timm_ext.train.oom_recovery import OomRecoveryError
from timm_ext.train.oom_replay import PLAIN_WINDOW, WindowAttempt, WindowReplay

CPU = torch.device('cpu')


def make_replay(batch_size=4, grow_back=None, model=None):
    model = model or nn.Linear(3, 2)
    task = ClassificationTask(model, nn.CrossEntropyLoss(), device=CPU, verbose=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    return WindowReplay(task, params, CPU, batch_size, accum_steps=2, grow_back=grow_back, world_size=1, rank=0,
                        optimizer=optimizer), params


def oom_step(*args):
    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')


def test_an_oom_replays_the_window_with_twice_the_pieces_and_discards_its_gradients(caplog):
    replay, params = make_replay()
    seen = []

    def window_pass(attempt):
        params[0].grad = torch.ones_like(params[0])  # a half-done backward's gradient
        seen.append((replay.splitter.splits, params[0].grad is None))
        if len(seen) == 1:
            assert attempt.backward(oom_step, None, None, 1.0, True) is None
            assert attempt.failed and attempt.stop_now
        return 'done'

    with caplog.at_level(logging.WARNING, logger='train'):
        assert replay.run(window_pass, 'epoch 0 update 3') == 'done'
    assert [s for s, _ in seen] == [1, 2] and replay.replays == 1
    assert 'OOM recovery at epoch 0 update 3' in caplog.text and 'micro-batch 4 -> 2' in caplog.text


def test_a_clean_window_runs_once():
    replay, _ = make_replay()
    calls = []
    assert replay.run(lambda attempt: calls.append(attempt) or len(calls), 'w') == 1
    assert replay.replays == 0 and replay.splitter.splits == 1


def test_one_sample_that_does_not_fit_is_an_oom_recovery_error():
    replay, _ = make_replay(batch_size=1)
    with pytest.raises(OomRecoveryError, match='even with a micro-batch of 1 sample'):
        replay.run(lambda attempt: attempt.backward(oom_step, None, None, 1.0, True), 'epoch 1 update 0')


def test_other_errors_propagate_on_one_process():
    attempt = WindowAttempt(make_replay()[0].splitter, CPU, distributed=False)
    with pytest.raises(ValueError, match='shapes'):
        attempt.backward(lambda *a: (_ for _ in ()).throw(ValueError('shapes')), None, None, 1.0, True)


def test_pieces_are_weighted_by_their_share_of_the_batch():
    replay, _ = make_replay(batch_size=5)
    replay.splitter.splits = 2
    attempt = WindowAttempt(replay.splitter, CPU, distributed=False)
    input, target = torch.randn(5, 3), torch.arange(5)
    pieces = attempt.pieces(input, target, 5, 0.5)
    assert [n for _, _, n, _ in pieces] == [3, 2]
    assert sum(w for _, _, _, w in pieces) == pytest.approx(0.5)
    assert PLAIN_WINDOW.pieces(input, target, 5, 0.5) == [(input, target, 5, 0.5)]


def test_guard_update_turns_an_oom_into_a_clear_error_and_lets_others_through():
    replay, _ = make_replay()
    with pytest.raises(OomRecoveryError, match='optimizer step at epoch 2 update 1') as err:
        replay.guard_update(oom_step, 'epoch 2 update 1')
    assert '\n' not in str(err.value)
    with pytest.raises(KeyError):
        replay.guard_update(lambda: {}['x'], 'w')
    done = []
    replay.guard_update(lambda: done.append(1), 'w')
    assert done == [1]


def test_after_update_grows_back_after_clean_updates_only(caplog):
    replay, _ = make_replay(batch_size=4, grow_back=2)
    replay.splitter.splits = 4
    replay.replays = 1  # a replayed window does not count as clean
    replay.after_update('w')
    assert replay.splitter.clean_updates == 0
    replay.replays = 0
    with caplog.at_level(logging.INFO, logger='train'):
        replay.after_update('epoch 0 update 1')
        replay.after_update('epoch 0 update 2')
    assert replay.splitter.splits == 2
    assert '2 clean updates, trying the larger micro-batch again: 1 -> 2' in caplog.text
