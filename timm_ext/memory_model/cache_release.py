"""What the caching allocator releases, beyond its wholly free segments, when no cached block fits a request, and what
it reports of its cache to cuDNN.

`oversize_to_release` and `garbage_to_collect` are torch 2.14's (c10/cuda/CUDACachingAllocator.cpp, `DeviceCachingAllocator`) and act only where an option
asks: `oversize_to_release` under `max_split_size_mb`, `garbage_to_collect` under `garbage_collection_threshold` with a
memory-fraction cap. Only wholly free segments are released (`release_block` cudaFrees a whole segment). Each says
which free blocks to release and the allocator (`timm_ext.memory_model.allocator`) releases their segments: this
module knows a pool only as its sorted (size, address, block) entries and a block's `size`, `segment.blocks` and
`gc_base`.

`cache_info` is `cacheInfo` called with 0, as cuDNN's benchmark search calls it (aten/src/ATen/native/cudnn/Conv_v8.cpp
`get_available_workspace`): CUDACachingAllocator.cpp `DeviceCachingAllocator::cacheInfo` starts from cudaMemGetInfo's
free memory and raises it to the largest cached free block of any pool (`cache_info_aux`); the same in torch 1.12.1,
2.9.1 and 2.14.1. cudaMemGetInfo knows nothing of `set_per_process_memory_fraction` (only `allowed_memory_maximum`,
checked in `alloc_block`, does), so under a fraction cap the search starts from the card's free memory, above the cap.
"""
from typing import Iterable, List, Sequence, Tuple

__all__ = ['oversize_to_release', 'garbage_to_collect', 'cache_info']


def _whole(pool: Sequence[tuple]) -> list:
    """The free blocks of a pool that are a whole segment, smallest first."""
    return [entry[2] for entry in pool if len(entry[2].segment.blocks) == 1]


def oversize_to_release(pool: Sequence[tuple], size: int, limit: int) -> Tuple[list, bool]:
    """`release_available_cached_blocks` under max_split_size `limit`: (the free blocks whose segments to release,
    whether that releases enough). The smallest free oversize segment that holds the request, else the largest ones
    down to `limit` until as much as the request is released."""
    key = max(size, limit)
    whole = _whole(pool)  # oversize blocks are never split
    fitting = [b for b in whole if b.size >= key]
    if fitting:
        return fitting[:1], True
    released, chosen = 0, []
    for block in reversed(whole):
        if released >= key or block.size < limit:
            break
        chosen.append(block)
        released += block.size
    return chosen, released >= key


def garbage_to_collect(pool: Sequence[tuple], excess: int, searches: int) -> List:
    """`garbage_collect_cached_blocks` with `excess` bytes reserved above the threshold's share of the cap: the wholly
    free large-pool blocks at least as old as the average (a block's age is the pool's free-block searches since it was
    freed), again over the rest, until the excess is released."""
    if excess <= 0:
        return []
    ages = {b: searches - b.gc_base for b in _whole(pool)}
    total, reclaimed, chosen = sum(ages.values()), 0, []
    while reclaimed < excess and ages:
        average = total / len(ages)
        old = [b for _, _, b in pool if b in ages and ages[b] >= average]
        for block in old:
            reclaimed += block.size
            total -= ages.pop(block)
            chosen.append(block)
        if not old:
            break
    return chosen


def cache_info(pools: Iterable[Sequence[tuple]], device_free: int) -> int:
    """`cacheInfo` from 0: `device_free` (cudaMemGetInfo's free memory: the device's, whatever the cap), or the largest
    cached free block of any of `pools` where that is larger."""
    return max([device_free] + [pool[-1][0] for pool in pools if pool])
