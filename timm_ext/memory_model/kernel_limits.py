"""Batch limits of CUDA kernels that are not memory: sizes a kernel cannot launch however much the card holds.

A limit is a rule of a release: the trace runs once (with the installed torch) and records version-neutral facts of
each op `KernelSizes` knows; `launch_limit` decides the route, and so the limit, for the software the plan models
(`timm_ext.memory_model.versions`). A tensor "fits 32-bit indexing" as `canUse32BitIndexMath` says: fewer than
2**31 - 1 elements (`INDEX_ELEMENTS`).

* Depthwise convolutions (aten/src/ATen/native/Convolution.cpp, `ConvParams::use_cudnn_depthwise`, `use_cudnn`,
  `check_cudnn_depthwise_workload_with_filter`; aten/src/ATen/native/cuda/DepthwiseConv2d.cu,
  `conv_depthwise2d_forward_out` / `_backward_out`). PyTorch's own kernel checks that its input and output (forward),
  or the gradients of both (backward), fit 32-bit indexing; cuDNN has no such limit (it splits the batch, or runs
  64-bit). Which one runs (`depthwise_route`):

  * every release sends a contiguous float16 depthwise convolution of 32 channels or more, square stride (or 1-d),
    no dilation, whose filter and width pass `check_cudnn_depthwise_workload_with_filter`, to cuDNN (the "cuDNN
    shape" recorded at trace time);
  * v1.12.1 (the PyPI wheel's libtorch_cpu.so, a cu102 build of the same source as the table's cu113 one,
    `use_cudnn_depthwise` disassembled: no 32-bit test at all, cuDNN version tests 7603, 7600 and 8200 only; the check
    texts of DepthwiseConv2d.cu in its libtorch_cuda.so): every channels-last one goes to cuDNN, and every other
    contiguous one to PyTorch's kernel, whatever its size: the limit is its input or output, the larger;
  * v2.9.1 and v2.14.1 (their wheels' libtorch_cpu.so, `use_cudnn_depthwise` disassembled; the warning "Upgrade
    cuDNN or enable the V8 API to use cuDNN for 64-bit depthwise convolutions" in both): an input or weight past
    32-bit indexing goes to cuDNN when the runtime cuDNN is 9.3 or newer (its v8 API on, the default), except a
    channels-last one while cuDNN refuses those: v2.9.1 above 9.10.0 (`> 91000`: both its wheels, cuDNN 9.10.2 and
    9.13.0), v2.14.1 from 9.10.1 to 9.14 (`> 91000 && < 91500`; its wheel ships 9.24). Refused, it runs PyTorch's
    kernel, which cannot launch it: the limit is its input. Within 32-bit indexing every channels-last one goes to
    cuDNN, and a contiguous one without the cuDNN shape to PyTorch's kernel, where only an output larger than the
    input can cross (a channel multiplier, wide padding), and only until the input crosses too and cuDNN takes
    over: the limit is that window's start.

  Between and around those releases the route is a function of the run's torch and cuDNN
  (`timm_ext.memory_model.depthwise_route`).

  Convolutions of 3-d inputs (conv3d) are not modelled; the weight, never near 2**31, is not counted.
* The compiled step's convolutions (`torch.compile`): inductor runs convolutions channels-last (`layout_opt`; an
  assumption for every compiled graph), so in a compiled trace every depthwise convolution takes the channels-last
  route above. Under v2.9.1 that is the cap timm's dynamo tables show (results/benchmark-infer-amp-nchw-pt291-*-
  dynamo.csv, evidence the rule reproduces): convolutional models run the same compiled batch on the RTX 4090, 5090
  and Pro 6000 (24, 32 and 96 GB) while eager's grows with the memory. efficientnet_b5 at 448 px runs 256 compiled
  on all three (eager 512, 768, 2048): its first stage-2 depthwise convolution takes the expansion's 144 x 224 x 224
  = 7,225,344 elements per sample, 256 times under 2**31 - 1 and 384 times not; efficientnet_lite3 at 300 px 512
  (eager 1024, 1024, 2048), legacy_xception 768 (eager 768, 1024, 2048) likewise. Eager tables ran contiguous
  (NCHW), whose large depthwise convolutions cuDNN 9.3+ takes: no cap. Matmul outputs past 2**31 elements ran
  compiled (beit_large_patch16_384's 577 x 4096 MLP activations at 1024 on the 5090), and so does every other
  convolution (`use_cudnn` refuses only what splitting the batch cannot bring within 32-bit indexing). v2.14.1
  with its cuDNN 9.24 has no cap (not seen on a GPU here).
* Reflection and replication padding (aten/src/ATen/native/cuda/ReflectionPad.cu, ReplicationPadding.cu): the
  forward checks its input; the backward of replication padding (and of 1-d and 3-d reflection padding) checks the
  input and the output gradient; 2-d reflection padding's backward checks nothing (the 2-d checks counted in the
  installed libtorch_cuda.so; the 1-d and 3-d ones read from the stored sources). The same check texts ("input
  tensor must fit into 32-bit index math", "output gradient tensor must fit ...") are in the v1.12.1 and v2.9.1
  wheels' libtorch_cuda.so: assumed unchanged.
* Flash attention (flash_attn/flash_fwd_launch_template.h, `run_flash_fwd`: `dim3 grid(num_m_block, params.b,
  params.h)`): the batch (a windowed model's batch x windows) is a grid's y dimension, at most 65535
  (`ATTENTION_ROWS`). Whether flash runs is the release's backend choice for the card
  (`kernels_attention.cuda_attention_backend`, asked at 65536 rows): v2.14.1's cuDNN attention refuses more than
  65535 rows and hands them to flash; v1.12.1 has no scaled_dot_product_attention (`kernels_attention.sdpa_available`).
  The memory-efficient kernel, which takes masks, is documented as unlimited from timm's tables: maxvit's masked
  attention runs past 65535 rows.

`KernelSizes` records the largest size of each kind of op while a step is traced; `launch_limit` applies the rules
above to those sizes per sample.
"""
from typing import Dict, Mapping, Optional, Tuple

