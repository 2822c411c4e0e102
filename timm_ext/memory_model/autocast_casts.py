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
"""
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ['CUDA_FLOAT32_FUNCTIONS', 'CUDA_FLOAT32_OUTPUT_FUNCTIONS', 'CudaAutocastCasts']

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
_DTYPE_POSITION = {F.softmax: 3, F.log_softmax: 3}  # where a positional dtype sits


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _HALF:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(v) for v in value)
    return value


def _casts(func, args: tuple, kwargs: dict) -> bool:
    if func is F.interpolate:
        mode = args[3] if len(args) > 3 else kwargs.get('mode', 'nearest')
        return mode in _UPSAMPLING
    return func in CUDA_FLOAT32_FUNCTIONS


class CudaAutocastCasts(TorchFunctionMode):
    """While CPU autocast is on, run CUDA autocast's float32 functions as CUDA autocast runs them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled('cpu'):
            if _casts(func, args, kwargs):
                args, kwargs = _to_float32(args), {k: _to_float32(v) for k, v in kwargs.items()}
            elif func in CUDA_FLOAT32_OUTPUT_FUNCTIONS and 'dtype' not in kwargs \
                    and len(args) <= _DTYPE_POSITION.get(func, len(args)) and args \
                    and isinstance(args[0], torch.Tensor) and args[0].dtype in _HALF:
                kwargs = {**kwargs, 'dtype': torch.float32}
        return func(*args, **kwargs)
