"""PyTorch's CUDA caching allocator, replayed in plain Python: where each block lands, and when the card runs out.

A card runs out of memory when the allocator cannot place a block, not when live bytes pass its size. The rules are
torch 2.14's (c10/cuda/CUDACachingAllocator.cpp, `DeviceCachingAllocator`), on one stream, with the options of
`timm_ext.memory_model.allocator_config.AllocatorConfig` (its `round_size` and `segment_size`):

* a request takes the smallest free block of its pool that holds it (`get_free_block`: best fit, lowest address on
  ties); a request under `max_split_size` never takes a block at or above it, and a larger request takes a block only
  when less than `max_non_split_rounding` larger;
* the block is split when the rest is at least 512 B in the small pool or with expandable segments, else when the
  request is under `max_split_size` and more than 1 MiB remains (`should_split`);
* a freed block merges with its free neighbours of the same segment (`free_block`);
* when no free block fits: under a memory-fraction cap with `garbage_collection_threshold`, old wholly free large
  segments are released first (`garbage_collect_cached_blocks`); then a new segment is tried, then oversize free
  segments are released (`release_available_cached_blocks`), then every wholly free segment (`release_cached_blocks`)
  and the segment tried once more; then the request fails (`OutOfMemory`). What is released, and what `cacheInfo`
  reports, is `timm_ext.memory_model.cache_release`'s.

With expandable segments each pool is one segment that maps pages as it grows (2 MiB small, `large_segment_size`
large), and on failure the pages no live block touches are unmapped.
"""
import bisect
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from .allocator_config import MIN_BLOCK, NO_LIMIT, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE, AllocatorConfig
from .cache_release import garbage_to_collect, oversize_to_release

__all__ = ['OutOfMemory', 'Block', 'Segment', 'CachingAllocator', 'page_runs', 'ROUND_LARGE']


class OutOfMemory(Exception):
    """The allocator could not place a block, even after releasing its wholly free segments."""


def page_runs(pages: Iterable[int]) -> List[Tuple[int, int]]:
    """The runs of consecutive page indices in `pages`, as (first, end) pairs in order."""
    runs: List[List[int]] = []
    for index in sorted(pages):
        if runs and runs[-1][1] == index:
            runs[-1][1] += 1
        else:
            runs.append([index, index + 1])
    return [(first, end) for first, end in runs]


@dataclass(eq=False)
class Segment:
    """A cudaMalloc'ed range (or, expandable, one pool's growing range)."""
    address: int
    size: int
    small: bool
    blocks: List['Block'] = field(default_factory=list)  # in address order
    mapped: set = field(default_factory=set)  # expandable: the indices of its mapped pages


@dataclass(eq=False)
class Block:
    """A range of a segment, live (with the bytes asked for) or free."""
    segment: Segment
    address: int
    size: int
    requested: int = 0
    live: bool = False
    tag: object = None  # the caller's label (the snapshot's frames)
    gc_base: int = 0  # its pool's count of free-block searches when it was freed (its age is the count since)


