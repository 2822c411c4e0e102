"""Each versioned rule on both sides of the release where it changed (release_history), and a plan for torches the
model has no wheel of: the file, the pull request and the two releases are named in each test."""
import pytest
import torch.nn.functional as F

from timm_ext.memory_model.allocator_releases import has_expandable_segments
from timm_ext.memory_model.autocast_casts import caches_weights, cuda_float32_functions
from timm_ext.memory_model.cards import find_card
from timm_ext.memory_model.estimate import estimate_memory
from timm_ext.memory_model.kernel_limits import depthwise_route
from timm_ext.memory_model.kernels import cublaslt_unified
from timm_ext.memory_model.kernels_attention import (
    attention_allocations, cuda_attention_backend, math_in_float32, sdpa_available,
)
from timm_ext.memory_model.release_history import CHANGES, assumed_changes, in_force
from timm_ext.memory_model.versions import Software, parse_software, run_software
from timm_ext.train.args import parse_args


def _args(model: str, size: int, software: str, gpu: str, *extra: str):
    args, _ = parse_args(['--model', model, '--img-size', str(size), '--device', 'cuda', '--amp', *extra])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    args.gpu, args.software = gpu, software
    return args


def _plan(model: str, size: int, software: str, gpu: str, *extra: str, batches=(2, 4)):
    """validate.py's forward planned on `gpu` under `software`: (the estimate, the largest batch on the whole card)."""
    estimate = estimate_memory(_args(model, size, software, gpu, *extra), 'cuda', batches=batches,
                               step_kind='validate')
    usable = find_card(gpu).allocator_bytes_for(estimate.device.software)
    return estimate, estimate.largest_batch(usable)


def test_every_change_names_its_source_and_an_unpinned_one_its_window():
    for change in CHANGES:
        assert change.source and change.evidence and change.library in ('torch', 'cudnn')
        if change.window is not None:
            low, high = change.window
            assert low < change.since <= high, change.key


def test_depthwise_kernel_raises_up_to_2_8_and_cudnn_takes_it_from_2_9():
    """aten/src/ATen/native/Convolution.cpp, use_cudnn_depthwise; pytorch#153101 and #156140 (assumed first in
    v2.9.0), read in the v2.9.1 wheel against v1.12.1's (pytorch#155225: the native kernel raised up to v2.8.x).

    efficientnet_b3 at 320 px on an RTX 4090, AMP, contiguous: its stride-2 depthwise convolution over 144 x 160 x 160
    (3,686,400 elements a sample) is not cuDNN's float16 shape. Under torch 2.4 it takes PyTorch's 32-bit kernel, which
    raises from 583 samples (a batch that raises does not run: decay stops at 512); under 2.9.1 with its wheel's cuDNN
    9.10.2 cuDNN takes it, and only memory binds."""
    old, old_batch = _plan('efficientnet_b3', 320, 'torch=2.4.0', 'rtx4090')
    new, new_batch = _plan('efficientnet_b3', 320, 'torch=2.9.1,cuda=12.8', 'rtx4090')
    assert old.launch_limit[0] == (2 ** 31 - 2) // (144 * 160 * 160) == 582
    assert "PyTorch's 32-bit kernel" in old.launch_limit[1] and 'torch 2.4.0' in old.launch_limit[1]
    assert old_batch <= 582 < new_batch and new.launch_limit == (None, '')


def test_cudnn_version_decides_the_depthwise_route_under_one_torch():
    """Convolution.cpp use_cudnn_depthwise under torch 2.9.1 (pytorch#134890: cuDNN 9.3+ takes 64-bit convolutions;
    #163171: channels-last refused above 9.10.0) and 2.10 (#168364, assumed: allowed again from cuDNN 9.15)."""
    specs = ('torch=2.9.1,cuda=12.8,cudnn=9.2.1', 'torch=2.9.1,cuda=12.8,cudnn=9.15.0',
             'torch=2.10.0,cuda=12.8,cudnn=9.13.0', 'torch=2.10.0,cuda=12.8,cudnn=9.15.0')
    channels_last = [depthwise_route(parse_software(spec), True, half=True, cudnn_shape=False, fits=False)
                     for spec in specs]
    assert channels_last == ['native', 'native', 'native', 'cudnn']
    contiguous = [depthwise_route(parse_software(spec), False, True, False, False)
                  for spec in ('torch=2.9.1,cuda=12.8,cudnn=9.2.1', 'torch=2.9.1,cuda=12.8,cudnn=9.15.0')]
    assert contiguous == ['native', 'cudnn']
    named, line = run_software('torch=2.9.1,cuda=12.8,cudnn=9.15.0')
    assert named.cudnn == (9, 15, 0) and 'cuDNN 9.15.0' in line  # the run's own cuDNN, not the wheel's


def test_vit_base_384_runs_unfused_under_1_13_and_fused_from_2_0_on_an_rtx3090():
    """torch/nn/functional.py: scaled_dot_product_attention is public from v2.0.0 (absent in the v1.12.1 wheel, and in
    v1.13's functional.py); under v2.1.0 flash-attention 1 runs head size 64 on sm86 (sdp_utils.cpp).

    vit_base_patch16_384 on an RTX 3090: timm's unfused attention keeps batch x 12 x 577 x 577 scores; the fused call
    does not, so 2.1 fits a larger batch than 1.13."""
    old, old_batch = _plan('vit_base_patch16_384', 384, 'torch=1.13.1', 'rtx3090')
    new, new_batch = _plan('vit_base_patch16_384', 384, 'torch=2.1.2', 'rtx3090')
    assert not [k for k in old.kernel_sizes if k.startswith('attention')]
    assert [k for k in new.kernel_sizes if k.startswith('attention')]
    assert cuda_attention_backend('torch.float16', 64, 64, 577, True, False, False, False, (8, 6), {},
                                  parse_software('torch=2.1.2')) == 'flash'
    assert new_batch > old_batch


