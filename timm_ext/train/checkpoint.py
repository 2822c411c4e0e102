"""Crash-safe training checkpoints: ranked history, recovery files, resume, safetensors export.

Every file is written through `timm_ext.atomic_files`: under a temporary name in its final folder, fsynced, then
``os.replace``d onto its real name,
so a process killed at any moment leaves each ``*.pth.tar`` / ``*.safetensors`` on disk either absent, the previous
complete version, or the new complete version. Copies (``checkpoint-<epoch>``, ``model_best``) are hard links of
the already-synced ``last`` file made under a temporary name and renamed the same way (a byte copy where the file
system has no hard links).

Checkpoints keep timm's keys (epoch, arch, state_dict, optimizer, version, args, amp_scaler, state_dict_ema, metric)
so ``timm.models.load_checkpoint``, timm's validate.py and timm's train.py ``--resume`` read them, plus our own:
``scheduler``, ``rng``, ``saver`` (history bookkeeping), ``device_name`` (the hardware it trained on: with the batch
size, world size and accumulation in ``args`` it is the layout an elastic resume re-plans from, ``batch_layout``),
the training loop's ``micro_batch`` (OOM recovery) and ``noise_scale`` (the estimate's EMAs) and, in recovery
checkpoints, ``updates_done`` and ``epoch_rng`` so a resume continues inside the interrupted epoch.
"""
import argparse
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..atomic_files import atomic_duplicate, atomic_torch_save, atomic_write, state_bytes
from ..errors import TimmExtError
from .elastic import BatchLayout

_logger = logging.getLogger(__name__)

CHECKPOINT_EXT = '.pth.tar'

# the training loop's state (`TrainLoop.state_dict` names) -> the checkpoint key it is stored under; rank 0's
# noise-scale EMAs are saved and every rank continues from them on resume
LOOP_KEYS = {'splitter': 'micro_batch', 'noise_scale': 'noise_scale'}
RAMP_KEY = 'batch_ramp'  # --batch-ramp's state (`timm_ext.train.batch_ramp.RampState`)


class CheckpointError(TimmExtError):
    """A checkpoint that cannot be resumed from (missing, truncated, not a training checkpoint), or written."""


def export_safetensors(state_dict: Dict[str, torch.Tensor], path: os.PathLike) -> None:
    """Write model weights as a ``.safetensors`` file that ``timm.create_model`` can load as ``file=``.

    Tensors are cloned to contiguous CPU memory so tied weights are written as independent entries and the file
    loads with a strict ``load_state_dict``.
    """
    from safetensors.torch import save_file
    tensors = {k: v.detach().to('cpu').contiguous().clone() for k, v in state_dict.items() if torch.is_tensor(v)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={'format': 'pt'}), size=state_bytes(tensors))


def rng_state() -> Dict[str, Any]:
    """Random number generator states as weights-only loadable types (tensors, ints, tuples)."""
    np_state = np.random.get_state()
    state = {
        'python': random.getstate(),
        'numpy': (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        'torch': torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state['python'])
    name, keys, *rest = state['numpy']
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available() and len(state['cuda']) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state['cuda'])


def _load_failure(e: Exception) -> str:
    """Why torch.load failed, in a few words: its first line, or for the weights-only unpickler (random bytes, a
    foreign pickle) what it met, without its advice to load with weights_only=False."""
    text = str(e).strip()
    if 'WeightsUnpickler error:' in text:
        detail = text.split('WeightsUnpickler error:', 1)[1].split('Check the documentation', 1)[0]
        return f'unpickling failed: {" ".join(detail.split())}'
    return text.splitlines()[0] if text else type(e).__name__


