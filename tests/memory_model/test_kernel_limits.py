"""The kernels' launch limits against the torch 2.14.1 sources they were read from."""
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from timm_ext.memory_model.kernel_limits import KernelSizes, launch_limit

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
