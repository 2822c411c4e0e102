"""What a device adds to the bytes a step's tensors hold: the stated model behind the memory estimate.

A fake-tensor trace (`timm_ext.memory_model.live_bytes`) counts tensors only. A real step also needs what kernels allocate
for themselves, what libraries keep between ops, what the allocator holds beyond each request, and what the runtime
keeps once a step has run. Each `DeviceModel` says how much of that it assumes (`assumptions`, printed with every
estimate):

* CPU, with train.py's steady heap (`timm_ext.memory.steady_cpu_heap`: large blocks mapped and handed back). The
  budget counts memory above what the process held before the step, so the weights, built before, are not counted.
  Measured op by op with torch 2.14 (oneDNN off): a grouped convolution (depthwise included) runs group by group and
  concatenates, holding its output once more in the forward and its input once more in the backward
  (`slow_conv_workspace`); from batch 16 an ungrouped float32 convolution runs in NNPACK, whose workspace PyTorch keeps
  between calls at the largest size asked: the kernel in 8x8 tiles, Cout x Cin x 64 floats (`nnpack_kept`: 309 MiB
  for mobilenetv3's 960 -> 1280 head, which is why its batch 16 peaks 330 MiB above batch 14); the runtime keeps
  `CPU_RUNTIME_BYTES` (vit_tiny, with no convolutions, peaks 16 MiB above its tensors). Against the VmData peak of real
  updates near a 1 GiB cap on six families the largest batch comes out at 0.97-0.99x the one that holds
  (`bench/bench_estimate.py`). With oneDNN on, convolutions keep scratchpads and reordered weights per shape instead,
  which are not modelled.
* CUDA: the step's ordered event log is replayed on PyTorch's caching allocator with CUDA's own kernels
  (`timm_ext.memory_model`): the answer is the least memory at which the step runs, segments and cuBLAS / cuDNN
  workspaces included. A budget is what the caching allocator may use. A card named with `--gpu`
  (`timm_ext.memory_model.cards`) gives the whole card's: its memory as CUDA reports it less the CUDA context outside
  the allocator, and its compute capability reaches the replay. AMP is traced under CPU autocast with CUDA
  autocast's float32 casts replayed (`timm_ext.memory_model.autocast_casts`). Under gradient accumulation every micro-batch
  after the first runs with the gradients resident (`MemoryEstimate.peak(..., accumulating=True)`). docs/gpu.md
  compares it with timm's published GPU tables; a GPU check is `bench/gpu_check.sh`.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from ..memory import BudgetError, MemoryBudget
from .cards import Card
from .versions import PINNED, Software

__all__ = ['DeviceModel', 'device_model', 'onednn_runs', 'CPU_RUNTIME_BYTES', 'CPU_COMPILE_BYTES', 'CPU_ESTIMATE_MARGIN',
           'MODELLED_DEVICE_TYPES']

MiB = 1 << 20
CPU_RUNTIME_BYTES = 32 * MiB  # CPU with the steady heap: vit_tiny's 16 MiB beyond its tensors, doubled
# what a process keeps once inductor has compiled a training step on the CPU (its generated modules, the loaded kernels,
# TorchDynamo's and AOTAutograd's caches): 160.3-166.0 MiB above the process before the compile on resnet18,
# vit_tiny and convnext_atto at 96 px (`bench/bench_compile_cpu.py --step-check`), the largest taken
CPU_COMPILE_BYTES = 166 * MiB
# how far below a real CPU trial's measured peak an estimate may fall (the fit's spread, with a margin)
CPU_ESTIMATE_MARGIN = 0.15

MODELLED_DEVICE_TYPES = ('cpu', 'cuda')  # the device types `device_model` has a model for

# conv2d: under inference_mode it reaches the dispatch modes undecomposed
_CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
                 torch.ops.aten.conv2d.default)


@dataclass(frozen=True)
class DeviceModel:
    """What one device type adds to a trace, and what its budget counts.

    Attributes:
        name: The device as the report names it.
        allocated: Bytes the allocator hands out for n bytes made by an op, given (op or None, its args, n); n on
            CUDA, whose caching allocator the replay runs (`timm_ext.memory_model.allocator`, the one model of it).
        workspace: Bytes an op allocates for itself while it runs, given (op, args, its result); None: none.
        kept: Bytes a library keeps from an op on (the largest ask stays), given (op, args, its result); None: none.
        fixed: Categories the device adds whatever the batch, name -> bytes.
        uncounted: Categories the budget does not count (CPU: the weights, built before the cap is set).
        card: CUDA: the card planned for (`--gpu`), None when none is named.
        software: CUDA: the torch, CUDA and cuDNN whose rules plan the run (`timm_ext.memory_model.versions`).
        software_line: CUDA: the plan's line naming them and what the model substituted ('' off CUDA).
        assumptions: One line on what this model assumes (the report's and the YAML's header).
    """
    name: str
    allocated: Callable[[object, tuple, int], int] = lambda func, args, n: n
    workspace: Optional[Callable[[object, tuple, object], int]] = None
    kept: Optional[Callable[[object, tuple, object], int]] = None
    fixed: Dict[str, int] = field(default_factory=dict)
    uncounted: Tuple[str, ...] = ()
    card: Optional[Card] = None
    assumptions: str = ''
    software: Software = PINNED
    software_line: str = ''

    def on_device(self, split: Dict[str, float]) -> Dict[str, float]:
        """A traced split with the device's fixed categories added."""
        return {**split, **self.fixed}

    def counted(self, split: Dict[str, float]) -> float:
        """The bytes of `split` the budget counts."""
        return sum(v for k, v in split.items() if k not in self.uncounted)

    @property
    def compute_capability(self) -> Optional[Tuple[int, int]]:
        """The planned card's compute capability (None: not known)."""
        return self.card.compute_capability if self.card else None

    def plan_in(self, budget: MemoryBudget, text: str, outside: int = 0) -> Tuple[int, int]:
        """(the bytes the budget names, what the caching allocator may use of them) for a budget as written (`text`;
        empty: none was given, all of the device).

        A size is the allocator's, as the probe's cap is; on a named card (`Card.plan_in`) it may not pass what the
        card leaves the allocator, and a fraction is of that. Without a card a fraction is of what the device here can
        still give (the CUDA context already out of it). `outside`: bytes besides the context that the run holds
        outside the allocator (NCCL's buffers): off a card or a fraction, not off a size, which is the allocator's.

        Raises:
            BudgetError: A size larger than the named card leaves the allocator, or a fraction of a CUDA device that
                is neither here nor named.
        """
        if self.card is not None:
            return self.card.plan_in(budget, text, outside, self.software)
        if budget.fraction is None:
            return budget.num_bytes, budget.num_bytes
        device = torch.device('cuda' if self.name == 'cuda' else 'cpu')
        if device.type == 'cuda' and not torch.cuda.is_available():
            asked = f'--mem-budget {text}: a fraction of a GPU' if text else 'without --mem-budget, all of a GPU'
            raise BudgetError(f"{asked} needs the GPU here; name the card (--gpu, e.g. h100-80gb) or give what the "
                              f"caching allocator may use as a size, e.g. --mem-budget 70GiB")
        num_bytes = budget.resolve(device)
        return num_bytes, max(0, num_bytes - outside)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def slow_conv_workspace(func, args: tuple, out) -> int:
    """Bytes PyTorch's own CPU convolution holds beside its result for a grouped convolution (0 for other ops).

    Measured on torch 2.14 with oneDNN off: a grouped convolution (depthwise included) runs group by group and
    concatenates, holding about its output once more in the forward and its input once more in the backward.
    """
    groups = _groups(func, args)
    if groups is None or groups == 1:
        return 0
    return _nbytes(out if func is torch.ops.aten.convolution.default else _conv_input(func, args))