def load_training_checkpoint(path: os.PathLike) -> Dict[str, Any]:
    """Load a checkpoint for resuming, weights only, raising :class:`CheckpointError` with a one-line reason."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f'--resume {path} is a folder; pass the checkpoint file in it (last.pth.tar, say)')
    if not path.is_file():
        raise CheckpointError(f'--resume file not found: {path}; pass the path of a checkpoint train.py wrote')
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # torch.load fails on a torn or foreign file with many exception types
        reason = _load_failure(e)
        raise CheckpointError(f'--resume file {path} is not a readable checkpoint ({reason[:120]}); pass a '
                              f'checkpoint train.py wrote') from None
    if not isinstance(checkpoint, dict) or not ({'state_dict', 'model'} & checkpoint.keys()):
        raise CheckpointError(f'--resume file {path} is not a training checkpoint (no state_dict)')
    return checkpoint


def training_state(
        task: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        args: argparse.Namespace,
        epoch: int,
        metric: Optional[float] = None,
        grad_scaler: Any = None,
        lr_scheduler: Any = None,
        device_name: Optional[str] = None,
        loop_state: Optional[Dict[str, Any]] = None,
        updates_done: Optional[int] = None,
        ramp_state: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Everything a checkpoint holds, under timm's keys plus ``scheduler``, ``rng`` and ``device_name``, and the
    training loop's state under ``micro_batch`` and ``noise_scale`` (`LOOP_KEYS`).

    A recovery checkpoint (``updates_done`` given) also holds ``updates_done`` and ``epoch_rng``, the RNG states the
    interrupted epoch started from, so a resume replays that epoch's order and continues inside it.

    Args:
        task: The timm.task training task (its model and EMA state dicts, DDP/compile wrappers removed).
        optimizer: The optimizer.
        args: Parsed arguments, stored as ``args`` (stock does the same).
        epoch: Epoch the state belongs to.
        metric: Value that ranks the checkpoint, if any.
        grad_scaler: The AMP gradient scaler, stored as ``amp_scaler`` (timm's NativeScaler key).
        lr_scheduler: The timm scheduler.
        device_name: The hardware the run trains on (`timm_ext.memory.device_name`).
        loop_state: `TrainLoop.state_dict()`, or None.
        updates_done: Updates of ``epoch`` completed, for a recovery checkpoint (None: an epoch checkpoint).
        ramp_state: `BatchRamp.state_dict()` under --batch-ramp (key ``batch_ramp``), or None.
    """
    state = {'epoch': epoch, 'arch': args.model, 'optimizer': optimizer.state_dict(), 'version': 2, 'args': args}
    if grad_scaler is not None:
        state['amp_scaler'] = grad_scaler.state_dict()
    state.update(task.get_checkpoint_state())
    state.update(task.get_checkpoint_state(ema=True))
    if metric is not None:
        state['metric'] = metric
    if lr_scheduler is not None:
        state['scheduler'] = lr_scheduler.state_dict()
    state['rng'] = rng_state()
    if device_name is not None:
        state['device_name'] = device_name
    loop_state = loop_state or {}
    for name, key in LOOP_KEYS.items():
        if loop_state.get(name) is not None:
            state[key] = loop_state[name]
    if updates_done is not None:
        state['updates_done'] = updates_done
        state['epoch_rng'] = loop_state.get('epoch_rng')
    if ramp_state is not None:
        state[RAMP_KEY] = ramp_state
    return state


def saved_loop_state(checkpoint: Dict[str, Any], with_epoch_rng: bool = True) -> Dict[str, Any]:
    """The training loop's state in a checkpoint, for `TrainLoop.load_state_dict` (what it lacks is None).

    Args:
        checkpoint: A loaded checkpoint (ours, or stock timm's: it has none of these keys).
        with_epoch_rng: Include a recovery checkpoint's ``epoch_rng`` (under DDP each rank seeds its own streams
            and only rank 0's were saved, so a distributed resume leaves it out).
    """
    state = {name: checkpoint.get(key) for name, key in LOOP_KEYS.items()}
    state['epoch_rng'] = checkpoint.get('epoch_rng') if with_epoch_rng else None
    return state


