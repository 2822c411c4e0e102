"""CUDA autocast's float32 ops, replayed in a CPU trace: where a CUDA step holds float32 copies that CPU's does not.

The memory estimate traces on CPU fake tensors (the backward of a CUDA fake tensor needs a GPU), so AMP runs under
CPU autocast. The two autocasts agree on what runs in half precision (convolutions, matmuls, linear layers,
attention), not on what runs in float32: CUDA autocast casts the inputs of layer_norm, group_norm, softmax,
log_softmax and a few pointwise ops to float32 and returns float32, while CPU autocast leaves them in half precision.
Under CUDA a LayerNorm therefore saves a float32 copy of its half-precision input for the backward (ConvNeXt, every
transformer), and an unfused attention's softmax keeps its float32 output beside the half-precision copy the next
matmul saves. `CudaAutocastCasts` casts those inputs as CUDA autocast would, above autograd, so the trace saves what a
CUDA step saves.
"""
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ['CUDA_FLOAT32_FUNCTIONS', 'CudaAutocastCasts']

_HALF = (torch.float16, torch.bfloat16)
# the functions of CUDA autocast's float32 list that timm's models call on activations (torch's autocast_mode.cpp)
CUDA_FLOAT32_FUNCTIONS = frozenset({
    F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm,
    F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
    torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.rsqrt, torch.Tensor.rsqrt,
    torch.reciprocal, torch.Tensor.reciprocal, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, F.softplus,
})


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _HALF:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(v) for v in value)
    return value


class CudaAutocastCasts(TorchFunctionMode):
    """While CPU autocast is on, run CUDA autocast's float32 functions on float32 copies of their inputs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CUDA_FLOAT32_FUNCTIONS and torch.is_autocast_enabled('cpu'):
            args, kwargs = _to_float32(args), {k: _to_float32(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
