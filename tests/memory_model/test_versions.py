"""The software a plan models: read from the installed torch or named with --software; its own rules from 1.12 to 2.14,
the nearest covered release outside."""
import importlib.util

import pytest
import torch

from timm_ext.errors import UsageError
from timm_ext.memory_model.versions import (
    PINNED, RELEASES, Software, installed_software, modelled_software, parse_software, run_software,
    software_flag_problem,
)
from tests.conftest import REPO_ROOT


def test_installed_software_is_read_from_this_torch_without_a_cuda_context(monkeypatch):
    initialized = []
    monkeypatch.setattr(torch.cuda, '_lazy_init', lambda: initialized.append(True))  # what a device query would do
    software = installed_software()
    assert not initialized
    assert '.'.join(map(str, software.torch)) == torch.__version__.split('+')[0]
    if torch.version.cuda:
        assert '.'.join(map(str, software.cuda)) == torch.version.cuda
        assert software.cudnn_number == torch._C._cudnn.getVersionInt()


def test_cudnn_number_follows_cudnn_h():
    """cudnn.h's CUDNN_VERSION: major x 1000 before cuDNN 9, major x 10000 from it."""
    assert Software((1, 12, 1), (11, 3), (8, 3, 2)).cudnn_number == 8302
    assert Software((2, 14, 1), (13, 0), (9, 24, 0)).cudnn_number == 92400
    assert Software((2, 14, 1), None, None).cudnn_number == 0


def test_the_pin_is_covered_and_requirements_name_it():
    pinned = (REPO_ROOT / 'requirements.txt').read_text()
    assert f"torch=={'.'.join(map(str, PINNED.torch))}" in pinned
    assert all(modelled_software(release) == (release, '') for release in RELEASES)


@pytest.mark.parametrize('spec,expected', [
    ('torch=2.9.1', Software((2, 9, 1), (12, 8), (9, 10, 2))),  # the first covered CUDA of that torch
    ('torch=2.9.1,cuda=13.0', Software((2, 9, 1), (13, 0), (9, 13, 0))),
    (' cuda=11.3 , torch=1.12.1 ', Software((1, 12, 1), (11, 3), (8, 3, 2))),
    ('torch=2.14.1,cuda=12.6,cudnn=9.10', Software((2, 14, 1), (12, 6), (9, 10, 0))),
    ('torch=2.6', Software((2, 6, 0), None, None)),  # no covered release: nothing filled in
])
def test_parse_software(spec, expected):
    assert parse_software(spec) == expected


@pytest.mark.parametrize('spec,words', [
    ('cuda=12.8', 'names no torch'), ('torch=2.9.1,rocm=6.0', "'rocm=6.0' is not"), ('torch=two', 'not a version'),
    ('torch=2.x', "'2.x' is not a version"), ('torch=2.9.1,cudnn=9.15.0rc', 'not a version'),
])
def test_bad_software_is_one_line_naming_the_fix(spec, words):
    with pytest.raises(UsageError, match=words) as error:
        parse_software(spec)
    assert 'e.g. --software torch=' in str(error.value) and '\n' not in str(error.value)


def test_software_flag_needs_a_cuda_estimate():
    assert 'needs --estimate' in software_flag_problem('torch=2.9.1', 'cuda', estimate=False)
    assert '--device cuda' in software_flag_problem('torch=2.9.1', 'cpu', estimate=True)
    assert software_flag_problem('torch=2.9.1', 'cuda:1', estimate=True) is None
    assert software_flag_problem(None, 'cpu', estimate=False) is None


@pytest.mark.parametrize('asked,torch_used', [((1, 11, 0), (1, 12, 1)), ((3, 1, 0), (2, 14, 1)), ((2, 15, 0), (2, 14, 1))])
def test_only_a_torch_outside_the_span_is_planned_with_the_nearest_release_and_said(asked, torch_used):
    modelled, note = modelled_software(Software(asked, (12, 4), (9, 1, 0)))
    assert modelled.torch == torch_used
    assert modelled.cuda == (12, 4) and modelled.cudnn == (9, 1, 0), 'the run\'s own CUDA and cuDNN are kept'
    assert f"torch {'.'.join(map(str, asked))} is outside the releases the model's rules cover (1.12 to 2.14)" in note
    assert f"nearest covered release, torch {'.'.join(map(str, torch_used))}" in note


