"""The compiled step's launch cap: a batch whose compiled graphs hold a tensor of 2**31 elements does not run."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from timm_ext.memory_model import compiled_step
from timm_ext.memory_model.kernel_limits import COMPILED_TENSOR, KernelSizes, launch_limit

B5_448_PER_SAMPLE = 144 * 224 * 224  # efficientnet_b5 at 448 px: its first stage-2 expansion, the largest tensor


def test_the_compiled_cap_is_the_rung_timms_dynamo_tables_ran_on_every_card():
    """Evidence, not a source: timm's results/benchmark-infer-amp-nchw-pt291-cu128-4090-dynamo.csv, -cu130-5090-dynamo
    and -cu130-pro6000maxq-dynamo.csv. efficientnet_b5 at 448 px runs 256 compiled on the 24, 32 and 96 GB cards
    (eager 512, 768, 2048): 256 x 7,225,344 elements fits 2**31, 384 x it does not. maxvit_tiny_tf_512 (2**24 per
    sample) runs 96, not 128: exactly 2**31 elements already fails."""
    batch, why = launch_limit({COMPILED_TENSOR: B5_448_PER_SAMPLE})
    assert 256 <= batch < 384 and 'compiled graphs' in why and '2**31' in why
    assert launch_limit({COMPILED_TENSOR: 2 ** 24})[0] == 2 ** 7 - 1
    assert launch_limit({COMPILED_TENSOR: 2 ** 31 - 1})[0] == 1  # one element under 2**31 still runs


def test_the_compiled_trace_notes_its_largest_tensor_under_the_rules_name():
    """timm_ext/memory_model/compiled_step.py, BufferRun.__call__: each graph's largest tensor, fused ones included,
    noted into KernelSizes as compiled_step.COMPILED_TENSOR, the name launch_limit's rule reads."""
    assert compiled_step.COMPILED_TENSOR == COMPILED_TENSOR
    # an AOTAutograd graph returns a tuple
    graph = make_fx(lambda x: ((x.repeat(1, 4, 1, 1).relu() * 2).sum(1),))(torch.randn(2, 3, 8, 8))
    with FakeTensorMode():
        sizes = KernelSizes()
        with sizes:
            compiled_step.BufferRun(graph, 'cuda')([torch.randn(2, 3, 8, 8)])
    per_sample = {kind: size / 2 for kind, size in sizes.sizes.items()}
    assert per_sample == {COMPILED_TENSOR: 12 * 8 * 8}
    assert launch_limit(per_sample)[0] == (2 ** 31 - 1) // (12 * 8 * 8)
