"""Named cards: what a plan for a GPU that is not here needs to know about it, each figure with its source.

`--gpu NAME` (tune_batch.py and validate.py with `--estimate`) names one of `CARDS`. Each entry gives:

* the capacity as CUDA reports it (`torch.cuda.get_device_properties().total_memory`, the "total capacity" of
  PyTorch's out-of-memory message, which reads `cudaMemGetInfo`), read from a published output of that card; it is a
  little below nvidia-smi's total (the driver keeps some) and moves by a few tens of MiB between drivers, so the
  smallest figure seen is kept (the safe side). Where no published figure was found it is derived from one that was,
  and `note` says how (an assumption the plan prints);
* the compute capability, from NVIDIA's list (`COMPUTE_CAPABILITY_SOURCE`): cuBLAS's workspace and the attention
  backends depend on it (`timm_ext.memory_model.kernels`);
* the CUDA context outside the caching allocator, a function of the card's generation and the run's CUDA and torch
  (`cuda_context`, from the published measurements of `CONTEXT_MEASUREMENTS`). The allocator may use the capacity
  less the context (`Card.allocator_bytes_for`).

Names are lower case with hyphens; a few obvious aliases are accepted, case-insensitively (`find_card`).
"""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..errors import UsageError
from ..memory import BudgetError, MemoryBudget, format_bytes
from .versions import PINNED, Software

__all__ = ['Card', 'CudaContext', 'ContextMeasurement', 'CARDS', 'CONTEXTS', 'CONTEXT_MEASUREMENTS',
           'COMPUTE_CAPABILITY_SOURCE', 'cuda_context', 'module_loading', 'find_card', 'card_flag_problem']

MiB = 1 << 20
GiB = 1 << 30
COMPUTE_CAPABILITY_SOURCE = 'https://developer.nvidia.com/cuda-gpus'
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


# one context per loading mode on a card of no known generation (what bench/card_table.py lists)
CONTEXTS: Dict[str, CudaContext] = {c.name: c for c in (
    cuda_context(None, PINNED), cuda_context(None, Software((1, 12, 1), (11, 3), (8, 3, 2))))}


@dataclass(frozen=True)
class Card:
    """One GPU as a plan for it needs it.

    Attributes:
        name: The `--gpu` name (lower case, hyphens).
        title: The card as NVIDIA names it.
        reported_bytes: Its memory as CUDA reports it (`total_memory`), the smallest figure seen.
        reported_source: Where that figure was read.
        compute_capability: (major, minor), from `COMPUTE_CAPABILITY_SOURCE`.
        aliases: Other names accepted for it (lower case).
        note: How `reported_bytes` was derived where no output of the card itself was found, or how it varies
            between drivers (an assumption the plan prints; empty: none).
    """
    name: str
    title: str
    reported_bytes: int
    reported_source: str
    compute_capability: Tuple[int, int]
    aliases: Tuple[str, ...] = ()
    note: str = ''

    def context(self, software: Software = PINNED) -> CudaContext:
        """The CUDA context this card holds under `software` (`cuda_context`)."""
        return cuda_context(self.compute_capability, software)

    @property
    def context_bytes(self) -> int:
        """The context under the pinned software (`context` for another)."""
        return self.context().nbytes

    @property
    def allocator_bytes(self) -> int:
        """What the caching allocator may use of the whole card under the pinned software (`allocator_bytes_for`)."""
        return self.allocator_bytes_for()

    def allocator_bytes_for(self, software: Software = PINNED) -> int:
        """What the caching allocator may use of the whole card: its reported memory less the context."""
        return self.reported_bytes - self.context(software).nbytes

    def assumptions(self, software: Software = PINNED) -> str:
        """The card's figures and their sources, for the plan's assumptions line."""
        major, minor = self.compute_capability
        reported = f'{format_bytes(self.reported_bytes)} as CUDA reports it ({self.reported_source}'
        reported += f'; {self.note})' if self.note else ')'
        return (f'card {self.name} ({self.title}): {reported}, compute capability {major}.{minor} '
                f'({COMPUTE_CAPABILITY_SOURCE}), {self.context(software).describe()}')

    def plan_in(self, budget: MemoryBudget, text: str, outside: int = 0,
                software: Software = PINNED) -> Tuple[int, int]:
        """(the bytes the budget names, what the allocator may use of them) on this card under `software`, where
        `outside` bytes besides the context lie outside the allocator (NCCL's buffers under DDP,
        `timm_ext.memory_model.nccl`).

        A size is the allocator's own; a fraction is of what the card leaves the allocator.

        Raises:
            BudgetError: A size larger than the card leaves the allocator.
        """
        context = self.context(software).nbytes
        room = max(0, self.reported_bytes - context - outside)
        if budget.fraction is not None:
            return self.reported_bytes, int(room * budget.fraction)
        if budget.num_bytes > room:
            nccl = f' and {format_bytes(outside)} of NCCL buffers' if outside else ''
            raise BudgetError(f'--mem-budget {text} is more than {self.name} leaves the caching allocator '
                              f'({format_bytes(room)}: {format_bytes(self.reported_bytes)} less '
                              f'{format_bytes(context)} of CUDA context{nccl}); pass at most that, or drop '
                              f'--mem-budget to plan the whole card')
        return budget.num_bytes, budget.num_bytes


def _gib(value: float) -> int:
    """Bytes of a capacity published in GiB to two decimals (as PyTorch's out-of-memory message prints it)."""
    return round(value * GiB)


