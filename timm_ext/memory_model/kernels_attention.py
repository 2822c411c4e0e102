"""scaled_dot_product_attention on CUDA: which backend a torch release picks, and what it holds beyond the CPU trace.

The trace runs on CPU, where `scaled_dot_product_attention` runs `_scaled_dot_product_flash_attention_for_cpu`
(without dropout, and without a mask that needs a gradient: those run CPU's math path, whose ops the trace already
records). That op saves its output and a float32 logsumexp (batch x heads x queries), as CUDA's flash kernel does.
`describe_attention` writes the call's shapes and flags into the event log; `attention_allocations` picks the CUDA
backend for the card and the software (`cuda_attention_backend`) and gives what that backend allocates beyond the
CPU op.

Which releases have it (`sdpa_available`): torch.nn.functional.scaled_dot_product_attention appeared in torch 2.0;
torch 1.12.1's torch/nn/functional.py (its PyPI wheel) has only the private `_scaled_dot_product_attention` that
`MultiheadAttention` calls, so a 1.12.1 run computes attention op by op (timm falls back to its unfused path).

Between the releases read, each rule is a change of `timm_ext.memory_model.release_history`, decided by the run's
torch: the op from 2.0 (`SDPA`); masks on the memory-efficient kernel from 2.1 (`SDPA_MASKED_EFFICIENT`, assumed);
flash-attention 2 from 2.2 (`FLASH_V2`, assumed; before it flash-attention 1: head sizes up to 128, above 64 in
training only on sm80/sm90); cuDNN tried first on H100 in 2.5.0 only (`CUDNN_SDPA_PREFERRED_25`, made opt-in by
2.5.1), then by 2.9.1's checks from 2.9 (`CUDNN_SDPA_PREFERRED_29`) and 2.14.1's from 2.10 (`CUDNN_SDPA_RULES_210`,
assumed); the math path's float32 upcast of half inputs from 2.5 (`MATH_SDPA_FLOAT32`, pytorch#128922 and #135964:
before it the scores, the softmax and the scaled operands are half precision, and no float32 copy exists). The fused
kernels take 4-d inputs in every release, so 3-d and 5-d calls (NesT, Twins, Hiera, SAM's relative-position mask) take
the math path.

Backend choice (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, `select_sdp_backend`, `priority_order`,
`check_prefer_cudnn_attention` and the `can_use_*` checks). v2.14.1: read against the installed libtorch_cuda.so
(warning strings; `select_sdp_backend` disassembled: preference when the runtime cuDNN > 91500 and the major is 9 or
10). v2.9.1: read from a stored sdp_utils.cpp whose checks match the v2.9.1 PyPI wheel's libtorch_cuda.so (the
TORCH_CUDNN_SDPA_PREFERRED switch, the cuDNN dropout window "9.11 - 9.13", no cuDNN batch check, no d256 backward
check), and against that wheel's binary:

* order: flash, memory-efficient, math, cuDNN, unless cuDNN is preferred (`cudnn_preferred`), then cuDNN first:
  * v2.14.1: compute capability 9.x or 10.x, the runtime cuDNN newer than 9.15.0, and TORCH_CUDNN_SDPA_DEPRIORITIZED
    not "1";
  * v2.9.1: compute capability 9.0 or 10.0 (minor 0), cuDNN 9.9 or newer at build time (`#if CUDNN_VERSION`), and
    TORCH_CUDNN_SDPA_PREFERRED not "0" (on unless switched off). The PyPI cu128 wheel was built against cuDNN 9.8.0
    (its `torch._C._cudnn.getCompileVersion`, disassembled), so its `select_sdp_backend` never prefers cuDNN; the
    cu130 build is assumed built against the cuDNN it ships (9.13.0): not read;
* every fused kernel takes 4-d inputs only (`check_tensor_shapes`);
* flash (both releases): float16/bfloat16, sm80 to sm121, no mask, query, key and value of one head size of at most
  256; in training not a head size in (192, 224], nor above 224 with dropout, on sm86-sm89 and sm120-sm121;
* memory-efficient (both): sm50 to sm121, float32 or float16 (bfloat16 from sm80), query and key of one head size,
  both head sizes divisible by `minimum_gemm_alignment` (8 for half inputs, 4 for float32 from sm80, else 1);
* cuDNN, both: float16/bfloat16, sm80 to sm121, head sizes multiples of 8, more than one key;
  * v2.14.1: head sizes of at most 256 (128 where they differ), in training on 9.0/10.x at most 128 (the binary says
    "does not support backward with these head dimensions"; the bound of 128 is an assumption), and a batch and a
    head count of at most 65535 (`check_cudnn_tensor_shapes`: above it cuDNN refuses and the next backend runs);
  * v2.9.1: head sizes of at most 128, 256 on sm90 (9.0) when built against cuDNN 9.10 or newer
    (`check_cudnn_tensor_shapes` reads the build's `versionCuDNN`); no batch check.

What each holds beyond the CPU op (the same kernels in v2.9.1 and v2.14.1: flash-attention 2 and the cutlass
memory-efficient kernels; read at v2.14.1, assumed unchanged in v2.9.1):

* flash's backward (flash_attn/flash_api.cpp, `mha_bwd`): float32 accumulators for dq (batch x queries rounded to
  128 x heads x head size rounded to 32, 64 above 128) and the softmax row sums (batch x heads x queries rounded to
  128), for the time of the op;
* the memory-efficient backward (attention_backward.cu, `_efficient_attention_backward`; mem_eff_attention/
  kernel_backward.h, `workspace_size`): a float32 dq accumulator per batch and head (`kNeedsAccumGradQ`, split keys
  from sm70), and for half inputs with head sizes above the kernel's block (`kNeedsAccumGradK/V`) dk and dv
  accumulators; the tiles are `MEM_EFFICIENT_TILE` (an assumption: the kernel is picked at run time);
* the math path (attention.cpp, `_scaled_dot_product_attention_math`): half inputs computed in float32
  (`allow_fp16_bf16_reduction_math_sdp` off by default; the switch is in both releases' torch.backends.cuda): the
  query and key scaled by the root of the scale, the batch x heads x queries x keys scores and their softmax. Without
  a gradient all of it lives for the op; in training autograd keeps the scaled query and key, the softmax and the
  float32 value until the op's backward, which holds float32 gradients of the softmax, of its input, and of the
  operands for its own time. A release without the op (1.12.1) is priced as this path, should a trace hold the op.

Not modelled: cuDNN attention's workspace (its engine picks it at run time), the memory-efficient kernel's padded
mask copy and its logsumexp's queries rounded to 32, flash's padded copies of head sizes that are not multiples of
8, and what a CUDA fused kernel saves less than the CPU math path the trace ran (CPU runs math for dropout and for a
mask that needs a gradient).
"""
import os
from typing import Iterator, List, Mapping, Optional, Tuple

