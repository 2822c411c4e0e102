"""What CUDA's kernels allocate that the CPU kernels the trace ran do not: rules read from the PyTorch sources.

A fake-tensor trace sees each op's outputs, not what a kernel allocates for itself while it runs. Where the CUDA
kernel differs, `describe_op` writes the op's shapes into the event log (`timm_ext.memory_model.events`), and
`cuda_allocations` turns them into the allocations the CUDA kernel makes, for the replay
(`timm_ext.memory_model.replay`). Each rule names its source (torch 2.14):

* cuBLAS (aten/src/ATen/cuda/CublasHandlePool.cpp): the first matrix product on a handle allocates its workspace
  through the caching allocator and keeps it; handles are per thread, and autograd runs a CUDA backward on its own
  device thread, so a training step holds two (`cublas_workspace_bytes`: CUBLAS_WORKSPACE_CONFIG's default).
* cuDNN convolutions (aten/src/ATen/native/cudnn/Conv_v8.cpp): a plan's workspace adapts to the memory left (with
  `cudnn.benchmark` only plans whose workspace fits are kept, the largest is halved until it fits, and the cache is
  emptied after each search), so a workspace never fails a step by itself: the replay gives it at most the largest
  free block the cache holds, never a new segment; the most asked is the convolution's input.
* layer_norm (aten/src/ATen/native/layer_norm.cpp): the kernels take a contiguous input (`expect_contiguous`): a
  channels-first LayerNorm2d (a permuted view) copies its input in the forward, and its input and output gradient in
  the backward, for the time of the op.
* scaled_dot_product_attention with 3-d inputs (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
  `check_tensor_shapes`: "All fused kernels requires query, key and value to be 4 dimensional"; attention.cpp,
  `_scaled_dot_product_attention_math`): CUDA runs the math path where the CPU unsqueezed the inputs to a batch of
  one and ran its flash kernel (the trace sees that leading 1; a traced batch is never 1). With half
  inputs and `allow_fp16_bf16_reduction_math_sdp` off (the default) it computes in float32: copies of the operands,
  the scaled query and key, then the batch x rows x keys scores and their softmax, for the time of the op (the
  saved softmax of a training step's math path is not modelled).
* flash attention's backward (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp): float32
  accumulators for dq (batch x seq rounded to 128 x heads x head size rounded to 32, 64 above 128) and the softmax
  row sums (batch x heads x seq rounded to 128), for the time of the op; the CPU trace's flash kernel saves the same
  logsumexp as CUDA's forward.
"""
from typing import Iterator, List, Optional, Tuple

__all__ = ['describe_op', 'cuda_allocations', 'cublas_workspace_bytes', 'Allocation']

KiB = 1 << 10
_MATMULS = ('mm.default', 'addmm.default', 'bmm.default', 'baddbmm.default', 'addmv.default', 'mv.default')
_CONVOLUTIONS = ('convolution.default', 'convolution_backward.default', 'conv2d.default')
_LAYER_NORMS = ('native_layer_norm.default', 'native_layer_norm_backward.default')
_FLASH_FORWARD = '_scaled_dot_product_flash_attention_for_cpu.default'
_FLASH_BACKWARD = '_scaled_dot_product_flash_attention_for_cpu_backward.default'
_HALF_TYPES = ('torch.float16', 'torch.bfloat16')

# an allocation a rule asks for: (bytes, how long it lives: 'op' (freed when the op ends), 'kept' (never freed,
# once per key), or 'adaptive' (as much of it as the allocator can give, halved until it fits, then freed)), key
Allocation = Tuple[int, str, str]