_ISSUE = 'https://github.com/{}/issues/{}'
# public PyTorch out-of-memory logs quoting 'GPU 0 has a total capacity of {} GiB', found by exact-text search of
# public repositories (the index behind it names no repository or URL for them)
_SEEN = 'PyTorch OOM messages "GPU 0 has a total capacity of {} GiB" in public repositories (exact-text search)'
CARDS: Dict[str, Card] = {c.name: c for c in (
    Card('t4', 'NVIDIA T4', _gib(14.56), _ISSUE.format('Zheng-Chong/CatVTON', 133), (7, 5), aliases=('tesla-t4',),
         note='other drivers report up to 14.76 GiB (https://github.com/googlecolab/colabtools/issues/3439: 14.75); '
                 'the smallest recent figure is kept'),
    Card('l4', 'NVIDIA L4', _gib(22.03), _ISSUE.format('ArcInstitute/evo2', 190), (8, 9)),
    Card('a10', 'NVIDIA A10', _gib(21.99), _ISSUE.format('zai-org/CogVLM', 236), (8, 6), aliases=('a10g',),
         note='an A10G (AWS\'s A10, the same 24 GB GDDR6) read 22.49 GiB under a 2022 driver '
              '(https://github.com/AUTOMATIC1111/stable-diffusion-webui/issues/1259); the recent figure is kept'),
    Card('rtx3090', 'GeForce RTX 3090', _gib(23.70), _ISSUE.format('GaoLii/DSP', 10), (8, 6),
         aliases=('3090', 'rtx-3090')),
    Card('rtx4090', 'GeForce RTX 4090', _gib(23.64), _ISSUE.format('TMElyralab/MuseTalk', 76), (8, 9),
         aliases=('4090', 'rtx-4090')),
    Card('rtx5090', 'GeForce RTX 5090', _gib(31.36), _ISSUE.format('TrajectoryCrafter/TrajectoryCrafter', 20), (12, 0),
         aliases=('5090', 'rtx-5090')),
    Card('l40s', 'NVIDIA L40S', _gib(44.42), _ISSUE.format('stepfun-ai/Step-Video-T2V', 8), (8, 9)),
    Card('a100-40gb', 'NVIDIA A100 40GB', _gib(39.25), _SEEN.format('39.25'), (8, 0),
         aliases=('a100-40g', 'a100-sxm4-40gb'),
         note='other drivers report up to 39.50 GiB (https://github.com/TianheWu/CoSeR/issues/10); the smallest '
              'figure seen is kept'),
    Card('a100-80gb', 'NVIDIA A100 80GB', _gib(79.25), _ISSUE.format('HiDream-ai/VAREdit', 6), (8, 0),
         aliases=('a100-80g', 'a100-sxm4-80gb')),
    Card('h100-80gb', 'NVIDIA H100 80GB HBM3', _gib(79.11), _ISSUE.format('vllm-project/vllm', 27508), (9, 0),
         aliases=('h100', 'h100-sxm')),
    Card('h200', 'NVIDIA H200', _gib(139.72), _SEEN.format('139.72'), (9, 0), aliases=('h200-141gb',),
         note='other drivers report up to 139.81 GiB (https://github.com/sungwon-chae/arxiv_confi, etu_logging.md); '
              'the smallest figure seen is kept'),
    Card('b200', 'NVIDIA B200', _gib(178.35), 'https://github.com/pytorch/ao/pull/4002', (10, 0)),
    Card('rtx-pro-6000', 'RTX PRO 6000 Blackwell Workstation Edition', _gib(94.97),
         _ISSUE.format('antirez/ds4', 431), (12, 0), aliases=('rtx-pro-6000-blackwell', 'rtxpro6000', 'pro6000')),
    Card('rtx-pro-6000-max-q', 'RTX PRO 6000 Blackwell Max-Q Workstation Edition', _gib(94.97),
         _ISSUE.format('antirez/ds4', 431), (12, 0), aliases=('pro6000maxq', 'rtx-pro-6000-maxq'),
         note='read on the Workstation Edition, whose 96 GB GDDR7 the Max-Q board carries too (an assumption)'),
)}


def find_card(name: str) -> Card:
    """The card `name` names (its name or an alias, any case).

    Raises:
        UsageError: No card has that name; the message lists the known names.
    """
    key = name.strip().lower().replace('_', '-').replace(' ', '-')
    for card in CARDS.values():
        if key == card.name or key in card.aliases:
            return card
    raise UsageError(f'--gpu {name}: not a card this plan knows; pass one of {", ".join(CARDS)}, or --mem-budget '
                     f'with the memory the caching allocator may use')


def card_flag_problem(name: Optional[str], device: str, estimate: bool) -> Optional[str]:
    """Why `--gpu name` cannot be used with `--device device` (and `--estimate` or not), in one line; None if it can.

    A card is named only to plan for it: on the device itself the probe measures the card that is here, so `--gpu`
    without `--estimate` is refused rather than checked against it.
    """
    if name is None:
        return None
    if device.split(':', 1)[0] != 'cuda':
        return f'argument --gpu: names a CUDA card; drop it, or pass --device cuda to plan for {name}'
    if not estimate:
        return (f'argument --gpu: plans for a card that is not here and needs --estimate; add --estimate, or drop '
                f'--gpu to measure the card here')
    try:
        find_card(name)
    except UsageError as e:
        return f'argument {e}'
    return None