def nnpack_kept(func, args: tuple, out) -> int:
    """NNPACK's workspace, which PyTorch keeps between calls and grows to the largest asked: a convolution it runs
    (CPU without oneDNN, float32, batch 16 or more, ungrouped) transforms its kernel into 8x8 tiles, Cout x Cin x 64
    floats, with one tile of each image channel in and out (measured: 309 MiB for 960 -> 1280 channels at batch 16)."""
    if func is not torch.ops.aten.convolution.default:
        return 0
    input, weight = args[0], args[1]
    backend = torch._C._select_conv_backend(input, weight, None, *args[3:9], None)
    if backend != torch._C._ConvBackend.NnpackSpatial:
        return 0
    tiles = weight.shape[0] * weight.shape[1] + input.shape[0] * (input.shape[1] + weight.shape[0])
    return 64 * input.element_size() * tiles


def _groups(func, args: tuple) -> Optional[int]:
    """A convolution op's groups (None for other ops)."""
    if func is torch.ops.aten.convolution.default:
        return args[8]
    if func is torch.ops.aten.convolution_backward.default:
        return args[9]
    return None


def _conv_input(func, args: tuple) -> Optional[torch.Tensor]:
    """A convolution op's input (None for other ops): the forward's first argument, the backward's second (after the
    gradient of the output)."""
    if func not in _CONVOLUTIONS:
        return None
    return args[1] if func is torch.ops.aten.convolution_backward.default else args[0]