import torch
from torch._prims_common import suggest_memory_format

from .kernels_attention import cuda_attention_backend
from .live_bytes import TraceMode
from .depthwise_route import depthwise_route
from .versions import PINNED, Software

__all__ = ['INDEX_ELEMENTS', 'ATTENTION_ROWS', 'COMPILED_TENSOR', 'CONVOLUTION', 'KernelSizes', 'depthwise_route',
           'as_channels_last', 'launch_limit']

INDEX_ELEMENTS = 2 ** 31 - 1  # canUse32BitIndexMath's max_elem: a tensor of this many elements or more does not fit
ATTENTION_ROWS = 65535  # CUDA's maxGridSize[1]
COMPILED_TENSOR = 'compiled tensor'  # the signature compiled_step notes the compiled graphs' largest tensor under
# every convolution's larger tensor, input or output: recorded for the benchmarks' evidence, no rule reads it
CONVOLUTION = 'convolution'
DEPTHWISE = 'depthwise'  # the signatures' prefix: 'depthwise <layout> <dtype> <shape> <quantity>'
_QUANTITIES = ('input', 'output', 'grown')  # 'grown': the output of one whose output is larger than its input
_CUDNN_DEPTHWISE_CHANNELS = 32  # use_cudnn_depthwise: "min 32 channels supported"
# (op, where its stride, dilation and groups arguments sit): under inference_mode conv2d reaches the modes whole
_CONVOLUTIONS = {torch.ops.aten.convolution.default: (3, 5, 8), torch.ops.aten.conv2d.default: (3, 5, 6)}
_PAD_FORWARD = {getattr(torch.ops.aten, f'{op}_pad{d}d').default: mode
                for op, mode in (('reflection', 'reflect'), ('replication', 'replicate')) for d in (1, 2, 3)}
_PAD_BACKWARD = {getattr(torch.ops.aten, f'{op}_pad{d}d_backward').default: mode
                 for op, mode, dims in (('reflection', 'reflect', (1, 3)), ('replication', 'replicate', (1, 2, 3)))
                 for d in dims}
# signatures of traces recorded before the rules were versioned (cached estimates), read as the facts they stood for:
# a call flash runs on the assumed card, and a contiguous depthwise convolution outside cuDNN's float16 shape whose
# output is larger than its input
_LEGACY = {'attention flash': ('attention torch.float16 4-d unmasked inference 64 64 197',),
           'depthwise native': ('depthwise contiguous float32 other-shape output', 'depthwise contiguous float32 '
                                'other-shape grown')}
_ATTENTION = {torch.ops.aten.scaled_dot_product_attention.default: 3,  # undecomposed under inference_mode
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: None}


def _argument(args: tuple, kwargs: dict, at: int, name: str, default):
    return args[at] if len(args) > at else kwargs.get(name, default)


