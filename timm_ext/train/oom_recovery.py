"""Out-of-memory recovery for training that leaves the math alone: split micro-batches, keep every update.

When a micro-batch's forward or backward runs out of memory, the training loop's replay
(`timm_ext.train.oom_replay.WindowReplay`) frees what the failed attempt held, doubles the number of pieces each
loader batch is cut into (`MicroBatchSplitter.shrink`) and replays the window from its first batch. A piece's loss
is weighted by its share of its batch, so the window's gradient is the mean over the very same samples: the global
batch, the LR, the schedule and the data order do not change, and no sample is dropped or seen twice. The whole
window is replayed, not just the failed micro-batch, because a backward that fails midway has already added part of
its gradient to ``.grad``.

Under DDP every rank must take the same decision at the same time, or one rank waits forever in a collective: while
recovery is on, every backward runs without DDP's own gradient all-reduce (which launches collectives midway
through a backward, where an OOM can strike on one rank alone). A rank that runs out of memory stops computing but
walks the rest of the window (its batches are needed for the replay), so the only collectives inside a window are
ones every rank reaches anyway: DDP's buffer broadcast before the window's first forward, NaFlex's sample count per
batch. Then every rank shares one status per window (`agree_status`), and only once all are known to have finished
it are the gradients averaged explicitly, in buckets as DDP does, through buffers made before training
(`GradientAllReduce`). The cost against plain DDP is one small all-reduce and host sync per window, and the gradient
all-reduce no longer overlapping the backward.
"""
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import TimmExtError
from ..oom import should_retry
from ..peer_wait import peer_wait

__all__ = ['is_recoverable_oom', 'sync_bn_problem', 'MicroBatchSplitter', 'OomRecoveryError', 'WindowOutOfMemory',
           'RankFailed', 'agree_status', 'GradientAllReduce', 'gradient_buckets', 'split_batch', 'OK', 'OOM',
           'FAILED', 'ALLREDUCE_BUCKET_BYTES']

# per-rank status shared once per window while recovery is on
OK, OOM, FAILED = 0, 1, 2

# Gradients are all-reduced in buckets of about this size: DDP's own default (bucket_cap_mb=25), few enough
# collectives that their latency does not count, small enough that the flat copies cost little memory.
ALLREDUCE_BUCKET_BYTES = 25 * 2 ** 20


def is_recoverable_oom(exc: BaseException) -> bool:
    """An OOM that a smaller micro-batch can fix: `timm_ext.oom.should_retry`, the rule the probe and validate.py's
    --retry read too (oneDNN's primitive failures count under a CPU data cap)."""
    return should_retry(exc)


def sync_bn_problem(oom_recover: bool, sync_bn: bool, world_size: int) -> Optional[str]:
    """Why `--oom-recover` cannot run with `--sync-bn` here, or None when it can.

    SyncBatchNorm all-gathers statistics inside every forward and backward of a process group: a rank that runs out
    of memory alone would go to the OOM agreement while its peers wait in SyncBN's exchange (a hang, or on NCCL two
    collectives mixed up).
    """
    if oom_recover and sync_bn and world_size > 1:
        return ('--oom-recover cannot run with --sync-bn on several processes: SyncBatchNorm exchanges statistics '
                'inside every step, where a rank that runs out of memory alone leaves the others waiting; drop '
                '--sync-bn (--dist-bn reduce averages BN statistics after each epoch) or --oom-recover')
    return None


class OomRecoveryError(TimmExtError):
    """Out of memory even with a micro-batch of one sample: nothing smaller to try."""


class WindowOutOfMemory(Exception):
    """A piece of the window ran out of memory on one or more ranks (carries no frames, so memory can be freed).

    Attributes:
        ranks: The ranks that ran out of memory.
        reason: The first line of this rank's error, or '' when only other ranks failed.
    """

    def __init__(self, ranks: List[int], reason: str = ''):
        super().__init__(f'out of memory on rank(s) {ranks}: {reason}')
        self.ranks = ranks
        self.reason = reason


class RankFailed(RuntimeError):
    """Another rank failed with an error that is not an OOM; this rank stops instead of waiting for it."""


