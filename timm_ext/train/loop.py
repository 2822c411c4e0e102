"""Training and evaluation loops for train.py: explicit gradient accumulation, host syncs only when logging.

An epoch of n micro-batches with k accumulation steps is cut into ceil(n / k) windows (the last may be shorter).
Within a window each micro-batch's loss is weighted by its samples over the window's samples, so the accumulated
gradient is the mean over every sample of the window, the shorter last window included. Under DDP the gradient
all-reduce runs only on a window's last backward (``no_sync`` before it). Optimizer step, EMA update, ``zero_grad``
and the scheduler's ``step_update`` happen once per window. Losses stay on the device as tensors and are read
(``.item()``) only on log lines and at the end of the epoch.

Extension points: :meth:`TrainLoop.forward_backward` is one micro-batch (or any slice of one, weighted by its own
samples), :meth:`TrainLoop.optimizer_update` sees a window's complete gradient before it is applied.

Two options build on them. OOM recovery (``oom_recover``, `timm_ext.train.oom_recovery`): a window that runs out of memory
is replayed with each loader batch cut into twice as many pieces, each weighted by its share of the batch, so the
update is the same mean over the same samples; under DDP the ranks agree once per window and all-reduce the
window's gradients themselves, in buckets. Noise scale (``log_noise_scale``, `timm_ext.train.noise_monitor`): each
micro-batch's and the window's gradient norms feed a B_simple estimate, with no extra passes.
"""
import dataclasses
import logging
import math
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torchvision.utils
from timm.utils import accuracy, dispatch_clip_grad

from ..accum import accumulation_windows
from .checkpoint import rng_state
from ..distributed import reduce_mean, reduce_sum
from ..memory import free_memory
from .noise_monitor import NoiseScaleMonitor, NoiseScaleSummary
from .oom_recovery import (
    FAILED, OK, OOM, GradientAllReduce, MicroBatchSplitter, OomRecoveryError, RankFailed, WindowOutOfMemory,
    agree_status, is_recoverable_oom,
)
from .stop_signal import StopOnSignal, TrainingStopped

_logger = logging.getLogger('train')

# How a micro-batch's loss is weighted against its window: 'samples' is the true mean over the window's samples;
# 'none', 'linear' and 'sqrt' are timm's --variable-batch-loss-scale / --naflex-loss-scale modes for loaders whose
# batch size varies on purpose (each micro-batch counts 1, n / reference or sqrt(n / reference), divided by the
# window length).
LOSS_WEIGHTINGS = ('samples', 'none', 'linear', 'sqrt')


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


