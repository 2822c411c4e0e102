"""The replay: the least memory a traced step runs in, the two golden cases, and logs scaled between batch sizes."""
import pytest
import torch
import torch.nn as nn
from timm.models.convnext import ConvNeXtBlock
from torch._subclasses.fake_tensor import FakeTensorMode

from timm_ext.memory_model.allocator import ROUND_LARGE
from timm_ext.memory_model.events import AlignmentError, EventLog, ScaledLog, step_log
from timm_ext.memory_model.replay import UNLIMITED, ReplayConfig, fits, largest_batch, least_memory, replay

PLAIN = ReplayConfig(cudnn_benchmark=False)


def traced_steps(model: nn.Module, batches, chw=(96, 96, 96)) -> dict:
    """Training steps of `model` on fake tensors, one per batch size (after one at the first size): batch -> log."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = list(model.parameters())
        log = EventLog(params, [*params, *model.buffers()], dict(model.named_modules()))
        marks = []
        with log:
            for batch in (batches[0], *batches):
                start = log.mark()
                model(torch.randn(batch, *chw)).float().pow(2).mean().backward()
                for p in params:
                    p.grad = None
                marks.append((start, log.mark()))
        log.remove_hooks()
    return {b: step_log(log.events, log.names, *marks[i + 1], marks[i][0]) for i, b in enumerate(batches)}


def ratio(log: dict) -> float:
    return least_memory(log, PLAIN) / replay(log, UNLIMITED, PLAIN).peak_allocated


def test_a_convnext_block_needs_more_than_its_live_peak_and_a_uniform_chain_does_not():
    # golden cases: ConvNeXt's block frees and makes tensors of four sizes (depthwise conv, LayerNorm copies, a 4x
    # wider MLP), which leaves holes the next sizes do not fit; conv -> BN -> ReLU makes one size throughout
    block = traced_steps(ConvNeXtBlock(96), [32])[32]
    chain = traced_steps(nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(96, 96, 3, padding=1, bias=False),
                                                                        nn.BatchNorm2d(96), nn.ReLU())]), [32])[32]
    assert ratio(block) > 1.02
    assert ratio(chain) < 1.005


def test_the_least_memory_is_the_smallest_segment_multiple_that_runs():
    log = traced_steps(ConvNeXtBlock(96), [16])[16]
    least = least_memory(log, PLAIN)
    assert least % ROUND_LARGE == 0
    assert fits(log, least, PLAIN) and not fits(log, least - ROUND_LARGE, PLAIN)
    assert least < replay(log, UNLIMITED, PLAIN).peak_reserved  # the failure path releases what caching kept


def test_logs_of_two_batch_sizes_line_up_and_scale_linearly():
    model = ConvNeXtBlock(32)
    logs = traced_steps(model, [8, 16, 24], chw=(32, 24, 24))
    scaled = ScaledLog(logs[8], 8, logs[16], 16)
    assert scaled.at(24) == logs[24]  # every size predicted exactly at a batch not traced
    with pytest.raises(AlignmentError):
        ScaledLog(logs[8], 8, traced_steps(nn.Conv2d(32, 32, 1), [16], chw=(32, 24, 24))[16], 16)


def test_the_largest_batch_is_the_largest_that_runs():
    logs = traced_steps(ConvNeXtBlock(32), [8, 16], chw=(32, 24, 24))
    scaled = ScaledLog(logs[8], 8, logs[16], 16)
    capacity = least_memory(scaled.at(40), PLAIN)
    found = largest_batch(scaled.at, capacity, guess=4, config=PLAIN)
    assert found >= 40 and fits(scaled.at(found), capacity, PLAIN) and not fits(scaled.at(found + 1), capacity, PLAIN)
    assert largest_batch(scaled.at, capacity, guess=400, config=PLAIN) == found  # from above as from below
    assert largest_batch(scaled.at, capacity, guess=4, config=PLAIN, limit=20) == 20
    assert largest_batch(scaled.at, 1 << 20, guess=4, config=PLAIN) == 0  # the weights alone do not fit


def conv_log(workspace: int, resident: int = 0) -> dict:
    """A step of one cuDNN convolution asking for `workspace` bytes, after `resident` bytes of weights."""
    names = ['convolution.default', 'forward', 'weights']
    return dict(names=names, residents=[[resident, 2, 0, 1]] if resident else [], events=[['o', 0, 1, workspace]])


def workspace_allocs(allocator) -> list:
    return [e['size'] for e in allocator.trace if e['action'] == 'alloc' and e['tag'][0] == 'workspace']


def test_a_cudnn_search_takes_the_devices_free_memory_and_may_open_a_segment():
    """Conv_v8.cpp `get_available_workspace`: `cacheInfo` is called with 0, so it starts from cudaMemGetInfo's free
    memory (CUDACachingAllocator.cpp `cacheInfo`); with nothing cached, the workspace opens a segment of its own."""
    searched = replay(conv_log(50 << 20), 100 << 20, ReplayConfig(iterations=1), record=True)
    assert workspace_allocs(searched)[0] == 50 << 20 and searched.peak_reserved == 50 << 20
    heuristic = replay(conv_log(50 << 20), 100 << 20, ReplayConfig(iterations=1, cudnn_benchmark=False), record=True)
    assert workspace_allocs(heuristic) == [50 << 20]


def test_a_cudnn_search_halves_its_workspace_on_each_out_of_memory():
    """Conv_v8.cpp `generate_and_filter_plans`: the largest workspace that fits `get_available_workspace` is allocated,
    halved on each OutOfMemoryError; here 71 MiB are free but a 71 MiB block takes a 72 MiB segment (kRoundLarge)."""
    allocator = replay(conv_log(100 << 20, resident=30 << 20), 101 << 20, ReplayConfig(iterations=1), record=True)
    sizes = workspace_allocs(allocator)  # the search's, then the chosen plan's run: 35.5 MiB (a 36 MiB block)
    assert len(sizes) == 2 and all(71 << 19 <= size <= 36 << 20 for size in sizes)
    assert [e['action'] for e in allocator.trace].count('oom') == 1


def test_a_small_cudnn_workspace_is_allocated_and_one_that_does_not_fit_is_done_without():
    """Conv_v8.cpp `run_conv_plan` allocates any workspace the plan asks for (no lower bound; 0 takes nothing), and
    `try_configs` goes to the next heuristic plan on OutOfMemoryError instead of failing the step."""
    small = replay(conv_log(256 << 10), UNLIMITED, ReplayConfig(iterations=1, cudnn_benchmark=False), record=True)
    assert workspace_allocs(small) == [256 << 10]
    assert fits(conv_log(500 << 20, resident=30 << 20), 64 << 20, ReplayConfig(cudnn_benchmark=False))


def test_under_a_fraction_cap_the_cudnn_search_starts_from_the_devices_free_memory_above_the_cap():
    """CUDACachingAllocator.cpp `DeviceCachingAllocator::cacheInfo` (torch 2.14.1, the same in 1.12.1 and 2.9.1)
    starts from cudaMemGetInfo's free memory, which `set_per_process_memory_fraction` does not lower: under a 40 MiB cap
    on a device with 100 MiB free, a 50 MiB plan is kept and tried, runs out under the cap, and the search halves."""
    capped = replay(conv_log(50 << 20), 40 << 20, ReplayConfig(iterations=1, device_bytes=100 << 20), record=True)
    assert workspace_allocs(capped) == [25 << 20, 25 << 20]
    assert [e['action'] for e in capped.trace].count('oom') == 1
    oom = next(e for e in capped.trace if e['action'] == 'oom')
    assert oom['addr'] == 100 << 20  # torch records cudaMemGetInfo's free memory, the device's, in the OOM event
    whole = replay(conv_log(50 << 20), 40 << 20, ReplayConfig(iterations=1), record=True)  # no cap: the device is 40
    assert workspace_allocs(whole) == [40 << 20, 40 << 20] and 'oom' not in [e['action'] for e in whole.trace]
