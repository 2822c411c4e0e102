"""timm_ext.amp: the AMP decision shared by train.py and validate.py."""
import pytest
import torch

from timm_ext import amp as amp_mod
from timm_ext.amp import resolve_amp

CPU = torch.device('cpu')


def _matmul_dtype(choice):
    with choice.autocast():
        a = torch.ones(2, 2)
        return (a @ a).dtype


def test_amp_off_is_a_no_op():
    choice = resolve_amp(CPU, False, 'float16')
    assert not choice.enabled and choice.dtype is None and not choice.use_grad_scaler
    assert _matmul_dtype(choice) == torch.float32
    assert 'not enabled' in choice.message


@pytest.mark.parametrize('name,dtype', [('float16', torch.float16), ('bfloat16', torch.bfloat16)])
def test_cpu_autocast_runs_the_asked_dtype_without_scaler(name, dtype):
    choice = resolve_amp(CPU, True, name)
    assert choice.dtype == dtype and choice.enabled
    assert not choice.use_grad_scaler  # loss scaling is for float16 on CUDA only
    assert _matmul_dtype(choice) == dtype
    assert name in choice.message


def test_cpu_without_float16_falls_back_to_bfloat16_and_says_so(monkeypatch):
    # this torch build runs float16 on CPU, so the unsupported case has to be simulated
    real = amp_mod._autocast_runs
    monkeypatch.setattr(amp_mod, '_autocast_runs', lambda dev, dt: dt != torch.float16 and real(dev, dt))
    choice = resolve_amp(CPU, True, 'float16')
    assert choice.dtype == torch.bfloat16
    assert _matmul_dtype(choice) == torch.bfloat16
    assert 'falling back to bfloat16' in choice.message


def test_no_runnable_dtype_turns_amp_off(monkeypatch):
    monkeypatch.setattr(amp_mod, '_autocast_runs', lambda dev, dt: False)
    choice = resolve_amp(CPU, True, 'bfloat16')
    assert not choice.enabled and _matmul_dtype(choice) == torch.float32
    assert 'without AMP' in choice.message


def test_unknown_dtype_name_is_a_value_error():
    with pytest.raises(ValueError, match='--amp-dtype'):
        resolve_amp(CPU, True, 'float8')
