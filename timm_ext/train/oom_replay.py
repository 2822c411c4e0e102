"""OOM replay of a training window (``--oom-recover``), as one object the training loop calls at three points.

`timm_ext.train.loop.TrainLoop` walks a window of micro-batches the same way with or without recovery; what differs is
the `WindowAttempt` it is handed: how a loader batch is cut into pieces, how one piece's backward runs, whether DDP
may all-reduce inside a backward, and whether this rank has failed already. Without recovery that is `PLAIN_WINDOW`
(one piece, errors propagate). With it, `WindowReplay`:

* `WindowReplay.run` runs a window pass under protection, settles it across ranks, and replays it with twice as many
  pieces per batch until it completes everywhere (then all-reduces the gradients itself under DDP);
* `WindowReplay.guard_update` turns an OOM in the optimizer step (not replayable) into a clear error;
* `WindowReplay.after_update` counts a clean update toward trying the larger micro-batch again (``--oom-grow-back``).

The splitting arithmetic and the collectives are `timm_ext.train.oom_recovery`'s.
"""
import logging
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
import torch.nn as nn

from ..memory import device_broken, free_memory
from .noise_monitor import NoiseScaleMonitor
from .oom_recovery import (
    FAILED, OK, OOM, GradientAllReduce, MicroBatchSplitter, OomRecoveryError, RankFailed, WindowOutOfMemory,
    agree_status, is_recoverable_oom,
)

__all__ = ['PLAIN_WINDOW', 'PieceFailure', 'Piece', 'PlainWindow', 'WindowAttempt', 'WindowReplay', 'batch_len']

_logger = logging.getLogger('train')

T = TypeVar('T')
# one piece of a loader batch: (input, target, samples, weight of its mean loss)
Piece = Tuple[Any, torch.Tensor, int, float]
BackwardFn = Callable[[Any, torch.Tensor, float, bool], torch.Tensor]


def batch_len(input: Any) -> int:
    """Samples in a batch: a tensor's first dimension, or the patches of a NaFlex dict."""
    return (input['patches'] if isinstance(input, dict) else input).shape[0]


@dataclass(frozen=True)
class PieceFailure:
    """How a piece of a window failed under OOM recovery (kept until the window's agreement).

    Attributes:
        status: OOM or FAILED.
        reason: The first line of an OOM's message ('' for other errors).
        error: The exception of a FAILED piece, raised once the peers know (None for an OOM: its frames are freed).
    """
    status: int
    reason: str = ''
    error: Optional[BaseException] = None


class PlainWindow:
    """A window pass without OOM recovery: each batch is one piece, errors propagate, DDP syncs in the last backward.
    """
    ddp_sync = True
    failed = False
    stop_now = False

    def pieces(self, input: Any, target: torch.Tensor, num_samples: int, weight: float) -> List[Piece]:
        return [(input, target, num_samples, weight)]

    def backward(self, step: BackwardFn, input: Any, target: torch.Tensor, weight: float,
                 sync: bool) -> Optional[torch.Tensor]:
        return step(input, target, weight, sync)


PLAIN_WINDOW = PlainWindow()


