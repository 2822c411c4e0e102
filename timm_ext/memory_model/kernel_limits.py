"""Batch limits of CUDA kernels that are not memory: sizes a kernel cannot launch however much the card holds.

timm's published inference tables show them (`bench/bench_gpu_tables.py`): a model whose rung is the same on a 32 GB
and a 96 GB card is not held back by memory. Three limits explain the rows:

* attention: the flash kernel, which scaled_dot_product_attention takes without a mask, puts the leading (batch x
  windows) dimension in a CUDA grid dimension of at most 65535 (`ATTENTION_ROWS`): davit_tiny and hieradet_small (64
  windows a sample) stop below 1024 on both cards, sam2's hiera at 896 px below 96; maxvit's attention, which passes
  a relative-position mask, goes past it;
* depthwise convolutions that PyTorch's own 32-bit kernel runs must hold fewer than 2**31 elements
  (`INDEX_ELEMENTS`): ConvNeXt's 7x7, and strided (permuted) inputs (pvt_v2, gcvit, maxxvit) stop where their
  largest such tensor crosses it; contiguous 3x3 and 5x5 ones (MobileNet, MobileViT) go past it on cuDNN, which
  takes only those of 32 channels or more (`CUDNN_DEPTHWISE_CHANNELS`): mobilenetv4_conv_aa's 24-channel blur pool
  stops at 2**31;
* reflection and replication padding index in 32 bits: the blur pools of resnetblur, densenetblur and tresnet.

`KernelSizes` records the largest tensor of each kind of op while a step is traced, keyed by what decides its
kernel; `launch_limit` applies the rules above to those sizes per sample.
"""
from typing import Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ['INDEX_ELEMENTS', 'ATTENTION_ROWS', 'KernelSizes', 'launch_limit']

INDEX_ELEMENTS = 2 ** 31 - 1
ATTENTION_ROWS = 65535
CUDNN_DEPTHWISE_FILTERS = (1, 3, 5)
CUDNN_DEPTHWISE_CHANNELS = 32  # Convolution.cpp, use_cudnn_depthwise: cuDNN's depthwise path needs 32 channels
# (op, where its groups argument sits): under inference_mode conv2d reaches the dispatch modes undecomposed
_CONVOLUTIONS = {torch.ops.aten.convolution.default: 8, torch.ops.aten.conv2d.default: 6}
_PADDING = {getattr(torch.ops.aten, f'{op}_pad{d}d').default: mode
            for op, mode in (('reflection', 'reflect'), ('replication', 'replicate')) for d in (1, 2, 3)}
_ATTENTION = {torch.ops.aten.scaled_dot_product_attention.default: 3,  # undecomposed under inference_mode
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: None}


def _signature(func, args: tuple, kwargs: dict, out) -> Optional[Tuple[str, int]]:
    """(what decides the op's kernel, the size that kernel limits) for the ops `launch_limit` has rules for."""
    if func in _CONVOLUTIONS:
        at = _CONVOLUTIONS[func]
        input, weight = args[0], args[1]
        groups = args[at] if len(args) > at else kwargs.get('groups', 1)
        if groups > 1 and groups == input.shape[1]:
            layout = 'strided' if not input.is_contiguous() else 'narrow' if groups < CUDNN_DEPTHWISE_CHANNELS \
                else 'contiguous'
            return f'depthwise {weight.shape[-1]}x{weight.shape[-2]} {layout}', max(input.numel(), out.numel())
    elif func in _ATTENTION:
        at = _ATTENTION[func]
        mask = kwargs.get('attn_mask', args[at] if at is not None and len(args) > at else None)
        return f'attention {"masked" if mask is not None else "unmasked"}', args[0].shape[0]
    elif func in _PADDING:  # F.pad outside inference_mode
        return f'pad {_PADDING[func]}', max(args[0].numel(), out.numel())
    elif func is torch.ops.aten.pad.default:
        mode = args[2] if len(args) > 2 else kwargs.get('mode', 'constant')
        if mode in ('reflect', 'replicate'):
            return f'pad {mode}', max(args[0].numel(), out.numel())
    return None


class KernelSizes(TorchDispatchMode):
    """The largest size of each kind of op `launch_limit` knows, over the ops run while active."""

    def __init__(self):
        super().__init__()
        self.sizes: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = _signature(func, args, kwargs, out)
        if found is not None:
            self.sizes[found[0]] = max(self.sizes.get(found[0], 0), found[1])
        return out


def _limit(signature: str) -> Optional[Tuple[int, str]]:
    """The size a kind of op may reach, and why (None: no limit known)."""
    kind, _, detail = signature.partition(' ')
    if kind == 'attention' and detail == 'unmasked':
        return ATTENTION_ROWS, "attention's batch x windows reaches 65536 rows (a CUDA grid dimension)"
    if kind == 'depthwise':
        filter_size, layout = detail.split(' ')
        if layout != 'contiguous' or int(filter_size.split('x')[0]) not in CUDNN_DEPTHWISE_FILTERS:
            return INDEX_ELEMENTS, f'a {detail} depthwise convolution reaches 2**31 elements (a 32-bit kernel)'
    if kind == 'pad':
        return INDEX_ELEMENTS, f'{detail} padding reaches 2**31 elements (a 32-bit kernel)'
    return None


def launch_limit(per_sample: Dict[str, float]) -> Tuple[Optional[int], str]:
    """The largest batch every kernel can launch, and why (None, '' when nothing binds), from sizes per sample."""
    bounds = []
    for signature, size in per_sample.items():
        rule = _limit(signature)
        if rule is not None and size > 0:
            bounds.append((int(rule[0] // size), rule[1]))
    return min(bounds) if bounds else (None, '')
