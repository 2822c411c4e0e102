"""CUDA set-up that a CPU machine can check: the backend flags every entry point sets, CUDA indices that do not exist,
and validate.py keeping to the asked GPU.

The flags are real (this torch build has CUDA support, so they can be set without a GPU). Where a GPU would have to
exist (`device_count`, `set_device`, a tensor on cuda:1) the few `torch.cuda` calls involved are replaced, and each
test says which.
"""
import argparse
import importlib.util
import logging
import sys

import pytest
import torch

from conftest import REPO_ROOT
from timm_ext import amp as amp_mod
from timm_ext.train import run as train_run
from timm_ext.tune import critical_batch
from timm_ext.cuda_backends import configure_cuda_backends
from timm_ext.distributed import DeviceError, init_device
from timm_ext.train.args import parse_args
from timm_ext.validate.evaluate import ValidationError, resolve_device


def load_script(name: str):
    """Import one of the project's scripts as a module (they are not a package)."""
    spec = importlib.util.spec_from_file_location(f'{name}_script', REPO_ROOT / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def backend_flags():
    """Both flags off for the test, restored afterwards (they are process-wide)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.benchmark = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark = saved


def test_cuda_runs_get_stock_tf32_and_cudnn_benchmark(backend_flags):
    assert not configure_cuda_backends('cpu')
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.benchmark
    assert configure_cuda_backends(torch.device('cuda', 1))
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark


class Stop(Exception):
    """Raised by the spy once the entry point has asked for the flags: nothing after it needs to run."""


def spy_on_flags(monkeypatch, module) -> list:
    calls = []

    def spy(device):
        calls.append(torch.device(device))
        raise Stop

    monkeypatch.setattr(module, 'configure_cuda_backends', spy)
    return calls


def cpu_train_args(image_folder) -> argparse.Namespace:
    args, _ = parse_args(['--data-dir', str(image_folder), '--model', 'test_resnet', '--device', 'cpu', '-j', '0'])
    return args


def test_train_sets_the_flags_for_its_device(monkeypatch, image_folder):
    train_script = load_script('train')
    calls = spy_on_flags(monkeypatch, train_run)  # the run's build phase configures the backends
    with pytest.raises(Stop):
        train_script.train(cpu_train_args(image_folder), '')
    assert calls == [torch.device('cpu')]


def test_tune_batch_sets_the_flags_before_probing(monkeypatch, image_folder):
    tune_script = load_script('tune_batch')
    calls = spy_on_flags(monkeypatch, tune_script)
    parser = tune_script.build_tune_parser()
    args, _ = parse_args(['--data-dir', str(image_folder), '--model', 'test_resnet', '--device', 'cpu'], parser=parser)
    with pytest.raises(Stop):
        tune_script.tune(parser, args, given=set())
    assert calls == [torch.device('cpu')]


def test_critical_batch_warm_up_sets_the_flags(monkeypatch, image_folder):
    calls = spy_on_flags(monkeypatch, critical_batch)
    args, device = init_device(cpu_train_args(image_folder))
    with pytest.raises(Stop):
        critical_batch.measure_noise_scale(args, device, micro_batch=2)
    assert calls == [torch.device('cpu')]


def test_validate_sets_the_flags_for_its_device(monkeypatch, image_folder, tmp_path):
    validate_script = load_script('validate')
    calls = spy_on_flags(monkeypatch, validate_script)
    checkpoint = tmp_path / 'weights.pth'
    checkpoint.write_bytes(b'')  # never read: the spy stops the run first
    with pytest.raises(Stop):
        validate_script.main([str(image_folder), '--model', 'test_resnet', '--checkpoint', str(checkpoint),
                              '--device', 'cpu'])
    assert calls == [torch.device('cpu')]


# ---- CUDA indices: a machine with two GPUs (torch.cuda.is_available and device_count replaced) --------------------

@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    for var in ('WORLD_SIZE', 'LOCAL_RANK', 'RANK', 'SLURM_NTASKS', 'SLURM_PROCID'):
        monkeypatch.delenv(var, raising=False)


def test_missing_cuda_index_is_an_error_naming_index_and_count(two_gpus):
    args = argparse.Namespace(device='cuda:5')
    with pytest.raises(DeviceError) as info:
        init_device(args)
    message = str(info.value)
    assert 'cuda:5' in message and 'no CUDA device 5' in message and 'device_count() is 2' in message
    assert '\n' not in message


def test_more_torchrun_processes_than_gpus_is_an_error_naming_the_local_rank(two_gpus, monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '4')
    monkeypatch.setenv('LOCAL_RANK', '3')
    with pytest.raises(DeviceError) as info:
        init_device(argparse.Namespace(device='cuda'))  # raised before any process group is set up
    message = str(info.value)
    assert 'local rank 3' in message and 'device_count() is 2' in message and 'at most 2 processes' in message


def test_train_py_with_a_missing_cuda_index_prints_one_line(two_gpus, monkeypatch, capsys, image_folder, tmp_path):
    train_script = load_script('train')
    monkeypatch.setattr(sys, 'argv', ['train.py', '--data-dir', str(image_folder), '--model', 'test_resnet',
                                      '--device', 'cuda:5', '--output', str(tmp_path / 'out')])
    monkeypatch.setattr(logging.root, 'handlers', [])
    assert train_script.main() == 1
    err = capsys.readouterr().err
    assert 'Traceback' not in err
    assert [line for line in err.splitlines() if 'error' in line] == [
        'train.py: error: --device cuda:5: there is no CUDA device 5, torch.cuda.device_count() is 2; pass an '
        'index below 2 (or cuda for the first)']


def test_validate_with_a_missing_cuda_index_is_a_validation_error(two_gpus):
    with pytest.raises(ValidationError, match=r'no CUDA device 5, torch.cuda.device_count\(\) is 2'):
        resolve_device('cuda:5')


def test_validate_on_cuda_n_makes_it_the_current_device(two_gpus, monkeypatch):
    chosen = []

    def set_device(device):  # the real one needs the GPU
        chosen.append(torch.device(device))
        raise Stop

    monkeypatch.setattr(torch.cuda, 'set_device', set_device)
    with pytest.raises(Stop):
        resolve_device('cuda:1')
    assert chosen == [torch.device('cuda', 1)]


def test_amp_check_runs_on_the_asked_gpu_not_gpu_0(monkeypatch):
    made_on = []
    real_ones = torch.ones

    def ones(*size, device=None, **kwargs):  # there is no GPU to make the tensor on: note where it was asked
        if device is None or torch.device(device).type == 'cpu':
            return real_ones(*size, device=device, **kwargs)
        made_on.append(torch.device(device))
        raise RuntimeError('no CUDA device here')

    monkeypatch.setattr(torch, 'ones', ones)
    choice = amp_mod.resolve_amp(torch.device('cuda', 1), True, 'bfloat16')
    assert not choice.enabled  # neither dtype could be checked on this machine
    assert made_on and all(d == torch.device('cuda', 1) for d in made_on)


def test_tune_batch_nproc_beyond_the_gpus_is_refused_before_torchrun(two_gpus, capsys):
    tune_script = load_script('tune_batch')
    assert tune_script.main(['--model', 'test_resnet', '--device', 'cuda', '--nproc', '3']) == 1
    err = capsys.readouterr().err.strip()
    assert err == ('tune_batch.py: error: --device cuda: local rank 2 trains on CUDA device 2, but '
                   'torch.cuda.device_count() is 2; start at most 2 processes per node')
