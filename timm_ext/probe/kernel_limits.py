"""Batch limits of CUDA kernels that are not memory: sizes a kernel cannot launch however much the card holds.

timm's published inference tables show them (`bench/bench_gpu_tables.py`). A model whose rung is the same on a 32 GB
and a 96 GB card is not held back by memory: davit_tiny and hieradet_small stop below 1024, where their window
attention calls scaled_dot_product_attention with 64 windows a sample, 65536 rows; sam2's hiera at 896 px stops
below 96. And on the 96 GB card the rung of resnetblur18, densenetblur121d, maxxvit, mobilenetv4 (448 and 544 px)
and convnext_base sits where their largest depthwise convolution's input crosses 2**31 elements. So:

* `DEPTHWISE_ELEMENTS`: a depthwise convolution that PyTorch runs with its own CUDA kernel, which indexes in 32 bits,
  must hold fewer than 2**31 elements in its input and output. cuDNN takes a depthwise convolution over from it only
  in float16, from 32 channels, with a square 1x1, 3x3 or 5x5 filter on a contiguous input at least 7 wide, at stride
  1 (at stride 2 only from 512 channels, or 256 on inputs 28 wide); bfloat16 and 7x7 filters (ConvNeXt) always take
  PyTorch's kernel (`native_depthwise`, after torch's `use_cudnn_depthwise`);
* `ATTENTION_ROWS`: the flash and memory-efficient attention kernels put the leading (batch x windows) dimension in a
  grid dimension of at most 65535.

`KernelSizes` records, per traced batch, the largest of each; `launch_limit` turns them into the largest batch.
"""
from typing import Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ['DEPTHWISE_ELEMENTS', 'ATTENTION_ROWS', 'KernelSizes', 'launch_limit']

DEPTHWISE_ELEMENTS = 2 ** 31 - 1
ATTENTION_ROWS = 65535
LIMITS = {'depthwise_elements': DEPTHWISE_ELEMENTS, 'attention_rows': ATTENTION_ROWS}
REASONS = {'depthwise_elements': "a depthwise convolution's tensor reaches 2**31 elements (32-bit indexing)",
           'attention_rows': "attention's batch x windows reaches 65536 rows (a CUDA grid dimension)"}
# (op, where its groups argument sits): under inference_mode conv2d reaches the dispatch modes undecomposed
_CONVOLUTIONS = {torch.ops.aten.convolution.default: 8, torch.ops.aten.conv2d.default: 6}
_ATTENTION = {torch.ops.aten.scaled_dot_product_attention.default,  # undecomposed under inference_mode
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


def native_depthwise(input: torch.Tensor, weight: torch.Tensor, stride) -> bool:
    """Whether PyTorch's own CUDA kernel, not cuDNN, runs this depthwise convolution (see the module doc)."""
    stride = tuple(stride) if isinstance(stride, (list, tuple)) else (stride, stride)
    filter_h, filter_w = weight.shape[-2:]
    channels, width = input.shape[1], input.shape[-1]
    cudnn = (input.dtype == torch.float16 and channels >= 32 and filter_h == filter_w and filter_w in (1, 3, 5)
             and width >= 7 and input.is_contiguous() and len(set(stride)) == 1
             and (stride[0] == 1 or (stride[0] == 2 and (channels >= 512 or (channels >= 256 and width >= 28)))))
    return not cudnn


class KernelSizes(TorchDispatchMode):
    """The largest depthwise-convolution tensor and attention row count of the ops run while active."""

    def __init__(self):
        super().__init__()
        self.sizes: Dict[str, int] = dict.fromkeys(LIMITS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CONVOLUTIONS:
            at = _CONVOLUTIONS[func]
            input, groups = args[0], args[at] if len(args) > at else kwargs.get('groups', 1)
            stride = args[3] if len(args) > 3 else kwargs.get('stride', 1)
            if groups > 1 and groups == input.shape[1] and native_depthwise(input, args[1], stride):
                elements = max(input.numel(), out.numel())
                self.sizes['depthwise_elements'] = max(self.sizes['depthwise_elements'], elements)
        elif func in _ATTENTION:
            self.sizes['attention_rows'] = max(self.sizes['attention_rows'], args[0].shape[0])
        return out


def launch_limit(per_sample: Dict[str, float]) -> Tuple[Optional[int], str]:
    """The largest batch every kernel can launch, and why (None, '' when nothing binds), from sizes per sample."""
    bounds = [(int(LIMITS[name] // size), REASONS[name]) for name, size in per_sample.items() if size > 0]
    return min(bounds) if bounds else (None, '')
