"""PyTorch 2.14's caching allocator rules, one test each (c10/cuda/CUDACachingAllocator.cpp; constants in
c10/core/AllocatorConfig.h), on the plain-Python replay, with the options a user sets (allocator_config)."""
import pytest

from timm_ext.memory_model.allocator import CachingAllocator, OutOfMemory
from timm_ext.memory_model.allocator_config import AllocatorConfig, parse_allocator_conf

MiB = 1 << 20
UNLIMITED = 1 << 50
DEFAULT = AllocatorConfig()
round_size, segment_size = DEFAULT.round_size, DEFAULT.segment_size


def test_requests_are_rounded_up_to_512_bytes():  # round_size, kMinBlockSize
    assert round_size(1) == round_size(512) == 512
    assert round_size(513) == 1024
    a = CachingAllocator(UNLIMITED)
    a.malloc(700)
    assert a.allocated == 1024


def test_segment_sizes_follow_the_three_size_classes():  # get_allocation_size
    assert segment_size(512) == segment_size(1 * MiB) == 2 * MiB  # kSmallBuffer
    assert segment_size(1 * MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # kLargeBuffer
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB) == 12 * MiB  # kRoundLarge


def test_small_requests_share_a_2_mib_segment_and_large_ones_do_not_mix_with_them():
    a = CachingAllocator(UNLIMITED)
    a.malloc(100 * 1024)
    a.malloc(300 * 1024)
    assert [s.size for s in a.segments] == [2 * MiB]
    a.malloc(3 * MiB)  # the large pool: a segment of its own even though the small one has room
    assert sorted(s.size for s in a.segments) == [2 * MiB, 20 * MiB]


def test_a_large_block_is_split_only_when_more_than_1_mib_remains():  # should_split
    a = CachingAllocator(UNLIMITED)
    block = a.malloc(11 * MiB + 512 * 1024)  # a 12 MiB segment: 0.5 MiB would remain, so the block keeps it all
    assert block.size == 12 * MiB and len(a.segments[0].blocks) == 1
    b = CachingAllocator(UNLIMITED)
    block = b.malloc(4 * MiB)  # a 20 MiB segment: 16 MiB remain, split off for the next request
    assert block.size == 4 * MiB and len(b.segments[0].blocks) == 2
    b.malloc(5 * MiB)
    assert len(b.segments) == 1


def test_a_small_block_is_split_when_512_bytes_remain():
    a = CachingAllocator(UNLIMITED)
    a.malloc(1 * MiB)
    a.malloc(1 * MiB - 512)  # the small pool's 2 MiB segment, 512 B left over and split off
    a.malloc(512)
    assert len(a.segments) == 1 and a.allocated == a.reserved == 2 * MiB


def test_a_request_takes_the_best_fitting_free_block():  # get_free_block: lower_bound on size
    a = CachingAllocator(UNLIMITED)
    big, small, keep = a.malloc(40 * MiB), a.malloc(30 * MiB), a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    assert a.malloc(25 * MiB).segment is small.segment


def test_freed_neighbours_merge_into_one_block():  # free_block: try_merge_blocks with prev and next
    a = CachingAllocator(UNLIMITED)
    blocks = [a.malloc(2 * MiB) for _ in range(3)]  # one 20 MiB segment, split four ways
    for block in (blocks[0], blocks[2], blocks[1]):
        a.free(block)
    segment, = a.segments
    assert len(segment.blocks) == 1 and segment.blocks[0].size == 20 * MiB and not segment.blocks[0].live


def test_on_failure_wholly_free_segments_are_released_and_the_request_retried():  # release_cached_blocks
    a = CachingAllocator(60 * MiB)
    first, second = a.malloc(26 * MiB), a.malloc(26 * MiB)
    a.free(first)
    a.malloc(30 * MiB)  # 52 + 30 > 60: the free 26 MiB segment goes, then 26 + 30 fits
    assert a.reserved == 56 * MiB and a.peak_reserved == 56 * MiB


