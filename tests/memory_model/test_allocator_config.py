"""The allocator options a user sets, read as torch 2.14.1 reads them (timm_ext.memory_model.allocator_config)."""
import json
import subprocess
import sys

import pytest

from timm_ext.errors import UsageError
from timm_ext.memory_model.allocator_config import AllocatorConfig, allocator_config, parse_allocator_conf

MiB = 1 << 20
# settings torch accepts or refuses, each for a rule of AllocatorConfig.h / AllocatorConfig.cpp / CUDAAllocatorConfig.cpp
SETTINGS = ['expandable_segments:True', 'expandable_segments:true', 'expandable_segments:1',
            'EXPANDABLE_SEGMENTS:True', ' max_split_size_mb : 64 , expandable_segments:True,', 'max_split_size_mb:19', 'max_split_size_mb:abc',
            'large_segment_size_mb:10', 'large_segment_size_mb:32,max_split_size_mb:24', 'max_non_split_rounding_mb:40',
            'roundup_power2_divisions:4', 'roundup_power2_divisions:3', 'roundup_power2_divisions:[256:1,512:2,>:4]',
            'roundup_power2_divisions:[3:1]', 'garbage_collection_threshold:0.6', 'garbage_collection_threshold:1.0',
            'pinned_num_register_threads:8,release_lock_on_cudamalloc:True', 'release_lock_on_cudamalloc:true',
            'foo:1', ',expandable_segments:True', 'per_process_memory_fraction:1.5']


def test_the_settings_torch_refuses_are_refused_and_the_ones_it_takes_are_read():
    """AllocatorConfig.h `ConfigTokenizer` (separators, white space dropped, `toBool` takes True/False only),
    AllocatorConfig.cpp `parseArgs` and its parse* checks, CUDAAllocatorConfig.cpp `parseArgs` (unknown keys): each
    setting is run through the installed torch's own parser (torch._C._accelerator_setAllocatorSettings, in a child
    so this process keeps its settings) and ours agrees."""
    script = ('import json, sys, torch\nok = []\nfor s in json.loads(sys.argv[1]):\n    try:\n'
              '        torch._C._accelerator_setAllocatorSettings(s)\n        ok.append(True)\n'
              '    except Exception:\n        ok.append(False)\nprint(json.dumps(ok))\n')
    done = subprocess.run([sys.executable, '-c', script, json.dumps(SETTINGS)], capture_output=True, text=True,
                          timeout=120)
    torch_takes = json.loads(done.stdout.strip().splitlines()[-1])
    for setting, takes in zip(SETTINGS, torch_takes):
        try:
            parse_allocator_conf(setting)
            ours = True
        except UsageError as e:
            assert 'not modelled' not in str(e), setting
            ours = False
        assert ours == takes, setting


def test_the_cuda_variable_wins_over_the_newer_one():
    """AllocatorConfig.cpp `AcceleratorAllocatorConfig::instance` (2.14.1: PYTORCH_CUDA_ALLOC_CONF, then
    PYTORCH_HIP_ALLOC_CONF, then PYTORCH_ALLOC_CONF, the first set is parsed; checked on the installed wheel, where a
    PYTORCH_ALLOC_CONF torch would refuse is not even read when PYTORCH_CUDA_ALLOC_CONF is set)."""
    assert allocator_config({}) == AllocatorConfig()
    both = allocator_config({'PYTORCH_ALLOC_CONF': 'expandable_segments:True',
                             'PYTORCH_CUDA_ALLOC_CONF': 'max_split_size_mb:64'})
    assert not both.expandable_segments and both.max_split_size == 64 * MiB
    assert both.variable == 'PYTORCH_CUDA_ALLOC_CONF'
    assert allocator_config({'PYTORCH_ALLOC_CONF': 'expandable_segments:true', 'PYTORCH_CUDA_ALLOC_CONF': ''}) == \
        AllocatorConfig(variable='PYTORCH_CUDA_ALLOC_CONF')  # an empty one is still the one read
    assert allocator_config({'PYTORCH_ALLOC_CONF': 'expandable_segments:True'}).expandable_segments


@pytest.mark.parametrize('setting, named', [
    ('expandable_segments:true', 'expandable_segments:true'),
    ('foo:1', "'foo'"),
    ('backend:cudaMallocAsync', 'backend:cudaMallocAsync is not modelled'),
    ('per_process_memory_fraction:0.5', 'per_process_memory_fraction:0.5 is not modelled'),
    ('throw_on_cudamalloc_oom:True', 'throw_on_cudamalloc_oom:True is not modelled'),
])
def test_a_refused_setting_is_one_line_naming_the_option(setting, named):
    """CUDAAllocatorConfig.h `getKeys` / CUDAAllocatorConfig.cpp `parseArgs`: options torch knows but the replay does
    not follow (another allocator backend, a second cap, another out-of-memory path) are refused, as are the ones
    torch refuses; the message names the variable and the option."""
    with pytest.raises(UsageError) as e:
        allocator_config({'PYTORCH_CUDA_ALLOC_CONF': setting})
    message = str(e.value)
    assert '\n' not in message and message.startswith('PYTORCH_CUDA_ALLOC_CONF=') and named in message


def test_options_without_effect_on_device_blocks_are_read_as_the_defaults():
    """CUDAAllocatorConfig.h `getKeys`: pinned host memory, the allocator's lock and graph capture change nothing an
    eager step places on the device; backend:native is the allocator modelled."""
    config = parse_allocator_conf('backend:native,pinned_use_cuda_host_register:True,graph_capture_record_stream_reuse:'
                                  'False,per_process_memory_fraction:1.0')
    assert config == AllocatorConfig(variable=config.variable, text=config.text)
