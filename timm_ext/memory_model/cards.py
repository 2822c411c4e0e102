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
  (`timm_ext.memory_model.contexts.cuda_context`, from published measurements). The allocator may use the capacity
  less the context (`Card.allocator_bytes_for`).

Names are lower case with hyphens; a few obvious aliases are accepted, case-insensitively (`find_card`).
"""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..errors import UsageError
from ..memory import BudgetError, MemoryBudget, format_bytes
from .contexts import CudaContext, cuda_context
from .versions import PINNED, Software

__all__ = ['Card', 'CARDS', 'COMPUTE_CAPABILITY_SOURCE', 'MULTIPROCESSORS_SOURCE', 'find_card', 'card_flag_problem']

GiB = 1 << 30
COMPUTE_CAPABILITY_SOURCE = 'https://developer.nvidia.com/cuda-gpus'
MULTIPROCESSORS_SOURCE = ('NVIDIA\'s architecture whitepapers (Turing, Ampere GA100 and GA102, Ada, Hopper, Blackwell) '
                          'and the T4, L4, A10, L40S, H200, B200 and RTX PRO 6000 data sheets')


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
        multiprocessors: Its streaming multiprocessors (`multi_processor_count`), from NVIDIA's architecture
            whitepapers and data sheets (`MULTIPROCESSORS_SOURCE`): inductor sizes split reductions and kernel
            launches by it (`timm_ext.memory_model.fake_cuda`).
    """
    name: str
    title: str
    reported_bytes: int
    reported_source: str
    compute_capability: Tuple[int, int]
    aliases: Tuple[str, ...] = ()
    note: str = ''
    multiprocessors: int = 0

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
                 'the smallest recent figure is kept', multiprocessors=40),
    Card('l4', 'NVIDIA L4', _gib(22.03), _ISSUE.format('ArcInstitute/evo2', 190), (8, 9), multiprocessors=58),
    Card('a10', 'NVIDIA A10', _gib(21.99), _ISSUE.format('zai-org/CogVLM', 236), (8, 6), aliases=('a10g',),
         note='an A10G (AWS\'s A10, the same 24 GB GDDR6) read 22.49 GiB under a 2022 driver '
              '(https://github.com/AUTOMATIC1111/stable-diffusion-webui/issues/1259); the recent figure is kept',
         multiprocessors=72),
    Card('rtx3090', 'GeForce RTX 3090', _gib(23.70), _ISSUE.format('GaoLii/DSP', 10), (8, 6),
         aliases=('3090', 'rtx-3090'), multiprocessors=82),
    Card('rtx4090', 'GeForce RTX 4090', _gib(23.64), _ISSUE.format('TMElyralab/MuseTalk', 76), (8, 9),
         aliases=('4090', 'rtx-4090'), multiprocessors=128),
    Card('rtx5090', 'GeForce RTX 5090', _gib(31.36), _ISSUE.format('TrajectoryCrafter/TrajectoryCrafter', 20), (12, 0),
         aliases=('5090', 'rtx-5090'), multiprocessors=170),
    Card('l40s', 'NVIDIA L40S', _gib(44.42), _ISSUE.format('stepfun-ai/Step-Video-T2V', 8), (8, 9),
         multiprocessors=142),
    Card('a100-40gb', 'NVIDIA A100 40GB', _gib(39.25), _SEEN.format('39.25'), (8, 0),
         aliases=('a100-40g', 'a100-sxm4-40gb'),
         note='other drivers report up to 39.50 GiB (https://github.com/TianheWu/CoSeR/issues/10); the smallest '
              'figure seen is kept', multiprocessors=108),
    Card('a100-80gb', 'NVIDIA A100 80GB', _gib(79.25), _ISSUE.format('HiDream-ai/VAREdit', 6), (8, 0),
         aliases=('a100-80g', 'a100-sxm4-80gb'), multiprocessors=108),
    Card('h100-80gb', 'NVIDIA H100 80GB HBM3', _gib(79.11), _ISSUE.format('vllm-project/vllm', 27508), (9, 0),
         aliases=('h100', 'h100-sxm'), multiprocessors=132),
    Card('h200', 'NVIDIA H200', _gib(139.72), _SEEN.format('139.72'), (9, 0), aliases=('h200-141gb',),
         note='other drivers report up to 139.81 GiB (https://github.com/sungwon-chae/arxiv_confi, etu_logging.md); '
              'the smallest figure seen is kept', multiprocessors=132),
    Card('b200', 'NVIDIA B200', _gib(178.35), 'https://github.com/pytorch/ao/pull/4002', (10, 0), multiprocessors=148),
    Card('rtx-pro-6000', 'RTX PRO 6000 Blackwell Workstation Edition', _gib(94.97),
         _ISSUE.format('antirez/ds4', 431), (12, 0), aliases=('rtx-pro-6000-blackwell', 'rtxpro6000', 'pro6000'),
         multiprocessors=188),
    Card('rtx-pro-6000-max-q', 'RTX PRO 6000 Blackwell Max-Q Workstation Edition', _gib(94.97),
         _ISSUE.format('antirez/ds4', 431), (12, 0), aliases=('pro6000maxq', 'rtx-pro-6000-maxq'),
         note='read on the Workstation Edition, whose 96 GB GDDR7 the Max-Q board carries too (an assumption)',
         multiprocessors=188),
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
