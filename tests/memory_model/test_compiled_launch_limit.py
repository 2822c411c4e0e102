"""The compiled step's launch cap: a compiled convolution whose tensor reaches 2**31 elements does not run."""
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from timm_ext.memory_model import compiled_step
from timm_ext.memory_model.kernel_limits import COMPILED_TENSOR, CONVOLUTION, KernelSizes, launch_limit

B5_448_PER_SAMPLE = 144 * 224 * 224  # efficientnet_b5 at 448 px: its first stage-2 expansion, the largest tensor


def test_a_compiled_convolution_is_capped_at_the_rung_timms_dynamo_tables_ran_on_every_card():
    """Evidence, not a source: timm's results/benchmark-infer-amp-nchw-pt291-cu128-4090-dynamo.csv,
    -cu130-5090-dynamo.csv and -cu130-pro6000maxq-dynamo.csv. efficientnet_b5 at 448 px runs 256 compiled on the 24,
    32 and 96 GB cards (eager 512, 768, 2048): 256 x 7,225,344 elements fits 2**31, 384 x it does not. The same
    convolution in an eager trace (no compiled tensor noted) binds nothing: eager ran 2048."""
    batch, why = launch_limit({CONVOLUTION: B5_448_PER_SAMPLE, COMPILED_TENSOR: B5_448_PER_SAMPLE})
    assert 256 <= batch < 384 and 'convolution of the compiled graphs' in why and '2**31' in why
    assert launch_limit({CONVOLUTION: B5_448_PER_SAMPLE}) == (None, '')
    assert launch_limit({CONVOLUTION: 2 ** 31 - 1, COMPILED_TENSOR: 1})[0] == 1  # under 2**31 still runs


def test_the_compiled_graphs_largest_tensor_alone_caps_nothing():
    """Evidence, not a source: the same tables ran matmul outputs past 2**31 elements compiled: beit_large_patch16_384
    (577 x 4096 MLP activations per sample) at 1024 on the RTX 5090, swinv2_cr_tiny_384 (3,981,312 attention scores
    per sample) at 1536 on the RTX Pro 6000."""
    assert launch_limit({COMPILED_TENSOR: 577 * 4096}) == (None, '')


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


def test_the_compiled_trace_notes_its_largest_tensor_under_the_name_launch_limit_reads():
    """timm_ext/memory_model/compiled_step.py, BufferRun.__call__: each graph's largest tensor, fused ones included,
    noted into KernelSizes as compiled_step.COMPILED_TENSOR: what marks a trace as compiled for launch_limit."""
    assert compiled_step.COMPILED_TENSOR == COMPILED_TENSOR
    # an AOTAutograd graph returns a tuple
    graph = make_fx(lambda x: ((x.repeat(1, 4, 1, 1).relu() * 2).sum(1),))(torch.randn(2, 3, 8, 8))
    with FakeTensorMode():
        sizes = KernelSizes()
        with sizes:
            compiled_step.BufferRun(graph, 'cuda')([torch.randn(2, 3, 8, 8)])
    assert sizes.sizes == {COMPILED_TENSOR: 2 * 12 * 8 * 8}
