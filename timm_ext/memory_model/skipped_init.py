"""The weights' initialisation left out of a traced model's build: its values are thrown away at once.

The trace builds the model for real (timm models read tensor values while they are built: drop-path rates, position
tables), then moves it onto fake tensors (`Module.to_empty`), which replaces every parameter's storage: the values the
build's initialisers wrote are never read. Writing them is most of a large model's build (vit_base's truncated
normals over 86M weights). `SkippedInit` returns a parameter unchanged from the in-place ops that initialisers and
weight loading run on it with autograd off (`torch.nn.init`, timm's `trunc_normal_`, `load_state_dict`'s copies);
everything else runs, so the modules, shapes, buffers and values the build reads are those of a normal build.
"""
import torch
from torch.overrides import TorchFunctionMode

__all__ = ['SkippedInit']

# what initialisers write with: random fills, their transforms (truncated normal: erfinv, scale, shift, clamp),
# constants, and copies (sinusoidal tables, loaded weights)
_WRITES = {getattr(torch.Tensor, name) for name in (
    'uniform_', 'normal_', 'erfinv_', 'mul_', 'add_', 'sub_', 'div_', 'clamp_', 'fill_', 'zero_', 'copy_',
    'bernoulli_', 'exponential_', 'log_normal_', 'geometric_', 'cauchy_', 'random_')}


class SkippedInit(TorchFunctionMode):
    """While active, an initialiser's in-place write to a `torch.nn.Parameter` (autograd off) leaves it as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _WRITES and args and isinstance(args[0], torch.nn.Parameter) and not torch.is_grad_enabled():
            return args[0]
        return func(*args, **(kwargs or {}))
