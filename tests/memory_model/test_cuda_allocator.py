"""PyTorch 2.14's caching allocator rules, one test each (c10/cuda/CUDACachingAllocator.cpp; constants in
c10/core/AllocatorConfig.h), on the plain-Python replay."""
import pytest

from timm_ext.memory_model.allocator import (CachingAllocator, OutOfMemory, expandable_segments_asked, round_size,
                                            segment_size)

MiB = 1 << 20
UNLIMITED = 1 << 50


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


def test_expandable_segments_are_read_from_either_variable_the_newer_first():
    assert not expandable_segments_asked({})
    assert expandable_segments_asked({'PYTORCH_CUDA_ALLOC_CONF': 'max_split_size_mb:64,expandable_segments:True'})
    assert not expandable_segments_asked({'PYTORCH_ALLOC_CONF': 'expandable_segments:False',
                                          'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True'})


def test_expandable_segments_unmap_the_free_pages_of_a_pinned_segment_where_fixed_segments_run_out():
    def pinned_hole(allocator):  # a 60 MiB hole in front of a live 30 MiB block, then a 70 MiB request
        allocator.free(allocator.malloc(100 * MiB))
        first, pin = allocator.malloc(60 * MiB), allocator.malloc(30 * MiB)
        allocator.free(first)
        return allocator.malloc(70 * MiB)

    with pytest.raises(OutOfMemory):  # the 100 MiB segment holds the pin, so it cannot be released: 100 + 70 > 150
        pinned_hole(CachingAllocator(150 * MiB))
    expandable = CachingAllocator(150 * MiB, expandable=True)
    pinned_hole(expandable)  # the hole's three 20 MiB pages are unmapped, and the segment grows by 70 MiB
    assert expandable.reserved == 100 * MiB
