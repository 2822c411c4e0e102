"""What DistributedDataParallel holds on each rank besides the step: the reducer's gradient buckets and NCCL's buffers.

train.py wraps the model in `torch.nn.parallel.DistributedDataParallel` with `device_ids` (and `broadcast_buffers`
off under `--no-ddp-bb`): `bucket_cap_mb`, `gradient_as_bucket_view`, `static_graph` and `find_unused_parameters`
keep torch's defaults. Read from torch 2.14.1 (`torch/nn/parallel/distributed.py`: `_BucketCapacityConfig`,
`_ddp_init_helper`, `_pre_forward`) and the reducer (`torch/csrc/distributed/c10d/reducer.cpp`: `initialize_buckets`,
`autograd_hook`, `rebuild_buckets`, `compute_bucket_assignment_by_size`):

* Without `gradient_as_bucket_view` each bucket is one flat tensor of its own (`initialize_buckets`: `at::empty` of
  the bucket's elements in its parameters' dtype), a second copy of the gradients beside `param.grad`, resident from
  construction to the end of the run.
* At construction, with `find_unused_parameters` off, every parameter goes into one bucket per dtype and device
  (`compute_bucket_size_limits`: limit `sys.maxsize`; `initial_bucket_sizes`). The first backward records the order
  in which the gradients become ready (`autograd_hook`: `push_rebuilt_params`), and the next forward (`_pre_forward`
  -> `_rebuild_buckets`) frees those buckets and assigns new ones in that order with the limits
  [`_DEFAULT_FIRST_BUCKET_BYTES` (1 MiB), `bucket_cap_mb` (25 MiB)] when `bucket_cap_mb` is left at its default,
  [`bucket_cap_mb`] when set (`rebuilt_bucket_sizes`). The total is the same; the run holds the rebuilt buckets from
  its second step on.
* `compute_bucket_assignment_by_size`: per (dtype, device), parameters join the open bucket in order; a bucket closes
  as soon as its bytes reach its limit (the parameter that crosses it stays in), and that dtype's next bucket takes
  the next limit (the last repeats); open buckets close at the end.
* With `broadcast_buffers`, before each training forward (`_pre_forward` -> `_sync_buffers`) the module's buffers go
  from rank 0 to the others through flat copies, in buckets of `broadcast_bucket_size` (250 MiB), at most two at once
  (comm.cpp `broadcast_coalesced`): temporaries freed before the forward runs (`broadcast_bucket_sizes`).

The order gradients become ready in is autograd's, not `parameters()` reversed: timm's ViT makes `pos_embed`'s and
`cls_token`'s ready before the patch embedding's, so the order is recorded from the step itself
(`timm_ext.train.trial_steps`). While the trial allocates the buckets (`allocating_buckets`), the memory trace files
them as DDP's (`timm_ext.memory_model.live_bytes`), so the replay places each as a resident block of its own.

NCCL's own buffers lie outside PyTorch's caching allocator: `timm_ext.memory_model.nccl`.
"""
import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ['DDP_BUCKET_CAP_BYTES', 'DDP_FIRST_BUCKET_BYTES', 'initial_bucket_sizes', 'rebuilt_bucket_sizes',
           'broadcast_bucket_sizes', 'DDP_BROADCAST_BUCKET_BYTES', 'BROADCAST_IN_FLIGHT',
           'allocating_buckets', 'buckets_being_allocated']

MiB = 1 << 20
# torch/nn/parallel/distributed.py: `_DEFAULT_BUCKET_CAP_MB = 25` MiB (`_MB_TO_BYTES = 1024 * 1024`)
DDP_BUCKET_CAP_BYTES = 25 * MiB
# torch/csrc/distributed/c10d/reducer.hpp: `kDefaultFirstBucketBytes`, exposed as `dist._DEFAULT_FIRST_BUCKET_BYTES`
DDP_FIRST_BUCKET_BYTES = 1 * MiB
# torch/nn/parallel/distributed.py `__init__`: `self.broadcast_bucket_size = 250 * 1024 * 1024`
DDP_BROADCAST_BUCKET_BYTES = 250 * MiB
# torch/csrc/distributed/c10d/comm.cpp `broadcast_coalesced`: `max_in_flight = 2`
BROADCAST_IN_FLIGHT = 2

