"""The CUDA context: the device memory a process holds outside the caching allocator, from published measurements.

A card's context is a function of its generation and the run's software (`cuda_context`): how the run's CUDA loads
kernel modules (`module_loading`: eager before CUDA 11.7, lazy where torch or CUDA turns it on), and the bare context
published for that software or generation (`CONTEXT_MEASUREMENTS`, each with its source), plus the kernel modules a
step loads after it (`MODULES_BYTES`). `timm_ext.memory_model.cards` gives each named card its context.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

from ..memory import format_bytes
from .versions import PINNED, Software

__all__ = ['CudaContext', 'ContextMeasurement', 'CONTEXT_MEASUREMENTS', 'MODULES_BYTES', 'MODULES_LOW',
           'MODULES_HIGH', 'MODULES_SOURCE', 'cuda_context', 'module_loading']

MiB = 1 << 20
GiB = 1 << 30
LAZY_LOADING_SOURCE = 'https://docs.nvidia.com/cuda/cuda-programming-guide/04-special-topics/lazy-loading.html'
TORCH_SETS_LAZY_SOURCE = 'https://github.com/pytorch/pytorch/pull/86509'


@dataclass(frozen=True)
class ContextMeasurement:
    """A published measurement of the device memory a PyTorch process holds outside the caching allocator before any
    step has run (the bare context: nvidia-smi's or cudaMemGetInfo's used memory less what the allocator reserved).

    Attributes:
        loading: 'lazy' or 'eager' (CUDA_MODULE_LOADING at the time).
        nbytes: The bytes measured.
        compute_capability: The card's, where the card is named (None: not named).
        what: The card, the software and what was measured.
        source: Where it was published.
        torch_cuda: The torch (major, minor) and CUDA (major, minor) it ran, where the source names them.
    """
    loading: str
    nbytes: int
    compute_capability: Optional[Tuple[int, int]]
    what: str
    source: str
    torch_cuda: Optional[Tuple[Tuple[int, int], Tuple[int, int]]] = None


_PT = 'https://github.com/pytorch/pytorch/{}'
CONTEXT_MEASUREMENTS: Tuple[ContextMeasurement, ...] = (
    ContextMeasurement('lazy', 287_047_680, None, 'torch 1.13 + CUDA 11.7, card not named: cudaMemGetInfo used '
                       'after one randn tensor (274 MiB)', _PT.format('pull/86509'), ((1, 13), (11, 7))),
    ContextMeasurement('lazy', 426 * MiB, (8, 9), 'RTX 6000 Ada, torch 2.10 + CUDA 13.0: nvidia-smi after '
                       'torch.cuda.mem_get_info alone, 0 B reserved', 'https://github.com/unslothai/unsloth-zoo/pull/1053',
                       ((2, 10), (13, 0))),
    ContextMeasurement('eager', 666_632_192, None, 'torch 1.13 + CUDA 11.7 with CUDA_MODULE_LOADING=DEFAULT, card '
                       'not named: cudaMemGetInfo used after one randn tensor (636 MiB)', _PT.format('pull/86509'),
                       ((1, 13), (11, 7))),
    ContextMeasurement('eager', 843 * MiB, None, 'torch 1.12.1 + CUDA 11.3, card not named: '
                       'torch.cuda.list_gpu_processes after mem_get_info alone', _PT.format('issues/86493'),
                       ((1, 12), (11, 3))),
    ContextMeasurement('eager', 999 * MiB, (8, 6), 'RTX 3090, torch 1.7.1 + CUDA 11.1: nvidia-smi 1001 MiB with '
                       'one 100x100 tensor (a 2 MiB segment)', _PT.format('issues/54564'), ((1, 7), (11, 1))),
    ContextMeasurement('eager', 1486 * MiB, (8, 6), 'RTX 3090, torch 1.7.1 + CUDA 11.0: nvidia-smi 1644 MiB with '
                       'one 64x16x200x200 float32 tensor (a 158 MiB segment)', _PT.format('issues/49877'),
                       ((1, 7), (11, 0))),
    ContextMeasurement('eager', 877 * MiB, (7, 5), 'RTX 2080 Ti, torch 1.6.0 + CUDA 10.1: nvidia-smi 1035 MiB with '
                       'the same 158 MiB tensor', _PT.format('issues/49877'), ((1, 6), (10, 1))),
)
# The kernel modules a run loads after the context exists (lazily, at each kernel's first use; cuDNN 8's sub-libraries,
# opened at the first convolution, under eager loading): vLLM's profile reports the growth of the memory outside
# torch's allocator past its baseline, taken once the context exists, over loading and running a model: 0.16 GiB on
# an H100 (https://github.com/vllm-project/vllm/pull/12126) and 0.20 GiB on a 23.58 GiB card
# (https://github.com/vllm-project/vllm/pull/14447). The larger is the figure; a CNN's training step runs cuDNN's
# convolution engines and more of torch's kernels than an LLM's forward, so the range reaches an assumed 512 MiB.
MODULES_BYTES = round(0.20 * GiB)
MODULES_LOW, MODULES_HIGH = round(0.16 * GiB), 512 * MiB
MODULES_SOURCE = 'https://github.com/vllm-project/vllm/pull/14447'


def module_loading(software: Software) -> str:
    """'lazy' or 'eager': how the run's CUDA loads kernel modules.

    Lazy loading exists from CUDA 11.7 and is the default from 12.2 (`LAZY_LOADING_SOURCE`); torch sets
    CUDA_MODULE_LOADING=LAZY itself from 1.13 where the user has not (`TORCH_SETS_LAZY_SOURCE`). A user who sets
    CUDA_MODULE_LOADING=EAGER is not modelled.
    """
    cuda = software.cuda or PINNED.cuda
    if cuda < (11, 7):
        return 'eager'
    return 'lazy' if cuda >= (12, 2) or software.torch >= (1, 13, 0) else 'eager'


@dataclass(frozen=True)
class CudaContext:
    """Device memory a process holds outside the caching allocator once its step has run: the CUDA context with the
    kernel modules the step loads.

    Attributes:
        name: The loading mode and compute capability, as plans and docs name it.
        nbytes: The bytes the plan takes off the card.
        low: The least the published measurements allow.
        high: The most they allow (with the modules' assumed upper end).
        source: The measurement the bare context is taken from.
        basis: What was measured there, and what is assumed on top of it.
        measured: Whether the bare context was measured on a card of this compute capability (else: assumed, from
            another generation's).
    """
    name: str
    nbytes: int
    low: int
    high: int
    source: str
    basis: str
    measured: bool

    def describe(self) -> str:
        """The context for the plan's assumptions line: the figure, its source, and its range where assumed."""
        text = f'CUDA context {format_bytes(self.nbytes)} outside the allocator ({self.name}: {self.basis}'
        if not self.measured:
            text += f'; an assumption, range {format_bytes(self.low)}-{format_bytes(self.high)}'
        return text + ')'


def cuda_context(compute_capability: Optional[Tuple[int, int]], software: Software = PINNED) -> CudaContext:
    """The context of a card of `compute_capability` under `software`: the bare context measured with the run's
    module loading, the closest evidence first, the largest within it (the safe side: more context leaves the allocator
    less): measured on the run's torch and CUDA (an eager context is every module of the libraries the release loads,
    so the software decides it more than the card), else on that generation, else on any card (an assumption); plus
    the modules a step loads (`MODULES_BYTES`).

    The range runs from the smallest bare context seen with that loading plus the least module growth seen, to the
    largest plus the assumed upper end (`MODULES_HIGH`). A `compute_capability` of None is a card of no known
    generation.
    """
    loading = module_loading(software)
    seen = [m for m in CONTEXT_MEASUREMENTS if m.loading == loading]
    same = [m for m in seen if compute_capability and m.compute_capability == tuple(compute_capability)]
    release = (software.torch[:2], (software.cuda or PINNED.cuda)[:2])
    same_software = [m for m in seen if m.torch_cuda == release]
    bare = max(same_software or same or seen, key=lambda m: m.nbytes)
    generation = '.'.join(map(str, compute_capability)) if compute_capability else 'any card'
    where = ('with the run\'s torch and CUDA' if same_software else 'on that generation' if same
             else f'on another card, none of {generation} published')
    basis = (f'{format_bytes(bare.nbytes)} bare context measured {where} ({bare.what}; {bare.source}), plus '
             f'{format_bytes(MODULES_BYTES)} of kernel modules loaded after it ({MODULES_SOURCE})')
    return CudaContext(f'{loading} loading, {generation}', bare.nbytes + MODULES_BYTES,
                       min(m.nbytes for m in seen) + MODULES_LOW, max(m.nbytes for m in seen) + MODULES_HIGH,
                       bare.source, basis, bool(same or same_software))
