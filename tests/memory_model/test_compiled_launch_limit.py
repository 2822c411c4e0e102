"""The compiled step's launch cap: under torch 2.9.1 a compiled (channels-last) depthwise convolution whose input
reaches 2**31 - 1 elements runs on PyTorch's 32-bit kernel, and does not run."""
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from timm_ext.memory_model.cards import find_card
from timm_ext.memory_model.inductor_capture import compiling_for_trace, inductor_backend
from timm_ext.memory_model.kernel_limits import COMPILED_TENSOR, CONVOLUTION, KernelSizes, launch_limit
from timm_ext.memory_model.versions import RELEASES

B5_448_PER_SAMPLE = 144 * 224 * 224  # efficientnet_b5 at 448 px: its first stage-2 depthwise input, the largest
V112, V291_CU128, V291_CU130, V2141 = RELEASES


def _b5_stage2(compiled: bool) -> dict:
    """Per sample, what KernelSizes records for efficientnet_b5's first stage-2 depthwise convolution as the eager
    NCHW tables ran it (float16, contiguous, 3x3 stride 2), in a compiled trace or not."""
    sizes = {f'depthwise contiguous float16 other-shape {q}': B5_448_PER_SAMPLE if q == 'input' else
             B5_448_PER_SAMPLE // 4 for q in ('input', 'output')}
    return {**sizes, COMPILED_TENSOR: B5_448_PER_SAMPLE} if compiled else sizes


def test_a_compiled_depthwise_convolution_is_capped_under_torch_2_9_1_at_the_rung_timms_dynamo_tables_ran():
    """aten/src/ATen/native/Convolution.cpp, ConvParams::use_cudnn_depthwise at v2.9.1: a channels-last depthwise
    convolution past 32-bit indexing is refused by cuDNN above 9.10.0 (`cudnn_version > 91000`; both 2.9.1 wheels)
    and runs PyTorch's 32-bit kernel (DepthwiseConv2d.cu, conv_depthwise2d_forward_out), which cannot launch it;
    inductor runs convolutions channels-last. Evidence the rule reproduces: timm's results/benchmark-infer-amp-nchw-
    pt291-cu128-4090-dynamo.csv, -cu130-5090-dynamo.csv and -cu130-pro6000maxq-dynamo.csv run efficientnet_b5 at
    448 px at 256 compiled on the 24, 32 and 96 GB cards (eager 512, 768, 2048): 256 x 7,225,344 elements fits,
    384 x it does not. At v2.14.1 (`> 91000 && < 91500`) its cuDNN 9.24 takes it: no cap. The eager trace (no
    compiled tensor, contiguous) binds nothing under either: eager ran 2048."""
    for software in (V291_CU128, V291_CU130):
        batch, why = launch_limit(_b5_stage2(compiled=True), software)
        assert 256 <= batch < 384 and 'compiled channels-last depthwise' in why and '2**31' in why
        assert launch_limit(_b5_stage2(compiled=False), software) == (None, '')
    assert launch_limit(_b5_stage2(compiled=True), V2141) == (None, '')
    assert launch_limit({'depthwise contiguous float16 other-shape input': 2 ** 31 - 2, COMPILED_TENSOR: 1},
                        V291_CU130)[0] == 1  # within 32-bit indexing still runs


def test_the_compiled_graphs_largest_tensor_and_other_convolutions_cap_nothing():
    """Convolution.cpp, ConvParams::use_cudnn at v2.9.1: cuDNN refuses only a convolution that splitting the batch
    cannot bring within 32-bit indexing (needs_64bit_indexing_no_split, per sample). Evidence: the same tables ran
    matmul outputs past 2**31 elements compiled: beit_large_patch16_384 (577 x 4096 MLP activations per sample) at
    1024 on the RTX 5090, swinv2_cr_tiny_384 (3,981,312 attention scores per sample) at 1536 on the RTX Pro 6000."""
    assert launch_limit({COMPILED_TENSOR: 577 * 4096}, V291_CU130) == (None, '')
    assert launch_limit({CONVOLUTION: B5_448_PER_SAMPLE, COMPILED_TENSOR: B5_448_PER_SAMPLE}, V291_CU130) == (None, '')


def test_kernel_sizes_notes_a_convolutions_larger_tensor_input_or_output():
    """The rule's size: a strided convolution's input is its larger tensor, an expanding one's output."""
    def run():
        F.conv2d(torch.randn(2, 8, 32, 32), torch.randn(8, 8, 3, 3), stride=2, padding=1)
        F.conv2d(torch.randn(2, 4, 16, 16), torch.randn(24, 4, 1, 1))
    with FakeTensorMode():
        sizes = KernelSizes()
        with sizes:
            run()
    assert sizes.sizes[CONVOLUTION] == 2 * 8 * 32 * 32


def test_the_compiled_trace_notes_its_largest_buffer_under_the_name_launch_limit_reads():
    """timm_ext/memory_model/wrapper_run.py, WrapperRun.__call__: the largest buffer a generated wrapper allocates,
    noted into KernelSizes as COMPILED_TENSOR: what marks a trace as compiled for launch_limit. repeat, relu, * 2 and
    the sum fuse into one reduction kernel, so its output is the only buffer (the repeated tensor never exists)."""
    def fused(x):
        return (x.repeat(1, 4, 1, 1).relu() * 2).sum(1)
    with FakeTensorMode(allow_non_fake_inputs=True), compiling_for_trace():
        torch._dynamo.reset()
        compiled = torch.compile(fused, backend=inductor_backend(find_card('rtx4090')), dynamic=False)
        sizes = KernelSizes()
        with sizes:
            compiled(torch.randn(2, 3, 8, 8))
        torch._dynamo.reset()
    assert sizes.sizes == {COMPILED_TENSOR: 2 * 8 * 8}