def test_math_path_upcasts_half_inputs_from_2_5():
    """aten/src/ATen/native/transformers/attention.cpp, _scaled_dot_product_attention_math; pytorch#128922 and
    #135964 (both merged before the v2.5.0 branch cut; v2.4.x computes in the inputs' dtype). A 3-d call (NesT,
    Twins: no fused kernel takes it) holds float32 scores from 2.5, float16 ones before."""
    signature, numbers = 'attention forward torch.float16 3-d unmasked inference', [64, 4, 196, 196, 32, 32]
    held = {}
    for spec in ('torch=2.4.1', 'torch=2.5.0'):
        software = parse_software(spec)
        assert cuda_attention_backend('torch.float16', 32, 32, 196, False, False, False, False, (8, 9), {},
                                      software) == 'math'
        held[spec] = dict((key, size) for size, _, key in attention_allocations(signature, numbers, (8, 9), {},
                                                                                  software))
    assert not math_in_float32(parse_software('torch=2.4.1')) and math_in_float32(parse_software('torch=2.5.0'))
    assert held['torch=2.5.0']['math attention scores'] == 2 * held['torch=2.4.1']['math attention scores']
    assert held['torch=2.5.0']['math attention operands'] > 2 * held['torch=2.4.1']['math attention operands']


def test_autocast_weight_cache_under_inference_mode_until_2_9_and_not_from_2_10():
    """aten/src/ATen/autocast_mode.cpp cached_cast; pytorch#165068 (assumed first in v2.10.0; the v2.9.1 behaviour
    is a stored autocast_mode.cpp without the test, v2.14.1's is measured here). validate.py's forward runs
    inference_mode: resnet18's half-precision weight copies (11.7 M parameters, 23 MB) are held for the whole forward
    under 2.9.1 and one at a time under 2.10, so 2.10's peak at batch 1 is lower by most of them."""
    assert caches_weights(parse_software('torch=2.9.1')) and not caches_weights(parse_software('torch=2.10.0'))
    assert caches_weights(parse_software('torch=2.14.1'), inference_mode=False)  # a no_grad forward, or training
    old, _ = _plan('resnet18', 32, 'torch=2.9.1,cuda=12.8', 'rtx4090')
    new, _ = _plan('resnet18', 32, 'torch=2.10.0,cuda=12.8', 'rtx4090')
    half_weights = 11_689_512 * 2
    assert 0.5 * half_weights < old.peak(1) - new.peak(1) < 1.1 * half_weights


@pytest.mark.parametrize('torch_version', ['1.13.1', '2.1.2', '2.4.0', '2.11.0'])
def test_a_model_planned_at_four_uncovered_releases_uses_the_rules_in_force_there(torch_version):
    """test_vit planned under four torches the model has no wheel of: each with its own rules, each assumption named."""
    software, line = run_software(f'torch={torch_version}')
    estimate, batch = _plan('test_vit', 32, f'torch={torch_version}', 'rtx4090', '--num-classes', '3')
    version = software.torch
    assert software.torch == tuple(map(int, torch_version.split('.')))  # not the nearest covered release
    assert f'torch {torch_version}' in estimate.device.software_line and batch > 0
    fused = bool([k for k in estimate.kernel_sizes if k.startswith('attention')])
    expected = {
        'sdpa': version >= (2, 0, 0), 'fused in the trace': version >= (2, 0, 0),
        'math float32': version >= (2, 5, 0), 'expandable segments': version >= (2, 1, 0),
        'weight cache under inference_mode': version < (2, 10, 0),
        '64-bit depthwise to cuDNN': version >= (2, 9, 0), 'cuBLASLt unified': version >= (2, 10, 0),
        'rms_norm in float32': version >= (2, 10, 0),
    }
    found = {
        'sdpa': sdpa_available(software), 'fused in the trace': fused, 'math float32': math_in_float32(software),
        'expandable segments': has_expandable_segments(software),
        'weight cache under inference_mode': caches_weights(software),
        '64-bit depthwise to cuDNN': depthwise_route(software, False, True, False, fits=False) == 'cudnn',
        'cuBLASLt unified': cublaslt_unified({}, software), 'rms_norm in float32': F.rms_norm in
        cuda_float32_functions(software),
    }
    assert found == expected
    for note in assumed_changes(software):  # every assumed side is in the plan's line
        assert note in line
    assert "default wheel, as recalled" in line  # the CUDA and cuDNN it was not told


def test_in_force_reads_the_library_that_decides():
    cudnn_change = next(change for change in CHANGES if change.library == 'cudnn')
    assert not in_force(cudnn_change, Software((2, 14, 1), None, None))  # no cuDNN: no cuDNN behaviour
    assert in_force(cudnn_change, Software((1, 12, 1), (11, 3), (9, 24, 0)))  # cuDNN's own version, whatever torch
