"""What CUDA's kernels allocate that the CPU kernels the trace ran do not: rules read from the PyTorch sources.

A fake-tensor trace sees each op's outputs, not what a kernel allocates for itself while it runs. Where the CUDA
kernel differs, `describe_op` writes the op's shapes into the event log (`timm_ext.memory_model.events`), and
`cuda_allocations` turns them into the allocations the CUDA kernel makes, for the replay
(`timm_ext.memory_model.replay`). Each rule names its source and the torch release it holds for (`versions.RELEASES`:
the pinned 2.14.1 where no other is named; where the stored source was newer or older, that release's
libtorch_cuda.so decided):

* cuBLAS and cuBLASLt workspaces, a rule of the torch release (`cublas_workspace_bytes`,
  `cublaslt_workspace_bytes`, `cuda_allocations`):

  - torch 2.14.1 and 2.9.1 (aten/src/ATen/cuda/CublasHandlePool.cpp, `getCurrentCUDABlasHandle`,
    `setWorkspaceForHandle`, `parseChosenWorkspaceSize`): the first matrix product on a (handle, stream) allocates
    the workspace through the caching allocator and keeps it; handles are per thread, and autograd runs a CUDA
    backward on its own device thread, so a training step holds two. The size is CUBLAS_WORKSPACE_CONFIG's when it
    parses (every ":SIZE:COUNT" found adds SIZE KiB x COUNT), else the default of the compute capability: 2.14.1
    gives 32 MiB to majors 9 to 12 (the wheel's code: `major - 9 < 4`), 2.9.1 only to 9.0 (the wheel's code compares
    major and minor with (9, 0)); every other card gets 8 MiB + 128 KiB (":4096:2:16:8").
  - cuBLASLt (a Linear layer's addmm with a bias, `gemm_and_bias`): `getCurrentCUDABlasLtHandle` is the cuBLAS
    handle, so the cuBLAS workspace exists too; `getCUDABlasLtWorkspace` shares it when the two are unified, else
    keeps CUBLASLT_WORKSPACE_SIZE KiB (1024 by default) per (handle, stream). Unified is
    TORCH_CUBLASLT_UNIFIED_WORKSPACE read by `c10::utils::check_env`, and its default is the release's: on in
    2.14.1 (`unified_cublas_and_lt_workspaces`), off in 2.9.1 (`getCUDABlasLtWorkspaceSize`'s static `unified`).
  - torch 1.12.1 (the same file at v1.12.1 sets no workspace; the 1.12.1 wheel's libtorch_cuda.so imports no
    cublasSetWorkspace): cuBLAS allocates its own workspace with cudaMalloc, outside the caching allocator, by its
    own reading of CUBLAS_WORKSPACE_CONFIG (default ":4096:2:16:8" on cuBLAS 11). `cuda_allocations` replays them
    as a kept allocator block of the same bytes, as for 2.x: an approximation (the bytes are counted, but placed in
    the allocator's segments, whose rounding is not cuBLAS's cudaMalloc). Its addmm takes cuBLASLt's epilogue only
    on CUDA 11.4 and later (aten/src/ATen/native/cuda/Blas.cpp, `addmm_out_cuda_impl`'s `CUDA_VERSION >= 11040`
    guard, read from later stored copies: the v1.12.1 text was not found), with a 1 MiB `at::empty` workspace for the
    call (aten/src/ATen/cuda/CUDABlas.cpp, `gemm_and_bias`, pytorch#73328): timm's RTX 3090 table (CUDA 11.3) ran
    none.
  - Between those releases each rule is a change of `timm_ext.memory_model.release_history`, by the run's torch:
    the workspace from the caching allocator and cuBLASLt's kept workspace from 2.0 (`CUBLAS_WORKSPACE_ALLOCATOR`,
    `CUBLASLT_KEPT_WORKSPACE`: between 1.12.1 and 2.9.1, assumed 2.0), the wide default and the unified cuBLASLt
    workspace from 2.10 (`CUBLAS_WIDE_DEFAULT`, `CUBLASLT_UNIFIED`: between 2.9.1 and 2.14.1, assumed 2.10).
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
from .release_history import (
    CUBLAS_WIDE_DEFAULT, CUBLAS_WORKSPACE_ALLOCATOR, CUBLASLT_KEPT_WORKSPACE, CUBLASLT_UNIFIED, in_force,
)
from .versions import PINNED, Software

__all__ = ['describe_op', 'cuda_allocations', 'cublas_workspace_bytes', 'cublaslt_workspace_bytes', 'cublaslt_unified',
           'Allocation']

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


def _default_cublas_bytes(compute_capability: Tuple[int, int], software: Software) -> int:
    """`parseChosenWorkspaceSize`'s default: 32 MiB (":4096:8") for the release's large-workspace cards (majors 9 to
    12 from `CUBLAS_WIDE_DEFAULT`, 9.0 alone before), else ":4096:2:16:8" (before `CUBLAS_WORKSPACE_ALLOCATOR`:
    cuBLAS 11's own default)."""
    if in_force(CUBLAS_WIDE_DEFAULT, software):
        large = 9 <= compute_capability[0] <= 12
    elif in_force(CUBLAS_WORKSPACE_ALLOCATOR, software):
        large = tuple(compute_capability[:2]) == (9, 0)
    else:
        large = False
    return 4096 * KiB * 8 if large else 4096 * KiB * 2 + 16 * KiB * 8


def cublas_workspace_bytes(compute_capability: Optional[Tuple[int, int]] = None,
                           environ: Optional[Mapping[str, str]] = None, software: Optional[Software] = None) -> int:
    """The cuBLAS workspace of one (handle, stream), as `parseChosenWorkspaceSize` sizes it (the module doc).

    Args:
        compute_capability: The card's; unknown: `ASSUMED_COMPUTE_CAPABILITY` (the newest generation).
        environ: The run's environment (default: this process's).
        software: The torch whose rule applies (default: `versions.PINNED`).
    """
    config = (os.environ if environ is None else environ).get('CUBLAS_WORKSPACE_CONFIG')
    pairs = _WORKSPACE_CONFIG.findall(config) if config is not None else []
    if pairs:
        return sum(int(size) * KiB * int(count) for size, count in pairs)
    # unset or unparsed: the default
    return _default_cublas_bytes(compute_capability or ASSUMED_COMPUTE_CAPABILITY, software or PINNED)


def _check_env(value: Optional[str]) -> Optional[bool]:
    """`c10::utils::check_env`: "1" is true, "0" false; unset or anything else (warned) is no answer."""
    return {'1': True, '0': False}.get(value) if value is not None else None


def cublaslt_unified(environ: Optional[Mapping[str, str]] = None, software: Optional[Software] = None) -> bool:
    """Whether cuBLASLt shares the cuBLAS workspace: TORCH_CUBLASLT_UNIFIED_WORKSPACE, else the release's default
    (on in 2.14.1, off in 2.9.1; the module doc). 1.12.1 keeps no cuBLASLt workspace (False)."""
    software = software or PINNED
    if not in_force(CUBLASLT_KEPT_WORKSPACE, software):
        return False
    answer = _check_env((os.environ if environ is None else environ).get('TORCH_CUBLASLT_UNIFIED_WORKSPACE'))
    return in_force(CUBLASLT_UNIFIED, software) if answer is None else answer


def cublaslt_workspace_bytes(environ: Optional[Mapping[str, str]] = None, software: Optional[Software] = None) -> int:
    """cuBLASLt's own workspace per (handle, stream): 0 where it shares cuBLAS's (`cublaslt_unified`) or the release
    keeps none (1.12.1), else CUBLASLT_WORKSPACE_SIZE KiB (`parseCUDABlasLtWorkspaceSize`: 1024 when unset or not a
    number)."""
    environ = os.environ if environ is None else environ
    if not in_force(CUBLASLT_KEPT_WORKSPACE, software or PINNED) or cublaslt_unified(environ, software):
        return 0
    return _lt_size(environ)


def _lt_size(environ: Mapping[str, str]) -> int:
    number = re.match(r'\s*([+-]?[0-9]+)', environ.get('CUBLASLT_WORKSPACE_SIZE', ''))  # std::stoi's reading
    return (int(number.group(1)) if number else 1024) * KiB


def _lt_call_workspace(software: Software) -> int:
    """torch 1.12.1's cuBLASLt workspace, allocated for each call: 1 MiB where its addmm takes the epilogue (CUDA
    11.4 and later: the module doc), else 0."""
    if in_force(CUBLASLT_KEPT_WORKSPACE, software) or software.cuda is None or software.cuda < (11, 4):
        return 0
    return 1024 * KiB


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
        # 2.x: a caching-allocator block. 1.12.1: cuBLAS cudaMallocs its own, outside the allocator; replayed here as
        # a kept block of the same bytes (an approximation: the bytes are counted, its segment rounding is not cuBLAS's)
        yield cublas_workspace_bytes(compute_capability, environ, software), 'kept', f'cublas {thread}'
        if signature == 'matmul lt':
            lt_bytes = cublaslt_workspace_bytes(environ, software)
            if lt_bytes:
                yield lt_bytes, 'kept', f'cublaslt {thread}'
            call_bytes = _lt_call_workspace(software)
            if call_bytes:
                yield call_bytes, 'op', 'cublaslt call'
    elif signature.startswith(_CONVOLUTIONS):
        yield numbers[0], 'adaptive', signature
    elif signature in _LAYER_NORMS:
        if numbers[0]:
            yield numbers[0], 'op', signature
    elif signature.startswith('attention '):
        yield from attention_allocations(signature, numbers, compute_capability, environ, software)
