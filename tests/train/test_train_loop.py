"""TrainLoop in process: update counts, gradient equivalence of accumulation, host syncs, recovery indices."""
import logging
import math

import pytest
import timm
import torch
import torch.nn as nn
from timm.task import ClassificationTask

from timm_ext.train.loop import LoopConfig, TrainLoop, loss_weight

CPU = torch.device('cpu')


def tiny_vit() -> nn.Module:
    """A timm model without batch norm (LayerNorm only), so a batch's gradient does not depend on its split."""
    torch.manual_seed(0)
    return timm.create_model('test_vit', num_classes=3, img_size=32)


def make_batches(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def make_loop(model, opt='sgd', lr=1.0, **cfg):
    task = ClassificationTask(model, nn.CrossEntropyLoss(), device=CPU, verbose=False)
    if opt == 'sgd':
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)  # plain SGD, lr 1: the update is minus the gradient
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg.setdefault('batch_size', 4)
    return TrainLoop(task, optimizer, LoopConfig(device=CPU, **cfg))


def param_delta(model, batches, accum, **cfg):
    """Parameter change after one epoch of plain SGD (lr 1), i.e. minus the sum of each window's gradient."""
    before = [p.detach().clone() for p in model.parameters()]
    make_loop(model, accum_steps=accum, **cfg).train_one_epoch(0, batches)
    return [p.detach() - b for p, b in zip(model.parameters(), before)]


def full_batch_delta(batches):
    """Minus the gradient of the mean loss over all samples of ``batches`` taken as one batch."""
    model = tiny_vit()
    model.train()
    inputs = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    nn.CrossEntropyLoss()(model(inputs), targets).backward()
    return [-p.grad for p in model.parameters()]


def assert_close(got, want, atol=1e-5):
    worst = max((g - w).abs().max().item() for g, w in zip(got, want))
    assert worst <= atol, f'largest gradient difference {worst:.3g} > {atol}'


def test_accumulated_window_equals_one_big_batch():
    batches = make_batches([3, 3, 3, 3])
    assert_close(param_delta(tiny_vit(), batches, accum=4, batch_size=3), full_batch_delta(batches))


def test_short_last_micro_batch_is_a_true_mean():
    # a window whose last micro-batch holds fewer samples: every sample still weighs the same
    batches = make_batches([4, 4, 2])
    assert_close(param_delta(tiny_vit(), batches, accum=3, batch_size=4), full_batch_delta(batches))


def test_shorter_last_window_is_its_own_mean():
    # 5 micro-batches, accumulation 3: windows of 3 and 2; SGD at lr 1 from the same start would need the second
    # window's gradient at moved weights, so compare the last window alone, from its own starting weights
    batches = make_batches([2] * 5)
    model = tiny_vit()
    loop = make_loop(model, accum_steps=3, batch_size=2, lr=0.0)  # lr 0: weights stay put, only gradients matter
    grads = []
    loop.optimizer_update = lambda correction=1.0, _orig=loop.optimizer_update: (
        grads.append([p.grad.clone() * correction for p in model.parameters()]), _orig(correction))
    loop.train_one_epoch(0, batches)
    assert len(grads) == 2
    assert_close([-g for g in grads[1]], full_batch_delta(batches[3:]))
    assert_close([-g for g in grads[0]], full_batch_delta(batches[:3]))


def test_fourteen_batches_accum_eight_make_two_updates(caplog):
    # stock timm takes 3 optimizer steps here and logs [2/2 (150%)]
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3))
    loop = make_loop(model, opt='adamw', accum_steps=8, log_interval=1)
    recoveries = []
    loop.save_recovery = lambda epoch, idx: recoveries.append((epoch, idx))
    loop.cfg.recovery_interval = 1

    class Sched:
        updates = []

        def step_update(self, num_updates, metric=None):
            self.updates.append(num_updates)

    loop.lr_scheduler = Sched()
    with caplog.at_level(logging.INFO, logger='train'):
        loop.train_one_epoch(3, make_batches([4] * 14))
    steps = {int(s['step']) for s in loop.optimizer.state_dict()['state'].values()}
    assert steps == {2}
    assert Sched.updates == [3 * 2 + 1, 3 * 2 + 2]  # scheduler sees global update counts of epoch 3
    assert recoveries == [(3, 0), (3, 1)]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Train:')]
    assert len(logged) == 2 and '[   1/2 (100%)]' in logged[-1], logged


def test_resume_inside_epoch_trains_only_the_rest():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3))
    loop = make_loop(model, opt='adamw', accum_steps=3)
    seen = []
    loop.forward_backward = lambda input, target, weight, sync, _f=loop.forward_backward: (
        seen.append(input.shape[0]), _f(input, target, weight, sync))[1]
    batches = make_batches([1, 2, 3, 4, 5, 6, 7])  # windows [1,2,3] [4,5,6] [7]
    loop.train_one_epoch(0, batches, start_update=1)
    assert seen == [4, 5, 6, 7]
    assert {int(s['step']) for s in loop.optimizer.state_dict()['state'].values()} == {2}


def test_no_host_sync_per_micro_batch(monkeypatch):
    """Loss values are read on log lines and at the end of the epoch only, never per micro-batch."""
    reads = []
    for name in ('item', 'tolist', '__float__', '__int__', '__bool__'):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=original, _name=name, **kw):
            reads.append(_name)
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counting)

    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3))
    loop = make_loop(model, accum_steps=2, log_interval=1000, lr=0.1)
    batches = make_batches([4] * 12)  # 12 micro-batches, 6 updates; log lines at updates 0 and 5
    reads.clear()
    loop.train_one_epoch(0, batches)
    assert reads.count('item') == 2 * 2 + 1, reads  # (now, avg) per log line + the epoch mean
    assert len(reads) < len(batches), reads


def test_unknown_loss_weighting_is_refused():
    with pytest.raises(ValueError, match='loss_weighting'):
        make_loop(nn.Linear(2, 2), loss_weighting='cubic')


@pytest.mark.parametrize('mode,expected', [('none', 1.0), ('linear', 0.5), ('sqrt', math.sqrt(0.5))])
def test_variable_batch_loss_weights_follow_timm_modes(mode, expected):
    loop = make_loop(nn.Linear(2, 2), batch_size=8, loss_weighting=mode)
    assert loss_weight(loop.cfg, 4, window_len=2) == pytest.approx(expected / 2)