def test_a_segment_holding_a_live_block_is_never_released():
    a = CachingAllocator(60 * MiB)
    blocks = [a.malloc(4 * MiB) for _ in range(2)]  # one 20 MiB segment
    other = a.malloc(30 * MiB)
    a.free(blocks[0])  # 16 MiB of the first segment free, but in a segment that holds a live block
    assert a.allocated == 34 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(18 * MiB)  # 20 + 30 + 18 > 60, and nothing can be released
    del other


def test_expandable_segments_unmap_the_free_pages_of_a_pinned_segment_where_fixed_segments_run_out():
    def pinned_hole(allocator):  # a 60 MiB hole in front of a live 30 MiB block, then a 70 MiB request
        allocator.free(allocator.malloc(100 * MiB))
        first, pin = allocator.malloc(60 * MiB), allocator.malloc(30 * MiB)
        allocator.free(first)
        return allocator.malloc(70 * MiB)

    with pytest.raises(OutOfMemory):  # the 100 MiB segment holds the pin, so it cannot be released: 100 + 70 > 150
        pinned_hole(CachingAllocator(150 * MiB))
    expandable = CachingAllocator(150 * MiB, AllocatorConfig(expandable_segments=True))
    pinned_hole(expandable)  # the hole's three 20 MiB pages are unmapped, and the segment grows by 70 MiB
    assert expandable.reserved == 100 * MiB


def test_expandable_segments_split_a_large_block_when_512_bytes_remain():
    """CUDACachingAllocator.cpp `should_split`: with expandable segments active, a large-pool block is split as a
    small-pool one is (remaining >= kMinBlockSize), not only when more than 1 MiB (kSmallSize) remains."""
    fixed = CachingAllocator(UNLIMITED)
    assert fixed.malloc(19 * MiB + 512 * 1024).size == 20 * MiB  # a 20 MiB segment; 0.5 MiB is not split off
    expandable = CachingAllocator(UNLIMITED, AllocatorConfig(expandable_segments=True))
    block = expandable.malloc(19 * MiB + 512 * 1024)  # one 20 MiB page; the 0.5 MiB rest is a free block of its own
    assert block.size == 19 * MiB + 512 * 1024
    assert [(b.size, b.live) for b in block.segment.blocks] == [(block.size, True), (512 * 1024, False)]


def test_max_split_size_keeps_requests_under_it_off_oversize_blocks_and_never_splits_those_at_or_above_it():
    """CUDACachingAllocator.cpp `get_free_block` (a request under max_split_size takes no block at or above it; an
    oversize request takes a block less than max_non_split_rounding larger) and `should_split` (a request at or above
    max_split_size is not split)."""
    config = parse_allocator_conf('max_split_size_mb:40')
    a = CachingAllocator(UNLIMITED, config)
    a.free(a.malloc(60 * MiB))
    a.malloc(30 * MiB)  # the free 60 MiB block is oversize: a segment of its own
    assert sorted(s.size for s in a.segments) == [30 * MiB, 60 * MiB]
    assert a.malloc(45 * MiB).size == 60 * MiB  # oversize, within 20 MiB (max_non_split_rounding): taken whole
    b = CachingAllocator(UNLIMITED, config)
    b.free(b.malloc(80 * MiB))
    b.malloc(45 * MiB)  # 80 >= 45 + 20: the cached block is too large to round up to
    assert sorted(s.size for s in b.segments) == [46 * MiB, 80 * MiB]


def test_max_split_size_releases_oversize_segments_before_every_free_segment():
    """CUDACachingAllocator.cpp `release_available_cached_blocks`: under max_split_size, when a new segment does not
    fit, the smallest free oversize segment that holds the request is released first, and the other free segments
    stay cached (`release_cached_blocks` comes after)."""
    a = CachingAllocator(100 * MiB, parse_allocator_conf('max_split_size_mb:40'))
    kept, oversize = a.malloc(20 * MiB), a.malloc(60 * MiB)
    a.free(kept)
    a.free(oversize)
    a.malloc(30 * MiB)  # 80 + 30 > 100: the 60 MiB oversize segment goes, the free 20 MiB one stays
    assert sorted(s.size for s in a.segments) == [20 * MiB, 30 * MiB]