_allocating = [False]  # whether the trial is allocating DDP's buckets now


@contextlib.contextmanager
def allocating_buckets() -> Iterator[None]:
    """While active, the tensors created are DDP's (its gradient buckets, its buffers' broadcast copies): the memory
    trace files them as 'buckets'."""
    _allocating[0] = True
    try:
        yield
    finally:
        _allocating[0] = False


def buckets_being_allocated() -> bool:
    """Whether `allocating_buckets` is active."""
    return _allocating[0]


def initial_bucket_sizes(params: Sequence[torch.Tensor]) -> List[Tuple[torch.dtype, int]]:
    """DDP's gradient buckets from its construction to the first step's end, as (dtype, elements): one per dtype
    (`_BucketCapacityConfig.compute_bucket_size_limits`: `sys.maxsize` without `find_unused_parameters`).

    Args:
        params: The wrapped module's parameters (those without gradients are skipped, a shared one counts once).
    """
    totals: Dict[tuple, int] = {}
    for p in _reduced(params):
        totals[(p.dtype, p.device)] = totals.get((p.dtype, p.device), 0) + p.numel()
    return [(key[0], numel) for key, numel in totals.items()]


def rebuilt_bucket_sizes(ready_order: Sequence[torch.Tensor], bucket_cap_mb: Optional[float] = None
                         ) -> List[Tuple[torch.dtype, int]]:
    """DDP's gradient buckets from the second step on, as (dtype, elements) in the reducer's bucket order.

    Args:
        ready_order: The parameters in the order the first backward made their gradients ready.
        bucket_cap_mb: DDP's `bucket_cap_mb` (None: its default, which also gives the small first bucket).
    """
    limits = [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES] if bucket_cap_mb is None else [int(bucket_cap_mb * MiB)]
    return [(dtype, numel) for dtype, numel, _ in _assign(_reduced(ready_order), limits)]


def broadcast_bucket_sizes(buffers: Sequence[torch.Tensor]) -> List[Tuple[torch.dtype, int]]:
    """The flat copies DDP makes of the module's buffers to broadcast them before each training forward under
    `broadcast_buffers` (train.py's default; off with --no-ddp-bb), as (dtype, elements) in the order they are made.

    distributed.py `_sync_buffers` -> `_default_broadcast_coalesced` (`broadcast_bucket_size` 250 MiB) -> comm.cpp
    `broadcast_coalesced`: the buffers bucketed by `compute_bucket_assignment_by_size` with that one limit, buckets
    in the order of their first buffer, each flattened into a new tensor (`BroadcastWork`); at most
    `BROADCAST_IN_FLIGHT` are alive at once, all freed before the forward runs.
    """
    assigned = _assign(list(buffers), [DDP_BROADCAST_BUCKET_BYTES])
    return [(dtype, numel) for dtype, numel, _ in sorted(assigned, key=lambda bucket: bucket[2])]


def _assign(tensors: Sequence[torch.Tensor], limits: Sequence[int]) -> List[Tuple[torch.dtype, int, int]]:
    """reducer.cpp `compute_bucket_assignment_by_size`: (dtype, elements, index of its first tensor) of each
    bucket, closed ones first, then those left open."""
    closed: List[Tuple[torch.dtype, int, int]] = []
    open_buckets: Dict[tuple, List[int]] = {}  # (dtype, device) -> [elements, bytes, index of its limit, first]
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        bucket = open_buckets.setdefault(key, [0, 0, 0, i])
        bucket[3] = bucket[3] if bucket[0] else i
        bucket[0] += t.numel()
        bucket[1] += t.numel() * t.element_size()
        if bucket[1] >= limits[bucket[2]]:  # the tensor that reaches the limit stays in
            closed.append((t.dtype, bucket[0], bucket[3]))
            open_buckets[key] = [0, 0, min(bucket[2] + 1, len(limits) - 1), i]
    for key, bucket in open_buckets.items():
        if bucket[0]:
            closed.append((key[0], bucket[0], bucket[3]))
    return closed


def _reduced(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The parameters DDP reduces (`_build_params_for_reducer`): those that need a gradient, each once."""
    seen, kept = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            kept.append(p)
    return kept
