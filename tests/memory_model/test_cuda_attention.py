"""scaled_dot_product_attention on CUDA: the backend a torch release picks for the card, and what it holds beyond the
CPU flash op the trace ran, each against the source it was read from (torch 2.14.1 where a test names no release)."""
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from timm_ext.memory_model.events import EventLog
from timm_ext.memory_model.kernels import cuda_allocations
from timm_ext.memory_model.kernels_attention import (attention_allocations, cuda_attention_backend, cudnn_preferred,
                                                     sdpa_available)
from timm_ext.memory_model.replay import UNLIMITED, ReplayConfig, replay
from timm_ext.memory_model.versions import RELEASES, Software

HALF, BF16, FLOAT = 'torch.float16', 'torch.bfloat16', 'torch.float32'


def _backend(cc, dtype=HALF, head=64, masked=False, four_d=True, training=False, environ=None, head_v=None,
             software=None):
    return cuda_attention_backend(dtype, head, head_v or head, 197, four_d, masked, False, training, cc,
                                  environ if environ is not None else {}, software)


def _attention_ops(run, cc=(12, 0)):
    """The attention events of `run` on fake tensors: [(signature, where, numbers, allocations on card `cc`)]."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        log = EventLog([], [], {})
        with log:
            run()
        log.remove_hooks()
    ops = [(log.names[e[1]], log.names[e[2]], e[3:]) for e in log.events if e[0] == 'o']
    return [(sig, where, numbers, list(cuda_allocations(sig, numbers, where.startswith('backward'), cc, {})))
            for sig, where, numbers in ops if sig.startswith('attention')]


def test_cudnn_attention_runs_first_on_compute_capability_9_and_10_unless_deprioritized():
    """aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, check_prefer_cudnn_attention and priority_order: cuDNN
    before flash on majors 9 and 10 with cuDNN newer than 9.15.0 (the wheel's 9.24), unless
    TORCH_CUDNN_SDPA_DEPRIORITIZED is "1"; elsewhere flash, memory-efficient, math, then cuDNN."""
    assert _backend((9, 0)) == _backend((10, 0)) == 'cudnn'
    assert _backend((9, 0), environ={'TORCH_CUDNN_SDPA_DEPRIORITIZED': '1'}) == 'flash'
    assert _backend((8, 0)) == _backend((8, 9)) == _backend((12, 0)) == 'flash'
    assert _backend(None) == 'flash'  # unknown: the newest generation of the named cards (sm120)


def test_flash_needs_half_precision_sm80_and_no_mask_and_memory_efficient_takes_the_rest_it_can_align():
    """sdp_utils.cpp: check_flash_attention_hardware_support ([sm80, sm121]), check_dtypes_flash_attention,
    check_for_attn_mask; check_mem_efficient_hardware_support ([sm50, sm121], bfloat16 from sm80) and
    check_head_dim_size_mem_efficient (minimum_gemm_alignment: 8 for half, 4 for float32 from sm80)."""
    assert _backend((7, 5)) == 'efficient'  # a T4: no flash
    assert _backend((7, 5), dtype=BF16) == 'math'  # and no bfloat16 memory-efficient kernel
    assert _backend((12, 0), masked=True) == 'efficient'
    assert _backend((12, 0), dtype=FLOAT) == 'efficient'
    assert _backend((12, 0), head=36, masked=True) == 'math'  # 36 is no multiple of 8
    assert _backend((12, 0), head=36) == 'flash'
    assert _backend((8, 0), head=320) == 'efficient'  # flash stops at 256


def test_every_fused_kernel_takes_4d_inputs_only_and_flash_refuses_wide_heads_in_training_on_sm86_to_89():
    """sdp_utils.cpp, check_tensor_shapes ("All fused kernels requires query, key and value to be 4 dimensional") and
    check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120 (the installed binary: major 8 with minor
    6-9, or major 12 with minor 0-1)."""
    assert _backend((12, 0), four_d=False) == _backend((9, 0), four_d=False) == 'math'
    assert _backend((8, 6), head=200, training=True) == _backend((12, 0), head=200, training=True) == 'efficient'
    assert _backend((8, 0), head=200, training=True) == 'flash'


def test_flash_attention_backward_holds_float32_accumulators_for_dq_and_the_softmax_sums():
    """aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_bwd: dq_accum is float32 batch x
    round_multiple(seq, 128) x heads x round_multiple(head_size, 32); softmax_d float32 batch x heads x seq rounded."""
    def attention():
        q = torch.randn(2, 3, 197, 64, dtype=torch.float16, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    ops = _attention_ops(attention)
    assert [where.startswith('backward') for _, where, _, _ in ops] == [False, True]
    assert ops[0][3] == []  # the forward saves what the CPU op saved
    (dq_accum, life, _), (softmax_d, _, _) = ops[1][3]
    assert life == 'op' and dq_accum == 4 * 2 * 256 * 3 * 64 and softmax_d == 4 * 2 * 3 * 256


def test_the_memory_efficient_backward_holds_a_float32_dq_accumulator():
    """aten/src/ATen/native/transformers/cuda/attention_backward.cu, _efficient_attention_backward: a workspace of
    p.workspace_size() bytes; mem_eff_attention/kernel_backward.h: kNeedsAccumGradQ (split keys from sm70), a float32
    accumulator per (batch, head) of the queries x head size in tiles (MEM_EFFICIENT_TILE, an assumption)."""
    def attention():
        q = torch.randn(2, 3, 197, 64, requires_grad=True)  # float32: memory-efficient on every card
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    ops = _attention_ops(attention)
    assert ops[0][3] == [] and ops[1][3] == [(4 * 2 * 3 * 256 * 64, 'op', 'efficient backward workspace')]


def test_the_math_path_keeps_its_float32_softmax_and_operands_for_the_backward_in_training():
    """aten/src/ATen/native/transformers/attention.cpp, _scaled_dot_product_attention_math: half inputs upcast
    (allow_fp16_bf16_reduction_math_sdp off), query and key scaled, then matmul, _safe_softmax and matmul, which
    autograd saves; the backward holds float32 gradients of the softmax and its input. 3-d inputs run it on CUDA."""
    rows, seq, head = 24, 256, 64

    def folded(grad: bool):
        q = torch.randn(rows, seq, head, dtype=torch.float16, requires_grad=grad)
        out = F.scaled_dot_product_attention(q, q, q)
        if grad:
            out.sum().backward()
    scores, operand = 4 * rows * seq * seq, 4 * rows * seq * head
    (_, _, _, inference), = _attention_ops(lambda: folded(False))
    assert [n for n, _, _ in inference] == [6 * operand, scores, scores]  # copies, scaled, value, output; scores
    assert {life for _, life, _ in inference} == {'op'}
    (_, _, _, forward), (_, _, _, backward) = _attention_ops(lambda: folded(True))
    assert forward[0] == (2 * operand + scores + operand, 'saved', 'math attention saved')
    assert backward[0] == (2 * scores + 4 * operand, 'op', 'math attention backward')
    assert backward[1] == (0, 'release', 'math attention saved')


def test_the_replay_holds_what_an_op_saved_until_its_backward_releases_it():
    """The 'saved' life (timm_ext.memory_model.kernels): held from the forward op to the latest 'release' of its key,
    as autograd frees an op's saved tensors when its backward has run (LIFO across layers)."""
    sig = 'attention forward torch.float16 3-d unmasked training'
    back = 'attention backward torch.float16 3-d unmasked training'
    names = [sig, back, 'block', 'backward node']
    numbers = [1, 24, 256, 256, 64, 64]
    events = [['o', 0, 2, *numbers], ['o', 0, 2, *numbers], ['o', 1, 3, *numbers], ['o', 1, 3, *numbers]]
    allocator = replay(dict(names=names, residents=[], events=events), UNLIMITED, ReplayConfig(iterations=2))
    assert allocator.allocated == 0
    saved = 4 * 24 * 256 * (3 * 64 + 256)
    assert allocator.peak_allocated >= 2 * saved


V112, V291_CU128, V291_CU130, V2141 = RELEASES


def test_scaled_dot_product_attention_exists_from_torch_2_only():
    """torch/nn/functional.py at v1.12.1 (its PyPI wheel): only the private _scaled_dot_product_attention that
    MultiheadAttention calls; v2.9.1 and v2.14.1 have F.scaled_dot_product_attention. A 1.12.1 trace that still holds
    the op is priced as the math path."""
    assert not sdpa_available(V112) and sdpa_available(V291_CU130) and sdpa_available(V2141) and sdpa_available()
    assert _backend((8, 0), software=V112) == 'math'
    numbers = [2, 3, 197, 197, 64, 64]
    sig = 'attention backward torch.float16 4-d unmasked training'
    assert [key for _, _, key in attention_allocations(sig, numbers, (8, 6), {}, V112)] == \
        ['math attention backward', 'math attention saved']
    assert [key for _, _, key in attention_allocations(sig, numbers, (8, 6), {}, V2141)] == \
        ['flash dq_accum', 'flash softmax_d']


def test_cudnn_attentions_preference_is_each_releases_check_prefer_cudnn_attention():
    """aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, check_prefer_cudnn_attention: v2.14.1 (installed
    libtorch_cuda.so, select_sdp_backend disassembled) majors 9 and 10, runtime cuDNN > 9.15.0, unless
    TORCH_CUDNN_SDPA_DEPRIORITIZED=1; v2.9.1 (stored source matching its wheel) sm90 and sm100 only (minor 0), a build
    against cuDNN 9.9+ (the PyPI cu128 wheel was built against 9.8.0: never; its select_sdp_backend never sets the
    order), unless TORCH_CUDNN_SDPA_PREFERRED=0. The tables' cards (sm89, sm120) never prefer it."""
    assert cudnn_preferred((10, 3), V2141, {}) and not cudnn_preferred((10, 3), V291_CU130, {})
    assert cudnn_preferred((9, 0), V291_CU130, {}) and not cudnn_preferred((9, 0), V291_CU128, {})
    assert not cudnn_preferred((9, 0), V291_CU130, {'TORCH_CUDNN_SDPA_PREFERRED': '0'})
    assert not cudnn_preferred((9, 0), V2141, {'TORCH_CUDNN_SDPA_DEPRIORITIZED': '1'})
    assert not cudnn_preferred((9, 0), Software((2, 14, 1), (12, 8), (9, 10, 2)), {})  # runtime cuDNN <= 9.15.0
    assert not any(cudnn_preferred(cc, software, {}) for cc in ((8, 9), (12, 0)) for software in RELEASES)
    assert not cudnn_preferred((9, 0), V112, {})
    assert _backend((9, 0), software=V291_CU130) == 'cudnn' and _backend((9, 0), software=V291_CU128) == 'flash'


def test_cudnn_attentions_head_size_and_batch_checks_per_release():
    """sdp_utils.cpp, check_cudnn_tensor_shapes: v2.9.1 head sizes up to 128, 256 on sm90 when built against cuDNN
    9.10+ (versionCuDNN), no batch check; v2.14.1 up to 256 and at most 65535 rows (max_cudnn_dim_size; the binary's
    "cuDNN SDPA does not support batch size or num_heads greater than"), above which flash runs."""
    assert _backend((9, 0), head=192, software=V291_CU130) == 'cudnn'
    assert _backend((10, 0), head=192, software=V291_CU130) == 'flash'  # 128 off sm90
    assert _backend((10, 0), head=192, software=V2141) == 'cudnn'
    assert cuda_attention_backend(HALF, 64, 64, 197, True, False, False, False, (9, 0), {}, V2141,
                                  rows=65536) == 'flash'
    assert cuda_attention_backend(HALF, 64, 64, 197, True, False, False, False, (9, 0), {}, V291_CU130,
                                  rows=65536) == 'cudnn'