def saved_ramp_state(checkpoint: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The --batch-ramp state a checkpoint holds (None: no checkpoint, or one trained without the ramp)."""
    return checkpoint.get(RAMP_KEY) if checkpoint is not None else None


def batch_layout(checkpoint: Dict[str, Any]) -> Optional[BatchLayout]:
    """How the checkpoint's run built its global batch (from its ``args`` and ``device_name``).

    None when the checkpoint has no ``args`` with a batch size (written by other code). A stock timm checkpoint has
    ``args`` without our ``device_name``: the layout's device is then unknown ('').
    """
    args = checkpoint.get('args')
    batch_size = getattr(args, 'batch_size', None)
    if not isinstance(batch_size, int) or batch_size < 1:
        return None
    world_size = getattr(args, 'world_size', 1) or 1
    accum_steps = getattr(args, 'grad_accum_steps', 1) or 1
    return BatchLayout(batch_size, int(world_size), int(accum_steps), str(checkpoint.get('device_name', '')))


def saved_lr(checkpoint: Dict[str, Any]) -> Optional[float]:
    """The LR the checkpoint's run trained with (``args.lr``), or None when it does not say."""
    lr = getattr(checkpoint.get('args'), 'lr', None)
    return float(lr) if isinstance(lr, (int, float)) and lr > 0 else None


@dataclass
class ResumePoint:
    """Where a resumed run starts: ``epoch``, after ``updates_done`` optimizer updates of that epoch."""
    epoch: int
    updates_done: int = 0


def resume_point(checkpoint: Dict[str, Any]) -> ResumePoint:
    """Starting epoch and update for a loaded checkpoint.

    An epoch checkpoint resumes at the next epoch (timm's version-2 rule). A recovery checkpoint written by us
    carries ``updates_done`` and resumes inside its own epoch; one written by stock timm has no such key and is
    resumed as stock does, at the next epoch.
    """
    epoch = int(checkpoint.get('epoch', -1))
    updates_done = checkpoint.get('updates_done')
    if updates_done is not None:
        return ResumePoint(epoch, int(updates_done))
    return ResumePoint(epoch + 1 if checkpoint.get('version', 1) > 1 else epoch)


def restore_model(task: torch.nn.Module, checkpoint: Dict[str, Any], ema: bool = False) -> None:
    """Load a checkpoint's weights (and task state) into the task, or into its EMA copy.

    For the EMA copy, a checkpoint without EMA weights provides its model weights (as timm does).

    Raises:
        CheckpointError: The weights do not fit the model (another architecture or number of classes).
    """
    from timm.models import clean_state_dict
    keys = [('state_dict_ema', 'task_state_ema'), ('model_ema', '')] if ema else []
    keys += [('state_dict', 'task_state'), ('model', '')]
    model_key, task_key = next((m, t) for m, t in keys if checkpoint.get(m) is not None)
    try:
        task.load_checkpoint_state(
            clean_state_dict(checkpoint[model_key]), checkpoint.get(task_key) if task_key else None, ema=ema)
    except RuntimeError as e:
        detail = ' '.join(str(e).split())[:160]
        raise CheckpointError(f"--resume checkpoint ({checkpoint.get('arch', '?')}) does not fit this model: "
                              f"{detail}") from None


def restore_optimizer(optimizer: torch.optim.Optimizer, checkpoint: Dict[str, Any], grad_scaler: Any = None) -> None:
    """Load optimizer and AMP scaler state when the checkpoint has them.

    Raises:
        CheckpointError: The optimizer state belongs to another optimizer or parameter layout.
    """
    if 'optimizer' in checkpoint:
        try:
            optimizer.load_state_dict(checkpoint['optimizer'])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f'--resume optimizer state does not fit this optimizer ({str(e)[:120]}); '
                                  f'pass --no-resume-opt to start a fresh optimizer') from None
    if grad_scaler is not None and 'amp_scaler' in checkpoint:
        grad_scaler.load_state_dict(checkpoint['amp_scaler'])


def position_scheduler(lr_scheduler: Any, point: ResumePoint, updates_per_epoch: int,
                       state: Optional[Dict[str, Any]] = None) -> None:
    """Move a freshly built timm scheduler to a resume point, then restore its metric-driven state.

    Epoch and update schedules are pure functions of the step, so stepping to the point reproduces them (and
    honours a changed --epochs). Only the plateau scheduler carries state a step cannot rebuild (its best metric).
    """
    from timm.scheduler import PlateauLRScheduler
    if point.epoch > 0 or point.updates_done > 0:
        lr_scheduler.step(point.epoch)
        lr_scheduler.step_update(point.epoch * updates_per_epoch + point.updates_done)
    if state is not None and isinstance(lr_scheduler, PlateauLRScheduler):
        lr_scheduler.load_state_dict(state)