@pytest.mark.parametrize('asked', [(1, 13, 1), (2, 1, 2), (2, 4, 0), (2, 6, 0), (2, 9, 0), (2, 11, 0), (2, 13, 1)])
def test_a_torch_inside_the_span_keeps_its_own_rules_and_names_its_assumptions(asked):
    modelled, note = modelled_software(Software(asked, (12, 4), (9, 1, 0)))
    assert modelled == Software(asked, (12, 4), (9, 1, 0))
    assert 'nearest' not in note and 'outside' not in note
    assert 'assumed' in note  # every one of these lies in some change's window (release_history.assumed_changes)


def test_unknown_cuda_and_cudnn_come_from_the_release_and_are_said():
    modelled, note = modelled_software(Software((2, 9, 1), None, None))
    assert modelled == Software((2, 9, 1), (12, 8), (9, 10, 2))
    assert 'CUDA 12.8 and cuDNN 9.10.2 assumed' in note and 'not covered' not in note


@pytest.fixture
def torch_2_6(monkeypatch):
    """This process's torch claims to be 2.6.0+cu124 with cuDNN 9.1.0 (only 2.14.1 installs here)."""
    monkeypatch.setattr(torch, '__version__', '2.6.0+cu124')
    monkeypatch.setattr(torch.version, 'cuda', '12.4')
    monkeypatch.setattr(torch._C._cudnn, 'getRuntimeVersion', lambda: (9, 1, 0))


def test_run_software_says_what_it_modelled(torch_2_6):
    modelled, line = run_software(None)
    assert modelled == Software((2, 6, 0), (12, 4), (9, 1, 0))
    assert line.startswith('Software modelled: torch 2.6.0, CUDA 12.4, cuDNN 9.1.0 (installed here: torch 2.6.0')
    assert 'flash-v2 assumed with (it changed between torch 2.0.0 and 2.9.1; taken as 2.2.0)' in line
    _, named = run_software('torch=2.14.1')
    assert named == 'Software modelled: torch 2.14.1, CUDA 13.0, cuDNN 9.24.0 (named by --software; the model ' \
                    'covers it).'


def test_a_plan_names_the_faked_torch_and_the_release_used_instead(torch_2_6, capsys):
    spec = importlib.util.spec_from_file_location('validate_script_versions', REPO_ROOT / 'validate.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.setup_default_logging = lambda: None
    plan = ['--model', 'test_resnet', '--img-size', '32', '--num-classes', '3', '--device', 'cuda', '--amp',
            '--gpu', 'rtx4090', '--estimate']
    assert module.main(plan) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith('Software modelled:'))
    assert 'torch 2.6.0' in line and 'rules of torch' not in line
    assert "torch 2.6.0, CUDA 12.4, cuDNN 9.1.0's rules" in out  # the assumptions name the rules applied
    assert module.main(plan + ['--software', 'torch=2.14.1']) == 0
    assert 'Software modelled: torch 2.14.1, CUDA 13.0, cuDNN 9.24.0 (named by --software' in capsys.readouterr().out


def test_a_release_without_sdpa_traces_timm_attention_unfused():
    """torch 1.12.1 has no F.scaled_dot_product_attention (kernels_attention.sdpa_available): timm ran its own
    matmul-softmax-matmul there, so the trace builds the model unfused; 2.14.1 records its fused attention calls."""
    from timm_ext.memory_model.estimate import estimate_memory
    from timm_ext.train.args import parse_args
    args, _ = parse_args(['--model', 'test_vit', '--img-size', '32', '--num-classes', '3', '--device', 'cuda', '--amp'])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    attention = {}
    for spec in ('torch=1.12.1', 'torch=2.14.1'):
        args.software = spec
        estimate = estimate_memory(args, 'cuda', batches=(4, 8), step_kind='validate')
        attention[spec] = [name for name in estimate.kernel_sizes if name.startswith('attention')]
    assert attention['torch=1.12.1'] == [] and attention['torch=2.14.1']