def split_batch(input: Any, target: torch.Tensor, pieces: int) -> List[Tuple[Any, torch.Tensor]]:
    """Cut a batch into ``pieces`` consecutive slices of sizes differing by at most one (no copies).

    ``input`` is a tensor or a dict of tensors (NaFlex patches, coordinates, ...) sharing the batch dimension.
    """
    if pieces <= 1:
        return [(input, target)]
    targets = target.tensor_split(pieces)
    if isinstance(input, dict):
        parts = {k: v.tensor_split(pieces) if torch.is_tensor(v) else [v] * pieces for k, v in input.items()}
        inputs = [{k: v[i] for k, v in parts.items()} for i in range(pieces)]
    else:
        inputs = input.tensor_split(pieces)
    return list(zip(inputs, targets))


@dataclass
class MicroBatchSplitter:
    """How many pieces each loader batch is cut into, and when to try fewer again.

    Attributes:
        batch_size: The loader's batch size (per rank).
        grow_back: Halve the pieces again after this many clean updates (None: never).
        splits: Pieces per loader batch; the micro-batch in force is ceil(batch_size / splits).
        clean_updates: Updates completed since the last change.
    """
    batch_size: int
    grow_back: Optional[int] = None
    splits: int = 1
    clean_updates: int = 0

    @property
    def micro_batch(self) -> int:
        """The largest piece of a full loader batch: the micro-batch in force."""
        return math.ceil(self.batch_size / self.splits)

    def split(self, input: Any, target: torch.Tensor, num_samples: int) -> List[Tuple[Any, torch.Tensor]]:
        """The pieces of one loader batch of ``num_samples`` samples."""
        return split_batch(input, target, min(self.splits, num_samples))

    def shrink(self) -> Tuple[int, int]:
        """Double the pieces per batch after an OOM; returns (old, new) micro-batch.

        Raises:
            OomRecoveryError: The micro-batch is already one sample.
        """
        old = self.micro_batch
        if old <= 1:
            raise OomRecoveryError('out of memory with a micro-batch of 1 sample')
        self.splits = min(self.splits * 2, self.batch_size)
        self.clean_updates = 0
        return old, self.micro_batch

    def after_clean_update(self) -> Optional[Tuple[int, int]]:
        """Count an update that needed no recovery; every ``grow_back`` of them, halve the pieces.

        Returns:
            (old, new) micro-batch when it grew, else None.
        """
        self.clean_updates += 1
        if self.grow_back is None or self.splits == 1 or self.clean_updates < self.grow_back:
            return None
        old = self.micro_batch
        self.splits = max(1, self.splits // 2)
        self.clean_updates = 0
        return old, self.micro_batch

    def state_dict(self) -> Dict[str, int]:
        return {'batch_size': self.batch_size, 'splits': self.splits, 'micro_batch': self.micro_batch}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continue with a checkpoint's micro-batch (re-derived when the loader batch size has changed)."""
        if state.get('batch_size') == self.batch_size:
            splits = int(state['splits'])
        else:
            splits = math.ceil(self.batch_size / max(1, int(state['micro_batch'])))
        self.splits = max(1, min(splits, self.batch_size))
        self.clean_updates = 0


def agree_status(status: int, rank: int, world_size: int, device: torch.device) -> List[int]:
    """Every rank's status for a window (OK / OOM / FAILED), the same list on all ranks (one small all-reduce)."""
    flags = torch.zeros(world_size, dtype=torch.int32, device=device)
    flags[rank] = status
    with peer_wait('the agreement on an out-of-memory window'):
        dist.all_reduce(flags)
    return flags.tolist()


def gradient_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int = ALLREDUCE_BUCKET_BYTES,
                     ) -> List[List[torch.Tensor]]:
    """Consecutive tensors (parameters or their gradients) of one dtype and device, grouped into buckets of at most
    `bucket_bytes` (a larger one is a bucket alone). Every rank builds the same buckets from the same parameters."""
    buckets: List[List[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        last = buckets[-1] if buckets else None
        if last is None or (last[0].dtype, last[0].device) != (tensor.dtype, tensor.device) or (
                size + nbytes > bucket_bytes):
            buckets.append([tensor])
            size = nbytes
        else:
            last.append(tensor)
            size += nbytes
    return buckets


class GradientAllReduce:
    """Averages the gradients of `params` over ranks in place, in buckets: what DDP's synchronising backward does,
    done after the backward instead.

    Every trainable parameter takes part, in the same order on every rank: one without a gradient gets zeros, so the
    collectives match even if a parameter was unused on some rank. A bucket is one collective; the next is copied
    into its flat buffer while the previous one is in flight. The buffers (two per dtype, the size of the largest
    bucket that needs one) are allocated here, before training takes the memory, and reused: an all-reduce that
    allocated could run out of memory on one rank after its peers had entered the collective, a hang no agreement
    can prevent. What a call must still allocate (zeros for a missing gradient, a buffer for a layout not foreseen)
    is allocated before its first collective. A lone contiguous gradient is reduced in place, without a buffer.

    Args:
        params: The trainable parameters (the model's layout, channels_last included, already applied).
        world_size: Number of ranks.
        bucket_bytes: Bucket size.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], world_size: int,
                 bucket_bytes: int = ALLREDUCE_BUCKET_BYTES):
        self.params = [p for p in params if p.requires_grad]
        self.world_size = world_size
        self.buckets = gradient_buckets(self.params, bucket_bytes)
        sizes: Dict[Tuple[torch.dtype, torch.device], int] = {}
        for bucket in self.buckets:
            if len(bucket) > 1 or not bucket[0].is_contiguous():  # gradients take their parameter's layout
                key = (bucket[0].dtype, bucket[0].device)
                sizes[key] = max(sizes.get(key, 0), sum(p.numel() for p in bucket))
        self._buffers = {key: [torch.empty(n, dtype=key[0], device=key[1]) for _ in range(2)]
                         for key, n in sizes.items()}
        self._next = {key: 0 for key in sizes}

    def _fresh(self, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """A flat buffer of its own for a bucket whose layout was not foreseen when the buffers were made (None: the
        bucket is reduced in place, or one of its dtype's two buffers serves)."""
        if len(grads) == 1 and grads[0].is_contiguous():
            return None
        numel = sum(g.numel() for g in grads)
        pair = self._buffers.get((grads[0].dtype, grads[0].device))
        return torch.empty(numel, dtype=grads[0].dtype, device=grads[0].device) if (
            pair is None or pair[0].numel() < numel) else None

    def _launch(self, grads: List[torch.Tensor], fresh: Optional[torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        if len(grads) == 1 and grads[0].is_contiguous():
            flat = grads[0]
        else:
            flat = fresh
            if flat is None:  # the next of the dtype's two buffers (the one before it is still in flight)
                key = (grads[0].dtype, grads[0].device)
                turn, self._next[key] = self._next[key], 1 - self._next[key]
                flat = self._buffers[key][turn][:sum(g.numel() for g in grads)]
            views = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
            torch._foreach_copy_(views, grads)
        return dist.all_reduce(flat, async_op=True), flat

    def _finish(self, work: Any, flat: torch.Tensor, grads: List[torch.Tensor]) -> None:
        """Wait for a bucket's sum, make it the mean, and copy it back into the gradients if it went through a copy."""
        work.wait()
        flat.div_(self.world_size)
        if flat is not grads[0]:
            views = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
            torch._foreach_copy_(grads, views)

    def __call__(self) -> None:
        # everything allocated first (zeros for a missing gradient, a buffer not foreseen): an OOM here leaves this
        # rank outside every collective, not half-way through the buckets its peers are reducing
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket_grads = [[p.grad for p in bucket] for bucket in self.buckets]
        fresh = [self._fresh(grads) for grads in bucket_grads]
        in_flight = None
        for grads, buffer in zip(bucket_grads, fresh):
            launched = (*self._launch(grads, buffer), grads)
            if in_flight is not None:
                self._finish(*in_flight)
            in_flight = launched
        if in_flight is not None:
            self._finish(*in_flight)