class CachingAllocator:
    """The allocator of one device with `capacity` bytes for segments (the card less what lies outside the allocator).

    Args:
        capacity: Bytes cudaMalloc can still hand out when the run starts.
        config: The allocator options (`AllocatorConfig`; its expandable segments: see the module doc).
        record: Keep a trace of alloc / free / segment events (the snapshot's `device_traces`).
        capped: A memory fraction (`set_per_process_memory_fraction`) caps the allocator at `capacity`: only then does
            `garbage_collection_threshold` act (`allowed_memory_maximum`).
        device_bytes: What cudaMalloc could hand out on the device when the run starts, a cap aside (the card less what
            lies outside the allocator); None: `capacity` (no cap). Only the device's free memory (cudaMemGetInfo's,
            which no memory-fraction cap lowers) reads it: `device_bytes - reserved`.
    """

    def __init__(self, capacity: int, config: AllocatorConfig = AllocatorConfig(), record: bool = False,
                 capped: bool = False, device_bytes: Optional[int] = None):
        self.capacity = capacity
        self.device_bytes = max(capacity, device_bytes or 0)
        self.config = config
        self.expandable = config.expandable_segments
        self._collects = capped and config.garbage_collection_threshold > 0
        self.searches = {True: 0, False: 0}  # small? -> the pool's free-block searches (`get_free_blocks_call_count`)
        self.segments: List[Segment] = []
        self.pools: Dict[bool, List[Tuple[int, int, Block]]] = {True: [], False: []}  # small? -> sorted (size, addr)
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.trace: Optional[List[dict]] = [] if record else None
        self._next_address = 1 << 40

    # -- the pools -------------------------------------------------------------------------------------------------
    def _insert_free(self, block: Block) -> None:
        block.gc_base = self.searches[block.segment.small]
        bisect.insort(self.pools[block.segment.small], (block.size, block.address, block))

    def _remove_free(self, block: Block) -> None:
        pool = self.pools[block.segment.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]

    def _best_fit(self, size: int, small: bool) -> Optional[Block]:
        """`get_free_block`: the smallest free block that holds `size`, unless max_split_size rules it out."""
        self.searches[small] += self._collects
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block, limit = pool[i][2], self.config.max_split_size
        if size < limit <= block.size or (size >= limit and block.size >= size + self.config.max_non_split_rounding):
            return None
        return block

    def page_size(self, small: bool) -> int:
        """An expandable segment's page in a pool: 2 MiB small, `large_segment_size` large."""
        return SMALL_BUFFER if small else self.config.large_segment_size

    def _event(self, action: str, address: int, size: int, tag: object = None) -> None:
        if self.trace is not None:
            self.trace.append(dict(action=action, addr=address, size=size, tag=tag))

    def _page_events(self, action: str, segment: Segment, pages: Iterable[int]) -> None:
        """One event per run of contiguous pages: `map_block` and `unmap_block` each record the one range they map."""
        page = self.page_size(segment.small)
        for first, end in page_runs(pages):
            self._event(action, segment.address + first * page, (end - first) * page)

    # -- segments --------------------------------------------------------------------------------------------------
    def _new_segment(self, size: int, small: bool) -> Optional[Block]:
        """cudaMalloc a segment for a rounded request (None when the card has no room)."""
        if self.expandable:
            return self._grow(size, small)
        nbytes = self.config.segment_size(size)
        if self.reserved + nbytes > self.capacity:
            return None
        segment = Segment(self._next_address, nbytes, small)
        self._next_address += nbytes + ROUND_LARGE  # segments never touch: blocks cannot merge across them
        block = Block(segment, segment.address, nbytes)
        segment.blocks.append(block)
        self.segments.append(segment)
        self._add_reserved(nbytes)
        self._event('segment_alloc', segment.address, nbytes)
        return block

    def _add_reserved(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _release_cached(self) -> bool:
        """Release what no live block uses (`release_cached_blocks`); whether anything was released."""
        if self.expandable:
            return self._unmap_free_pages()
        free = [s.blocks[0] for s in self.segments if len(s.blocks) == 1 and not s.blocks[0].live]
        self.release_segments(free)
        return bool(free)

    def release_segments(self, blocks: Iterable[Block]) -> None:
        """cudaFree the wholly free segments of free `blocks` (`release_block`)."""
        for segment in [block.segment for block in blocks]:
            self._remove_free(segment.blocks[0])
            self.segments.remove(segment)
            self.reserved -= segment.size
            self._event('segment_free', segment.address, segment.size)

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()` (what cuDNN's benchmark does after its search)."""
        self._release_cached()

    # -- expandable segments ---------------------------------------------------------------------------------------
    def _pool_segment(self, small: bool) -> Segment:
        for segment in self.segments:
            if segment.small == small:
                return segment
        segment = Segment(self._next_address, 0, small)
        self._next_address += 1 << 36  # room to grow
        self.segments.append(segment)
        return segment

    def _grow(self, size: int, small: bool) -> Optional[Block]:
        """Extend the pool's segment at its end (its free tail included) by pages; None when the card has no room."""
        segment = self._pool_segment(small)
        tail = segment.blocks[-1] if segment.blocks and not segment.blocks[-1].live else None
        start = tail.address if tail else segment.address + segment.size
        if not self._map(segment, start, size):
            return None
        end = start + size
        page = self.page_size(small)
        new_end = segment.address + -(-(end - segment.address) // page) * page
        if tail is None:
            tail = Block(segment, start, 0)
            segment.blocks.append(tail)
        else:
            self._remove_free(tail)
        tail.size = new_end - tail.address
        segment.size = new_end - segment.address
        return tail

    def _map(self, segment: Segment, start: int, size: int) -> bool:
        """Map the pages [start, start + size) touches; False (nothing mapped) when the card has no room."""
        page = self.page_size(segment.small)
        first, last = (start - segment.address) // page, (start + size - 1 - segment.address) // page
        missing = [p for p in range(first, last + 1) if p not in segment.mapped]
        if self.reserved + page * len(missing) > self.capacity:
            return False
        segment.mapped.update(missing)
        self._add_reserved(page * len(missing))
        self._page_events('segment_map', segment, missing)
        return True

    def _unmap_free_pages(self) -> bool:
        released = False
        for segment in self.segments:
            page = self.page_size(segment.small)
            used = set()
            for block in segment.blocks:
                if block.live:
                    used.update(range((block.address - segment.address) // page,
                                      (block.address + block.size - 1 - segment.address) // page + 1))
            unmapped = segment.mapped - used
            if unmapped:
                segment.mapped -= unmapped
                self.reserved -= page * len(unmapped)
                self._page_events('segment_unmap', segment, unmapped)
                released = True
        return released

    # -- malloc and free -------------------------------------------------------------------------------------------
    def _take_free(self, size: int, small: bool) -> Optional[Block]:
        """A cached free block for a rounded request (expandable: with its pages mapped), or None."""
        block = self._best_fit(size, small)
        if block is not None:
            self._remove_free(block)
            if not self.expandable or self._map(block.segment, block.address, size):
                return block
            self._insert_free(block)
        return None

    def _place(self, size: int, small: bool) -> Optional[Block]:
        """A free block for a rounded request, from the pool or a new segment (None when neither has room)."""
        return self._take_free(size, small) or self._new_segment(size, small)

    def malloc(self, nbytes: int, tag: object = None) -> Block:
        """Place a request of `nbytes`.

        Raises:
            OutOfMemory: Not even after releasing the cache.
        """
        size = self.config.round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small)
        if block is None and self._collects and not self.expandable:
            excess = self.reserved - int(self.config.garbage_collection_threshold * self.capacity)
            self.release_segments(garbage_to_collect(self.pools[False], excess, self.searches[False]))
        if block is None:
            block = self._new_segment(size, small)
        if block is None and not self.expandable and self.config.max_split_size != NO_LIMIT:
            oversize, enough = oversize_to_release(self.pools[small], size, self.config.max_split_size)
            self.release_segments(oversize)
            block = self._new_segment(size, small) if enough else None
        if block is None and self._release_cached():
            block = self._place(size, small)
        if block is None:
            self._event('oom', self.device_bytes - self.reserved, size, tag)  # torch records cudaMemGetInfo's free
            raise OutOfMemory(f'cannot place {size} B with {self.reserved} B reserved of {self.capacity} B')
        rest = block.size - size
        if rest >= MIN_BLOCK if small or self.expandable else size < self.config.max_split_size and rest > SMALL_SIZE:
            remainder = Block(block.segment, block.address + size, rest)
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, remainder)
            block.size = size
            self._insert_free(remainder)
        block.live, block.requested, block.tag = True, nbytes, tag
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._event('alloc', block.address, nbytes, tag)
        return block

    def free(self, block: Block) -> None:
        """Return a live block to its pool, merged with its free neighbours."""
        self._event('free_requested', block.address, block.requested, block.tag)
        self._event('free_completed', block.address, block.requested, block.tag)
        block.live, block.tag = False, None
        self.allocated -= block.size
        blocks = block.segment.blocks
        i = blocks.index(block)
        for j in (i + 1, i - 1):  # the next neighbour first, so that `i` stays right for the previous one
            if 0 <= j < len(blocks) and not blocks[j].live:
                neighbour = blocks[j]
                self._remove_free(neighbour)
                block.address = min(block.address, neighbour.address)
                block.size += neighbour.size
                blocks.remove(neighbour)
        self._insert_free(block)
