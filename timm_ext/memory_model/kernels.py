"""What CUDA's kernels allocate that the CPU kernels the trace ran do not: rules read from the PyTorch sources.

A fake-tensor trace sees each op's outputs, not what a kernel allocates for itself while it runs. Where the CUDA
kernel differs, `describe_op` writes the op's shapes into the event log (`timm_ext.memory_model.events`), and
`cuda_allocations` turns them into the allocations the CUDA kernel makes, for the replay
(`timm_ext.memory_model.replay`). Each rule names its source (torch 2.14.1; where the stored source was newer or
older, the installed libtorch_cuda.so decided):

* cuBLAS (aten/src/ATen/cuda/CublasHandlePool.cpp, `parseChosenWorkspaceSize`, `setWorkspaceForHandle`): the first
  matrix product on a (handle, stream) allocates the workspace through the caching allocator and keeps it; handles
  are per thread, and autograd runs a CUDA backward on its own device thread, so a training step holds two. The size
  is CUBLAS_WORKSPACE_CONFIG's when it parses (every ":SIZE:COUNT" found adds SIZE KiB x COUNT), else 32 MiB on
  compute capability 9.x to 12.x and 8 MiB + 128 KiB below (`cublas_workspace_bytes`). cuBLASLt (the Linear layers'
  addmm with bias) uses the same workspace unless TORCH_CUBLASLT_UNIFIED_WORKSPACE is "0"
  (`unified_cublas_and_lt_workspaces`); then it keeps its own CUBLASLT_WORKSPACE_SIZE KiB (1024 by default) per
  thread (`getCUDABlasLtWorkspace`).
* cuDNN convolutions (aten/src/ATen/native/cudnn/Conv_v8.cpp): a plan's workspace adapts to the memory left (with
  `cudnn.benchmark` only plans whose workspace fits are kept, the largest is halved until it fits, and the cache is
  emptied after each search); the most asked is the convolution's input.
* layer_norm (aten/src/ATen/native/layer_norm.cpp): the kernels take a contiguous input (`expect_contiguous`): a
  channels-first LayerNorm2d (a permuted view) copies its input in the forward, and its input and output gradient in
  the backward, for the time of the op.
* scaled_dot_product_attention: the backend the card runs and what it holds (`timm_ext.memory_model.kernels_attention`).
"""
import os
import re
from typing import Iterator, List, Mapping, Optional, Tuple

from .kernels_attention import ASSUMED_COMPUTE_CAPABILITY, attention_allocations, describe_attention
from .versions import PINNED, Software

__all__ = ['describe_op', 'cuda_allocations', 'cublas_workspace_bytes', 'cublaslt_workspace_bytes', 'Allocation']

KiB = 1 << 10
_MATMULS = ('mm.default', 'addmm.default', 'bmm.default', 'baddbmm.default', 'addmv.default', 'mv.default')
_LT_MATMULS = ('addmm.default',)  # a Linear layer with a bias: cuBLASLt's gemm_and_bias epilogue
_CONVOLUTIONS = ('convolution.default', 'convolution_backward.default', 'conv2d.default')
_LAYER_NORMS = ('native_layer_norm.default', 'native_layer_norm_backward.default')
_WORKSPACE_CONFIG = re.compile(r':([0-9]+):([0-9]+)')  # parseChosenWorkspaceSize's std::regex, searched

# an allocation a rule asks for: (bytes, how long it lives, key). Lives: 'op' (freed when the op ends), 'kept' (never
# freed, once per key), 'adaptive' (as much of it as the allocator can give, halved until it fits, then freed),
# 'saved' (kept for the backward: freed by the latest 'release' of the same key, which allocates nothing)
Allocation = Tuple[int, str, str]


def cublas_workspace_bytes(compute_capability: Optional[Tuple[int, int]] = None,
                           environ: Optional[Mapping[str, str]] = None) -> int:
    """The cuBLAS workspace of one (handle, stream), as `parseChosenWorkspaceSize` sizes it (the module doc).

    Args:
        compute_capability: The card's; unknown: `ASSUMED_COMPUTE_CAPABILITY` (the newest generation, 32 MiB).
        environ: The run's environment (default: this process's).
    """
    config = (os.environ if environ is None else environ).get('CUBLAS_WORKSPACE_CONFIG')
    pairs = _WORKSPACE_CONFIG.findall(config) if config is not None else []
    if pairs:
        return sum(int(size) * KiB * int(count) for size, count in pairs)
    major = (compute_capability or ASSUMED_COMPUTE_CAPABILITY)[0]  # unset or unparsed: the default
    return 4096 * KiB * 8 if 9 <= major <= 12 else 4096 * KiB * 2 + 16 * KiB * 8


def cublaslt_workspace_bytes(environ: Optional[Mapping[str, str]] = None) -> int:
    """cuBLASLt's own workspace per (handle, stream): 0 where it shares cuBLAS's (the default), else
    CUBLASLT_WORKSPACE_SIZE KiB (`parseCUDABlasLtWorkspaceSize`: 1024 when unset or not a number)."""
    environ = os.environ if environ is None else environ
    if environ.get('TORCH_CUBLASLT_UNIFIED_WORKSPACE') != '0':
        return 0
    number = re.match(r'\s*([+-]?[0-9]+)', environ.get('CUBLASLT_WORKSPACE_SIZE', ''))  # std::stoi's reading
    return (int(number.group(1)) if number else 1024) * KiB


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def describe_op(func, args: tuple, out, kwargs: Optional[Mapping] = None) -> Optional[Tuple[str, List[int]]]:
    """For an op whose CUDA kernel allocates for itself: (a signature that stays the same across batch sizes, the
    numbers `cuda_allocations` reads); None for other ops."""
    name = str(func).removeprefix('aten.')
    if name in _MATMULS:
        return ('matmul lt' if name in _LT_MATMULS else 'matmul'), []
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
    return describe_attention(name, args, kwargs or {})


def cuda_allocations(signature: str, numbers: List[int], backward: bool,
                     compute_capability: Optional[Tuple[int, int]] = None,
                     environ: Optional[Mapping[str, str]] = None,
                     software: Optional[Software] = None) -> Iterator[Allocation]:
    """The allocations CUDA's kernel makes for an op `describe_op` described, in order.

    Args:
        signature, numbers: What `describe_op` wrote (the numbers scaled to the replayed batch).
        backward: Whether the op runs in autograd's backward (its device thread, its own cuBLAS handle).
        compute_capability: The card's, when known (cuBLAS's workspace and the attention backend depend on it).
        environ: The run's environment (default: this process's): CUBLAS_WORKSPACE_CONFIG and the like.
        software: The torch, CUDA and cuDNN whose rules apply (default: `versions.PINNED`).
    """
    software = software or PINNED
    if signature.startswith('matmul'):
        thread = 'backward' if backward else 'forward'
        yield cublas_workspace_bytes(compute_capability, environ), 'kept', f'cublas {thread}'
        lt_bytes = cublaslt_workspace_bytes(environ) if signature == 'matmul lt' else 0
        if lt_bytes:
            yield lt_bytes, 'kept', f'cublaslt {thread}'
    elif signature.startswith(_CONVOLUTIONS):
        yield numbers[0], 'adaptive', signature
    elif signature in _LAYER_NORMS:
        if numbers[0]:
            yield numbers[0], 'op', signature
    elif signature.startswith('attention '):
        yield from attention_allocations(signature, numbers, compute_capability, environ)
