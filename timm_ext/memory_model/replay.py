"""A traced step replayed on the caching allocator: the least memory it needs, and the largest batch that fits.

The answer is the least device memory at which `iterations` steps run without an out-of-memory error, with the
allocator's failure path (`timm_ext.memory_model.allocator`), found by bisection over segment-sized capacities. It is
not the unlimited run's reserved peak: when the card runs short, the allocator releases its wholly free segments and
tries again, and cuDNN's workspaces shrink to what is left (`timm_ext.memory_model.kernels`, `_cudnn_workspace`).

A step log (`timm_ext.memory_model.events.step_log`) is replayed as the training loop runs it: what was live before the
step is allocated first (weights, optimizer state, the resident batch), then the step's events `iterations` times,
each step freeing what the step before it left (its output, its gradients) where the trace freed it. Under gradient
accumulation (`accumulating`) the gradients stay resident and each new one is a temporary summed into them.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Type

from .allocator import ROUND_LARGE, Block, CachingAllocator, OutOfMemory
from .allocator_config import AllocatorConfig
from .cache_release import cache_info
from .kernels import cuda_allocations
from .versions import PINNED, Software

__all__ = ['ReplayConfig', 'replay', 'fits', 'least_memory', 'largest_batch']

UNLIMITED = 1 << 62


@dataclass(frozen=True)
class ReplayConfig:
    """How the step runs.

    Attributes:
        iterations: Steps replayed (the first differs: no step before it, cuDNN's search; the rest repeat).
        cudnn_benchmark: cuDNN searches its plans on each new convolution shape, then empties the cache (train.py and
            validate.py set `torch.backends.cudnn.benchmark`).
        allocator: The allocator options the run starts with (`timm_ext.memory_model.allocator_config`).
        accumulating: Gradients resident from the start (gradient accumulation; or zero_grad() that keeps them).
        compute_capability: The card's, when known.
        software: The torch, CUDA and cuDNN whose rules the kernels follow (`timm_ext.memory_model.versions`).
        cudnn_workspace_scale: The cuDNN convolution workspace a plan asks, as a multiple of the kernel model's (a
            stated assumption: `bench/bench_gpu_tables.py` scores the tables with it halved and doubled).
        device_bytes: Under a memory-fraction cap, what the card leaves the allocator without it (the card less what
            lies outside the allocator): cuDNN's search reads the device's free memory, which the cap does not lower
            (`timm_ext.memory_model.cache_release.cache_info`). None: the capacity replayed is the whole device's.
    """
    iterations: int = 3
    cudnn_benchmark: bool = True
    allocator: AllocatorConfig = AllocatorConfig()
    accumulating: bool = False
    compute_capability: Optional[Tuple[int, int]] = None
    software: Software = PINNED
    cudnn_workspace_scale: float = 1.0
    device_bytes: Optional[int] = None


def _try_malloc(allocator: CachingAllocator, nbytes: int, tag: tuple) -> Optional[Block]:
    """A workspace of `nbytes`, or None where it is 0 (`allocate(0)` takes nothing) or does not fit."""
    try:
        return allocator.malloc(nbytes, tag) if nbytes else None
    except OutOfMemory:
        return None


def _search(allocator: CachingAllocator, nbytes: int, tag: tuple) -> int:
    """cuDNN's benchmark search (Conv_v8.cpp `generate_and_filter_plans`): the plans kept are those whose workspace
    fits `get_available_workspace`, the allocator's `cacheInfo` from 0 (cudaMemGetInfo's free memory, which a fraction
    cap does not lower, or the largest cached free block where larger: `cache_info`), so the search may open a segment
    or start above the cap; the largest kept workspace is allocated, halved on each out-of-memory down to 0, and freed
    when the search ends. Returns the workspace the chosen plan runs with.

    Assumption (no source: the kernel model gives one workspace per convolution, the largest plan's): plans exist at
    every workspace below it, and the fastest kept plan uses the largest kept workspace.
    """
    size = min(nbytes, cache_info(allocator.pools.values(), allocator.device_bytes - allocator.reserved))
    while size:
        block = _try_malloc(allocator, size, tag)
        if block is not None:
            allocator.free(block)
            return size
        size //= 2
    return 0


def _cudnn_workspace(allocator: CachingAllocator, nbytes: int, tag: tuple, plans: dict,
                     config: ReplayConfig) -> Optional[Block]:
    """The workspace a cuDNN convolution runs with (Conv_v8.cpp `run_single_conv`), None for none.

    A plan found before runs with its workspace; where that runs out of memory, the plan is found again. With
    `cudnn.benchmark` the plans are searched (`_search`, then the cache is emptied); without it the heuristics' plans
    are tried in order, the next on each out-of-memory (`try_configs`). Assumption (no source: the heuristics' order
    is cuDNN's): the first asks for the kernel model's workspace, and the next needs none.
    """
    key = tag[1]
    if key in plans:
        block = _try_malloc(allocator, plans[key], tag)
        if block is not None or not plans[key]:
            return block
    if config.cudnn_benchmark:
        plans[key] = _search(allocator, nbytes, tag)
        allocator.empty_cache()
        return _try_malloc(allocator, plans[key], tag)
    block = _try_malloc(allocator, nbytes, tag)
    plans[key] = nbytes if block is not None else 0
    return block


def _run_op(allocator: CachingAllocator, event: list, names: list, kept: dict, plans: dict,
            config: ReplayConfig) -> None:
    signature, where = names[event[1]], names[event[2]]
    transient = []
    for nbytes, life, key in cuda_allocations(signature, event[3:], where.startswith('backward'),
                                              config.compute_capability, software=config.software):
        tag = ('workspace', key, where)
        if life == 'kept':
            if key not in kept:
                kept[key] = allocator.malloc(nbytes, tag)
        elif life == 'op':
            transient.append(allocator.malloc(nbytes, tag))
        elif life == 'saved':  # held for the op's backward, which releases the latest one (autograd's order)
            kept.setdefault(('saved', key), []).append(allocator.malloc(nbytes, ('activations', key, where)))
        elif life == 'release':
            if kept.get(('saved', key)):
                allocator.free(kept[('saved', key)].pop())
        else:
            block = _cudnn_workspace(allocator, int(nbytes * config.cudnn_workspace_scale), tag, plans, config)
            transient += [block] if block is not None else []
    for block in transient:
        allocator.free(block)


def replay(log: dict, capacity: int, config: ReplayConfig = ReplayConfig(), record: bool = False,
           allocator_type: Type[CachingAllocator] = CachingAllocator) -> CachingAllocator:
    """Run the step's log `config.iterations` times on an allocator of `capacity` bytes (of `allocator_type`;
    `record`: keep its trace).

    Raises:
        OutOfMemory: Where the card ran out.
    """
    names = log['names']
    allocator = allocator_type(capacity, config.allocator, record, device_bytes=config.device_bytes)
    for nbytes, category, op, where in log['residents']:
        allocator.malloc(nbytes, (names[category], names[op], names[where]))
    gradients = names.index('gradients') if 'gradients' in names else -1
    accumulated = {}  # accumulating: the resident gradient of each signature
    kept, plans, previous = {}, {}, {}  # cuBLAS workspaces, cuDNN plans' workspaces by convolution
    for _ in range(config.iterations):
        live, ranks, allocations = {}, {}, 0
        for event in log['events']:
            kind = event[0]
            if kind == 'a':
                key, allocations = allocations, allocations + 1
                signature = tuple(event[2:5])
                rank = ranks[signature] = ranks.get(signature, -1) + 1
                block = allocator.malloc(event[1], (names[event[2]], names[event[3]], names[event[4]]))
                if config.accumulating and event[2] == gradients:
                    if (*signature, rank) in accumulated:
                        allocator.free(block)  # summed into the resident gradient at once
                    else:  # the window's first gradient stays
                        accumulated[(*signature, rank)] = block
                    continue
                live[key] = block, (*signature, rank)
            elif kind == 'f':
                entry = live.pop(event[1], None)
                if entry is not None:
                    allocator.free(entry[0])
            elif kind == 'p':
                block = previous.pop(tuple(event[1:5]), None)
                if block is not None:
                    allocator.free(block)
            else:
                _run_op(allocator, event, names, kept, plans, config)
        previous = {signature: block for block, signature in live.values()}
    return allocator


def fits(log: dict, capacity: int, config: ReplayConfig = ReplayConfig()) -> bool:
    """Whether the step runs `config.iterations` times in `capacity` bytes."""
    try:
        replay(log, capacity, config)
    except OutOfMemory:
        return False
    return True


def least_memory(log: dict, config: ReplayConfig = ReplayConfig()) -> int:
    """The least capacity (a multiple of 2 MiB, the segments' granularity) at which the step runs without running
    out: bisected between the unlimited run's allocated peak and its reserved peak."""
    unlimited = replay(log, UNLIMITED, config)
    low = unlimited.peak_allocated // ROUND_LARGE  # in 2 MiB units: low fails (or is the answer), high fits
    high = -(-unlimited.peak_reserved // ROUND_LARGE)
    if fits(log, low * ROUND_LARGE, config):
        return low * ROUND_LARGE
    while high - low > 1:
        middle = (low + high) // 2
        if fits(log, middle * ROUND_LARGE, config):
            high = middle
        else:
            low = middle
    return high * ROUND_LARGE


def largest_batch(log_at: Callable[[int], dict], capacity: int, guess: int, config: ReplayConfig = ReplayConfig(),
                  limit: Optional[int] = None) -> int:
    """The largest batch whose step runs in `capacity` bytes (0: not even 1), searched from `guess` up or down.

    Args:
        log_at: The step log at a batch size (`timm_ext.memory_model.events.ScaledLog.at`).
        limit: A batch never to pass (the kernels' launch limits).
    """
    def holds(batch: int) -> bool:
        return fits(log_at(batch), capacity, config)

    top = limit or UNLIMITED
    guess = max(1, min(guess, top))
    if holds(guess):  # double until a batch fails (or the limit)
        low, high = guess, None
        while high is None:
            if low >= top:
                return top
            if holds(min(top, low * 2)):
                low = min(top, low * 2)
            else:
                high = min(top, low * 2)
    else:  # halve until a batch holds
        low, high = 0, guess
        while high > 1 and not low:
            if holds(high // 2):
                low = high // 2
            else:
                high //= 2
        if not low:
            return 0
    while high - low > 1:
        middle = (low + high) // 2
        if holds(middle):
            low = middle
        else:
            high = middle
    return low
