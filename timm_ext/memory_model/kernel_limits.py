"""Batch limits of CUDA kernels that are not memory: sizes a kernel cannot launch however much the card holds.

Each rule is read from torch 2.14.1's sources (the installed libtorch binaries decided where the stored sources
differed); a tensor "fits 32-bit indexing" as `canUse32BitIndexMath` says: fewer than 2**31 - 1 elements
(`INDEX_ELEMENTS`).

* Depthwise convolutions (aten/src/ATen/native/Convolution.cpp, `ConvParams::use_cudnn_depthwise`;
  aten/src/ATen/native/cuda/DepthwiseConv2d.cu, `conv_depthwise2d_forward_out`/`_backward_out`): an input or weight
  that does not fit 32-bit indexing goes to cuDNN, which has no such limit, when cuDNN is 9.3 or newer (the wheel
  ships 9.24; 9.11-9.14 refuse channels-last ones) with its v8 API on; so does every channels-last one, and a
  contiguous float16 one of 32 channels or more, square stride, no dilation, whose filter and width pass
  `check_cudnn_depthwise_workload_with_filter`. The rest run PyTorch's kernel, which checks that its input and output
  (forward) or its gradients (backward) fit 32-bit indexing: with the input within, only an output larger than the
  input can cross (a channel multiplier, wide padding), and only until the input crosses too and cuDNN takes over.
  The limit is that window's start.
* Reflection and replication padding (aten/src/ATen/native/cuda/ReflectionPad.cu, ReplicationPadding.cu): the
  forward checks its input; the backward of replication padding (and of 1-d and 3-d reflection padding) checks the
  input and the output gradient; 2-d reflection padding's backward checks nothing (the 2-d checks counted in the
  installed libtorch_cuda.so; the 1-d and 3-d ones read from the stored sources).
* Flash attention (flash_attn/flash_fwd_launch_template.h, `run_flash_fwd`: `dim3 grid(num_m_block, params.b,
  params.h)`): the batch (a windowed model's batch x windows) is a grid's y dimension, at most 65535
  (`ATTENTION_ROWS`). Flash is what the assumed card (sm120, `kernels_attention.ASSUMED_COMPUTE_CAPABILITY`) runs
  for half-precision, unmasked, 4-d attention of one head size up to 256 (`kernels_attention.cuda_attention_backend`).
  The memory-efficient kernel, which takes masks, is documented as unlimited from timm's tables: maxvit's masked
  attention runs past 65535 rows.

* The compiled step's convolutions (`torch.compile`, inductor; evidence, not a source): in timm's torch 2.9.1 dynamo
  tables (results/benchmark-infer-amp-nchw-pt291-*-dynamo.csv) convolutional models run the same compiled batch on the
  RTX 4090, 5090 and Pro 6000 (24, 32 and 96 GB) while eager's grows with the memory: efficientnet_b5 at 448 px runs
  256 compiled on all three (eager 512, 768, 2048), efficientnet_lite3 at 300 px 512 (eager 1024, 1024, 2048),
  legacy_xception 768 (eager 768, 1024, 2048). Each is the largest rung at which the batch times the larger tensor of
  a convolution (input or output, per sample) stays under 2**31 elements (`COMPILED_ELEMENTS`): efficientnet_b5's
  first stage-2 expansion, 144 x 224 x 224 = 7,225,344 per sample, fits 256 times and not 384. The cap follows the
  convolutions, not the compiled graphs' largest tensor (`COMPILED_TENSOR`, which `timm_ext.memory_model.
  compiled_step` notes and which only marks a trace as compiled here): matmul outputs past 2**31 elements ran
  (beit_large_patch16_384's 577 x 4096 MLP activations at 1024 on the 5090, swinv2_cr_tiny_384's 3,981,312 attention
  scores at 1536 on the Pro 6000). Inductor runs convolutions channels-last (`layout_opt`); eager channels-last runs
  under torch 2.4 went past 2**31 (efficientnet_b5 448 px at 512, results/benchmark-infer-amp-nhwc-pt240-cu124-
  rtx4090.csv). The tables do not record the error, and whether torch 2.14.1 keeps the cap is not known (no GPU has
  run it here): the plan keeps it, the safe side.

`KernelSizes` records the largest size of each kind of op while a step is traced; `launch_limit` applies the rules
above to those sizes per sample.
"""
from typing import Dict, Optional, Tuple

