"""CUDA autocast's float32 ops, replayed in a CPU trace: where a CUDA step holds float32 tensors that CPU's does not.

The memory estimate traces on CPU fake tensors (the backward of a CUDA fake tensor needs a GPU), so AMP runs under
CPU autocast. The two autocasts agree on what runs in half precision (convolutions, matmuls, linear layers,
attention), not on what runs in float32. CUDA autocast's lists are torch 2.14.1's `AT_FORALL_FP32` and
`AT_FORALL_FP32_SET_OPT_DTYPE` (aten/src/ATen/autocast_mode.h, registered for AutocastCUDA by autocast_mode.cpp);
the installed dispatcher (`torch._C._dispatch_dump_table`) shows which of their ops CPU autocast passes through:

* `fp32` ops CUDA casts and CPU does not (`CUDA_FLOAT32_FUNCTIONS`): the unary math ops (exp, log, rsqrt, pow, ...),
  softplus, layer_norm, rms_norm, group_norm, cosine_similarity, dist, pdist, renorm, logsumexp and every upsampling
  mode of `interpolate`. CUDA casts their half inputs to float32 and returns float32: a LayerNorm saves a float32
  copy of its input for the backward (ConvNeXt, every transformer). The losses, cdist and prod are cast by both.
* `fp32_set_opt_dtype` ops (`CUDA_FLOAT32_OUTPUT_FUNCTIONS`): softmax, log_softmax, sum, cumsum, cumprod and the
  vector and matrix norms run on the half input with a float32 result (`set_opt_dtype`: no input copy) unless the
  call names a dtype; an unfused attention's softmax keeps its float32 output beside the half-precision copy the next
  matmul saves.

`CudaAutocastCasts` does the same above autograd, so the trace saves what a CUDA step saves.

The lists are the torch release's (`cuda_float32_functions`, `cuda_float32_output_functions`, `casts_upsampling`;
`CudaAutocastCasts(software)`), each difference a change of `timm_ext.memory_model.release_history` (the release
where it appeared, or the window and the side assumed: `AUTOCAST_LISTS_20` between 1.12.1 and 2.9.1, taken as 2.0;
`AUTOCAST_RMS_NORM` between 2.9.1 and 2.14.1, taken as 2.10); the CPU side is always the installed torch's, which the
trace runs:

* 2.14.1: the installed aten/src/ATen/autocast_mode.h (the lists above).
* 2.9.1: the 2.9.1 wheel's ATen/autocast_mode.h: the same, less `rms_norm` (added to `AT_FORALL_FP32` after 2.9),
  and `AT_FORALL_FP32_SET_OPT_DTYPE` adds only Dimname overloads, which no Python entry point of timm reaches.
* 1.12.1: aten/src/ATen/autocast_mode.cpp registered its lists inline (`TORCH_LIBRARY_IMPL(aten, Autocast, m)`,
  `KERNEL(..., fp32)`); read from what the 1.12.1 wheel's libtorch_cpu.so registers for CUDA (its
  `WrapFunction_<CastPolicy, DeviceType::CUDA, ..., &at::op>` instantiations): fp32 has no `logsumexp`,
  `rms_norm` (the op did not exist) or upsampling kernel, so `interpolate` stays in half precision;
  fp32_set_opt_dtype has no `linalg_vector_norm` / `linalg_matrix_norm` (`norm` was fp32_append_dtype, which also
  returns float32 from the half input).

Autocast's weight cache (`caches_weights`): autocast keeps the half-precision copy of each float32 weight it casts
until the autocast region ends (aten/src/ATen/autocast_mode.cpp, `cached_cast`). From torch 2.10 (pytorch#165068,
`release_history.AUTOCAST_INFERENCE_NO_CACHE`) it does not under `inference_mode`: measured on the installed 2.14.1,
a Linear called three times under CPU autocast casts its weight once under `no_grad` and three times under
`inference_mode`. validate.py and train.py's evaluation run `inference_mode`; the trace runs `no_grad` (see
`timm_ext.train.trial_steps.trial_eval_forward`), so where the planned release skips the cache the trace turns
autocast's cache off (`torch.set_autocast_cache_enabled`) and each copy lives for its op only.
"""
from typing import Any, FrozenSet, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .release_history import AUTOCAST_INFERENCE_NO_CACHE, AUTOCAST_LISTS_20, AUTOCAST_RMS_NORM, in_force
from .versions import PINNED, Software

__all__ = ['CUDA_FLOAT32_FUNCTIONS', 'CUDA_FLOAT32_OUTPUT_FUNCTIONS', 'CudaAutocastCasts', 'cuda_float32_functions',
           'cuda_float32_output_functions', 'casts_upsampling', 'caches_weights']

_HALF = (torch.float16, torch.bfloat16)
_UNARY = ('acos', 'asin', 'cosh', 'erfinv', 'exp', 'expm1', 'log', 'log10', 'log2', 'log1p', 'reciprocal', 'rsqrt',
          'sinh', 'tan', 'pow', 'logsumexp', 'renorm', 'dist')
CUDA_FLOAT32_FUNCTIONS = frozenset({
    *(getattr(torch, name) for name in _UNARY), *(getattr(torch.Tensor, name) for name in _UNARY),
    torch.Tensor.__pow__, torch.Tensor.__rpow__, F.softplus, F.layer_norm, torch.layer_norm, F.rms_norm,
    torch.rms_norm, F.group_norm, torch.group_norm, F.cosine_similarity, torch.cosine_similarity, F.pdist,
    torch.pdist,
})
CUDA_FLOAT32_OUTPUT_FUNCTIONS = frozenset({
    F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
    torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod,
    torch.linalg.vector_norm, torch.linalg.matrix_norm, torch.norm, torch.Tensor.norm,
})
_UPSAMPLING = ('nearest', 'nearest-exact', 'linear', 'bilinear', 'bicubic', 'trilinear')  # not 'area': a pooling
_DTYPE_FOURTH = (F.softmax, F.log_softmax)  # a positional dtype is their fourth argument (a tuple: CudaAutocastCasts)


