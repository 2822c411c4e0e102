"""Bounded waits on the other ranks: a collective that a peer never joins ends this rank with one line.

Every collective our code issues outside DDP's backward (the probe's trial agreement and smallest-over-ranks, rank 0's
broadcasts, the stop flag) runs inside `peer_wait(what)`. Before it, the rank writes where it is into the process
group's store (one small key per rank); when the collective fails, because a peer died (gloo: "Connection reset /
closed by peer") or did not arrive within the group's timeout (`--dist-timeout`), the store says which ranks had not
reached this wait and where they were last, and the rank raises `PeerLostError`: one line, exit 1, no traceback.

The group's timeout is what bounds a wait on a stalled peer; a dead peer ends the wait at once (its sockets close).
"""
import contextlib
import datetime
import itertools
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .errors import TimmExtError

__all__ = ['PeerLostError', 'peer_wait', 'note_position', 'lost_peer', 'group_timeout_s']

_KEY = 'timm_ext/at/{}'  # one key per rank: '<sequence number>|<what it waits in>'
_SEQUENCE = itertools.count(1)

# How gloo and NCCL word a collective that did not complete in the group's timeout (a peer stalled or never came)
_TIMED_OUT_MARKERS = ('Timed out waiting', 'collective operation timeout', 'Socket Timeout')
# ... and one that failed because another process of the group is gone
_LOST_PEER_MARKERS = ('Connection reset by peer', 'Connection closed by peer', 'Broken pipe', 'Connection refused',
                      'NCCL communicator was aborted', 'ProcessGroupNCCL') + _TIMED_OUT_MARKERS


class PeerLostError(TimmExtError):
    """A wait on the other ranks failed: a peer died, exited or stalled past the group's timeout."""


def lost_peer(e: BaseException) -> bool:
    """Whether `e` is a collective that failed because another rank died, left or could not be reached in time."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return isinstance(e, dist.DistError) or any(m in str(e) for m in _LOST_PEER_MARKERS)


def group_timeout_s() -> Optional[float]:
    """The default process group's collective timeout in seconds (None without a group or where it is unknown)."""
    try:
        device = torch.device('cuda' if dist.get_backend() == 'nccl' else 'cpu')
        timeout = dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # no group, or a backend that keeps no options
        return None
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None


def _store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _mark(store: Optional[dist.Store], rank: int, sequence: int, what: str) -> None:
    if store is None:
        return
    try:
        store.set(_KEY.format(rank), f'{sequence}|{what}')
    except (RuntimeError, dist.DistError):  # the store's host is gone: the collective will say so
        pass


def _positions(store: Optional[dist.Store], ranks: List[int]) -> Dict[int, Tuple[int, str]]:
    """Where each of `ranks` last said it was: {rank: (sequence number, what)}; ranks the store cannot tell left out.
    Only keys that exist are read, so no read waits for a key."""
    found: Dict[int, Tuple[int, str]] = {}
    if store is None:
        return found
    for rank in ranks:
        key = _KEY.format(rank)
        try:
            if store.check([key]):
                sequence, _, what = store.get(key).decode().partition('|')
                found[rank] = (int(sequence), what)
        except (RuntimeError, ValueError, dist.DistError):  # the store's host died with its rank
            break
    return found


def _describe(e: BaseException, rank: int, world: int, sequence: int, what: str, waited_s: float,
              store: Optional[dist.Store]) -> str:
    others = [r for r in range(world) if r != rank]
    seen = _positions(store, others)
    behind = [r for r in others if seen.get(r, (0, ''))[0] < sequence]
    timed_out = any(m in str(e) for m in _TIMED_OUT_MARKERS)
    if seen and behind:
        peers = ', '.join(f'rank {r}' + (f' (last in {seen[r][1]})' if r in seen else '') for r in behind)
    else:  # every peer reached this wait and one failed inside it, or the store is gone with its host rank
        peers = f'rank {others[0]}' if len(others) == 1 else 'another rank'
    if timed_out:
        return (f'rank {rank} waited for {peers} in {what}: it did not arrive within {waited_s:.0f} s (the group '
                f'timeout, --dist-timeout); stopping this rank too')
    return f'rank {rank} lost contact with {peers} in {what}: it is gone (it exited or was killed); stopping this rank'


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def note_position(what: str) -> None:
    """Say in the store that this rank is now in `what` ('the trial at batch 8'): the line of a peer that gives up
    waiting for this rank names it. Every rank must note the same positions, in the same order, as its waits."""
    if _distributed():
        _mark(_store(), dist.get_rank(), next(_SEQUENCE), what)


@contextlib.contextmanager
def peer_wait(what: str) -> Iterator[None]:
    """Run the collective(s) in the block as a wait on the other ranks, named `what` ('the agreement on the trial at
    batch 8'); a failure that is a lost or late peer becomes `PeerLostError` naming the rank waited for.

    Without an initialized group of more than one rank the block runs as is.
    """
    if not _distributed():
        yield
        return
    rank, world, sequence = dist.get_rank(), dist.get_world_size(), next(_SEQUENCE)
    store = _store()
    _mark(store, rank, sequence, what)
    started = time.monotonic()
    try:
        yield
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        raise PeerLostError(_describe(e, rank, world, sequence, what, time.monotonic() - started, store)) from None
