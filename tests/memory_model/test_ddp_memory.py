"""DDP per rank: the reducer's gradient buckets (against torch's own bucketing and reducer) and NCCL's buffers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.distributed as dist

from timm_ext.memory_model.nccl import NCCL_ASSUMPTION, nccl_buffer_bytes
from timm_ext.train.ddp_buckets import (DDP_BROADCAST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES,
                                        allocating_buckets, broadcast_bucket_sizes, initial_bucket_sizes,
                                        rebuilt_bucket_sizes)
from timm_ext.memory_model.estimate import estimate_memory
from timm_ext.memory_model.live_bytes import LiveBytes
from timm_ext.train.args import parse_args
from timm_ext.train.trial_steps import DdpBuckets

MiB = 1 << 20
WORKER = Path(__file__).with_name('ddp_gloo_worker.py')


def _sizes_in_bytes(sizes):
    return [numel * torch.empty(0, dtype=dtype).element_size() for dtype, numel in sizes]


def _torch_assignment(tensors, limits):
    """torch's own `compute_bucket_assignment_by_size`, the tensors given in gradient-ready order."""
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors),
                                                         list(range(len(tensors))))
    return [sum(tensors[i].numel() * tensors[i].element_size() for i in bucket) for bucket in indices]


def test_default_limits_are_torchs():
    """torch/nn/parallel/distributed.py `_DEFAULT_BUCKET_CAP_MB` (25 MiB) and reducer.hpp `kDefaultFirstBucketBytes`
    (`dist._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB): the limits a DDP without `bucket_cap_mb` rebuilds its buckets with."""
    from torch.nn.parallel import distributed
    assert DDP_BUCKET_CAP_BYTES == distributed._DEFAULT_BUCKET_CAP_MB * distributed._MB_TO_BYTES
    assert DDP_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES


@pytest.mark.parametrize('bucket_cap_mb', [None, 1.5])
def test_rebuilt_buckets_follow_compute_bucket_assignment_by_size(bucket_cap_mb):
    """reducer.cpp `compute_bucket_assignment_by_size` (called by `rebuild_buckets` with [first_bucket_bytes_cap,
    bucket_bytes_cap]; distributed.py `_BucketCapacityConfig.create`: the first cap is 1 MiB only when bucket_cap_mb is
    left at its default): per dtype a bucket closes once its bytes reach the limit, the parameter that reaches it
    inside, the next limit for that dtype's next bucket. A tensor of exactly 1 MiB closes the first bucket alone."""
    ready = [torch.empty(MiB // 4), torch.empty(3, dtype=torch.float16), torch.empty(700_000),
             torch.empty(MiB // 2, dtype=torch.float16), torch.empty(5_000_000), torch.empty(1_000_000),
             torch.empty(300_000), torch.empty(10, dtype=torch.float16)]
    for p in ready:
        p.requires_grad_()
    limits = ([DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES] if bucket_cap_mb is None
              else [int(bucket_cap_mb * MiB)])
    predicted = _sizes_in_bytes(rebuilt_bucket_sizes(ready, bucket_cap_mb))
    assert sorted(predicted) == sorted(_torch_assignment(ready, limits))


def test_initial_buckets_are_one_per_dtype():
    """distributed.py `_BucketCapacityConfig.compute_bucket_size_limits`: without `static_graph` or
    `find_unused_parameters` (train.py sets neither) DDP's construction bucketing has the one limit `sys.maxsize`,
    so each dtype's parameters share one bucket; `_build_params_for_reducer` skips frozen and repeated ones."""
    shared = torch.nn.Parameter(torch.empty(10))
    frozen = torch.nn.Parameter(torch.empty(99), requires_grad=False)
    params = [shared, torch.nn.Parameter(torch.empty(7, dtype=torch.float16)), frozen, shared,
              torch.nn.Parameter(torch.empty(5))]
    assert sorted(initial_bucket_sizes(params), key=str) == [(torch.float16, 7), (torch.float32, 15)]
    reduced = [shared, params[1], params[4]]
    assert sorted(_sizes_in_bytes(initial_bucket_sizes(params))) == sorted(
        _torch_assignment(reduced, [sys.maxsize]))


def test_buffers_are_broadcast_in_torchs_buckets():
    """distributed.py `__init__` (`broadcast_bucket_size` 250 MiB) and `_default_broadcast_coalesced` -> comm.cpp
    `broadcast_coalesced`: before each training forward under `broadcast_buffers` (train.py's default) the buffers are
    flattened in the buckets `compute_bucket_assignment_by_size` gives them with that one limit, in the order of
    their first buffer (test_resnet: the batch norms' float32 statistics, then their int64 counters)."""
    from torch.nn.parallel import distributed
    buffers = list(timm.create_model('test_resnet', num_classes=3).buffers())
    assert DDP_BROADCAST_BUCKET_BYTES == 250 * MiB
    indices, _ = dist._compute_bucket_assignment_by_size(buffers, [DDP_BROADCAST_BUCKET_BYTES], [False] * len(buffers))
    expected = [sum(buffers[i].numel() * buffers[i].element_size() for i in bucket) for bucket in indices]
    assert _sizes_in_bytes(broadcast_bucket_sizes(buffers)) == expected and len(expected) == 2
    assert 'broadcast_bucket_size = 250 * 1024 * 1024' in Path(distributed.__file__).read_text()


@pytest.mark.parametrize('flags, broadcast', [((), True), (('--no-ddp-bb',), False)])
def test_the_trial_broadcasts_the_buffers_when_train_pys_ddp_does(flags, broadcast):
    """timm_ext/train/stack.py `build_training_stack`: train.py wraps the model in DDP with `broadcast_buffers` at its
    default (on), off under --no-ddp-bb; the trial's buckets broadcast the module's buffers exactly then."""
    from timm_ext.train.stack import build_training_stack
    from timm_ext.train.trial_steps import _ddp_buckets
    args = _ddp_args(2, *flags)
    args.device = 'cpu'
    stack = build_training_stack(args, torch.device('cpu'), lr=0.1, with_data=False, compile_model=False, ddp=False)
    held = _ddp_buckets(args, stack, torch.device('cpu'))
    expected = list(stack.task.get_trainable_module().buffers()) if broadcast else []
    assert [id(b) for b in held.buffers] == [id(b) for b in expected] and bool(held.buffers) == broadcast


def test_at_most_two_broadcast_copies_are_alive_at_once():
    """comm.cpp `broadcast_coalesced`: `max_in_flight = 2`, the oldest broadcast waited for (and its flat copy freed)
    before a third starts; all are gone when the forward runs. Three 300 MiB buffers, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        buffers = [torch.empty(300 * MiB // 4) for _ in range(3)]
        held = DdpBuckets([], torch.device('cpu'), buffers)
        with LiveBytes([]) as tracker:
            with held.update():
                pass
    assert tracker.peak['buckets'] == 2 * 300 * MiB and tracker.live['buckets'] == 0


def test_trial_buckets_match_ddps_reducer_on_two_gloo_ranks(tmp_path):
    """reducer.cpp `initialize_buckets` (one tensor per bucket), `autograd_hook`/`rebuild_buckets` (rebuilt in the
    order the first backward made the gradients ready) and distributed.py `_pre_forward` (the rebuild before the
    second forward): the buckets the trial holds (`DdpBuckets`) are those DDP's own reducer all-reduces on two gloo
    ranks, at the first step and at the second; with a small `bucket_cap_mb` the rule splits test_vit into 14 buckets
    as the reducer does. test_vit's order is not `parameters()` reversed (`pos_embed` and `cls_token` before the patch
    embedding): a rule that assumed it would put 26112 B, not 256 B, in the last bucket."""
    out = tmp_path / 'buckets.json'
    done = subprocess.run([sys.executable, str(WORKER), 'test_vit', str(out), 'default', '0.05'],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    real = json.loads(out.read_text())
    model = timm.create_model('test_vit', num_classes=3)
    buckets = DdpBuckets(model.parameters(), torch.device('cpu'))
    buckets.hold()
    assert [['torch.float32', t.numel() * 4] for t in buckets.tensors] == real['default'][0]  # construction: one
    ready = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(ready.append)
    with buckets.update():
        model(torch.randn(2, *model.pretrained_cfg['input_size'])).sum().backward()
    held = [['torch.float32', t.numel() * 4] for t in buckets.tensors]
    assert held == real['default'][1] and len(held) == 2  # rebuilt: the first bucket of 1 MiB, then the rest
    small = [['torch.float32', n * 4] for _, n in rebuilt_bucket_sizes(ready, bucket_cap_mb=0.05)]
    assert small == real['0.05'][1] and len(small) == 14


def test_buckets_are_traced_as_their_own_category():
    """What the trial allocates under `allocating_buckets` is filed as 'buckets' by the memory trace (so the replay
    places each bucket as a resident block, and the table shows them), not as activations."""
    params = [torch.nn.Parameter(torch.empty(4))]
    with LiveBytes(params) as tracker:
        with allocating_buckets():
            bucket = torch.empty(1000)
        other = torch.empty(10)
    assert tracker.live['buckets'] == 4000 and tracker.live['activations'] == 40
    del bucket, other


def _resident_buckets(log: dict) -> list:
    """The bytes of the buckets a step log holds from before the step (`step_log`'s residents), smallest first."""
    return sorted(r[0] for r in log['residents'] if log['names'][r[1]] == 'buckets')


def _ddp_args(world_size: int, *flags: str):
    args, _ = parse_args(['--model', 'test_resnet', '--num-classes', '40000', '--img-size', '32', '--amp',
                          '--opt', 'adamw', '--device', 'cuda', *flags])
    args.distributed, args.world_size, args.rank, args.local_rank = world_size > 1, world_size, 0, 0
    return args


def test_a_ddp_rank_peaks_at_least_a_float32_gradient_copy_above_one_process():
    """The per-rank estimate of an 8-process plan holds DDP's buckets, resident, beside the gradients (test_resnet
    with a 40000-class head: ~16 MB of gradients, its head's bucket above the allocator's 10 MiB). Its live peak (the
    trace's) is one float32 copy of the gradients above the one-process peak, exactly; the replay's least memory is at
    least that much above, but for a bucket under 10 MiB, which may share the free space of a 20 MiB segment
    (CUDACachingAllocator.cpp `get_allocation_size`). The blocks live at the replay's peak are not compared: that
    moment is where the allocator needs most, which the float32 loss of CUDA autocast's log_softmax can move."""
    one, eight = estimate_memory(_ddp_args(1), 'cuda'), estimate_memory(_ddp_args(8), 'cuda')
    model = timm.create_model('test_resnet', num_classes=40000)
    gradient_copy = sum(p.numel() * 4 for p in model.parameters())
    held = _resident_buckets(eight.replay.scaled.at(64))
    assert sum(held) == gradient_copy and len(held) == 2 and held[1] > 10 * MiB  # the rest, then the head's bucket
    shares_a_segment = held[0]
    for batch in (16, 64):
        assert eight.device.counted(eight.traced[batch]) == one.device.counted(one.traced[batch]) + gradient_copy
        assert eight.peak(batch) >= one.peak(batch) + gradient_copy - shares_a_segment
    assert not _resident_buckets(one.replay.scaled.at(64))


def test_nccl_buffers_per_rank():
    """NCCL src/init.cc `DEFAULT_BUFFSIZE` (4 MiB, NCCL_BUFFSIZE's documented default), `DEFAULT_LL128_BUFFSIZE`,
    `DEFAULT_LL_BUFFSIZE`, in 2 MiB granules (NVIDIA/nccl#1685: 10485760-byte buffers), 32 channels: none on one
    process, 320 MiB per rank on one node, more across nodes (the tree's links), stated in the plan's assumptions."""
    assert nccl_buffer_bytes(1) == 0
    assert nccl_buffer_bytes(8) == 32 * 10 * MiB
    assert nccl_buffer_bytes(16, nodes=2) == nccl_buffer_bytes(64, nodes=8) > nccl_buffer_bytes(8)
    assert 'NCCL_BUFFSIZE' in NCCL_ASSUMPTION


@pytest.mark.parametrize('nodes, nproc', [(1, 8), (2, 8)])
def test_a_cuda_plan_on_several_ranks_takes_nccls_buffers_off_each_card(nodes, nproc):
    """NCCL's buffers are allocated by NCCL itself, outside PyTorch's caching allocator: like the CUDA context they
    come off the card's memory before the allocator's share is planned, on each rank; a size given as the allocator's
    is the allocator's whatever the ranks."""
    from timm_ext.memory import MemoryBudget, parse_budget
    from timm_ext.memory_model.cards import find_card
    from timm_ext.memory_model.devices import device_model
    from timm_ext.memory_model.estimate import MemoryEstimate
    from timm_ext.memory_model.live_bytes import CATEGORIES
    from timm_ext.tune.estimate_plan import plan_from_estimate
    lines = {name: (0.0, 0.0) for name in CATEGORIES}
    lines.update(weights=(100 * MiB, 0.0), activations=(0.0, 10 * MiB))
    estimate = MemoryEstimate(lines, {}, device_model('cuda', card=find_card('rtx4090')), 'synthetic', 0.0)
    args = parse_args(['--model', 'resnet50', '--device', 'cuda'])[0]
    args.mem_headroom, args.max_batch, args.batch_multiple, args.select = 0.0, None, 8, 'max'
    args.target_global_batch, args.nnodes = 256, nodes
    card = [('rtx4090', MemoryBudget(fraction=1.0))]
    alone, = plan_from_estimate(args, 'cuda', estimate, card, 1, 256)
    rank, = plan_from_estimate(args, 'cuda', estimate, card, nodes * nproc, 256)
    assert alone.usable - rank.usable == nccl_buffer_bytes(nodes * nproc, nodes) > 0
    size = [('20GiB', parse_budget('20GiB'))]
    assert plan_from_estimate(args, 'cuda', estimate, size, nodes * nproc, 256)[0].usable == 20 * 1024 * MiB
