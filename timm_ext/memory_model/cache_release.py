"""What the caching allocator releases, beyond its wholly free segments, when no cached block fits a request.

Both are torch 2.14's (c10/cuda/CUDACachingAllocator.cpp, `DeviceCachingAllocator`) and act only where an option
asks: `release_oversize` under `max_split_size_mb`, `garbage_collect` under `garbage_collection_threshold` with a
memory-fraction cap. Only wholly free segments are released (`release_block` cudaFrees a whole segment).
"""
from typing import TYPE_CHECKING

from .allocator_config import NO_LIMIT

if TYPE_CHECKING:
    from .allocator import CachingAllocator

__all__ = ['release_oversize', 'garbage_collect']


def release_oversize(allocator: 'CachingAllocator', size: int, small: bool) -> bool:
    """`release_available_cached_blocks` (only under max_split_size): the smallest free oversize segment that
    holds the request, else the largest ones down to max_split_size until as much is released."""
    limit, pool = allocator.config.max_split_size, allocator.pools[small]
    if limit == NO_LIMIT or allocator.expandable:
        return False
    key = max(size, limit)
    whole = [entry[2] for entry in pool if len(entry[2].segment.blocks) == 1]  # oversize blocks are never split
    fitting = [b for b in whole if b.size >= key]
    if fitting:
        allocator.release_segment(fitting[0].segment)
        return True
    released = 0
    for block in reversed(whole):
        if released >= key or block.size < limit:
            break
        allocator.release_segment(block.segment)
        released += block.size
    return released >= key


def garbage_collect(allocator: 'CachingAllocator') -> None:
    """`garbage_collect_cached_blocks`: above the threshold's share of the cap, release the wholly free large
    segments at least as old as the average, and again over the rest, until the excess is released."""
    threshold = int(allocator.config.garbage_collection_threshold * allocator.capacity)
    if allocator.reserved <= threshold or allocator.expandable:
        return
    target, reclaimed = allocator.reserved - threshold, 0
    pool = allocator.pools[False]
    ages = {b: allocator.searches[False] - b.gc_base for _, _, b in pool if len(b.segment.blocks) == 1}
    total = sum(ages.values())
    while reclaimed < target and ages:
        average = total / len(ages)
        old = [b for _, _, b in pool if b in ages and ages[b] >= average]
        for block in old:
            reclaimed += block.size
            total -= ages.pop(block)
            allocator.release_segment(block.segment)
        if not old:
            break