class CheckpointManager:
    """Writes ``last``, the ranked ``checkpoint-<epoch>`` history, ``model_best`` and recovery checkpoints.

    Ranking follows timm: better metrics first (ties keep the earlier epoch), checkpoints without a metric after
    them, newest first; at most ``max_history`` are kept.

    Args:
        folder: Output folder of the run.
        decreasing: True when a lower metric is better (loss).
        max_history: Number of ``checkpoint-<epoch>`` files kept.
        export_weights: Also write ``last.safetensors`` and ``model_best.safetensors``.
    """

    def __init__(self, folder: os.PathLike, decreasing: bool, max_history: int = 10, export_weights: bool = True):
        self.folder = Path(folder)
        self.decreasing = decreasing
        self.max_history = max(1, max_history)
        self.export_weights = export_weights
        self.history: List[Tuple[str, Optional[float]]] = []  # (file name, metric), best first
        self.best_metric: Optional[float] = None
        self.best_epoch: Optional[int] = None
        # a resumed run in the same folder rotates out the recovery files its predecessor left
        self.recovery_files: List[Path] = sorted(
            self.folder.glob(f'recovery-*{CHECKPOINT_EXT}'), key=lambda p: p.stat().st_mtime)

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.decreasing else a > b

    def state_dict(self) -> Dict[str, Any]:
        return {'history': list(self.history), 'best_metric': self.best_metric, 'best_epoch': self.best_epoch}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Continue the history of a previous run in the same folder; files no longer on disk are dropped."""
        if not state:
            return
        self.history = [(f, m) for f, m in state.get('history', []) if (self.folder / f).exists()]
        self.best_metric = state.get('best_metric')
        self.best_epoch = state.get('best_epoch')

    def _add(self, name: str, metric: Optional[float]) -> None:
        # stable sort: among equal metrics the earlier epoch stays first; unranked entries newest first
        ranked = [h for h in self.history if h[1] is not None] + ([(name, metric)] if metric is not None else [])
        ranked.sort(key=lambda h: h[1], reverse=not self.decreasing)
        unranked = ([(name, metric)] if metric is None else []) + [h for h in self.history if h[1] is None]
        self.history = ranked + unranked

    def save_epoch(
            self,
            state: Dict[str, Any],
            epoch: int,
            metric: Optional[float],
            weights: Optional[Dict[str, torch.Tensor]] = None,
    ) -> Tuple[Optional[float], Optional[int]]:
        """Save the end-of-epoch checkpoint; returns (best metric, best epoch) so far.

        Args:
            state: Checkpoint dict without the saver bookkeeping (added here).
            epoch: Epoch just finished.
            metric: Value ranking this checkpoint, or None.
            weights: Weights to export as safetensors (the EMA weights when EMA is on).
        """
        name = f'checkpoint-{epoch}{CHECKPOINT_EXT}'
        self.history = [h for h in self.history if h[0] != name]  # a re-run epoch replaces its old entry
        keep = len(self.history) < self.max_history or self.history[-1][1] is None or (
            metric is not None and self._better(metric, self.history[-1][1]))
        is_best = metric is not None and (self.best_metric is None or self._better(metric, self.best_metric))
        evicted = []
        if keep:
            self._add(name, metric)
            evicted, self.history = self.history[self.max_history:], self.history[:self.max_history]
        if is_best:
            self.best_metric, self.best_epoch = metric, epoch

        last = self.folder / f'last{CHECKPOINT_EXT}'
        atomic_torch_save({**state, 'saver': self.state_dict()}, last)
        if keep:
            atomic_duplicate(last, self.folder / name)
        for old_name, _ in evicted:
            (self.folder / old_name).unlink(missing_ok=True)
        if is_best:
            atomic_duplicate(last, self.folder / f'model_best{CHECKPOINT_EXT}')
        if self.export_weights and weights is not None:
            export_safetensors(weights, self.folder / 'last.safetensors')
            if is_best:
                atomic_duplicate(self.folder / 'last.safetensors', self.folder / 'model_best.safetensors')
        if keep:
            _logger.info('Checkpoints kept: ' + ', '.join(f'{f} ({m})' for f, m in self.history))
        return self.best_metric, self.best_epoch

    def save_recovery(self, state: Dict[str, Any], epoch: int, update_idx: int) -> Path:
        """Save ``recovery-<epoch>-<update_idx>``; the two newest recovery files are kept."""
        path = self.folder / f'recovery-{epoch}-{update_idx}{CHECKPOINT_EXT}'
        atomic_torch_save({**state, 'saver': self.state_dict()}, path)
        self.recovery_files.append(path)
        while len(self.recovery_files) > 2:
            self.recovery_files.pop(0).unlink(missing_ok=True)
        return path