class WindowAttempt(PlainWindow):
    """One pass over a window under OOM protection: the pieces of each batch, and this rank's first failure.

    Args:
        splitter: How many pieces a loader batch is cut into.
        device: The training device (what counts as a recoverable OOM depends on it).
        distributed: Under DDP, gradients are all-reduced after the window (never inside a backward), and a rank
            that failed walks the rest of the window so that its peers' collectives are matched.
    """

    def __init__(self, splitter: MicroBatchSplitter, device: torch.device, distributed: bool):
        self.splitter = splitter
        self.device = device
        self.distributed = distributed
        self.ddp_sync = not distributed
        self.failure: Optional[PieceFailure] = None

    @property
    def failed(self) -> bool:
        """This rank has failed in this pass: compute nothing more."""
        return self.failure is not None

    @property
    def stop_now(self) -> bool:
        """Leave the pass now: one process has nobody to wait for."""
        return self.failure is not None and not self.distributed

    def pieces(self, input: Any, target: torch.Tensor, num_samples: int, weight: float) -> List[Piece]:
        """The pieces of one loader batch, each weighted by its share of the batch (the window's mean is kept)."""
        pieces = self.splitter.split(input, target, num_samples)
        if len(pieces) == 1:
            return [(input, target, num_samples, weight)]
        return [(p, t, batch_len(p), weight * batch_len(p) / num_samples) for p, t in pieces]

    def backward(self, step: BackwardFn, input: Any, target: torch.Tensor, weight: float,
                 sync: bool) -> Optional[torch.Tensor]:
        """``step`` on one piece; None when it failed (an OOM, or under DDP any error, told to the peers later)."""
        try:
            return step(input, target, weight, sync)
        except Exception as e:
            if not is_recoverable_oom(e):
                if not self.distributed:
                    raise
                self.failure = PieceFailure(FAILED, '', e)
                return None
            traceback.clear_frames(e.__traceback__)  # its frames hold the failed attempt's activations
            self.failure = PieceFailure(OOM, ' '.join(str(e).split())[:200] or type(e).__name__)
            return None