def test_roundup_power2_divisions_round_requests_up_to_a_division_of_their_power_of_two():
    """CUDACachingAllocator.cpp `round_size` / `roundup_power2_next_division` and AllocatorConfig.cpp
    `parseRoundUpPower2Divisions` (one count for all sizes, or per power of two in MiB with '>' for the rest)."""
    size = 1200 * 1024  # between 1 MiB and 2 MiB
    assert DEFAULT.round_size(size) == 1200 * 1024  # a multiple of 512 already
    assert parse_allocator_conf('roundup_power2_divisions:4').round_size(size) == 1280 * 1024  # 1, 1.25, 1.5, 1.75 MiB
    per_size = parse_allocator_conf('roundup_power2_divisions:[256:1,512:2,>:4]')
    assert per_size.round_size(300 * MiB + 1) == 300 * MiB + 512  # 256-512 MiB: 1 division, 512 B rounding
    assert per_size.round_size(600 * MiB + 1) == 768 * MiB  # 512 MiB - 1 GiB: 2 divisions
    assert per_size.round_size(1100 * MiB) == 1280 * MiB  # above: 4 divisions


def _aged_segments(allocator):
    """Two free 40 MiB segments: `old` freed before five searches of the large pool (which a free 50 MiB segment
    serves), `young` after them."""
    old, young = allocator.malloc(40 * MiB), allocator.malloc(40 * MiB)
    allocator.free(old)
    for _ in range(5):
        allocator.free(allocator.malloc(50 * MiB))
    allocator.free(young)
    return old.segment, young.segment


def test_garbage_collection_releases_the_oldest_free_segments_under_a_memory_fraction():
    """CUDACachingAllocator.cpp `garbage_collect_cached_blocks`, called from `malloc` when no cached block fits and
    `allowed_memory_maximum` (a memory fraction) is set: above the threshold's share of the cap, the wholly free large
    segments at least as old as the average (free-block searches since they were freed) are released."""
    config = parse_allocator_conf('garbage_collection_threshold:0.4')
    capped = CachingAllocator(300 * MiB, config, capped=True)
    old, young = _aged_segments(capped)
    capped.malloc(60 * MiB)  # 130 MiB reserved > 120: the old segment goes (age 6 of 8 / 3), which is enough
    assert old not in capped.segments and young in capped.segments and capped.reserved == 150 * MiB
    uncapped = CachingAllocator(300 * MiB, config)  # no memory fraction: no garbage collection
    _aged_segments(uncapped)
    uncapped.malloc(60 * MiB)
    assert uncapped.reserved == 190 * MiB


def test_cache_info_is_the_devices_free_memory_or_the_largest_cached_free_block():
    """CUDACachingAllocator.cpp `DeviceCachingAllocator::cacheInfo` from 0: cudaMemGetInfo's free memory, raised to the
    largest free block of any pool (`cache_info_aux`); a fraction cap does not lower the device's free memory."""
    from timm_ext.memory_model.cache_release import cache_info
    a = CachingAllocator(100 * MiB, device_bytes=300 * MiB)  # a 100 MiB cap on a device with 300 MiB free
    block = a.malloc(60 * MiB)
    assert cache_info(a.pools.values(), a.device_bytes - a.reserved) == 240 * MiB  # above the cap's 40 MiB
    a.free(block)
    assert cache_info(a.pools.values(), 10 * MiB) == 60 * MiB  # the cached 60 MiB block where the device has less
    assert CachingAllocator(100 * MiB).device_bytes == 100 * MiB  # no cap: the device is the capacity