def batch_len(input: Any) -> int:
    """Samples in a batch: a tensor's first dimension, or the patches of a NaFlex dict."""
    return (input['patches'] if isinstance(input, dict) else input).shape[0]


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
        stop: Asked after every update whether a signal wants the run to stop (`timm_ext.train.stop_signal`); if so, the
            update is saved as a recovery checkpoint and `TrainingStopped` raised.
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
        self.params = [p for p in task.get_trainable_module().parameters() if p.requires_grad]
        self.splitter: Optional[MicroBatchSplitter] = None
        if cfg.oom_recover:
            self.splitter = MicroBatchSplitter(max(1, round(cfg.batch_size)), cfg.oom_grow_back)
        # under DDP, recovery needs every backward local and one explicit all-reduce once all ranks are through
        self.explicit_allreduce = cfg.oom_recover and cfg.distributed
        self.gradient_allreduce = GradientAllReduce(self.params, cfg.world_size) if self.explicit_allreduce else None
        self.noise = NoiseScaleMonitor(self.params, cfg.world_size) if cfg.log_noise_scale else None
        self._has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in task.modules())
        self.window_replays = 0  # times the last window was replayed after an OOM

    def set_accum_steps(self, accum_steps: int) -> None:
        """Train the next epochs with `accum_steps` micro-batches per update (--batch-ramp grows it between epochs)."""
        if accum_steps != self.cfg.accum_steps:
            self.cfg = dataclasses.replace(self.cfg, accum_steps=accum_steps)

    # ---- one micro-batch ------------------------------------------------------------------------------------

    def prepare_batch(self, input: Any, target: torch.Tensor) -> Tuple[Any, torch.Tensor]:
        """Move a batch to the device and apply mixup when the loader did not; channels_last if asked."""
        if not self.cfg.prefetcher:
            if isinstance(input, (list, tuple)):
                # --aug-splits without the prefetcher's collate: stack the splits split-major, as fast_collate does
                target = target.repeat((len(input),) + (1,) * (target.ndim - 1))
                input = torch.cat(input)
            input = input.to(device=self.cfg.device, dtype=self.cfg.model_dtype)
            target = target.to(device=self.cfg.device)
            if self.mixup_fn is not None:
                input, target = self.mixup_fn(input, target)
        if self.cfg.channels_last and torch.is_tensor(input):
            input = input.contiguous(memory_format=torch.channels_last)
        return input, target

    def loss_weight(self, num_samples: int, window_len: int) -> float:
        """Weight of a micro-batch's mean loss in a window of ``window_len`` micro-batches of nominal size."""
        ratio = num_samples / self.cfg.batch_size
        per_batch = {'samples': ratio, 'none': 1.0, 'linear': ratio, 'sqrt': math.sqrt(ratio)}[self.cfg.loss_weighting]
        weight = per_batch / window_len
        if self.cfg.naflex and self.cfg.distributed:
            # ranks see different NaFlex batch sizes; weigh each rank by its share of the global batch (as timm)
            global_samples = reduce_sum(torch.tensor(float(num_samples), device=self.cfg.device))
            weight *= self.cfg.world_size * num_samples / global_samples
        return weight

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

    def _try_forward_backward(self, input: Any, target: torch.Tensor, weight: float, sync: bool,
                              ) -> Tuple[Optional[torch.Tensor], Optional[PieceFailure]]:
        """`forward_backward`, returning (loss, None), or (None, the failure) for an OOM and, under DDP, for any
        error: the peers learn of it at the window's agreement (`_settle_window`)."""
        try:
            return self.forward_backward(input, target, weight, sync), None
        except Exception as e:
            if not is_recoverable_oom(e, self.cfg.device):
                if not self.cfg.distributed:
                    raise
                return None, PieceFailure(FAILED, '', e)
            traceback.clear_frames(e.__traceback__)  # its frames hold the failed attempt's activations
            return None, PieceFailure(OOM, ' '.join(str(e).split())[:200] or type(e).__name__)

    def _settle_window(self, failure: Optional[PieceFailure]) -> None:
        """Raise for a window that failed anywhere: under DDP after the window's one status all-reduce, so that every
        rank takes the same decision (`WindowOutOfMemory` to replay it, `RankFailed` to stop)."""
        if not self.cfg.distributed:
            if failure is not None:
                raise WindowOutOfMemory([0], failure.reason)
            return
        status = OK if failure is None else failure.status
        statuses = agree_status(status, self.cfg.rank, self.cfg.world_size, self.cfg.device)
        if failure is not None and failure.error is not None:
            raise failure.error
        if FAILED in statuses:
            raise RankFailed(f'rank {statuses.index(FAILED)} failed with an error (see its log); rank '
                             f'{self.cfg.rank} stops too')
        if OOM in statuses:
            raise WindowOutOfMemory([r for r, s in enumerate(statuses) if s == OOM],
                                    failure.reason if failure is not None else '')

    def _arm_buffer_sync(self) -> None:
        """With the explicit all-reduce, have DDP broadcast rank 0's buffers in the first forward of each window pass.

        Every forward then runs under `no_sync`, and DDP broadcasts buffers in a forward only after one that synced
        gradients: left alone it would broadcast in the run's first forward only, and once more on a rank whose first
        forward failed (its flag was never cleared) but not on its peers, a collective only one side joins. Armed
        per pass, the broadcast comes where stock DDP has it (each window's first forward), on every rank alike.
        """
        module = self.task.get_trainable_module()
        if self.explicit_allreduce and isinstance(module, nn.parallel.DistributedDataParallel):
            module.require_forward_param_sync = True

    # ---- one window ---------------------------------------------------------------------------------------------

    def optimizer_update(self, grad_correction: float = 1.0) -> None:
        """Apply a window's accumulated gradient: unscale, correct, clip, step, then zero the gradients.

        Args:
            grad_correction: Factor on the accumulated gradient, for a window whose micro-batches held fewer
                samples than nominal (keeps the window a true mean).
        """
        needs_grads = grad_correction != 1.0 or self.cfg.clip_grad is not None
        if needs_grads and self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        if grad_correction != 1.0:
            grads = [p.grad for g in self.optimizer.param_groups for p in g['params'] if p.grad is not None]
            torch._foreach_mul_(grads, grad_correction)
        if self.cfg.clip_grad is not None:
            dispatch_clip_grad(
                self.task.get_clip_parameters(exclude_head='agc' in self.cfg.clip_mode),
                value=self.cfg.clip_grad,
                mode=self.cfg.clip_mode,
            )
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _guarded_optimizer_update(self, grad_correction: float, where: str) -> None:
        """`optimizer_update`; with OOM recovery armed, an OOM inside it stops the run with a clear error.

        Splitting micro-batches cannot help there: the optimizer's state and update take the same memory whatever
        the micro-batch, and a failed step may have updated some parameters already, so it is not replayed.
        """
        try:
            self.optimizer_update(grad_correction)
        except Exception as e:
            if self.splitter is None or not is_recoverable_oom(e, self.cfg.device):
                raise
            traceback.clear_frames(e.__traceback__)
            raise OomRecoveryError(
                f'out of memory in the optimizer step at {where}, after the update\'s forward and backward passes '
                f'fit: a smaller micro-batch does not shrink the optimizer\'s state or update, so OOM recovery '
                f'stops here; checkpoints already written are intact. Free device memory, use an optimizer with '
                f'less state (e.g. --opt sgd), --model-ema-force-cpu, or a smaller model') from None

    def train_window(self, batches: Iterator, window_len: int, where: str) -> Tuple[torch.Tensor, int, float, Any]:
        """Forward and backward over the next ``window_len`` batches; their gradients add up in ``.grad``.

        With OOM recovery the window's batches are kept until its update: a window that runs out of memory is
        replayed from its first batch with every batch cut into twice as many pieces.

        Returns:
            (sum of loss x samples, samples, seconds spent waiting for data, the window's last input)
        """
        kept: List[Tuple[Any, torch.Tensor]] = []
        data_time = [0.0]
        self.window_replays = 0
        while True:
            try:
                loss_sum, samples, input = self._window_pass(batches, window_len, kept, data_time)
                return loss_sum, samples, data_time[0], input
            except WindowOutOfMemory as e:
                oom = e
            self._recover(oom, where)
            self.window_replays += 1

    def _window_pass(self, batches: Iterator, window_len: int, kept: List, data_time: List[float],
                     ) -> Tuple[torch.Tensor, int, Any]:
        cfg = self.cfg
        loss_sum = torch.zeros((), device=cfg.device)
        samples = 0
        failure: Optional[PieceFailure] = None  # this rank's first failed piece (OOM recovery only)
        self._arm_buffer_sync()
        for pos in range(window_len):
            if pos < len(kept):
                input, target = kept[pos]
            else:
                data_start = time.time()
                input, target = self.prepare_batch(*next(batches))
                data_time[0] += time.time() - data_start
                if self.splitter is not None:
                    kept.append((input, target))
            num_samples = batch_len(input)
            weight = self.loss_weight(num_samples, window_len)  # a collective with NaFlex under DDP: every rank
            samples += num_samples
            if failure is not None:
                continue  # failed under DDP: walk on, the replay needs these batches and the peers are still at it
            pieces = [(input, target)] if self.splitter is None else self.splitter.split(input, target, num_samples)
            for i, (piece, piece_target) in enumerate(pieces):
                piece_samples = batch_len(piece)
                piece_weight = weight if len(pieces) == 1 else weight * piece_samples / num_samples
                sync = not self.explicit_allreduce and pos == window_len - 1 and i == len(pieces) - 1
                if self.noise is not None:
                    self.noise.before_backward()
                if self.splitter is None:
                    loss = self.forward_backward(piece, piece_target, piece_weight, sync)
                else:
                    loss, failure = self._try_forward_backward(piece, piece_target, piece_weight, sync)
                    if failure is not None:
                        break
                if self.noise is not None:
                    self.noise.after_backward(piece_samples, piece_weight)
                loss_sum += loss * piece_samples
            if failure is not None and not cfg.distributed:
                break  # one process: nobody to wait for, replay now
        if self.splitter is not None:
            self._settle_window(failure)
        if self.gradient_allreduce is not None:
            self.gradient_allreduce()
        return loss_sum, samples, input

    def _recover(self, oom: WindowOutOfMemory, where: str) -> None:
        """Free what the failed window held and cut batches into twice as many pieces (or give up at 1 sample)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.noise is not None:
            self.noise.reset_window()
        free_memory(self.cfg.device)
        on_ranks = f' on rank {", ".join(map(str, oom.ranks))}' if self.cfg.distributed else ''
        try:
            old, new = self.splitter.shrink()
        except OomRecoveryError:
            raise OomRecoveryError(
                f'out of memory at {where}{on_ranks} even with a micro-batch of 1 sample: nothing smaller to try; '
                f'checkpoints already written are intact. Free device memory or use a smaller model or input '
                f'size{f" ({oom.reason})" if oom.reason else ""}') from None
        splits = self.splitter.splits
        prefix = f'rank {self.cfg.rank}: ' if self.cfg.distributed else ''
        _logger.warning(
            f'{prefix}OOM recovery at {where}: out of memory{on_ranks}; micro-batch {old} -> {new} '
            f'({splits} pieces per loader batch, {splits * self.cfg.accum_steps} backward passes per update); '
            f'the global batch, LR and schedule are unchanged; replaying the update.')
        if self._has_batchnorm and self.cfg.rank == 0 and old == self.splitter.batch_size:
            _logger.warning(f'The model has batch norm: its batch statistics now come from micro-batches of {new}, '
                            f'so updates are close to, not exactly, those of the full micro-batch.')

    def _after_clean_update(self, where: str) -> None:
        grown = self.splitter.after_clean_update()
        if grown is not None:
            prefix = f'rank {self.cfg.rank}: ' if self.cfg.distributed else ''
            _logger.info(f'{prefix}OOM recovery at {where}: {self.cfg.oom_grow_back} clean updates, trying the '
                         f'larger micro-batch again: {grown[0]} -> {grown[1]}.')

    def noise_scale_summary(self) -> Optional[NoiseScaleSummary]:
        """The noise-scale estimate so far (a collective under DDP), or None when not estimating."""
        return self.noise.summary(self.cfg.device) if self.noise is not None else None

    # ---- one epoch ----------------------------------------------------------------------------------------------

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

        self.epoch_rng = rng_state()  # a recovery checkpoint replays the epoch's sample order from here
        batches: Iterator = iter(loader)
        if start_update:
            skip = windows[start_update].start if start_update < updates_per_epoch else len(loader)
            if cfg.rank == 0:
                _logger.info(f'Resuming epoch {epoch} at update {start_update}/{updates_per_epoch}: '
                             f'skipping {skip} batches already trained.')
            for _ in range(skip):
                next(batches)

        epoch_loss = torch.zeros((), device=cfg.device)  # sum of loss x samples
        epoch_samples = 0
        update_time = data_time = 0.0
        update_start = time.time()
        for update_idx in range(start_update, updates_per_epoch):
            window = windows[update_idx]
            where = f'epoch {epoch} update {update_idx}'
            window_loss, window_samples, window_data_time, input = self.train_window(batches, len(window), where)

            nominal = len(window) * cfg.batch_size
            correction = nominal / window_samples if cfg.loss_weighting == 'samples' else 1.0
            if self.noise is not None:
                amp_scale = self.grad_scaler.get_scale() if self.grad_scaler is not None else 1.0
                self.noise.end_window(window_samples, amp_scale, correction, check_finite=self.grad_scaler is not None)
            self._guarded_optimizer_update(correction, where)
            if self.splitter is not None and not self.window_replays:
                self._after_clean_update(where)
            num_updates += 1
            self.task.update_ema(step=num_updates)
            epoch_loss += window_loss
            epoch_samples += window_samples

            if cfg.synchronize_step and cfg.device.type == 'cuda':
                torch.cuda.synchronize()
            now = time.time()
            update_time, data_time, update_start = now - update_start, window_data_time, now

            last = update_idx == updates_per_epoch - 1
            if update_idx % cfg.log_interval == 0 or last:
                self._log_update(epoch, update_idx, updates_per_epoch, window_loss / window_samples,
                                 epoch_loss / epoch_samples, window_samples, update_time, data_time)
                if cfg.save_images_dir and torch.is_tensor(input):
                    torchvision.utils.save_image(
                        input, f'{cfg.save_images_dir}/train-batch-{window.stop - 1}.jpg', padding=0, normalize=True)

            if self.save_recovery is not None and cfg.recovery_interval and (
                    (update_idx + 1) % cfg.recovery_interval == 0):
                self.save_recovery(epoch, update_idx)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step_update(num_updates=num_updates)
            self._stop_if_asked(epoch, update_idx, where)

        if hasattr(self.optimizer, 'sync_lookahead'):
            self.optimizer.sync_lookahead()
        mean_loss = epoch_loss / max(epoch_samples, 1)
        if cfg.distributed:
            mean_loss = reduce_mean(mean_loss, cfg.world_size)
        return {'loss': mean_loss.item()}

    def _stop_if_asked(self, epoch: int, update_idx: int, where: str) -> None:
        signum = self.stop.requested(self.cfg.device) if self.stop is not None else None
        if signum:
            saved = self.save_recovery(epoch, update_idx) if self.save_recovery is not None else None
            raise TrainingStopped(signum, where, saved)

    def _log_update(
            self, epoch: int, update_idx: int, updates_per_epoch: int, loss_now: torch.Tensor, loss_avg: torch.Tensor,
            window_samples: int, update_time: float, data_time: float,
    ) -> None:
        if self.cfg.distributed:
            loss_now = reduce_mean(loss_now, self.cfg.world_size)
            loss_avg = reduce_mean(loss_avg, self.cfg.world_size)
        if self.cfg.rank != 0:
            return
        lrs = [g['lr'] for g in self.optimizer.param_groups]
        samples = window_samples * self.cfg.world_size
        _logger.info(
            f'Train: {epoch} [{update_idx:>4d}/{updates_per_epoch} '
            f'({100. * (update_idx + 1) / updates_per_epoch:>3.0f}%)]  '
            f'Loss: {loss_now.item():#.3g} ({loss_avg.item():#.3g})  '
            f'Time: {update_time:.3f}s, {samples / max(update_time, 1e-9):>7.2f}/s  '
            f'LR: {sum(lrs) / len(lrs):.3e}  '
            f'Data: {data_time:.3f}'
        )

    # ---- evaluation ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def evaluate(
            self, model: nn.Module, loader: Any, loss_fn: nn.Module, tta: int = 0, log_suffix: str = '',
    ) -> Dict[str, float]:
        """Loss, top-1 and top-5 accuracy of ``model`` on ``loader``, summed over all ranks' samples.

        Args:
            model: The eval model (EMA or not).
            loader: Evaluation loader.
            loss_fn: Loss on logits and class indices.
            tta: Test-time augmentation factor: average this many consecutive outputs per sample.
            log_suffix: Appended to the 'Test' log prefix, e.g. ' (EMA)'.
        """
        cfg = self.cfg
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
            with self.amp_autocast():
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