from .release_history import (
    CUDNN_SDPA_DEPRIORITIZED_251, CUDNN_SDPA_PREFERRED_25, CUDNN_SDPA_PREFERRED_29, CUDNN_SDPA_RULES_210, FLASH_V2,
    MATH_SDPA_FLOAT32, SDPA, SDPA_MASKED_EFFICIENT, in_force,
)
from .versions import PINNED, Software

__all__ = ['ASSUMED_COMPUTE_CAPABILITY', 'MEM_EFFICIENT_TILE', 'CUDNN_ATTENTION_ROWS', 'sdpa_available',
           'math_in_float32', 'cudnn_preferred', 'cuda_attention_backend', 'describe_attention',
           'attention_allocations']

# the card assumed where none is named: the newest generation of the named cards (RTX 5090, RTX Pro 6000: sm120)
ASSUMED_COMPUTE_CAPABILITY = (12, 0)
MEM_EFFICIENT_TILE = 64  # assumption: kBlockSizeI and MatmulGradQ's kN of the sm80 kernels for head sizes <= 128
CUDNN_ATTENTION_ROWS = 65535  # v2.14.1 check_cudnn_tensor_shapes: max_cudnn_dim_size, for the batch and the heads
FORWARD = '_scaled_dot_product_flash_attention_for_cpu.default'
BACKWARD = '_scaled_dot_product_flash_attention_for_cpu_backward.default'
_HALF = ('torch.float16', 'torch.bfloat16')
_NEWEST_FUSED = (12, 1)  # sm121: the top of every fused kernel's range in 2.9.1 and 2.14.1
_CUDNN_PREFERRED_ABOVE = 91500  # v2.14.1 check_prefer_cudnn_attention: runtime cuDNN > 9.15.0
_CUDNN_PREFERRED_BUILT_FROM = 90900  # v2.9.1 check_prefer_cudnn_attention: #if CUDNN_VERSION >= 90900
_CUDNN_WIDE_HEADS_BUILT_FROM = 91000  # v2.9.1 check_cudnn_tensor_shapes: head sizes up to 256 on sm90 from 9.10.0
# the cuDNN a v2.9.1 build was compiled against, by CUDA major: the PyPI cu128 wheel's getCompileVersion (9.8.0);
# CUDA 13 builds: assumed their wheel's runtime cuDNN (not read)
_V291_BUILT_CUDNN = {12: 90800}