class WindowReplay:
    """Runs training windows so that an out-of-memory error replays the window with smaller micro-batches.

    Args:
        task: The timm training task (its DDP module gets the buffer broadcast re-armed; batch norm is warned about).
        params: The trainable parameters (all-reduced explicitly under DDP).
        device: The training device.
        batch_size: The loader's batch size per rank.
        accum_steps: Loader batches per update (for the log line).
        grow_back: Try the larger micro-batch again after this many clean updates (None: never).
        world_size: Number of ranks.
        rank: This process's rank.
        optimizer: Its gradients are thrown away after a failed pass.
        noise: The noise-scale monitor, whose measurements of a failed pass are thrown away too, or None.
    """

    def __init__(self, task: nn.Module, params: List[nn.Parameter], device: torch.device, batch_size: int,
                 accum_steps: int, grow_back: Optional[int], world_size: int, rank: int,
                 optimizer: torch.optim.Optimizer, noise: Optional[NoiseScaleMonitor] = None):
        self.task = task
        self.device = device
        self.accum_steps = accum_steps
        self.grow_back = grow_back
        self.world_size = world_size
        self.rank = rank
        self.optimizer = optimizer
        self.noise = noise
        self.splitter = MicroBatchSplitter(batch_size, grow_back)
        # under DDP, recovery needs every backward local and one explicit all-reduce once all ranks are through
        self.gradient_allreduce = GradientAllReduce(params, world_size) if self.distributed else None
        self.has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in task.modules())
        self.replays = 0  # times the last window was replayed after an OOM

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def _prefix(self) -> str:
        return f'rank {self.rank}: ' if self.distributed else ''

    def run(self, window_pass: Callable[[WindowAttempt], T], where: str) -> T:
        """Run ``window_pass`` until it completes on every rank, replaying it after each OOM with smaller pieces.

        Raises:
            OomRecoveryError: Out of memory even with one sample per piece.
            RankFailed: Another rank failed with an error that is not an OOM.
        """
        self.replays = 0
        while True:
            attempt = WindowAttempt(self.splitter, self.device, self.distributed)
            self._arm_buffer_sync()
            result = window_pass(attempt)
            oom = self._settle(attempt.failure)
            if oom is None:
                break
            del result, attempt
            self._recover(oom, where)
            self.replays += 1
        if self.gradient_allreduce is not None:
            self.gradient_allreduce()
        return result

    def guard_update(self, update: Callable[[], None], where: str) -> None:
        """Run the optimizer ``update``; an OOM inside it stops the run with a clear error.

        Splitting micro-batches cannot help there: the optimizer's state and update take the same memory whatever
        the micro-batch, and a failed step may have updated some parameters already, so it is not replayed.
        """
        try:
            update()
        except Exception as e:
            if not is_recoverable_oom(e):
                raise
            traceback.clear_frames(e.__traceback__)
            raise OomRecoveryError(
                f'out of memory in the optimizer step at {where}, after the update\'s forward and backward passes '
                f'fit: a smaller micro-batch does not shrink the optimizer\'s state or update, so OOM recovery '
                f'stops here; checkpoints already written are intact. Free device memory, use an optimizer with '
                f'less state (e.g. --opt sgd), --model-ema-force-cpu, or a smaller model') from None

    def after_update(self, where: str) -> None:
        """Count an update that needed no replay; every ``grow_back`` of them, try the larger micro-batch."""
        if self.replays:
            return
        grown = self.splitter.after_clean_update()
        if grown is not None:
            _logger.info(f'{self._prefix}OOM recovery at {where}: {self.grow_back} clean updates, trying the '
                         f'larger micro-batch again: {grown[0]} -> {grown[1]}.')

    def _arm_buffer_sync(self) -> None:
        """Under DDP, have DDP broadcast rank 0's buffers in the first forward of each window pass.

        Every forward then runs under `no_sync`, and DDP broadcasts buffers in a forward only after one that synced
        gradients: left alone it would broadcast in the run's first forward only, and once more on a rank whose first
        forward failed (its flag was never cleared) but not on its peers, a collective only one side joins. Armed
        per pass, the broadcast comes where stock DDP has it (each window's first forward), on every rank alike.
        """
        module = self.task.get_trainable_module()
        if self.distributed and isinstance(module, nn.parallel.DistributedDataParallel):
            module.require_forward_param_sync = True

    def _settle(self, failure: Optional[PieceFailure]) -> Optional[WindowOutOfMemory]:
        """The window's OOM (on any rank) to replay, or None; raises for other failures. Under DDP every rank takes
        the same decision, after the window's one status all-reduce."""
        if not self.distributed:
            return WindowOutOfMemory([0], failure.reason) if failure is not None else None
        if failure is not None and failure.error is not None and device_broken(self.device):
            raise failure.error  # the agreement's own tensor would fail on this context and hide the error
        statuses = agree_status(OK if failure is None else failure.status, self.rank, self.world_size, self.device)
        if failure is not None and failure.error is not None:
            raise failure.error
        if FAILED in statuses:
            raise RankFailed(f'rank {statuses.index(FAILED)} failed with an error (see its log); rank '
                             f'{self.rank} stops too')
        if OOM in statuses:
            return WindowOutOfMemory([r for r, s in enumerate(statuses) if s == OOM],
                                     failure.reason if failure is not None else '')
        return None

    def _recover(self, oom: WindowOutOfMemory, where: str) -> None:
        """Free what the failed window held and cut batches into twice as many pieces (or give up at 1 sample)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.noise is not None:
            self.noise.reset_window()
        free_memory(self.device)
        on_ranks = f' on rank {", ".join(map(str, oom.ranks))}' if self.distributed else ''
        try:
            old, new = self.splitter.shrink()
        except OomRecoveryError:
            raise OomRecoveryError(
                f'out of memory at {where}{on_ranks} even with a micro-batch of 1 sample: nothing smaller to try; '
                f'checkpoints already written are intact. Free device memory or use a smaller model or input '
                f'size{f" ({oom.reason})" if oom.reason else ""}') from None
        splits = self.splitter.splits
        _logger.warning(
            f'{self._prefix}OOM recovery at {where}: out of memory{on_ranks}; micro-batch {old} -> {new} '
            f'({splits} pieces per loader batch, {splits * self.accum_steps} backward passes per update); '
            f'the global batch, LR and schedule are unchanged; replaying the update.')
        if self.has_batchnorm and self.rank == 0 and old == self.splitter.batch_size:
            _logger.warning(f'The model has batch norm: its batch statistics now come from micro-batches of {new}, '
                            f'so updates are close to, not exactly, those of the full micro-batch.')