def _cudnn_shape(input: torch.Tensor, weight: torch.Tensor, stride, dilation) -> bool:
    """use_cudnn_depthwise's float16 rule less its dtype, for a batch above 1 (the batches where a tensor crosses
    2**31), with check_cudnn_depthwise_workload_with_filter (the same in v1.12.1, v2.9.1 and v2.14.1)."""
    height, width = (1, input.shape[-1]) if input.dim() == 3 else input.shape[-2:]
    stride = tuple(stride) * (2 // len(tuple(stride)))
    if input.shape[1] < _CUDNN_DEPTHWISE_CHANNELS or any(d != 1 for d in dilation):
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


def _depthwise(func, args: tuple, kwargs: dict, out: torch.Tensor) -> Optional[Tuple[str, int, int]]:
    """A depthwise convolution's facts: ('<layout> <dtype> <shape>', input elements, output elements)."""
    stride_at, dilation_at, groups_at = _CONVOLUTIONS[func]
    input, weight = args[0], args[1]
    groups = _argument(args, kwargs, groups_at, 'groups', 1)
    transposed = func is torch.ops.aten.convolution.default and _argument(args, kwargs, 6, 'transposed', False)
    if transposed or input.dim() not in (3, 4) or groups <= 1 or input.shape[1] != groups or weight.shape[0] % groups:
        return None
    channels_last = torch.channels_last in (suggest_memory_format(input), suggest_memory_format(weight))
    stride = _argument(args, kwargs, stride_at, 'stride', (1,))
    dilation = _argument(args, kwargs, dilation_at, 'dilation', (1,))
    shape = 'cudnn-shape' if _cudnn_shape(input, weight, stride, dilation) else 'other-shape'
    dtype = str(input.dtype).removeprefix('torch.')
    return f'{"channels-last" if channels_last else "contiguous"} {dtype} {shape}', input.numel(), out.numel()


def _attention(func, args: tuple, kwargs: dict) -> Tuple[str, int]:
    """An attention call's facts: ('attention <dtype> <4-d|3-d> <masked|unmasked> <training|inference> <head_qk>
    <head_v> <keys>', its batch x windows)."""
    at = _ATTENTION[func]
    query, key, value = args[:3]
    mask = kwargs.get('attn_mask', args[at] if at is not None and len(args) > at else None)
    four_d = query.dim() == 4 and (at is not None or query.shape[0] != 1)  # the CPU op's leading 1: a 3-d call
    training = query.requires_grad or key.requires_grad or value.requires_grad
    facts = (str(query.dtype), '4-d' if four_d else '3-d', 'unmasked' if mask is None else 'masked',
             'training' if training else 'inference', query.shape[-1], value.shape[-1], key.shape[-2])
    return 'attention ' + ' '.join(map(str, facts)), query.shape[0] if four_d else 0


def _signatures(func, args: tuple, kwargs: dict, out):
    """(the kind of limit, the size it applies to) for the ops `launch_limit` has rules for."""
    if func in _CONVOLUTIONS:
        found = _depthwise(func, args, kwargs, out)
        if found is not None:
            facts, inputs, outputs = found
            yield f'{DEPTHWISE} {facts} input', inputs
            yield f'{DEPTHWISE} {facts} output', outputs
            if outputs > inputs:
                yield f'{DEPTHWISE} {facts} grown', outputs
        yield CONVOLUTION, max(args[0].numel(), out.numel())
    elif func in _ATTENTION:
        yield _attention(func, args, kwargs)
    elif func in _PAD_FORWARD:  # F.pad outside inference_mode
        yield f'pad {_PAD_FORWARD[func]}', args[0].numel()
    elif func in _PAD_BACKWARD:  # (grad_output, input, padding)
        yield f'pad {_PAD_BACKWARD[func]} backward', max(args[0].numel(), args[1].numel())
    elif func is torch.ops.aten.pad.default:
        mode = _argument(args, kwargs, 2, 'mode', 'constant')
        if mode in ('reflect', 'replicate'):
            yield f'pad {mode}', args[0].numel()


class KernelSizes(TraceMode):
    """The largest size of each kind of op `launch_limit` knows, over the ops run while active.

    `sizes` maps a signature (version-neutral facts, no software decided) to its largest size: plain JSON.
    """

    def __init__(self):
        super().__init__()
        self.sizes: Dict[str, int] = {}

    def note(self, signature: str, size: int) -> None:
        """Record a size of a kind of op (`compiled_step` notes its graphs' largest tensor, `COMPILED_TENSOR`)."""
        self.sizes[signature] = max(self.sizes.get(signature, 0), size)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for signature, size in _signatures(func, args, kwargs, out):
            if size > 0:
                self.note(signature, size)
        return out


def as_channels_last(sizes: Mapping[str, float]) -> Dict[str, float]:
    """`sizes` as a channels-last run records them: its depthwise convolutions' facts in that layout (the same
    elements a tensor; the saver `channels-last` prices a run this way)."""
    converted: Dict[str, float] = {}
    for signature, size in sizes.items():
        if signature.startswith(f'{DEPTHWISE} contiguous '):
            signature = signature.replace(' contiguous ', ' channels-last ', 1)
        converted[signature] = max(converted.get(signature, 0), size)
    return converted


def _depthwise_bound(facts: str, sizes: Mapping[str, float], software: Software,
                     compiled: bool) -> Optional[Tuple[int, float, str]]:
    """(the most elements, the per-sample elements that must stay within, why) for the depthwise convolutions of one
    set of facts; None where cuDNN runs them at every batch."""
    layout, dtype, shape = facts.split(' ')
    channels_last = compiled or layout == 'channels-last'
    half, cudnn_shape = dtype == 'float16', shape == 'cudnn-shape'
    inputs, outputs, grown = (sizes.get(f'{DEPTHWISE} {facts} {q}', 0) for q in _QUANTITIES)
    where = f'{"a compiled" if compiled else "a"} {"channels-last" if channels_last else "contiguous"} depthwise'
    # within 32-bit indexing PyTorch's kernel checks the output too; past it, the route for large tensors decides
    small = depthwise_route(software, channels_last, half, cudnn_shape, fits=True)
    large = depthwise_route(software, channels_last, half, cudnn_shape, fits=False)
    if large == 'native':
        bound = max(inputs, outputs) if small == 'native' else inputs
        crossing = 'input or output' if small == 'native' else 'input'
        why = (f"{where} convolution's {crossing} reaches 2**31 - 1 elements: {software} runs it on PyTorch's "
               f"32-bit kernel")
        return INDEX_ELEMENTS - 1, bound, why
    if small == 'native' and grown:
        why = (f"{where} convolution's output, larger than its input, reaches 2**31 - 1 elements on PyTorch's 32-bit "
               f"kernel ({software}; cuDNN takes it only once the input crosses too)")
        return INDEX_ELEMENTS - 1, grown, why
    return None


def _attention_bound(signature: str, rows: float, software: Software, compute_capability,
                     environ) -> Optional[Tuple[int, float, str]]:
    """Flash attention's grid: (65535, the rows per sample, why) where the release runs flash past 65535 rows."""
    _, dtype, shape, mask, mode, head_qk, head_v, keys = signature.split(' ')
    backend = cuda_attention_backend(dtype, int(head_qk), int(head_v), int(keys), shape == '4-d', mask == 'masked',
                                     False, mode == 'training', compute_capability, environ, software,
                                     rows=ATTENTION_ROWS + 1)
    if backend != 'flash':
        return None
    return ATTENTION_ROWS, rows, (f"flash attention's batch x windows reaches 65536 (a CUDA grid dimension; "
                                  f"{software})")


def launch_limit(per_sample: Mapping[str, float], software: Optional[Software] = None,
                 compute_capability: Optional[Tuple[int, int]] = None,
                 environ: Optional[Mapping[str, str]] = None) -> Tuple[Optional[int], str]:
    """The largest batch every kernel can launch, and why (None, '' when nothing binds), from sizes per sample.

    Args:
        per_sample: `KernelSizes.sizes` divided by the traced batch. The compiled graphs' largest tensor
            (`COMPILED_TENSOR`) binds nothing: it marks the trace as compiled (its convolutions run channels-last).
        software: The run's, its torch one of `versions.RELEASES`' (default: `versions.PINNED`).
        compute_capability: The card's (default: `kernels_attention.ASSUMED_COMPUTE_CAPABILITY`).
        environ: The run's environment (default: this process's): the attention backend's switches.
    """
    software = software or PINNED
    per_sample = {new: size for signature, size in per_sample.items() for new in _LEGACY.get(signature, (signature,))}
    compiled = COMPILED_TENSOR in per_sample
    found = []
    depthwise = {signature.rsplit(' ', 1)[0].split(' ', 1)[1] for signature in per_sample
                 if signature.startswith(f'{DEPTHWISE} ')}
    for facts in sorted(depthwise):
        found.append(_depthwise_bound(facts, per_sample, software, compiled))
    for signature, size in per_sample.items():
        if signature.startswith('attention '):
            found.append(_attention_bound(signature, size, software, compute_capability, environ))
        elif signature.startswith('pad '):
            mode = signature.removeprefix('pad ')
            found.append((INDEX_ELEMENTS - 1, size, f'{mode} padding reaches 2**31 - 1 elements (a 32-bit kernel)'))
    bounds = [(int(most // size), why) for most, size, why in filter(None, found) if size > 0]
    return min(bounds) if bounds else (None, '')