def _rules_214(software: Software) -> bool:
    """Whether sdp_utils.cpp's cuDNN rules are 2.14.1's (`release_history.CUDNN_SDPA_RULES_210`), else 2.9.1's."""
    return in_force(CUDNN_SDPA_RULES_210, software)


def sdpa_available(software: Optional[Software] = None) -> bool:
    """Whether the release has torch.nn.functional.scaled_dot_product_attention (torch 2.0 on; the module doc).

    Args:
        software: The run's (default: `versions.PINNED`).
    """
    return in_force(SDPA, software or PINNED)


def math_in_float32(software: Optional[Software] = None) -> bool:
    """Whether the math path computes half-precision inputs in float32 (`release_history.MATH_SDPA_FLOAT32`: from
    torch 2.5; `allow_fp16_bf16_reduction_math_sdp` off, its default, is assumed)."""
    return in_force(MATH_SDPA_FLOAT32, software or PINNED)


def _flag(environ: Mapping[str, str], name: str) -> Optional[bool]:
    """c10::utils::check_env: "1" is true, "0" false, anything else (or unset) no answer."""
    return {'1': True, '0': False}.get(environ.get(name, ''))


def _built_cudnn(software: Software) -> int:
    """The cuDNN version a build was compiled against (CUDNN_VERSION), for v2.9.1's compile-time checks."""
    return _V291_BUILT_CUDNN.get((software.cuda or (0,))[0], software.cudnn_number)


