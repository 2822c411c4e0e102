"""CUDA's kernels in the event log: each rule against the source it was read from (torch 2.14), and what the replay
would miss without it."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from timm_ext.memory_model.events import EventLog
from timm_ext.memory_model.kernels import cublas_workspace_bytes, cuda_allocations

MiB = 1 << 20


def _logged(run, module: nn.Module = None):
    """The 'o' events of `run` traced on fake tensors, as (signature, where, numbers), and their CUDA allocations."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        module = module or nn.Identity()
        log = EventLog(module.parameters(), [], dict(module.named_modules()))
        with log:
            run(module)
        log.remove_hooks()
    ops = [(log.names[e[1]], log.names[e[2]], e[3:]) for e in log.events if e[0] == 'o']
    return ops, [list(cuda_allocations(sig, numbers, where.startswith('backward'))) for sig, where, numbers in ops]


def test_cublas_keeps_one_workspace_per_handle_and_the_backward_runs_on_its_own_thread():
    # aten/src/ATen/cuda/CublasHandlePool.cpp: the workspace is allocated through the caching allocator per
    # (handle, stream), and a handle is per thread; CUBLAS_WORKSPACE_CONFIG's default ":4096:8" on sm90, else
    # ":4096:2:16:8"
    assert cublas_workspace_bytes((9, 0)) == 32 * MiB and cublas_workspace_bytes((8, 6)) == 8 * MiB + 128 * 1024

    def train(fc):
        fc(torch.randn(8, 64, requires_grad=True)).sum().backward()
    ops, allocations = _logged(train, nn.Linear(64, 64))
    kept = {key for per_op in allocations for _, life, key in per_op if life == 'kept'}
    assert kept == {'cublas', 'cublas backward'}


def test_layer_norm_copies_a_permuted_input_in_the_forward_and_its_gradient_in_the_backward():
    # aten/src/ATen/native/cuda/layer_norm_kernel.cu: `input.expect_contiguous()` in both passes, `dY.contiguous()`
    # in the backward; timm's LayerNorm2d normalizes a permuted (channels-last view of a channels-first) tensor
    x = torch.randn(4, 32, 16, 16)
    nbytes = x.numel() * 4

    def channels_first(ln):
        y = torch.randn(4, 32, 16, 16, requires_grad=True)
        ln(y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).pow(2).sum().backward()
    ops, allocations = _logged(channels_first, nn.LayerNorm(32))
    forward, backward = [a for (sig, _, _), a in zip(ops, allocations) if 'layer_norm' in sig]
    assert [n for n, life, _ in forward] == [nbytes] and forward[0][1] == 'op'
    assert sum(n for n, _, _ in backward) == nbytes  # the permuted input again (its gradient comes contiguous)

    def contiguous(ln):
        ln(torch.randn(4, 16, 16, 32, requires_grad=True)).pow(2).sum().backward()  # a contiguous gradient
    ops, allocations = _logged(contiguous, nn.LayerNorm(32))
    assert not any(allocations[i] for i, (sig, _, _) in enumerate(ops) if 'layer_norm' in sig)

    def expanded_gradient(ln):  # sum()'s gradient is an expanded scalar: the backward copies it
        ln(torch.randn(4, 16, 16, 32, requires_grad=True)).sum().backward()
    ops, allocations = _logged(expanded_gradient, nn.LayerNorm(32))
    assert [sum(n for n, _, _ in a) for (sig, _, _), a in zip(ops, allocations) if 'layer_norm' in sig] == [0, nbytes]


def test_flash_attention_backward_holds_float32_accumulators_for_dq_and_the_softmax_sums():
    # aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_bwd: dq_accum is float32 batch x
    # round_multiple(seq, 128) x heads x round_multiple(head_size, 32); softmax_d float32 batch x heads x seq rounded
    def attention(_):
        q = torch.randn(2, 3, 197, 64, dtype=torch.float16, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    ops, allocations = _logged(attention)
    flash = [a for (sig, _, _), a in zip(ops, allocations) if sig == 'flash backward']
    assert flash, [sig for sig, _, _ in ops]
    (dq_accum, _, _), (softmax_d, _, _) = flash[0]
    assert dq_accum == 4 * 2 * 256 * 3 * 64 and softmax_d == 4 * 2 * 3 * 256

    def float32_attention(_):  # CUDA runs the memory-efficient kernel: no flash accumulators
        q = torch.randn(2, 3, 197, 64, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    ops, _ = _logged(float32_attention)
    assert 'flash backward' not in [sig for sig, _, _ in ops]


def test_a_cudnn_convolution_asks_for_an_adaptive_workspace_keyed_by_its_shape():
    # aten/src/ATen/native/cudnn/Conv_v8.cpp: with benchmark, only plans whose workspace fits are kept, the largest
    # halved on OOM: a workspace shrinks to what is free and never fails the step by itself
    def conv(c):
        c(torch.randn(2, 8, 16, 16, requires_grad=True)).sum().backward()
    ops, allocations = _logged(conv, nn.Conv2d(8, 8, 3))
    lives = [life for per_op in allocations for _, life, _ in per_op]
    assert lives == ['adaptive', 'adaptive']  # the forward and the backward
    assert ops[0][0] != ops[1][0] and '(8, 16, 16)' in ops[0][0]  # one search per shape, the batch left out


def test_attention_on_3d_inputs_runs_cuda_math_path_in_float32_with_the_scores_and_their_softmax():
    # sdp_utils.cpp: every fused CUDA kernel checks for 4-d inputs (timm's SAM ViT folds the heads into the batch);
    # attention.cpp's math path upcasts half inputs (allow_fp16_bf16_reduction_math_sdp off by default), then
    # holds the scores and their softmax. The CPU trace ran its flash kernel, which holds neither.
    def folded(_):
        q = torch.randn(24, 256, 64, dtype=torch.float16)
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(24, 256, 256, dtype=torch.float16))
    ops, allocations = _logged(folded)
    math = [a for (sig, _, _), a in zip(ops, allocations) if sig == 'math attention']
    assert math, [sig for sig, _, _ in ops]
    operands, scores, softmax = (n for n, _, _ in math[0])
    assert scores == softmax == 4 * 24 * 256 * 256
    assert operands == 4 * 24 * 256 * 64 * (3 + 2 + 1)  # float32 copies, the scaled query and key, the output

    def four_d(_):  # flash or memory-efficient on CUDA: nothing of the math path
        q = torch.randn(2, 12, 256, 64, dtype=torch.float16)
        F.scaled_dot_product_attention(q, q, q)
    ops, _ = _logged(four_d)
    assert 'math attention' not in [sig for sig, _, _ in ops]
