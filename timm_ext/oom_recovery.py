"""Out-of-memory recovery for training that leaves the math alone: split micro-batches, keep every update.

When a micro-batch's forward or backward runs out of memory, the training loop frees what the failed attempt held,
doubles the number of pieces each loader batch is cut into (`MicroBatchSplitter.shrink`) and replays the window from
its first batch. A piece's loss is weighted by its share of its batch, so the window's gradient is the mean over the
very same samples: the global batch, the LR, the schedule and the data order do not change, and no sample is dropped
or seen twice. The whole window is replayed, not just the failed micro-batch, because a backward that fails midway
has already added part of its gradient to ``.grad``.

Under DDP every rank must take the same decision at the same time, or one rank waits forever in a collective: while
recovery is on, every backward runs without DDP's own gradient all-reduce (which launches collectives midway
through a backward, where an OOM can strike on one rank alone), so a window holds no collective of its own. A rank
that runs out of memory stops computing but walks the rest of the window (its batches are needed for the replay),
then every rank shares one status per window (`agree_status`), and only once all are known to have finished it are
the gradients averaged explicitly, in buckets as DDP does (`allreduce_gradients`). The cost against plain DDP is one
small all-reduce and host sync per window, and the gradient all-reduce no longer overlapping the backward.
"""
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .oom import cpu_data_capped, should_retry

__all__ = ['is_recoverable_oom', 'sync_bn_problem', 'MicroBatchSplitter', 'OomRecoveryError', 'WindowOutOfMemory',
           'RankFailed', 'agree_status', 'allreduce_gradients', 'gradient_buckets', 'split_batch', 'OK', 'OOM',
           'FAILED', 'ALLREDUCE_BUCKET_BYTES']

# per-rank status shared once per window while recovery is on
OK, OOM, FAILED = 0, 1, 2

# Gradients are all-reduced in buckets of about this size: DDP's own default (bucket_cap_mb=25), few enough
# collectives that their latency does not count, small enough that the flat copies cost little memory.
ALLREDUCE_BUCKET_BYTES = 25 * 2 ** 20


def is_recoverable_oom(exc: BaseException, device: torch.device) -> bool:
    """An OOM that a smaller micro-batch can fix: `timm_ext.oom.should_retry`, plus oneDNN's primitive-creation
    failure on a CPU whose data segment is capped (RLIMIT_DATA), which is how oneDNN reports an allocation failure.
    """
    return should_retry(exc, cpu_capped=device.type == 'cpu' and cpu_data_capped())


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


class OomRecoveryError(Exception):
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
    dist.all_reduce(flags)
    return flags.tolist()


def gradient_buckets(grads: Sequence[torch.Tensor], bucket_bytes: int = ALLREDUCE_BUCKET_BYTES,
                     ) -> List[List[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, grouped into buckets of at most `bucket_bytes` (a larger
    gradient is a bucket alone). Every rank builds the same buckets from the same parameter order."""
    buckets: List[List[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        last = buckets[-1] if buckets else None
        if last is None or (last[0].dtype, last[0].device) != (grad.dtype, grad.device) or size + nbytes > bucket_bytes:
            buckets.append([grad])
            size = nbytes
        else:
            last.append(grad)
            size += nbytes
    return buckets


def _launch_bucket(bucket: List[torch.Tensor]) -> Tuple[Any, torch.Tensor]:
    """Start the all-reduce of one bucket: in place for a lone contiguous gradient, else of a flat copy."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        flat = bucket[0]
    else:
        flat = torch.cat([g.reshape(-1) for g in bucket])
    return dist.all_reduce(flat, async_op=True), flat


def _finish_bucket(work: Any, flat: torch.Tensor, bucket: List[torch.Tensor], world_size: int) -> None:
    """Wait for a bucket's sum, make it the mean, and copy it back into the gradients if it was a copy."""
    work.wait()
    flat.div_(world_size)
    if flat is not bucket[0]:
        views = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in bucket]), bucket)]
        torch._foreach_copy_(bucket, views)


def allreduce_gradients(params: Iterable[torch.nn.Parameter], world_size: int,
                        bucket_bytes: int = ALLREDUCE_BUCKET_BYTES) -> None:
    """Average ``.grad`` over ranks in place (what DDP's synchronising backward does, done after it instead).

    Every trainable parameter takes part, in the same order on every rank: one without a gradient gets zeros, so
    the collectives match even if a parameter was unused on some rank. Gradients go in buckets (`gradient_buckets`),
    one collective each, and the next bucket is flattened while the previous one is in flight: at most two flat
    copies exist at a time.
    """
    grads = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    in_flight = None
    for bucket in gradient_buckets(grads, bucket_bytes):
        launched = (*_launch_bucket(bucket), bucket)
        if in_flight is not None:
            _finish_bucket(*in_flight, world_size)
        in_flight = launched
    if in_flight is not None:
        _finish_bucket(*in_flight, world_size)
