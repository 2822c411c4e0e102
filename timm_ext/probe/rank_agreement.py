"""Rank agreement under DDP: every rank takes the same outcome of a trial, and the same final size.

Under torchrun, wrap the trial with `agree_across_ranks`: each rank runs it, then one collective shares every rank's
outcome, so a rank that OOMs alone reports it instead of leaving the others waiting, and every rank takes the same
(the worst) outcome, hence the same path through the search and the same answer. `smallest_over_ranks` is the guard
on the final choice and on the budget the headroom is taken of. Each collective is a bounded wait on the peers
(`timm_ext.peer_wait`): a peer that died or stalls past the group's timeout ends every rank with one line.
"""
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..memory import device_broken
from ..peer_wait import note_position, peer_wait
from .table import ERROR, FIT, OOM, Trial, TrialError, TrialFn

__all__ = ['agree_across_ranks', 'smallest_over_ranks']


def _worst(trials: Sequence[Trial]) -> Trial:
    order = {FIT: 0, OOM: 1, ERROR: 2}
    return max(trials, key=lambda t: order[t.status])


def agree_across_ranks(run_trial: TrialFn) -> TrialFn:
    """Wrap a trial so that every rank of the default process group reports the same, combined outcome.

    After each local trial one `all_gather_object` collects all ranks' trials: the status is the worst (an OOM on
    any rank is an OOM for all), the peak and step time are the largest, samples/s counts every rank's samples at
    the slowest rank's pace. Without an initialized group of more than one rank the trial is returned as is.
    """

    def run(batch_size: int) -> Trial:
        note_position(f'the trial at batch {batch_size}')
        local = run_trial(batch_size)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        if local.status == ERROR and dist.get_backend() == 'nccl' and device_broken('cuda'):
            # NCCL's object collectives stage through the broken device: stop here with the error, in one line
            # (torchrun ends the peers waiting for this rank)
            raise TrialError(f'rank {dist.get_rank()}: {local.error}; the device cannot run anything after it',
                             [local])
        gathered: List[Optional[dict]] = [None] * dist.get_world_size()
        with peer_wait(f'the agreement on the trial at batch {batch_size}'):
            dist.all_gather_object(gathered, local.to_dict())
        per_rank = [Trial.from_dict(d) for d in gathered]
        worst = _worst(per_rank)
        if worst.status != FIT:
            rank = per_rank.index(worst)
            return Trial(batch_size, worst.status, error=f'rank {rank}: {worst.error}')
        peaks = [t.peak_bytes for t in per_rank]
        ms = max(t.ms_per_step for t in per_rank)
        return Trial(batch_size, FIT, peak_bytes=None if None in peaks else max(peaks), ms_per_step=ms,
                     samples_per_s=batch_size * len(per_rank) * 1000.0 / ms if ms else None)

    return run


def smallest_over_ranks(value: int, device: torch.device, what: str = 'value') -> int:
    """The minimum of `value` over the ranks of an initialized process group (`value` itself without one); `what` it
    is names the wait where a peer never joins it (`peer_wait`)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = torch.tensor([value], dtype=torch.int64, device=device if dist.get_backend() == 'nccl' else 'cpu')
    with peer_wait(f'the smallest {what} over ranks'):
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())
