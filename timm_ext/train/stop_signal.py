"""Stopping a training run cleanly on SIGTERM or SIGINT, at the next optimizer update.

Cluster schedulers send SIGTERM some time before they kill a job, and Ctrl-C sends SIGINT. Either one, caught
anywhere in a step, would leave the step half done; so the handler only records the signal, and the training loop
asks `StopOnSignal.requested` after each complete update. The loop then saves a recovery checkpoint of that update
(the run resumes from it exactly) and raises `TrainingStopped`; train.py exits with 128 + the signal's number, as a
shell reports a process ended by that signal. A second Ctrl-C interrupts at once (KeyboardInterrupt).

Under DDP the ranks may see the signal at different updates; `requested` takes the maximum over ranks, so all of
them stop after the same update and none waits in a collective for a rank that has left. That answer is read on the
host (a sync on CUDA), so the loop asks only on its log-line updates, where it syncs anyway: a signal stops a DDP run
at most `--log-interval` updates after it arrives. A peer that never joins the agreement (it died, or stalls past
`--dist-timeout`) ends this rank with one line (`timm_ext.peer_wait`).
"""
import signal
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..errors import TimmExtError
from ..peer_wait import peer_wait

__all__ = ['StopOnSignal', 'TrainingStopped']

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(TimmExtError):
    """Training stopped on a signal after a complete update.

    Attributes:
        signum: The signal's number.
        checkpoint: The checkpoint that holds the last update (None on ranks that do not save).
    """

    def __init__(self, signum: int, where: str, checkpoint: Optional[Path] = None):
        self.signum = signum
        self.checkpoint = checkpoint
        name = signal.Signals(signum).name
        saved = f'; resume with --resume {checkpoint}' if checkpoint is not None else ''
        super().__init__(f'stopped by {name} after {where}{saved}')

    label = ''  # 'train.py: stopped by SIGTERM ...', not an error

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopOnSignal:
    """Records SIGTERM / SIGINT while installed, instead of letting them end the process mid-step."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def install(self) -> 'StopOnSignal':
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> 'StopOnSignal':
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _record(self, signum: int, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the update to end
        self.signum = signum

    def requested(self, device: Optional[torch.device] = None) -> Optional[int]:
        """The signal that asks to stop, or None; the same answer on every rank under DDP (a collective)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signum  # nothing to agree with: no collective, no host read
        flag = torch.tensor(self.signum or 0, device=device)
        with peer_wait('the agreement on whether a signal stops the run'):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None