def _in_force(change, software: Optional[Software]) -> bool:
    return in_force(change, software or PINNED)


def cuda_float32_functions(software: Optional[Software] = None) -> FrozenSet:
    """The `fp32` functions CUDA autocast casts and CPU's does not, at the release of `software` (the module doc)."""
    functions = CUDA_FLOAT32_FUNCTIONS
    if not _in_force(AUTOCAST_RMS_NORM, software):
        functions = functions - {F.rms_norm, torch.rms_norm}
    if not _in_force(AUTOCAST_LISTS_20, software):
        functions = functions - {torch.logsumexp, torch.Tensor.logsumexp}
    return functions


def cuda_float32_output_functions(software: Optional[Software] = None) -> FrozenSet:
    """The `fp32_set_opt_dtype` (and `fp32_append_dtype`) functions at the release of `software`."""
    if _in_force(AUTOCAST_LISTS_20, software):
        return CUDA_FLOAT32_OUTPUT_FUNCTIONS
    return CUDA_FLOAT32_OUTPUT_FUNCTIONS - {torch.linalg.vector_norm, torch.linalg.matrix_norm}


def casts_upsampling(software: Optional[Software] = None) -> bool:
    """Whether CUDA autocast runs `interpolate`'s upsampling kernels in float32 at the release of `software`."""
    return _in_force(AUTOCAST_LISTS_20, software)


def caches_weights(software: Optional[Software] = None, inference_mode: bool = True) -> bool:
    """Whether autocast keeps its half-precision copies of the weights for the whole autocast region (`cached_cast`:
    float32 leaves that require grad), or casts a weight again at each use and frees the copy after it: from
    `release_history.AUTOCAST_INFERENCE_NO_CACHE` (torch 2.10) not under `inference_mode`, which validate.py's and
    train.py's evaluation forwards run. A training step (grad mode) and a `no_grad` forward (timm's benchmark.py
    before July 2025) keep the cache in every release."""
    return not (inference_mode and _in_force(AUTOCAST_INFERENCE_NO_CACHE, software))


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _HALF:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(v) for v in value)
    return value


def _casts(func, args: tuple, kwargs: dict, float32_functions: tuple, upsampling: bool) -> bool:
    if func is F.interpolate:
        mode = args[3] if len(args) > 3 else kwargs.get('mode', 'nearest')
        return upsampling and mode in _UPSAMPLING
    return func in float32_functions


_ENTERED: List[tuple] = []  # the lists of each CudaAutocastCasts entered, innermost last


class CudaAutocastCasts(TorchFunctionMode):
    """While CPU autocast is on, run CUDA autocast's float32 functions as CUDA autocast runs them.

    Args:
        software: The torch whose CUDA lists apply (default: `versions.PINNED`; the module doc).
        cache_weights: Whether autocast keeps its weight copies for the region, as that release does for the step
            traced (`caches_weights`); False turns the cache off while the mode is entered.
    """

    def __init__(self, software: Optional[Software] = None, cache_weights: bool = True):
        super().__init__()
        self._lists = (tuple(cuda_float32_functions(software)), tuple(cuda_float32_output_functions(software)),
                       casts_upsampling(software))
        self._cache_weights = cache_weights
        self._cache_before: List[bool] = []

    # the lists live in a module global while the mode is entered, not on the mode: TorchDynamo, compiling the step
    # under the mode, cannot build a guard on a mode's own attributes (torch 2.14.1: "name
    # '___get_torch_function_mode_stack_at' is not defined"), and it guards a global as any other. They are tuples,
    # not sets: TorchDynamo hashes a function it holds without a source (`Tensor.norm` reached through a tensor the
    # graph computed) by its own tracker's identity (torch/_dynamo/variables/base.py, `VariableTracker.hash_impl`),
    # so `func in frozenset` is False while tracing and True when the guard it leaves is checked ("Guard failed on
    # the same frame it was created": convnextv2's GRN, MetaFormers, XCiT); a tuple compares each item as Python does
    def __enter__(self):
        _ENTERED.append(self._lists)
        self._cache_before.append(torch.is_autocast_cache_enabled())
        torch.set_autocast_cache_enabled(self._cache_before[-1] and self._cache_weights)  # read by autocast's entry
        return super().__enter__()

    def __exit__(self, *exc_info):
        _ENTERED.pop()
        torch.set_autocast_cache_enabled(self._cache_before.pop())
        return super().__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled('cpu'):
            float32_functions, output_functions, upsampling = _ENTERED[-1]
            if _casts(func, args, kwargs, float32_functions, upsampling):
                args, kwargs = _to_float32(args), {k: _to_float32(v) for k, v in kwargs.items()}
            # `dtype=None` names none: `Tensor.norm` and `torch.norm` hand their own None on to the mode
            elif func in output_functions and kwargs.get('dtype') is None \
                    and (len(args) <= 3 or func not in _DTYPE_FOURTH) and args \
                    and isinstance(args[0], torch.Tensor) and args[0].dtype in _HALF:
                kwargs = {**kwargs, 'dtype': torch.float32}
        return func(*args, **kwargs)
