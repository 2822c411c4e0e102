"""PyTorch's CUDA caching allocator, replayed in plain Python: where each block lands, and when the card runs out.

A card runs out of memory when the allocator cannot place a block, not when live bytes pass its size. The rules and
constants are PyTorch 2.14's (c10/cuda/CUDACachingAllocator.cpp, c10/core/AllocatorConfig.h), with the default
configuration (no `max_split_size_mb`, no garbage collection threshold, one stream):

* a request is rounded up to 512 B (`kMinBlockSize`);
* up to 1 MiB (`kSmallSize`) it comes from the small pool, whose segments are 2 MiB (`kSmallBuffer`); under 10 MiB
  (`kMinLargeAlloc`) a new segment is 20 MiB (`kLargeBuffer`); larger segments are the request rounded up to 2 MiB
  (`kRoundLarge`);
* a request takes the smallest free block of its pool that holds it (best fit, lowest address first on ties); the
  block is split when the rest is at least 512 B (small pool) or more than 1 MiB (large pool);
* a freed block merges with its free neighbours of the same segment;
* when no free block fits and a new segment would pass the card, every segment that is wholly free is released
  (`release_cached_blocks`) and the segment tried once more; then the request fails (`OutOfMemory`).

With `expandable_segments` (`PYTORCH_ALLOC_CONF` or `PYTORCH_CUDA_ALLOC_CONF`) each pool is one segment that maps
pages as it grows (2 MiB small, 20 MiB large), and on failure the pages no live block touches are unmapped.
"""
import bisect
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

__all__ = ['OutOfMemory', 'Block', 'Segment', 'CachingAllocator', 'expandable_segments_asked', 'page_runs',
           'round_size', 'segment_size', 'MIN_BLOCK', 'SMALL_SIZE', 'SMALL_BUFFER', 'LARGE_BUFFER', 'MIN_LARGE_ALLOC',
           'ROUND_LARGE']

MiB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small pool segment (and an expandable small pool page)
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the segment of a request under kMinLargeAlloc (and a large pool page)
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger segments are rounded up to it


class OutOfMemory(Exception):
    """The allocator could not place a block, even after releasing its wholly free segments."""


def round_size(n: int) -> int:
    """The bytes a request of `n` takes from a block (`round_size`, without power-of-two divisions)."""
    return MIN_BLOCK * max(1, -(-n // MIN_BLOCK))


def segment_size(size: int) -> int:
    """The bytes of the segment cudaMalloc'ed for a rounded request that no cached block holds
    (`get_allocation_size`)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


def expandable_segments_asked(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the allocator configuration in the environment turns expandable segments on (PYTORCH_ALLOC_CONF wins
    over the older PYTORCH_CUDA_ALLOC_CONF)."""
    conf = environ.get('PYTORCH_ALLOC_CONF', environ.get('PYTORCH_CUDA_ALLOC_CONF', ''))
    for option in conf.split(','):
        key, _, value = option.partition(':')
        if key.strip() == 'expandable_segments':
            return value.strip().lower() == 'true'
    return False


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


class CachingAllocator:
    """The allocator of one device with `capacity` bytes for segments (the card less what lies outside the allocator).

    Args:
        capacity: Bytes cudaMalloc can still hand out when the run starts.
        expandable: Expandable segments (see the module doc).
        record: Keep a trace of alloc / free / segment events (the snapshot's `device_traces`).
    """

    def __init__(self, capacity: int, expandable: bool = False, record: bool = False):
        self.capacity = capacity
        self.expandable = expandable
        self.segments: List[Segment] = []
        self.pools: Dict[bool, List[Tuple[int, int, Block]]] = {True: [], False: []}  # small? -> sorted (size, addr)
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.trace: Optional[List[dict]] = [] if record else None
        self._next_address = 1 << 40

    # -- the pools -------------------------------------------------------------------------------------------------
    def _insert_free(self, block: Block) -> None:
        bisect.insort(self.pools[block.segment.small], (block.size, block.address, block))

    def _remove_free(self, block: Block) -> None:
        pool = self.pools[block.segment.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]

    def _best_fit(self, size: int, small: bool) -> Optional[Block]:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        return pool[i][2] if i < len(pool) else None

    def largest_free_block(self) -> int:
        """The largest cached free block (`cacheInfo`'s max block size: the large pool's)."""
        pool = self.pools[False]
        return pool[-1][0] if pool else 0

    def _event(self, action: str, address: int, size: int, tag: object = None) -> None:
        if self.trace is not None:
            self.trace.append(dict(action=action, addr=address, size=size, tag=tag))

    def _page_events(self, action: str, segment: Segment, pages: Iterable[int]) -> None:
        """One event per run of contiguous pages: `map_block` and `unmap_block` each record the one range they map."""
        page = SMALL_BUFFER if segment.small else LARGE_BUFFER
        for first, end in page_runs(pages):
            self._event(action, segment.address + first * page, (end - first) * page)

    # -- segments --------------------------------------------------------------------------------------------------
    def _new_segment(self, size: int, small: bool) -> Optional[Block]:
        """cudaMalloc a segment for a rounded request (None when the card has no room)."""
        if self.expandable:
            return self._grow(size, small)
        nbytes = segment_size(size)
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
        released = False
        for segment in [s for s in self.segments if len(s.blocks) == 1 and not s.blocks[0].live]:
            self._remove_free(segment.blocks[0])
            self.segments.remove(segment)
            self.reserved -= segment.size
            self._event('segment_free', segment.address, segment.size)
            released = True
        return released

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
        page = SMALL_BUFFER if small else LARGE_BUFFER
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
        page = SMALL_BUFFER if segment.small else LARGE_BUFFER
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
            page = SMALL_BUFFER if segment.small else LARGE_BUFFER
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
    def _place(self, size: int, small: bool) -> Optional[Block]:
        """A free block for a rounded request, from the pool or a new segment (None when neither has room)."""
        block = self._best_fit(size, small)
        if block is not None:
            self._remove_free(block)
            if not self.expandable or self._map(block.segment, block.address, size):
                return block
            self._insert_free(block)
        return self._new_segment(size, small)

    def malloc(self, nbytes: int, tag: object = None) -> Block:
        """Place a request of `nbytes`.

        Raises:
            OutOfMemory: Not even after releasing the cache.
        """
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._place(size, small)
        if block is None and self._release_cached():
            block = self._place(size, small)
        if block is None:
            self._event('oom', 0, size, tag)
            raise OutOfMemory(f'cannot place {size} B with {self.reserved} B reserved of {self.capacity} B')
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
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