def onednn_runs(device_type: str) -> bool:
    """Whether this process would run CPU convolutions in oneDNN (the model a CPU estimate for it takes)."""
    return device_type == 'cpu' and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def device_model(device_type: str, onednn: bool = False, card: Optional[Card] = None,
                 compiled: bool = False, software: Software = PINNED, software_line: str = '') -> DeviceModel:
    """The model for 'cpu' (oneDNN on or off; `compiled`: inductor compiles in the process) or 'cuda' (on `card` when
    one is named, with the rules of `software`, `software_line` saying so: `versions.run_software`; what the compile
    keeps is host memory there)."""
    if device_type == 'cuda':
        planned = (card.assumptions(software) if card else 'no card named: the budget is what the caching allocator may use '
                   '(no CUDA context taken off), compute capability unknown (the larger cuBLAS workspace)')
        return DeviceModel(
            'cuda', card=card, software=software, software_line=software_line,
            assumptions=(f'the step replayed on CUDA\'s caching allocator ({software}\'s rules) with cuBLAS / cuDNN '
                         f'workspaces, layer_norm copies and flash attention\'s accumulators, CUDA autocast\'s float32 '
                         f'casts, kernel launch limits; {planned}; not yet measured on a GPU'))
    if device_type not in MODELLED_DEVICE_TYPES:
        raise ValueError(f'no memory model for device type {device_type!r}; --estimate covers '
                         f'{" and ".join(MODELLED_DEVICE_TYPES)}')
    runtime = {'runtime': CPU_RUNTIME_BYTES, **({'compile': CPU_COMPILE_BYTES} if compiled else {})}
    common = (f'runtime {CPU_RUNTIME_BYTES // MiB} MiB (measured with the steady heap)'
              + (f', inductor\'s compile {CPU_COMPILE_BYTES // MiB} MiB (what it keeps in the process, measured)'
                 if compiled else '') + '; weights built before the budget counts')
    if onednn:
        return DeviceModel('cpu (oneDNN on)', fixed=runtime, uncounted=('weights',),
                           assumptions=f'CPU with oneDNN: its scratchpads not modelled, {common}')
    return DeviceModel('cpu (oneDNN off)', workspace=slow_conv_workspace, kept=nnpack_kept, fixed=runtime,
                       uncounted=('weights',),
                       assumptions=f'CPU without oneDNN: grouped convolutions\' buffers, NNPACK\'s workspace, {common}')
