"""Training and evaluation loops for train.py: explicit gradient accumulation, host syncs only when logging.

An epoch of n micro-batches with k accumulation steps is cut into ceil(n / k) windows (the last may be shorter).
Within a window each micro-batch's loss is weighted by its samples over the window's samples, so the accumulated
gradient is the mean over every sample of the window, the shorter last window included. Under DDP the gradient
all-reduce runs only on a window's last backward (``no_sync`` before it). Optimizer step, EMA update, ``zero_grad``
and the scheduler's ``step_update`` happen once per window. Losses stay on the device as tensors and are read
(``.item()``) only on log lines and at the end of the epoch.

Extension points: :meth:`TrainLoop.forward_backward` is one micro-batch (or any slice of one, weighted by its own
samples), `apply_update` sees a window's complete gradient before it is applied.

Two options build on them. OOM recovery (``oom_recover``, `timm_ext.train.oom_replay.WindowReplay`): a window that
runs out of memory is replayed with each loader batch cut into twice as many pieces, each weighted by its share of
the batch, so the update is the same mean over the same samples; under DDP the ranks agree once per window and
all-reduce the window's gradients themselves, in buckets. Noise scale (``log_noise_scale``,
`timm_ext.train.noise_monitor`): each micro-batch's and the window's gradient norms feed a B_simple estimate, with
no extra passes.
"""
import dataclasses
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torchvision.utils
from timm.utils import accuracy, dispatch_clip_grad

from ..accum import accumulation_windows
from .checkpoint import rng_state, set_rng_state
from ..distributed import reduce_mean, reduce_sum
from .noise_monitor import NoiseScaleMonitor, NoiseScaleSummary
from .oom_recovery import MicroBatchSplitter
from .oom_replay import PLAIN_WINDOW, PlainWindow, WindowReplay, batch_len
from .stop_signal import StopOnSignal, TrainingStopped

_logger = logging.getLogger('train')

# How a micro-batch's loss is weighted against its window: 'samples' is the true mean over the window's samples;
# 'none', 'linear' and 'sqrt' are timm's --variable-batch-loss-scale / --naflex-loss-scale modes for loaders whose
# batch size varies on purpose (each micro-batch counts 1, n / reference or sqrt(n / reference), divided by the
# window length).
LOSS_WEIGHTINGS = ('samples', 'none', 'linear', 'sqrt')


@dataclass
class LoopConfig:
    """Settings of the training loop that stay fixed for a run.

    Attributes:
        device: Device the model trains on.
        accum_steps: Micro-batches per optimizer update (--grad-accum-steps).
        batch_size: Nominal micro-batch size; the reference for loss weighting.
        loss_weighting: One of LOSS_WEIGHTINGS.
        clip_grad: Gradient clipping value, None for no clipping.
        clip_mode: 'norm', 'value' or 'agc'.
        log_interval: Log every this many updates (and the last one).
        recovery_interval: Call the recovery hook every this many updates (0: never).
        channels_last: Convert inputs to channels_last.
        model_dtype: Dtype inputs are cast to when the loader does not do it (no prefetcher).
        prefetcher: Batches arrive on the device already normalized (timm's PrefetchLoader).
        synchronize_step: Synchronize the device after every update (accurate per-update timing).
        world_size: Number of processes; > 1 means distributed.
        rank: This process's rank; only rank 0 writes log lines.
        naflex: Inputs are NaFlex dicts; under DDP each micro-batch is scaled by its share of the global batch.
        save_images_dir: Write the first input of each logged update here (--save-images), or None.
        oom_recover: On out-of-memory, replay the window with each batch in twice as many pieces (--oom-recover).
        oom_grow_back: After this many clean updates, try the larger micro-batch again (--oom-grow-back).
        log_noise_scale: Estimate the gradient noise scale from the window's gradients (--log-noise-scale).
    """
    device: torch.device
    accum_steps: int = 1
    batch_size: float = 1
    loss_weighting: str = 'samples'
    clip_grad: Optional[float] = None
    clip_mode: str = 'norm'
    log_interval: int = 50
    recovery_interval: int = 0
    channels_last: bool = False
    model_dtype: Optional[torch.dtype] = None
    prefetcher: bool = False
    synchronize_step: bool = False
    world_size: int = 1
    rank: int = 0
    naflex: bool = False
    save_images_dir: Optional[str] = None
    oom_recover: bool = False
    oom_grow_back: Optional[int] = None
    log_noise_scale: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def prepare_batch(input: Any, target: torch.Tensor, cfg: LoopConfig,
                  mixup_fn: Optional[Callable] = None) -> Tuple[Any, torch.Tensor]:
    """Move a batch to the device and apply mixup when the loader did not; channels_last if asked."""
    if not cfg.prefetcher:
        if isinstance(input, (list, tuple)):
            # --aug-splits without the prefetcher's collate: stack the splits split-major, as fast_collate does
            target = target.repeat((len(input),) + (1,) * (target.ndim - 1))
            input = torch.cat(input)
        input = input.to(device=cfg.device, dtype=cfg.model_dtype)
        target = target.to(device=cfg.device)
        if mixup_fn is not None:
            input, target = mixup_fn(input, target)
    if cfg.channels_last and torch.is_tensor(input):
        input = input.contiguous(memory_format=torch.channels_last)
    return input, target


