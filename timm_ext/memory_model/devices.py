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
  workspaces included. The CUDA context (`CUDA_CONTEXT_BYTES`) lies outside the allocator. A budget given as a card's
  nominal size ('24GiB', '80GB') is read as that card: CUDA reports `CARD_REPORTED_SHARE` of it as total memory (an
  RTX 3090 sold as 24 GB shows 23.7 GiB), and the context comes off that. AMP is traced under CPU autocast with CUDA
  autocast's float32 casts replayed (`timm_ext.memory_model.autocast_casts`). Under gradient accumulation every micro-batch
  after the first runs with the gradients resident (`MemoryEstimate.peak(..., accumulating=True)`). docs/gpu.md
  compares it with timm's published GPU tables; a GPU check is `bench/gpu_check.sh`.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from ..memory import BudgetError, MemoryBudget

__all__ = ['DeviceModel', 'device_model', 'onednn_runs', 'card_memory', 'CPU_RUNTIME_BYTES', 'CPU_ESTIMATE_MARGIN',
           'CUDA_CONTEXT_BYTES', 'CARD_REPORTED_SHARE', 'MODELLED_DEVICE_TYPES']

MiB = 1 << 20
CPU_RUNTIME_BYTES = 32 * MiB  # CPU with the steady heap: vit_tiny's 16 MiB beyond its tensors, doubled
# how far below a real CPU trial's measured peak an estimate may fall (the fit's spread, with a margin)
CPU_ESTIMATE_MARGIN = 0.15
GiB = 1 << 30
CUDA_CONTEXT_BYTES = 1024 * MiB  # outside the allocator: the context with cuBLAS / cuDNN (lazy loading, CUDA 12-13)
# what CUDA reports as total memory of a card sold as N GB: 0.9875 on an RTX 3090, 0.980 on an RTX 5090, 0.99 on
# A100 / H100 / H200 (the cards' public specifications against `total_memory`); ECC-on GDDR cards (T4, A10, L4) lose
# 6% more, which a nominal size cannot tell: give such a card's budget as the size CUDA shows
CARD_REPORTED_SHARE = 0.985
NOMINAL_CARD_GB = (4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 128, 141, 180, 192, 288)

MODELLED_DEVICE_TYPES = ('cpu', 'cuda')  # the device types `device_model` has a model for

# conv2d: under inference_mode it reaches the dispatch modes undecomposed
_CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
                 torch.ops.aten.conv2d.default)


@dataclass(frozen=True)
class DeviceModel:
    """What one device type adds to a trace, and what its budget counts.

    Attributes:
        name: The device as the report names it.
        allocated: Bytes the allocator hands out for n bytes made by an op, given (op or None, its args, n).
        workspace: Bytes an op allocates for itself while it runs, given (op, args, its result); None: none.
        kept: Bytes a library keeps from an op on (the largest ask stays), given (op, args, its result); None: none.
        fixed: Categories the device adds whatever the batch, name -> bytes.
        uncounted: Categories the budget does not count (CPU: the weights, built before the cap is set).
        context_bytes: Memory outside the allocator taken off an absolute budget.
        assumptions: One line on what this model assumes (the report's and the YAML's header).
    """
    name: str
    allocated: Callable[[object, tuple, int], int] = lambda func, args, n: n
    workspace: Optional[Callable[[object, tuple, object], int]] = None
    kept: Optional[Callable[[object, tuple, object], int]] = None
    fixed: Dict[str, int] = field(default_factory=dict)
    uncounted: Tuple[str, ...] = ()
    context_bytes: int = 0
    assumptions: str = ''

    def on_device(self, split: Dict[str, float]) -> Dict[str, float]:
        """A traced split with the device's fixed categories added."""
        return {**split, **self.fixed}

    def counted(self, split: Dict[str, float]) -> float:
        """The bytes of `split` the budget counts."""
        return sum(v for k, v in split.items() if k not in self.uncounted)

    def usable(self, budget: int) -> int:
        """What an absolute budget leaves the allocator (the card's memory, less what lies outside it)."""
        return max(0, budget - self.context_bytes)

    def plan_in(self, budget: MemoryBudget, text: str) -> Tuple[int, int]:
        """(the budget's bytes, what the allocator may use of them) for a budget as written (`text`).

        A size is the planned machine's (on CUDA a card's nominal size is read as that card, `card_memory`), and the
        context comes off it; a fraction is of what the device here can still give, the context already out of it.

        Raises:
            BudgetError: A fraction of a CUDA device that is not here.
        """
        if budget.fraction is None:
            num_bytes = card_memory(budget.num_bytes) if self.context_bytes else budget.num_bytes
            return num_bytes, self.usable(num_bytes)
        device = torch.device('cuda' if self.name == 'cuda' else 'cpu')
        if device.type == 'cuda' and not torch.cuda.is_available():
            raise BudgetError(f"--mem-budget {text}: a fraction of a GPU needs the GPU; give the card's memory as a "
                              f"size, e.g. '80GiB'")
        num_bytes = budget.resolve(device)
        return num_bytes, num_bytes


def card_memory(num_bytes: int) -> int:
    """The memory CUDA reports for a budget of `num_bytes`: a card's nominal size (24 GiB or 24 GB, say) is read as
    that card, whose reported total is `CARD_REPORTED_SHARE` of it; any other size is taken as given."""
    for gb in NOMINAL_CARD_GB:
        if num_bytes in (gb * GiB, gb * 10 ** 9):
            return int(gb * GiB * CARD_REPORTED_SHARE)
    return num_bytes


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


def caching_allocator_bytes(func, args: tuple, n: int) -> int:
    """The block CUDA's caching allocator hands out for a request of `n` bytes (its segments' tails apart)."""
    block = max(512, -(-n // 512) * 512)
    if block > 10 * MiB:
        block = -(-block // (2 * MiB)) * (2 * MiB)
    return block


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


def device_model(device_type: str, onednn: bool = False) -> DeviceModel:
    """The model for 'cpu' (oneDNN on or off) or 'cuda'."""
    if device_type == 'cuda':
        return DeviceModel(
            'cuda', caching_allocator_bytes, context_bytes=CUDA_CONTEXT_BYTES,
            assumptions=(f'the step replayed on CUDA\'s caching allocator (PyTorch 2.14\'s rules) with cuBLAS / cuDNN '
                         f'workspaces, layer_norm copies and flash attention\'s accumulators, CUDA context '
                         f'{CUDA_CONTEXT_BYTES // MiB} MiB, a nominal card size read as {CARD_REPORTED_SHARE:.1%} of '
                         f'it, CUDA autocast\'s float32 casts, kernel launch limits; not yet measured on a GPU'))
    if device_type not in MODELLED_DEVICE_TYPES:
        raise ValueError(f'no memory model for device type {device_type!r}; --estimate covers '
                         f'{" and ".join(MODELLED_DEVICE_TYPES)}')
    runtime = {'runtime': CPU_RUNTIME_BYTES}
    common = (f'runtime {CPU_RUNTIME_BYTES // MiB} MiB (measured with the steady heap); weights built before the '
              f'budget counts')
    if onednn:
        return DeviceModel('cpu (oneDNN on)', fixed=runtime, uncounted=('weights',),
                           assumptions=f'CPU with oneDNN: its scratchpads not modelled, {common}')
    return DeviceModel('cpu (oneDNN off)', workspace=slow_conv_workspace, kept=nnpack_kept, fixed=runtime,
                       uncounted=('weights',),
                       assumptions=f'CPU without oneDNN: grouped convolutions\' buffers, NNPACK\'s workspace, {common}')
