"""The kernels' launch limits against the sources they were read from: torch 2.14.1 where a test names no release
(`versions.PINNED`, `launch_limit`'s default), each covered release where the rule differs."""
import json

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from timm_ext.memory_model.kernel_limits import KernelSizes, as_channels_last, depthwise_route, launch_limit
from timm_ext.memory_model.versions import RELEASES, Software

MOST = 2 ** 31 - 2  # canUse32BitIndexMath: a tensor fits 32-bit indexing below INT32_MAX elements


def _per_sample(run, batch: int, dtype=torch.float16) -> dict:
    """What `KernelSizes` records while `run` runs on fake tensors under `dtype` autocast, per sample."""
    with FakeTensorMode():
        sizes = KernelSizes()
        with sizes, torch.autocast('cpu', dtype=dtype):
            run()
    return {kind: size / batch for kind, size in sizes.sizes.items()}


def test_a_depthwise_convolution_that_keeps_its_size_never_limits_the_batch():
    """aten/src/ATen/native/Convolution.cpp, ConvParams::use_cudnn_depthwise: an input or weight past 32-bit indexing
    goes to cuDNN (>= 9.3, the wheel's 9.24), which has none of PyTorch's 2**31 limit; below it PyTorch's kernel
    (DepthwiseConv2d.cu, conv_depthwise2d_forward_out) sees an output no larger than the input. nasnetalarge, held at
    765 by the old 2**31 table rule, ran 1536-2047."""
    x = lambda: torch.randn(4, 64, 96, 96)
    for size, stride in ((7, 1), (3, 1), (5, 2)):
        conv = lambda: F.conv2d(x(), torch.randn(64, 1, size, size), padding=size // 2, stride=stride, groups=64)
        assert launch_limit(_per_sample(conv, 4, torch.bfloat16)) == (None, ''), (size, stride)
    permuted = lambda: F.conv2d(x().transpose(2, 3), torch.randn(64, 1, 7, 7), padding=3, groups=64)
    assert launch_limit(_per_sample(permuted, 4)) == (None, '')


def test_a_depthwise_output_larger_than_its_input_limits_the_batch_on_pytorchs_kernel_only():
    """aten/src/ATen/native/cuda/DepthwiseConv2d.cu, conv_depthwise2d_forward_out: TORCH_CHECK that input and output
    fit 32-bit indexing; Convolution.cpp, use_cudnn_depthwise routes on the input and weight only, so a channel
    multiplier's output crosses first. Channels-last always goes to cuDNN; a float16 contiguous one of 32 channels or
    more at stride 1 too (check_cudnn_depthwise_workload_with_filter)."""
    doubled = lambda: F.conv2d(torch.randn(4, 16, 96, 96), torch.randn(32, 1, 3, 3), padding=1, groups=16)
    batch, why = launch_limit(_per_sample(doubled, 4, torch.bfloat16))
    assert batch == MOST // (32 * 96 * 96) and 'depthwise' in why and '2**31' in why
    last = lambda: F.conv2d(torch.randn(4, 16, 96, 96).to(memory_format=torch.channels_last),
                            torch.randn(32, 1, 3, 3), padding=1, groups=16)
    assert launch_limit(_per_sample(last, 4, torch.bfloat16)) == (None, '')
    wide = lambda: F.conv2d(torch.randn(4, 32, 96, 96), torch.randn(64, 1, 3, 3), padding=1, groups=32)
    assert launch_limit(_per_sample(wide, 4, torch.float16)) == (None, '')
    assert launch_limit(_per_sample(wide, 4, torch.bfloat16))[0] == MOST // (64 * 96 * 96)  # only float16 qualifies


def test_reflection_padding_checks_its_forward_input_and_replication_padding_its_backward_gradient():
    """aten/src/ATen/native/cuda/ReflectionPad.cu, reflection_pad2d_out_template: canUse32BitIndexMath(input), no
    check in reflection_pad2d_backward_out_template; ReplicationPadding.cu,
    replication_pad2d_backward_out_cuda_template: the input and the output gradient (the installed libtorch_cuda.so
    calls canUse32BitIndexMath once and twice there, and not at all in the 2-d reflection backward)."""
    def reflect():
        x = torch.randn(2, 8, 16, 16, requires_grad=True)
        F.pad(x, (1, 1, 1, 1), mode='reflect').sum().backward()
    assert launch_limit(_per_sample(reflect, 2)) == (MOST // (8 * 16 * 16), launch_limit(_per_sample(reflect, 2))[1])

    def replicate():
        x = torch.randn(2, 8, 16, 16, requires_grad=True)
        F.pad(x, (1, 1, 1, 1), mode='replicate').sum().backward()
    batch, why = launch_limit(_per_sample(replicate, 2))
    assert batch == MOST // (8 * 18 * 18) and 'replicate backward' in why


def test_flash_attention_puts_the_batch_in_a_grid_dimension_of_65535_and_other_backends_do_not():
    """flash_attn/flash_fwd_launch_template.h, run_flash_fwd: dim3 grid(num_m_block, params.b, params.h); flash runs
    half-precision, unmasked, 4-d attention (sdp_utils.cpp, can_use_flash_attention). A masked call runs the
    memory-efficient kernel and a float32 one too (check_dtypes_flash_attention): maxvit's masked attention ran past
    65535 rows in timm's tables."""
    q = lambda: torch.randn(64, 3, 49, 32)  # 64 windows of one sample
    plain = _per_sample(lambda: F.scaled_dot_product_attention(q(), q(), q()), 1)
    assert launch_limit(plain)[0] == 1023 and '65536' in launch_limit(plain)[1]
    masked = _per_sample(lambda: F.scaled_dot_product_attention(q(), q(), q(), attn_mask=torch.zeros(49, 49)), 1)
    assert launch_limit(masked) == (None, '')
    with FakeTensorMode():
        sizes = KernelSizes()
        with sizes:  # float32: no autocast
            F.scaled_dot_product_attention(q(), q(), q())
    assert launch_limit(sizes.sizes) == (None, '')


V112, V291_CU128, V291_CU130, V2141 = RELEASES


def test_depthwise_routing_is_the_releases_use_cudnn_depthwise():
    """aten/src/ATen/native/Convolution.cpp, ConvParams::use_cudnn_depthwise, at v1.12.1, v2.9.1 and v2.14.1 (each
    wheel's libtorch_cpu.so disassembled; the stored sources agree): v1.12.1 has no 32-bit test (channels-last and the
    float16 cuDNN shape go to cuDNN, the rest to PyTorch's kernel); from v2.9.1 a tensor past 32-bit indexing goes to
    cuDNN 9.3+, except a channels-last one on cuDNN > 9.10.0 (v2.9.1) or 9.10.1-9.14 (v2.14.1)."""
    def route(software, channels_last, half=True, shape=True, fits=False):
        return depthwise_route(software, channels_last, half, shape, fits)
    # channels-last past 32-bit indexing: the releases differ
    assert route(V112, True) == 'cudnn'
    assert route(V291_CU128, True) == route(V291_CU130, True) == 'native'  # cuDNN 9.10.2 and 9.13.0: > 9.10.0
    assert route(V2141, True) == 'cudnn'  # cuDNN 9.24: outside 9.10.1-9.14
    assert route(Software((2, 14, 1), (13, 0), (9, 13, 0)), True) == 'native'
    assert route(Software((2, 9, 1), (12, 8), (9, 5, 0)), True) == 'cudnn'  # 9.3 to 9.10.0 took it under v2.9.1
    # contiguous past 32-bit indexing without the float16 cuDNN shape: PyTorch's kernel before 2.x's 9.3+ rule
    assert route(V112, False, half=False) == 'native'
    assert route(V291_CU128, False, half=False) == route(V2141, False, half=False) == 'cudnn'
    assert route(Software((2, 14, 1), (12, 1), (9, 2, 0)), False, half=False) == 'native'  # cuDNN before 9.3
    # within 32-bit indexing: the same in every release
    for software in RELEASES:
        assert route(software, True, fits=True) == route(software, False, fits=True) == 'cudnn'
        assert route(software, False, half=False, fits=True) == route(software, False, shape=False, fits=True) \
            == 'native'


def test_a_contiguous_depthwise_convolution_is_capped_by_its_input_under_torch_1_12_only():
    """Convolution.cpp, use_cudnn_depthwise at v1.12.1 (no 64-bit route) against v2.9.1 and v2.14.1 (cuDNN 9.3+
    takes an input past 32-bit indexing); DepthwiseConv2d.cu, conv_depthwise2d_forward_out checks its input and
    output (the v1.12.1 wheel's "Expected canUse32BitIndexMath(input) && canUse32BitIndexMath(output)"). A bfloat16
    convolution never has the float16 cuDNN shape: the RTX 3090 table's torch 1.12.1 ran these on PyTorch's kernel."""
    conv = lambda: F.conv2d(torch.randn(4, 64, 96, 96), torch.randn(64, 1, 7, 7), padding=3, groups=64)
    sizes = _per_sample(conv, 4, torch.bfloat16)
    batch, why = launch_limit(sizes, V112)
    assert batch == MOST // (64 * 96 * 96) and 'torch 1.12.1' in why and "32-bit kernel" in why
    assert launch_limit(sizes, V291_CU130) == launch_limit(sizes, V2141) == (None, '')


def test_a_channels_last_depthwise_input_past_2_31_fails_under_torch_2_9_1s_cudnn_and_not_2_14_1s():
    """Convolution.cpp, use_cudnn_depthwise at v2.9.1 (`cudnn_version > 91000` refuses a channels-last 64-bit
    depthwise convolution: both 2.9.1 wheels' cuDNN, 9.10.2 and 9.13.0) and v2.14.1 (`> 91000 && < 91500`: its 9.24
    takes it); refused, PyTorch's 32-bit kernel cannot launch it. Within 32-bit indexing channels-last always ran
    cuDNN, so an output larger than the input binds nothing."""
    x = lambda: torch.randn(4, 16, 96, 96).to(memory_format=torch.channels_last)
    doubled = lambda: F.conv2d(x(), torch.randn(32, 1, 3, 3), padding=1, groups=16)
    sizes = _per_sample(doubled, 4)
    for software in (V291_CU128, V291_CU130):
        batch, why = launch_limit(sizes, software)
        assert batch == MOST // (16 * 96 * 96) and "channels-last depthwise convolution's input" in why
        assert str(software) in why
    assert launch_limit(sizes, V2141) == launch_limit(sizes, V112) == (None, '')
    # a contiguous run's sizes as a channels-last run records them (the saver channels-last)
    contiguous = _per_sample(lambda: F.conv2d(torch.randn(4, 16, 96, 96), torch.randn(32, 1, 3, 3), padding=1,
                                              groups=16), 4)
    assert as_channels_last(contiguous) == sizes


def test_flash_attentions_grid_limit_follows_the_releases_backend_choice():
    """aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, select_sdp_backend and check_prefer_cudnn_attention:
    v1.12.1 has no scaled_dot_product_attention (torch/nn/functional.py of its wheel); v2.9.1 and v2.14.1 run flash
    on sm120; on sm90 v2.14.1 prefers cuDNN, whose check_cudnn_tensor_shapes refuses more than 65535 rows (flash runs
    them, and its grid cannot), while the v2.9.1 cu130 build prefers cuDNN and has no such check."""
    q = lambda: torch.randn(64, 3, 49, 32)  # 64 windows of one sample
    plain = _per_sample(lambda: F.scaled_dot_product_attention(q(), q(), q()), 1)
    assert launch_limit(plain, V112) == (None, '')
    for software in (V291_CU128, V291_CU130, V2141):
        batch, why = launch_limit(plain, software)
        assert batch == 1023 and '65536' in why and str(software) in why
    assert launch_limit(plain, V2141, (9, 0), {})[0] == 1023
    assert launch_limit(plain, V291_CU130, (9, 0), {}) == (None, '')
    assert launch_limit(plain, V291_CU128, (9, 0), {})[0] == 1023  # built against cuDNN 9.8: never prefers it


def test_the_trace_records_version_neutral_facts_as_json():
    """What KernelSizes records decides no route (the trace runs once, with torch 2.14.1, and is replayed for every
    release): a depthwise convolution's layout, dtype and float16 cuDNN shape (Convolution.cpp,
    check_cudnn_depthwise_workload_with_filter: 32+ channels, a 3x3 filter at stride 1) with its input and output
    elements, and an attention call's dtype, rank, mask, mode, head sizes and keys with its rows."""
    def run():
        F.conv2d(torch.randn(2, 32, 16, 16), torch.randn(64, 1, 3, 3), padding=1, groups=32)
        q = torch.randn(2, 3, 49, 32)
        F.scaled_dot_product_attention(q, q, q)
    sizes = _per_sample(run, 2)
    assert sizes == {'depthwise contiguous float16 cudnn-shape input': 32 * 16 * 16,
                     'depthwise contiguous float16 cudnn-shape output': 64 * 16 * 16,
                     'depthwise contiguous float16 cudnn-shape grown': 64 * 16 * 16,
                     'convolution': 64 * 16 * 16,
                     'attention torch.float16 4-d unmasked inference 32 32 49': 1}
    assert json.loads(json.dumps(sizes)) == sizes