import torch
from torch._prims_common import suggest_memory_format

from .live_bytes import TraceMode

__all__ = ['INDEX_ELEMENTS', 'ATTENTION_ROWS', 'COMPILED_TENSOR', 'CONVOLUTION', 'COMPILED_ELEMENTS', 'KernelSizes',
           'launch_limit']

INDEX_ELEMENTS = 2 ** 31 - 1  # canUse32BitIndexMath's max_elem: a tensor of this many elements or more does not fit
ATTENTION_ROWS = 65535  # CUDA's maxGridSize[1]
COMPILED_TENSOR = 'compiled tensor'  # the signature compiled_step notes the compiled graphs' largest tensor under
CONVOLUTION = 'convolution'  # every convolution's larger tensor, input or output (a limit in a compiled trace only)
# evidence from timm's dynamo tables (see the module doc): a compiled convolution whose tensor reaches this many
# elements does not run
COMPILED_ELEMENTS = 2 ** 31
_CUDNN_DEPTHWISE_CHANNELS = 32  # use_cudnn_depthwise: "min 32 channels supported"
# (op, where its stride, dilation and groups arguments sit): under inference_mode conv2d reaches the modes whole
_CONVOLUTIONS = {torch.ops.aten.convolution.default: (3, 5, 8), torch.ops.aten.conv2d.default: (3, 5, 6)}
_PAD_FORWARD = {getattr(torch.ops.aten, f'{op}_pad{d}d').default: mode
                for op, mode in (('reflection', 'reflect'), ('replication', 'replicate')) for d in (1, 2, 3)}
_PAD_BACKWARD = {getattr(torch.ops.aten, f'{op}_pad{d}d_backward').default: mode
                 for op, mode, dims in (('reflection', 'reflect', (1, 3)), ('replication', 'replicate', (1, 2, 3)))
                 for d in dims}
_ATTENTION = {torch.ops.aten.scaled_dot_product_attention.default: 3,  # undecomposed under inference_mode
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: None}


def _argument(args: tuple, kwargs: dict, at: int, name: str, default):
    return args[at] if len(args) > at else kwargs.get(name, default)