def loss_weight(cfg: LoopConfig, num_samples: int, window_len: int) -> float:
    """Weight of a micro-batch's mean loss in a window of ``window_len`` micro-batches of nominal size."""
    ratio = num_samples / cfg.batch_size
    per_batch = {'samples': ratio, 'none': 1.0, 'linear': ratio, 'sqrt': math.sqrt(ratio)}[cfg.loss_weighting]
    weight = per_batch / window_len
    if cfg.naflex and cfg.distributed:
        # ranks see different NaFlex batch sizes; weigh each rank by its share of the global batch (as timm)
        global_samples = reduce_sum(torch.tensor(float(num_samples), device=cfg.device))
        weight *= cfg.world_size * num_samples / global_samples
    return weight


def _skip_trained(batches: Iterator, windows: List[range], start_update: int, epoch: int, cfg: LoopConfig) -> None:
    """Draw the batches of an epoch's first ``start_update`` updates (trained before a resume) from ``batches``."""
    skip = windows[start_update].start if start_update < len(windows) else sum(map(len, windows))
    if cfg.rank == 0:
        _logger.info(f'Resuming epoch {epoch} at update {start_update}/{len(windows)}: '
                     f'skipping {skip} batches already trained.')
    for _ in range(skip):
        next(batches)


class TrainLoop:
    """Runs training epochs and evaluations of a timm training task.

    Args:
        task: A timm.task TrainingTask (classification or distillation); DDP-wrapped inside when distributed.
        optimizer: The optimizer of the task's trainable parameters.
        cfg: Loop settings.
        amp_autocast: Zero-argument factory of the autocast context (``nullcontext`` when AMP is off).
        grad_scaler: A ``torch.amp.GradScaler`` (float16 AMP on CUDA), else None.
        mixup_fn: Mixup/CutMix applied here when the loader does not do it (no prefetcher), else None.
        lr_scheduler: A timm scheduler; its ``step_update`` is called once per update.
        save_recovery: Called as ``save_recovery(epoch, update_idx)`` every ``cfg.recovery_interval`` updates, and
            when `stop` asks to stop; returns the checkpoint written (None where this rank does not save).
        stop: Asked after every update (under DDP after every log-line update: the ranks' agreement is a host sync)
            whether a signal wants the run to stop (`timm_ext.train.stop_signal`); if so, the update is saved as a
            recovery checkpoint and `TrainingStopped` raised.
    """

    def __init__(
            self,
            task: nn.Module,
            optimizer: torch.optim.Optimizer,
            cfg: LoopConfig,
            amp_autocast: Callable[[], ContextManager] = nullcontext,
            grad_scaler: Optional[torch.amp.GradScaler] = None,
            mixup_fn: Optional[Callable] = None,
            lr_scheduler: Any = None,
            save_recovery: Optional[Callable[[int, int], Optional[Path]]] = None,
            stop: Optional[StopOnSignal] = None,
    ):
        if cfg.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f'loss_weighting must be one of {LOSS_WEIGHTINGS}, got {cfg.loss_weighting!r}')
        self.task = task
        self.optimizer = optimizer
        self.cfg = cfg
        self.amp_autocast = amp_autocast
        self.grad_scaler = grad_scaler
        self.mixup_fn = mixup_fn
        self.lr_scheduler = lr_scheduler
        self.save_recovery = save_recovery
        self.stop = stop
        self.second_order = getattr(optimizer, 'is_second_order', False)
        self.epoch_rng: Optional[Dict[str, Any]] = None  # RNG states when the current epoch's loader started
        self._resume_rng: Optional[Dict[str, Any]] = None  # a checkpoint's epoch_rng, for the epoch it resumes
        self.params = [p for p in task.get_trainable_module().parameters() if p.requires_grad]
        self.noise = NoiseScaleMonitor(self.params, cfg.world_size) if cfg.log_noise_scale else None
        self.replay: Optional[WindowReplay] = WindowReplay(
            task, self.params, cfg.device, max(1, round(cfg.batch_size)), cfg.accum_steps, cfg.oom_grow_back,
            cfg.world_size, cfg.rank, optimizer, self.noise) if cfg.oom_recover else None

    def set_layout(self, batch_size: float, accum_steps: int) -> None:
        """Train the next epochs with loader batches of `batch_size` and `accum_steps` of them per update.

        --batch-ramp grows them between epochs (a new micro-batch comes with a new loader). `batch_size` is the
        loss weights' reference; OOM recovery cuts the new batches into pieces no bigger than those it was cutting
        (a micro-batch that ran out of memory would again), or none when it was not cutting.
        """
        self.cfg = dataclasses.replace(self.cfg, batch_size=batch_size, accum_steps=accum_steps)
        if self.replay is not None:
            self.replay.accum_steps = accum_steps
            splitter, loader_batch = self.replay.splitter, max(1, round(batch_size))
            if splitter.splits > 1:
                splitter.splits = min(math.ceil(loader_batch / splitter.micro_batch), loader_batch)
            splitter.batch_size = loader_batch

    # ---- one micro-batch ------------------------------------------------------------------------------------

    def prepare_batch(self, input: Any, target: torch.Tensor) -> Tuple[Any, torch.Tensor]:
        """`prepare_batch` with this loop's settings and mixup."""
        return prepare_batch(input, target, self.cfg, self.mixup_fn)

    def forward_backward(self, input: Any, target: torch.Tensor, weight: float, sync: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss scaled by ``weight``; gradients add up in ``.grad``.

        Args:
            input: Input batch on the device.
            target: Targets on the device.
            weight: Factor on the micro-batch's mean loss (its share of the window).
            sync: All-reduce gradients across ranks in this backward (the window's last one).

        Returns:
            The micro-batch's unweighted mean loss, detached, on the device.
        """
        with nullcontext() if sync else self.task.no_sync():
            with self.amp_autocast():
                loss = self.task(input, target)['loss']
            scaled = loss * weight
            if self.grad_scaler is not None:
                scaled = self.grad_scaler.scale(scaled)
            scaled.backward(create_graph=self.second_order)
        return loss.detach()

    # ---- one window ---------------------------------------------------------------------------------------------

    def optimizer_update(self, grad_correction: float = 1.0) -> None:
        """Apply a window's accumulated gradient with this loop's settings (`apply_update`)."""
        apply_update(self.task, self.optimizer, self.cfg, self.grad_scaler, grad_correction)

    def train_window(self, batches: Iterator, window_len: int, where: str) -> Tuple[torch.Tensor, int, float, Any]:
        """Forward and backward over the next ``window_len`` batches; their gradients add up in ``.grad``.

        With OOM recovery the window's batches are kept until its update: a window that runs out of memory is
        replayed from its first batch with every batch cut into twice as many pieces (`WindowReplay.run`).

        Returns:
            (sum of loss x samples, samples, seconds spent waiting for data, the window's last input)
        """
        feed = _WindowFeed(batches, self.prepare_batch, keep=self.replay is not None)
        if self.replay is None:
            loss_sum, samples, input = self._window_pass(feed, window_len, PLAIN_WINDOW)
        else:
            loss_sum, samples, input = self.replay.run(
                lambda attempt: self._window_pass(feed, window_len, attempt), where)
        return loss_sum, samples, feed.data_time, input

    def _window_pass(self, feed: '_WindowFeed', window_len: int, attempt: PlainWindow,
                     ) -> Tuple[torch.Tensor, int, Any]:
        """One pass over a window: every micro-batch's backward, DDP's all-reduce only in the last one."""
        loss_sum = torch.zeros((), device=self.cfg.device)
        samples = 0
        for pos in range(window_len):
            input, target = feed.batch(pos)
            num_samples = batch_len(input)
            weight = loss_weight(self.cfg, num_samples, window_len)  # a collective with NaFlex under DDP: every rank
            samples += num_samples
            if attempt.failed:
                continue  # failed under DDP: walk on, the replay needs these batches and the peers are still at it
            pieces = attempt.pieces(input, target, num_samples, weight)
            for i, (piece, piece_target, piece_samples, piece_weight) in enumerate(pieces):
                sync = attempt.ddp_sync and pos == window_len - 1 and i == len(pieces) - 1
                if self.noise is not None:
                    self.noise.before_backward()
                loss = attempt.backward(self.forward_backward, piece, piece_target, piece_weight, sync)
                if loss is None:
                    break
                if self.noise is not None:
                    self.noise.after_backward(piece_samples, piece_weight)
                loss_sum += loss * piece_samples
            if attempt.stop_now:
                break
        return loss_sum, samples, input

    @property
    def splitter(self) -> Optional[MicroBatchSplitter]:
        """The OOM recovery's micro-batch splitter, or None without ``oom_recover``."""
        return self.replay.splitter if self.replay is not None else None

    def noise_scale_summary(self) -> Optional[NoiseScaleSummary]:
        """The noise-scale estimate so far (a collective under DDP), or None when not estimating."""
        return self.noise.summary(self.cfg.device) if self.noise is not None else None

    # ---- resumable state ----------------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs from the loop (None where an option is off).

        Returns:
            ``splitter``: the OOM recovery's micro-batch; ``noise_scale``: the noise-scale EMAs (this rank's);
            ``epoch_rng``: the RNG states the current epoch's loader started from.
        """
        return {
            'splitter': self.splitter.state_dict() if self.splitter is not None else None,
            'noise_scale': self.noise.estimator.state_dict() if self.noise is not None else None,
            'epoch_rng': self.epoch_rng,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from `state_dict`'s output; an ``epoch_rng`` replays the order of the epoch a resume continues
        inside (the next `train_one_epoch` with a ``start_update``)."""
        if self.splitter is not None and state.get('splitter'):
            self.splitter.load_state_dict(state['splitter'])
            if self.cfg.rank == 0 and self.splitter.splits > 1:
                _logger.info(f'OOM recovery: continuing with the checkpoint\'s micro-batch '
                             f'{self.splitter.micro_batch} ({self.splitter.splits} pieces per loader batch of '
                             f'{self.splitter.batch_size}).')
        if self.noise is not None and state.get('noise_scale'):
            self.noise.estimator.load_state_dict(state['noise_scale'])
        self._resume_rng = state.get('epoch_rng')

    # ---- epochs: training and evaluation ------------------------------------------------------------------------

    def train_one_epoch(self, epoch: int, loader: Any, start_update: int = 0) -> Dict[str, float]:
        """Train one epoch, or its remainder after ``start_update`` updates (a resumed recovery checkpoint).

        Returns:
            ``{'loss': mean training loss over the samples trained in this call}``, averaged over ranks.
        """
        cfg = self.cfg
        windows = accumulation_windows(len(loader), cfg.accum_steps)
        updates_per_epoch = len(windows)
        num_updates = epoch * updates_per_epoch + start_update
        self.task.get_trainable_module().train()
        self.optimizer.zero_grad(set_to_none=True)

        if start_update and self._resume_rng is not None:
            set_rng_state(self._resume_rng)  # replay the interrupted epoch's order and augmentation
        self._resume_rng = None
        self.epoch_rng = rng_state()  # a recovery checkpoint replays the epoch's sample order from here
        batches: Iterator = iter(loader)
        if start_update:
            _skip_trained(batches, windows, start_update, epoch, cfg)

        meter = _EpochMeter(cfg, self.optimizer, epoch, updates_per_epoch)
        for update_idx in range(start_update, updates_per_epoch):
            window = windows[update_idx]
            where = f'epoch {epoch} update {update_idx}'
            window_loss, window_samples, window_data_time, input = self.train_window(batches, len(window), where)

            nominal = len(window) * cfg.batch_size
            correction = nominal / window_samples if cfg.loss_weighting == 'samples' else 1.0
            if self.noise is not None:
                # the scale as a device tensor: get_scale() would read it on the host every update
                scale = self.grad_scaler._get_scale_async() if self.grad_scaler is not None else None
                amp_scale = scale if scale is not None else 1.0
                self.noise.end_window(window_samples, amp_scale, correction, check_finite=self.grad_scaler is not None)
            if self.replay is None:
                self.optimizer_update(correction)
            else:
                self.replay.guard_update(lambda: self.optimizer_update(correction), where)
                self.replay.after_update(where)
            num_updates += 1
            self.task.update_ema(step=num_updates)
            meter.update_done(update_idx, window, window_loss, window_samples, window_data_time, input)

            if self.save_recovery is not None and cfg.recovery_interval and (
                    (update_idx + 1) % cfg.recovery_interval == 0):
                self.save_recovery(epoch, update_idx)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step_update(num_updates=num_updates)
            self._stop_if_asked(epoch, update_idx, updates_per_epoch, where)

        if hasattr(self.optimizer, 'sync_lookahead'):
            self.optimizer.sync_lookahead()
        return {'loss': meter.mean_loss()}

    def _stop_if_asked(self, epoch: int, update_idx: int, updates_per_epoch: int, where: str) -> None:
        if self.stop is None:
            return
        if self.cfg.distributed and not is_log_update(update_idx, self.cfg.log_interval, updates_per_epoch):
            return  # the ranks agree (a collective read on the host) only where the loop syncs for its log line
        signum = self.stop.requested(self.cfg.device)
        if signum:
            saved = self.save_recovery(epoch, update_idx) if self.save_recovery is not None else None
            raise TrainingStopped(signum, where, saved)

    def evaluate(
            self, model: nn.Module, loader: Any, loss_fn: nn.Module, tta: int = 0, log_suffix: str = '',
    ) -> Dict[str, float]:
        """`evaluate` with this loop's settings and autocast."""
        return evaluate(model, loader, loss_fn, self.cfg, self.amp_autocast, tta, log_suffix)


def is_log_update(update_idx: int, log_interval: int, updates_per_epoch: int) -> bool:
    """Whether update `update_idx` of an epoch logs a line (every `log_interval`, and the last): the loop's only host
    syncs between epochs."""
    return update_idx % log_interval == 0 or update_idx == updates_per_epoch - 1


def apply_update(task: nn.Module, optimizer: torch.optim.Optimizer, cfg: LoopConfig,
                 grad_scaler: Optional[torch.amp.GradScaler] = None, grad_correction: float = 1.0) -> None:
    """Apply a window's accumulated gradient: unscale, correct, clip, step, then zero the gradients.

    Args:
        task: The training task (its clip parameters).
        optimizer: The optimizer.
        cfg: Loop settings (clipping).
        grad_scaler: The AMP loss scaler, or None.
        grad_correction: Factor on the accumulated gradient, for a window whose micro-batches held fewer
            samples than nominal (keeps the window a true mean).
    """
    needs_grads = grad_correction != 1.0 or cfg.clip_grad is not None
    if needs_grads and grad_scaler is not None:
        grad_scaler.unscale_(optimizer)
    if grad_correction != 1.0:
        grads = [p.grad for g in optimizer.param_groups for p in g['params'] if p.grad is not None]
        torch._foreach_mul_(grads, grad_correction)
    if cfg.clip_grad is not None:
        dispatch_clip_grad(
            task.get_clip_parameters(exclude_head='agc' in cfg.clip_mode),
            value=cfg.clip_grad,
            mode=cfg.clip_mode,
        )
    if grad_scaler is not None:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.inference_mode()
def evaluate(
        model: nn.Module, loader: Any, loss_fn: nn.Module, cfg: LoopConfig,
        amp_autocast: Callable[[], ContextManager] = nullcontext, tta: int = 0, log_suffix: str = '',
) -> Dict[str, float]:
    """Loss, top-1 and top-5 accuracy of ``model`` on ``loader``, summed over all ranks' samples.

    Args:
        model: The eval model (EMA or not).
        loader: Evaluation loader.
        loss_fn: Loss on logits and class indices.
        cfg: The loop's settings (device, prefetcher, channels_last, ranks, log interval).
        amp_autocast: Zero-argument factory of the autocast context.
        tta: Test-time augmentation factor: average this many consecutive outputs per sample.
        log_suffix: Appended to the 'Test' log prefix, e.g. ' (EMA)'.
    """
    model.eval()
    totals = torch.zeros(4, device=cfg.device, dtype=torch.float64)  # loss x n, top1 x n, top5 x n, n
    last_idx = len(loader) - 1
    start = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        if not cfg.prefetcher:
            input = input.to(device=cfg.device, dtype=cfg.model_dtype)
            target = target.to(device=cfg.device)
        if cfg.channels_last and torch.is_tensor(input):
            input = input.contiguous(memory_format=torch.channels_last)
        with amp_autocast():
            output = model(input)
            if isinstance(output, (tuple, list)):
                output = output[0]
            if tta > 1:
                output = output.unfold(0, tta, tta).mean(dim=2)
                target = target[0:target.size(0):tta]
            loss = loss_fn(output, target)
        top1, top5 = accuracy(output, target, topk=(1, 5))
        n = output.shape[0]
        # timm's accuracy is a float32 percentage; summed back as exact counts, top-1 / top-5 do not depend on
        # how the split is cut into batches (--validation-batch-size)
        hits = (torch.stack([top1, top5]).double() * n / 100).round() * 100
        totals += torch.stack([loss.double() * n, hits[0], hits[1],
                               torch.tensor(n, device=cfg.device, dtype=torch.float64)])
        if batch_idx == last_idx or batch_idx % cfg.log_interval == 0:
            seen = reduce_sum(totals) if cfg.distributed else totals
            loss_avg, top1_avg, top5_avg = (seen[:3] / seen[3]).tolist()
            if cfg.rank == 0:
                _logger.info(
                    f'Test{log_suffix}: [{batch_idx:>4d}/{last_idx}]  Time: {time.time() - start:.3f}  '
                    f'Loss: {loss_avg:>6.3f}  Acc@1: {top1_avg:>7.3f}  Acc@5: {top5_avg:>7.3f}')
    if cfg.distributed:
        totals = reduce_sum(totals)
    loss_avg, top1_avg, top5_avg = (totals[:3] / totals[3].clamp(min=1)).tolist()
    return {'loss': loss_avg, 'top1': top1_avg, 'top5': top5_avg}


class _EpochMeter:
    """An epoch's training loss and update times, and its log lines: the only host syncs of training.

    Args:
        cfg: The loop's settings.
        optimizer: Its param groups' LRs go on the log lines.
        epoch: The epoch.
        updates_per_epoch: Updates in a whole epoch.
    """

    def __init__(self, cfg: LoopConfig, optimizer: torch.optim.Optimizer, epoch: int, updates_per_epoch: int):
        self.cfg = cfg
        self.optimizer = optimizer
        self.epoch = epoch
        self.updates_per_epoch = updates_per_epoch
        self.loss_sum = torch.zeros((), device=cfg.device)  # sum of loss x samples, on the device
        self.samples = 0
        self.update_start = time.time()

    def update_done(self, update_idx: int, window: range, window_loss: torch.Tensor, window_samples: int,
                    data_time: float, input: Any) -> None:
        """Count an update's loss and time; log it (and save its input with --save-images) every log interval."""
        cfg = self.cfg
        self.loss_sum += window_loss
        self.samples += window_samples
        if cfg.synchronize_step and cfg.device.type == 'cuda':
            torch.cuda.synchronize()
        now = time.time()
        update_time, self.update_start = now - self.update_start, now
        if not is_log_update(update_idx, cfg.log_interval, self.updates_per_epoch):
            return
        self._log(update_idx, window_loss / window_samples, window_samples, update_time, data_time)
        if cfg.save_images_dir and torch.is_tensor(input):
            torchvision.utils.save_image(
                input, f'{cfg.save_images_dir}/train-batch-{window.stop - 1}.jpg', padding=0, normalize=True)

    def _log(self, update_idx: int, loss_now: torch.Tensor, window_samples: int, update_time: float,
             data_time: float) -> None:
        cfg = self.cfg
        loss_avg = self.loss_sum / self.samples
        if cfg.distributed:
            loss_now = reduce_mean(loss_now, cfg.world_size)
            loss_avg = reduce_mean(loss_avg, cfg.world_size)
        if cfg.rank != 0:
            return
        lrs = [g['lr'] for g in self.optimizer.param_groups]
        samples = window_samples * cfg.world_size
        _logger.info(
            f'Train: {self.epoch} [{update_idx:>4d}/{self.updates_per_epoch} '
            f'({100. * (update_idx + 1) / self.updates_per_epoch:>3.0f}%)]  '
            f'Loss: {loss_now.item():#.3g} ({loss_avg.item():#.3g})  '
            f'Time: {update_time:.3f}s, {samples / max(update_time, 1e-9):>7.2f}/s  '
            f'LR: {sum(lrs) / len(lrs):.3e}  '
            f'Data: {data_time:.3f}'
        )

    def mean_loss(self) -> float:
        """The mean training loss over the samples of this epoch's updates, averaged over ranks."""
        mean_loss = self.loss_sum / max(self.samples, 1)
        if self.cfg.distributed:
            mean_loss = reduce_mean(mean_loss, self.cfg.world_size)
        return mean_loss.item()


class _WindowFeed:
    """The batches of one window: fresh from the loader, or (for a replay) the ones kept from the first pass.

    Args:
        batches: The epoch's batch iterator.
        prepare: Moves a loader batch to the device (`TrainLoop.prepare_batch`).
        keep: Keep every batch until the window's update (OOM recovery replays them).
    """

    def __init__(self, batches: Iterator, prepare: Callable[[Any, torch.Tensor], Tuple[Any, torch.Tensor]],
                 keep: bool):
        self.batches = batches
        self.prepare = prepare
        self.keep = keep
        self.kept: List[Tuple[Any, torch.Tensor]] = []
        self.data_time = 0.0  # seconds spent waiting for the loader

    def batch(self, pos: int) -> Tuple[Any, torch.Tensor]:
        """The window's batch at ``pos``, on the device."""
        if pos < len(self.kept):
            return self.kept[pos]
        data_start = time.time()
        batch = self.prepare(*next(self.batches))
        self.data_time += time.time() - data_start
        if self.keep:
            self.kept.append(batch)
        return batch
