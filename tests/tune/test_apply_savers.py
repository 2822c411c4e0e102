"""--apply-saver (timm_ext.tune.savers.apply_savers): expandable segments merged into the allocator setting torch
reads, and the savers that do not apply refused in one line."""
import os

import pytest

from timm_ext.errors import UsageError
from timm_ext.memory_model.allocator_config import allocator_config
from timm_ext.memory_model.allocator_releases import VARIABLES
from timm_ext.train.args import parse_args
from timm_ext.tune.savers import apply_savers


def run_args(*argv):
    args, _ = parse_args(['--model', 'test_vit', '--num-classes', '10', *argv])
    return args


@pytest.fixture
def environment(monkeypatch):
    """Set the allocator variables for one test, each restored (or removed again) after it."""
    def set_only(**values):
        for variable in VARIABLES:
            monkeypatch.setenv(variable, '')
            monkeypatch.delenv(variable)
        for variable, value in values.items():
            monkeypatch.setenv(variable, value)
    return set_only


@pytest.mark.parametrize('given, variable, expected', [
    ({}, 'PYTORCH_ALLOC_CONF', 'expandable_segments:True'),
    ({'PYTORCH_ALLOC_CONF': 'max_split_size_mb:64'}, 'PYTORCH_ALLOC_CONF',
     'max_split_size_mb:64,expandable_segments:True'),
    ({'PYTORCH_ALLOC_CONF': 'garbage_collection_threshold:0.6', 'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:False,'
      'roundup_power2_divisions:[256:1,>:4]'}, 'PYTORCH_CUDA_ALLOC_CONF',
     'roundup_power2_divisions:[256:1,>:4],expandable_segments:True'),
])
def test_expandable_segments_are_merged_into_the_setting_torch_reads(environment, given, variable, expected):
    """AllocatorConfig.cpp `AcceleratorAllocatorConfig::instance`: torch 2.14.1 reads the first of
    PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF, PYTORCH_ALLOC_CONF that is set, so the saver goes there, with the
    user's other options kept, and the plan made in this process reads it back."""
    environment(**given)
    _, notes = apply_savers(run_args('--device', 'cuda'), ['expandable-segments'])
    assert os.environ[variable] == expected
    assert f'{variable}={expected}' in notes[0]
    assert allocator_config().expandable_segments  # what the plan assumes is what the run gets
    for other, value in given.items():
        if other != variable:
            assert os.environ[other] == value


def test_expandable_segments_on_a_device_without_the_cuda_allocator_is_refused(environment):
    environment()
    with pytest.raises(UsageError, match=r'^--apply-saver expandable-segments: .* --device cpu does not use; drop it$'):
        apply_savers(run_args('--device', 'cpu'), ['expandable-segments'])
    assert 'PYTORCH_ALLOC_CONF' not in os.environ


def test_savers_that_set_the_same_flag_two_ways_are_refused():
    with pytest.raises(UsageError, match=r'^--apply-saver amp-float16 and --apply-saver amp-bfloat16 set --amp-dtype'):
        apply_savers(run_args('--device', 'cuda'), ['amp-bfloat16', 'amp-float16'])
    args, _ = apply_savers(run_args('--device', 'cuda'), ['amp-bfloat16', 'grad-checkpointing'])
    assert args.amp and args.amp_dtype == 'bfloat16' and args.grad_checkpointing


def test_a_user_setting_torch_refuses_is_reported_not_overwritten(environment):
    environment(PYTORCH_CUDA_ALLOC_CONF='expandable_segments:true')
    with pytest.raises(UsageError, match=r"^PYTORCH_CUDA_ALLOC_CONF='expandable_segments:true': torch 2.14.1 refuses"):
        apply_savers(run_args('--device', 'cuda'), 'expandable-segments')
    assert os.environ['PYTORCH_CUDA_ALLOC_CONF'] == 'expandable_segments:true'