def _cudnn_takes_contiguous(input: torch.Tensor, weight: torch.Tensor, stride, dilation) -> bool:
    """use_cudnn_depthwise's float16 rule for a contiguous depthwise convolution at a batch above 1 (the batches where
    an output crosses 2**31), with check_cudnn_depthwise_workload_with_filter."""
    height, width = (1, input.shape[-1]) if input.dim() == 3 else input.shape[-2:]
    stride = tuple(stride) * (2 // len(tuple(stride)))
    if input.dtype != torch.float16 or input.shape[1] < _CUDNN_DEPTHWISE_CHANNELS or any(d != 1 for d in dilation):
        return False
    if not (stride[0] == stride[-1] or height == 1):
        return False
    if height == 1 and stride[-1] == 1:
        return True
    size = weight.shape[-1]
    if weight.shape[-2] != size or size not in (1, 3, 5) or width < 7 or stride[-1] not in (1, 2):
        return False
    channels = input.shape[1]
    return stride[-1] == 1 or (size in (3, 5) and (channels >= 512 or (channels >= 256 and width >= 28)))


def _depthwise(func, args: tuple, kwargs: dict, out: torch.Tensor) -> Optional[Tuple[str, int]]:
    """A depthwise convolution whose output can cross 32-bit indexing on PyTorch's kernel: ('depthwise native',
    its output's elements)."""
    stride_at, dilation_at, groups_at = _CONVOLUTIONS[func]
    input, weight = args[0], args[1]
    groups = _argument(args, kwargs, groups_at, 'groups', 1)
    transposed = func is torch.ops.aten.convolution.default and _argument(args, kwargs, 6, 'transposed', False)
    if transposed or groups <= 1 or input.shape[1] != groups or weight.shape[0] % groups:
        return None
    channels_last = torch.channels_last in (suggest_memory_format(input), suggest_memory_format(weight))
    stride = _argument(args, kwargs, stride_at, 'stride', (1,))
    dilation = _argument(args, kwargs, dilation_at, 'dilation', (1,))
    if channels_last or out.numel() <= input.numel() or _cudnn_takes_contiguous(input, weight, stride, dilation):
        return None
    return 'depthwise native', out.numel()


def _signature(func, args: tuple, kwargs: dict, out) -> Optional[Tuple[str, int]]:
    """(the kind of limit, the size it applies to) for the ops `launch_limit` has rules for."""
    if func in _CONVOLUTIONS:
        return _depthwise(func, args, kwargs, out)
    if func in _ATTENTION:
        at = _ATTENTION[func]
        query, key, value = args[:3]
        mask = kwargs.get('attn_mask', args[at] if at is not None and len(args) > at else None)
        four_d = query.dim() == 4 and (at is not None or query.shape[0] != 1)  # the CPU op's leading 1: a 3-d call
        flash = (query.dtype in (torch.float16, torch.bfloat16) and four_d and mask is None
                 and query.shape[-1] == key.shape[-1] == value.shape[-1] <= 256)
        return ('attention flash', query.shape[0]) if flash else None
    if func in _PAD_FORWARD:  # F.pad outside inference_mode
        return f'pad {_PAD_FORWARD[func]}', args[0].numel()
    if func in _PAD_BACKWARD:  # (grad_output, input, padding)
        return f'pad {_PAD_BACKWARD[func]} backward', max(args[0].numel(), args[1].numel())
    if func is torch.ops.aten.pad.default:
        mode = _argument(args, kwargs, 2, 'mode', 'constant')
        if mode in ('reflect', 'replicate'):
            return f'pad {mode}', args[0].numel()
    return None


class KernelSizes(TraceMode):
    """The largest size of each kind of op `launch_limit` knows, over the ops run while active."""

    def __init__(self):
        super().__init__()
        self.sizes: Dict[str, int] = {}

    def note(self, signature: str, size: int) -> None:
        """Record a size of a kind of op (`compiled_step` notes its graphs' largest tensor, `COMPILED_TENSOR`)."""
        self.sizes[signature] = max(self.sizes.get(signature, 0), size)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = _signature(func, args, kwargs, out)
        if found is not None:
            self.note(*found)
        if func in _CONVOLUTIONS:
            self.note(CONVOLUTION, max(args[0].numel(), out.numel()))
        return out


def _limit(signature: str) -> Tuple[int, str]:
    """The size a kind of op must stay at or under, and why."""
    if signature == 'attention flash':
        return ATTENTION_ROWS, "flash attention's batch x windows reaches 65536 (a CUDA grid dimension)"
    if signature == CONVOLUTION:
        return COMPILED_ELEMENTS - 1, ('a convolution of the compiled graphs reaches 2**31 elements (the cap of '
                                       "timm's dynamo tables under torch 2.9.1)")
    what = 'an output of a depthwise convolution on PyTorch\'s kernel' if signature == 'depthwise native' \
        else f'{signature.removeprefix("pad ")} padding'
    return INDEX_ELEMENTS - 1, f'{what} reaches 2**31 - 1 elements (a 32-bit kernel)'


def launch_limit(per_sample: Dict[str, float]) -> Tuple[Optional[int], str]:
    """The largest batch every kernel can launch, and why (None, '' when nothing binds), from sizes per sample.

    The compiled graphs' largest tensor binds nothing: it marks the trace as compiled, where convolutions are capped.
    """
    compiled = COMPILED_TENSOR in per_sample
    bounds = []
    for signature, size in per_sample.items():
        if size > 0 and signature != COMPILED_TENSOR and (signature != CONVOLUTION or compiled):
            most, why = _limit(signature)
            bounds.append((int(most // size), why))
    return min(bounds) if bounds else (None, '')