def cudnn_preferred(compute_capability: Tuple[int, int], software: Optional[Software] = None,
                    environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether `priority_order` puts cuDNN attention first (`check_prefer_cudnn_attention`, the module doc).

    Args:
        compute_capability: The card's.
        software: The run's (default: `versions.PINNED`).
        environ: The run's environment (default: this process's).
    """
    software = software or PINNED
    environ = os.environ if environ is None else environ
    if _rules_214(software):
        return (compute_capability[0] in (9, 10) and software.cudnn_number > _CUDNN_PREFERRED_ABOVE
                and _flag(environ, 'TORCH_CUDNN_SDPA_DEPRIORITIZED') is not True)
    if in_force(CUDNN_SDPA_PREFERRED_29, software):
        return (tuple(compute_capability) in ((9, 0), (10, 0))
                and _built_cudnn(software) >= _CUDNN_PREFERRED_BUILT_FROM
                and _flag(environ, 'TORCH_CUDNN_SDPA_PREFERRED') is not False)
    # torch 2.5.0 alone tried cuDNN first on H100 (2.5.1 made it opt-in); cuDNN 9 assumed needed
    return (in_force(CUDNN_SDPA_PREFERRED_25, software) and not in_force(CUDNN_SDPA_DEPRIORITIZED_251, software)
            and tuple(compute_capability) == (9, 0) and software.cudnn_number >= 90000)


def _cudnn_can_run(software: Software, cc: Tuple[int, int], half: bool, head_qk: int, head_v: int, keys: int,
                   training: bool, rows: Optional[int]) -> bool:
    """`can_use_cudnn_attention` for dense inputs (the module doc)."""
    if not (half and (8, 0) <= cc <= _NEWEST_FUSED and head_qk % 8 == 0 and head_v % 8 == 0 and keys > 1):
        return False
    if not _rules_214(software):
        wide = cc == (9, 0) and _built_cudnn(software) >= _CUDNN_WIDE_HEADS_BUILT_FROM
        return max(head_qk, head_v) <= (256 if wide else 128)
    widest = 256 if head_qk == head_v else 128
    backward_ok = not (training and cc[0] in (9, 10) and max(head_qk, head_v) > 128)
    return max(head_qk, head_v) <= widest and backward_ok and (rows is None or rows <= CUDNN_ATTENTION_ROWS)


def cuda_attention_backend(dtype: str, head_qk: int, head_v: int, keys: int, four_d: bool, masked: bool,
                           dropout: bool, training: bool, compute_capability: Optional[Tuple[int, int]] = None,
                           environ: Optional[Mapping[str, str]] = None, software: Optional[Software] = None,
                           rows: Optional[int] = None) -> str:
    """The backend `select_sdp_backend` picks: 'flash', 'efficient', 'cudnn' or 'math' (see the module doc).

    Args:
        dtype, head_qk, head_v, keys, four_d, masked, dropout, training: The call's.
        compute_capability: The card's; unknown: `ASSUMED_COMPUTE_CAPABILITY`.
        environ: The run's environment (default: this process's).
        software: The run's (default: `versions.PINNED`); a release without the op runs 'math' (the module doc).
        rows: The batch (x windows) of the call, where it matters: v2.14.1's cuDNN refuses more than 65535.
    """
    software = software or PINNED
    cc = compute_capability or ASSUMED_COMPUTE_CAPABILITY
    environ = os.environ if environ is None else environ
    half = dtype in _HALF
    if not four_d or not sdpa_available(software):
        return 'math'

    def flash() -> bool:
        narrow = (8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)
        if not in_force(FLASH_V2, software):  # flash-attention 1: head sizes up to 128, above 64 in training on sm80/90
            wide_ok = not training or head_qk <= 64 or tuple(cc) in ((8, 0), (9, 0))
            return half and (8, 0) <= cc <= _NEWEST_FUSED and not masked and head_qk == head_v <= 128 and wide_ok
        too_wide = training and narrow and (192 < head_qk <= 224 or (head_qk > 224 and dropout))
        return half and (8, 0) <= cc <= _NEWEST_FUSED and not masked and head_qk == head_v <= 256 and not too_wide

    def efficient() -> bool:
        alignment = 8 if half and cc >= (7, 0) else 4 if cc >= (8, 0) else 1
        dtype_ok = dtype in ('torch.float32', 'torch.float16') or (dtype == 'torch.bfloat16' and cc >= (8, 0))
        mask_ok = not masked or in_force(SDPA_MASKED_EFFICIENT, software)
        return ((5, 0) <= cc <= _NEWEST_FUSED and dtype_ok and mask_ok and head_qk % alignment == 0
                and head_v % alignment == 0)

    def cudnn() -> bool:
        return _cudnn_can_run(software, cc, half, head_qk, head_v, keys, training, rows)

    checks = {'flash': flash, 'efficient': efficient, 'math': lambda: True, 'cudnn': cudnn}
    order = ['flash', 'efficient', 'math', 'cudnn']
    if cudnn_preferred(cc, software, environ):
        order = ['cudnn', 'flash', 'efficient', 'math']
    return next(name for name in order if checks[name]())


def describe_attention(name: str, args: tuple, kwargs: Mapping) -> Optional[Tuple[str, List[int]]]:
    """For the CPU flash op or its backward: (a signature of what picks the backend, [batch, heads, queries, keys,
    query head size, value head size]); None for other ops."""
    if name == FORWARD:
        query, key, value = args[:3]
        mask = kwargs.get('attn_mask')
        training = query.requires_grad or key.requires_grad or value.requires_grad
    elif name == BACKWARD:
        query, key, value = args[1:4]
        mask, training = kwargs.get('attn_mask'), True
    else:
        return None
    # a traced batch is never 1: a leading 1 is a 3-d call the CPU unsqueezed, which CUDA's fused kernels refuse
    four_d = query.shape[0] != 1
    batch, heads, queries, head_qk = query.shape
    flags = (f'{str(query.dtype)} {"4-d" if four_d else "3-d"} {"masked" if mask is not None else "unmasked"}'
             f' {"training" if training else "inference"}')
    where = 'backward' if name == BACKWARD else 'forward'
    return f'attention {where} {flags}', [batch, heads, queries, key.shape[-2], head_qk, value.shape[-1]]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _math(backward: bool, training: bool, half: bool, batch: int, heads: int, queries: int, keys: int,
          head_qk: int, head_v: int, upcast: bool = True) -> Iterator[Tuple[int, str, str]]:
    """The math path's work (the module doc); 'saved' until the backward's 'release' of the same key. `upcast`: half
    inputs computed in float32 (`math_in_float32`); without it (torch before 2.5) everything stays in the input's
    dtype and no float32 copy exists."""
    wide = half and upcast
    size = 4 if wide or not half else 2  # float32 inputs stay float32
    rows = batch * heads
    scaled_query, scaled_key = rows * queries * head_qk * size, rows * keys * head_qk * size
    value_copy = rows * keys * head_v * 4 if wide else 0
    scores = rows * queries * keys * size
    if backward:  # gradients of the softmax and of its input, then (upcast) of the operands in float32
        operands = (rows * queries * head_v * 4 + scaled_query + scaled_key + rows * keys * head_v * 4) if wide else 0
        yield 2 * scores + operands, 'op', 'math attention backward'
        yield 0, 'release', 'math attention saved'
        return
    copies = (rows * queries * head_qk + rows * keys * head_qk) * 4 if wide else 0  # freed once scaled
    output = rows * queries * head_v * 4 if wide else 0  # float32 before the cast back
    if training:
        yield scaled_query + scaled_key + scores + value_copy, 'saved', 'math attention saved'
        yield copies + scores + output, 'op', 'math attention scores'
    else:
        yield copies + scaled_query + scaled_key + value_copy + output, 'op', 'math attention operands'
        yield scores, 'op', 'math attention scores'
        yield scores, 'op', 'math attention softmax'


def attention_allocations(signature: str, numbers: List[int], compute_capability: Optional[Tuple[int, int]] = None,
                          environ: Optional[Mapping[str, str]] = None,
                          software: Optional[Software] = None) -> Iterator[Tuple[int, str, str]]:
    """What the CUDA backend for a `describe_attention` call allocates beyond the CPU op, as (bytes, life, key).

    Args:
        signature, numbers: What `describe_attention` wrote (the numbers scaled to the replayed batch).
        compute_capability: The card's (default: `ASSUMED_COMPUTE_CAPABILITY`).
        environ: The run's environment (default: this process's).
        software: The run's (default: `versions.PINNED`): the backend is that release's choice.
    """
    _, where, dtype, shape, mask, mode = signature.split(' ')
    batch, heads, queries, keys, head_qk, head_v = numbers
    backward, training, half = where == 'backward', mode == 'training', dtype in _HALF
    backend = cuda_attention_backend(dtype, head_qk, head_v, keys, shape == '4-d', mask == 'masked', False,
                                     training, compute_capability, environ, software, rows=batch)
    if backend == 'math':
        yield from _math(backward, training, half, batch, heads, queries, keys, head_qk, head_v,
                         math_in_float32(software))
    elif backend == 'flash' and backward:
        queries_rounded = _round_up(queries, 128)
        yield 4 * batch * queries_rounded * heads * _round_up(head_qk, 32 if head_qk <= 128 else 64), 'op', \
            'flash dq_accum'
        yield 4 * batch * heads * queries_rounded, 'op', 'flash softmax_d'
    elif backend == 'efficient' and backward:
        tile = MEM_EFFICIENT_TILE
        per_head = _round_up(queries, tile) * _round_up(head_qk, tile)
        if half and max(head_qk, head_v) > 128:  # dk, dv accumulated outside the registers
            per_head += _round_up(keys, tile) * (_round_up(head_qk, tile) + _round_up(head_v, tile))
        yield 4 * batch * heads * per_head, 'op', 'efficient backward workspace'
