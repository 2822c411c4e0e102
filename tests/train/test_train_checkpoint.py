"""timm_ext.train.checkpoint: atomic writes, ranked history, resume points and errors, safetensors export."""
import argparse
import os

import pytest
import timm
import torch
from timm.models import load_checkpoint
from timm.task import ClassificationTask

from timm_ext import atomic_files
from timm_ext.train import checkpoint as ckpt


def test_atomic_write_failure_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / 'last.pth.tar'
    atomic_files.atomic_torch_save({'v': 1}, path)

    def half_write(tmp):
        tmp.write_bytes(b'partial')
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_files.atomic_write(path, half_write)
    assert torch.load(path)['v'] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ['last.pth.tar']


def test_stale_temp_files_are_hidden_and_removed(tmp_path):
    stale = tmp_path / '.last.pth.tar.1234.tmp'
    stale.write_bytes(b'torn')
    assert not list(tmp_path.glob('*.pth.tar'))  # a torn temp file never looks like a checkpoint
    assert atomic_files.remove_stale_tmp_files(tmp_path) == [stale]
    assert not stale.exists()


def test_duplicate_survives_replacing_its_source(tmp_path):
    src, dst = tmp_path / 'last.pth.tar', tmp_path / 'model_best.pth.tar'
    atomic_files.atomic_torch_save({'v': 1}, src)
    atomic_files.atomic_duplicate(src, dst)
    atomic_files.atomic_torch_save({'v': 2}, src)
    assert torch.load(dst)['v'] == 1 and torch.load(src)['v'] == 2


def _state(epoch):
    return {'epoch': epoch, 'state_dict': {'w': torch.full((2,), float(epoch))}, 'version': 2}


def test_history_keeps_best_ranked_and_evicts_worst(tmp_path):
    saver = ckpt.CheckpointManager(tmp_path, decreasing=False, max_history=2)
    for epoch, metric in enumerate([50.0, 70.0, 60.0, 40.0, 70.0]):
        saver.save_epoch(_state(epoch), epoch, metric)
    # ties keep the earlier epoch first; epoch 4's 70 enters behind epoch 1's 70 and evicts 60
    assert saver.history == [('checkpoint-1.pth.tar', 70.0), ('checkpoint-4.pth.tar', 70.0)]
    on_disk = sorted(p.name for p in tmp_path.glob('checkpoint-*'))
    assert on_disk == ['checkpoint-1.pth.tar', 'checkpoint-4.pth.tar']
    assert (saver.best_metric, saver.best_epoch) == (70.0, 1)
    assert torch.load(tmp_path / 'model_best.pth.tar')['epoch'] == 1
    assert torch.load(tmp_path / 'last.pth.tar')['epoch'] == 4


def test_history_continues_after_resume(tmp_path):
    first = ckpt.CheckpointManager(tmp_path, decreasing=True, max_history=2)
    first.save_epoch(_state(0), 0, 3.0)
    first.save_epoch(_state(1), 1, 2.0)
    saved = torch.load(tmp_path / 'last.pth.tar')['saver']
    second = ckpt.CheckpointManager(tmp_path, decreasing=True, max_history=2)
    second.load_state_dict(saved)
    second.save_epoch(_state(2), 2, 1.0)
    assert [f for f, _ in second.history] == ['checkpoint-2.pth.tar', 'checkpoint-1.pth.tar']
    assert not (tmp_path / 'checkpoint-0.pth.tar').exists()


def test_recovery_keeps_two_newest(tmp_path):
    saver = ckpt.CheckpointManager(tmp_path, decreasing=False)
    for idx in range(4):
        saver.save_recovery({**_state(0), 'updates_done': idx + 1}, 0, idx)
    assert sorted(p.name for p in tmp_path.glob('recovery-*')) == ['recovery-0-2.pth.tar', 'recovery-0-3.pth.tar']


def test_resume_point_of_epoch_and_recovery_checkpoints():
    assert ckpt.resume_point({'epoch': 4, 'version': 2}) == ckpt.ResumePoint(5)
    assert ckpt.resume_point({'epoch': 4, 'version': 1}) == ckpt.ResumePoint(4)
    # ours resumes inside the interrupted epoch; stock timm's recovery checkpoints (no updates_done) as stock
    assert ckpt.resume_point({'epoch': 4, 'version': 2, 'updates_done': 3}).updates_done == 3
    assert ckpt.resume_point({'epoch': 4, 'version': 2, 'updates_done': 3}).epoch == 4


@pytest.mark.parametrize('content,match', [
    (None, 'not found'),
    (b'', 'not a readable checkpoint'),
    (b'garbage' * 10, 'not a readable checkpoint'),
])
def test_resume_of_missing_or_corrupt_file_is_one_line(tmp_path, content, match):
    path = tmp_path / 'x.pth.tar'
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ckpt.CheckpointError, match=match) as info:
        ckpt.load_training_checkpoint(path)
    assert '\n' not in str(info.value)


def test_resume_of_truncated_checkpoint_is_refused(tmp_path):
    path = tmp_path / 'last.pth.tar'
    torch.save(_state(0), path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match='not a readable checkpoint'):
        ckpt.load_training_checkpoint(path)


def test_resume_into_another_model_is_one_line():
    task = ClassificationTask(timm.create_model('test_resnet', num_classes=3), torch.nn.CrossEntropyLoss(),
                              verbose=False)
    other = timm.create_model('test_vit', num_classes=3, img_size=32)
    with pytest.raises(ckpt.CheckpointError, match='does not fit this model') as info:
        ckpt.restore_model(task, {'state_dict': other.state_dict(), 'arch': 'test_vit'})
    assert '\n' not in str(info.value)


def test_training_state_loads_with_timm_and_exports_safetensors(tmp_path):
    model = timm.create_model('test_resnet', num_classes=3)
    task = ClassificationTask(model, torch.nn.CrossEntropyLoss(), verbose=False)
    task.setup_ema(decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # EMA and model weights now differ
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = argparse.Namespace(model='test_resnet', lr=0.1)
    state = ckpt.training_state(task, optimizer, args, epoch=0, metric=1.0)
    saver = ckpt.CheckpointManager(tmp_path, decreasing=False)
    saver.save_epoch(state, 0, 1.0, weights=state['state_dict_ema'])

    # timm's own loader (weights only) reads model and EMA weights
    for use_ema, want in ((False, model), (True, task.get_trainable_module(ema=True).module)):
        fresh = timm.create_model('test_resnet', num_classes=3)
        load_checkpoint(fresh, str(tmp_path / 'last.pth.tar'), use_ema=use_ema)
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), want.state_dict().values()))

    ema_weights = task.get_trainable_module(ema=True).module.state_dict()
    for name in ('last.safetensors', 'model_best.safetensors'):
        loaded = timm.create_model('test_resnet', pretrained=True, num_classes=3,
                                   pretrained_cfg_overlay=dict(file=str(tmp_path / name), num_classes=3))
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ema_weights.items()), name
    assert not [p for p in os.listdir(tmp_path) if p.endswith('.tmp')]


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    torch.manual_seed(3)
    state = ckpt.rng_state()
    atomic_files.atomic_torch_save({'rng': state, 'state_dict': {}}, tmp_path / 'c.pth.tar')
    want = torch.rand(3)
    loaded = ckpt.load_training_checkpoint(tmp_path / 'c.pth.tar')
    ckpt.set_rng_state(loaded['rng'])
    assert torch.equal(torch.rand(3), want)