def cublas_workspace_bytes(compute_capability: Optional[Tuple[int, int]] = None) -> int:
    """CUBLAS_WORKSPACE_CONFIG's default: 4096 KiB x 8 on sm90 / sm100 (Hopper, Blackwell datacenter), else
    4096 KiB x 2 + 16 KiB x 8; an unknown card is taken at the larger."""
    if compute_capability is None or compute_capability in ((9, 0), (10, 0)):
        return 4096 * KiB * 8
    return 4096 * KiB * 2 + 16 * KiB * 8


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def describe_op(func, args: tuple, out) -> Optional[Tuple[str, List[int]]]:
    """For an op whose CUDA kernel allocates for itself: (a signature that stays the same across batch sizes, the
    numbers `cuda_allocations` reads); None for other ops."""
    name = str(func).removeprefix('aten.')
    if name in _MATMULS:
        return 'matmul', []
    if name in _CONVOLUTIONS:
        input = args[1] if name == 'convolution_backward.default' else args[0]
        weight = args[2] if name == 'convolution_backward.default' else args[1]
        return f'{name} {tuple(input.shape[1:])} {tuple(weight.shape)} {input.dtype}', [_nbytes(input)]
    if name in _LAYER_NORMS:
        backward = name == 'native_layer_norm_backward.default'
        grad, input = (args[0], args[1]) if backward else (None, args[0])
        copies = _nbytes(input) * (not input.is_contiguous())
        if backward:
            copies += _nbytes(grad) * (not grad.is_contiguous())
        return name, [copies]
    if name == _FLASH_FORWARD and args[0].shape[0] == 1:
        # a 3-d call, which the CPU unsqueezes to one batch of 4-d (a traced batch is never 1): CUDA's fused
        # kernels take 4-d inputs only, so CUDA runs the math path
        query, key, value = (a[0] for a in args[:3])
        half = str(query.dtype) in _HALF_TYPES
        element = 4 if half else query.element_size()  # the math path computes half inputs in float32
        copies = (query.numel() + key.numel() + value.numel()) * 4 if half else 0
        scaled = (query.numel() + key.numel()) * element  # query and key times the square root of the scale
        output = query.numel() // query.shape[-1] * value.shape[-1] * element
        scores = query.numel() // query.shape[-1] * key.shape[-2] * element
        return 'math attention', [copies + scaled + output, scores]
    if name == _FLASH_BACKWARD:
        query = args[1]  # (grad_out, query, key, value, out, logsumexp, ...): query is batch x heads x seq x dim
        if str(query.dtype) not in _HALF_TYPES or query.shape[-1] > 256:
            return None  # CUDA runs the memory-efficient kernel (float32, or heads too large for flash)
        batch, heads, seq, dim = query.shape
        return 'flash backward', [batch, heads, seq, dim]
    return None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def cuda_allocations(signature: str, numbers: List[int], backward: bool,
                     compute_capability: Optional[Tuple[int, int]] = None) -> Iterator[Allocation]:
    """The allocations CUDA's kernel makes for an op `describe_op` described, in order.

    Args:
        signature, numbers: What `describe_op` wrote (the numbers scaled to the replayed batch).
        backward: Whether the op runs in autograd's backward (its device thread, its own cuBLAS handle).
        compute_capability: The card's, when known (cuBLAS's workspace depends on it).
    """
    if signature == 'matmul':
        yield cublas_workspace_bytes(compute_capability), 'kept', 'cublas backward' if backward else 'cublas'
    elif signature.startswith(_CONVOLUTIONS):
        yield numbers[0], 'adaptive', signature
    elif signature in _LAYER_NORMS:
        if numbers[0]:
            yield numbers[0], 'op', signature
    elif signature == 'math attention':  # operands, then the scores and their softmax (both alive at its end)
        yield numbers[0], 'op', 'math attention operands'
        yield numbers[1], 'op', 'math attention scores'
        yield numbers[1], 'op', 'math attention softmax'
    elif signature == 'flash backward':
        batch, heads, seq, dim = numbers
        seq_rounded, dim_rounded = _round_up(seq, 128), _round_up(dim, 32 if dim <= 128 else 64)
        yield 4 * batch * seq_rounded * heads * dim_rounded, 'op', 'flash dq_accum'
        yield 4 * batch * heads * seq_rounded, 'op', 'flash softmax_d'
