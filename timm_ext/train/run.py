"""One training run of train.py, as named phases: build, restore, open outputs, build the loop, run epochs, finish.

`TrainingRun.run` calls them in that order. `build` sets up the device, re-plans an elastic resume (the checkpoint's
global batch on this run's ranks), builds the stack (`timm_ext.train.stack`) and the LR and scheduler; `restore`
moves the scheduler to the resume point and restores the RNG; `open_outputs` makes the run folder, args.yaml, the
checkpoint saver and wandb (only then: bad input found before leaves nothing on disk); `build_loop` makes the
`TrainLoop` and loads its state from the checkpoint; `run_epochs` trains epoch after epoch (`run_epoch`: train,
noise-scale row, BN sync, eval, summary row, checkpoint, scheduler step) and calls `end_of_epoch` between epochs.
"""
import argparse
import dataclasses
import importlib
import json
import logging
import os
from datetime import datetime
from typing import AbstractSet, Any, Dict, List, Optional

import torch
import yaml
from timm import utils
from timm.layers import set_fast_norm
from timm.scheduler import create_scheduler_v2, scheduler_kwargs

from . import checkpoint as ckpt
from ..accum import MIN_UPDATES, accumulation_windows
from ..atomic_files import append_csv_row, atomic_text, remove_stale_tmp_files
from ..cuda_backends import configure_cuda_backends
from ..distributed import init_device
from ..launch import current_topology
from ..lr import default_lr_scale, scale_group_lrs
from ..memory import device_name
from .args import args_to_yaml
from .batch_ramp import BatchRamp, TrainLoaderRebuild
from .elastic import (
    ElasticResume, describe_change, device_note, elastic_lr, layout_flags_set_anew, plan_elastic_resume,
    resume_updates, tune_hint,
)
from .input_checks import loss_weighting
from .loop import LoopConfig, TrainLoop
from .noise_monitor import write_noise_scale_row
from .setup import disable_mixup, experiment_name
from .stack import TrainingStack, build_training_stack
from .stop_signal import StopOnSignal, TrainingStopped

try:
    import wandb
except ImportError:
    wandb = None

__all__ = ['TrainingRun', 'replan_for_resume', 'resumed_lr', 'summary_row', 'set_loader_epoch',
           'drop_summary_rows']

_logger = logging.getLogger('train')


class TrainingRun:
    """The run train.py's arguments describe, phase by phase.

    Args:
        args: Parsed and checked arguments (`timm_ext.train.args.parse_args`), left as they are: the run keeps its own
            copy, updated as stock keeps them for checkpoints (device, ranks, LR, an elastic resume's layout).
        args_text: The arguments as YAML, written to the run folder as args.yaml.
        given: The dests the command line or its -c YAML set (an elastic resume keeps the others).
    """

    def __init__(self, args: argparse.Namespace, args_text: str, given: AbstractSet[str] = frozenset()):
        self.args = args  # replaced by init_device's copy in `build`, before anything is written into it
        self.args_text = args_text
        self.given = given
        self.output_dir: Optional[str] = None
        self.saver: Optional[ckpt.CheckpointManager] = None
        self.loop: Optional[TrainLoop] = None
        self.results: List[Dict[str, Any]] = []
        self.best_metric = self.best_epoch = None

    def run(self) -> int:
        """Train every phase in order; returns the exit status (0)."""
        self.build()
        self.restore()
        self.open_outputs()
        self.build_loop()
        self.run_epochs()
        self.finish()
        return 0

    def build(self) -> None:
        """Device, elastic re-plan, seeds, the training stack, the LR and the scheduler."""
        args = self.args
        for module in args.device_modules or ():
            importlib.import_module(module)
        self.resumed = ckpt.load_training_checkpoint(args.resume) if args.resume else None  # fail fast on a bad file
        self.args, self.device = init_device(args)
        args = self.args
        args.prefetcher = not args.no_prefetcher
        configure_cuda_backends(self.device)
        self.primary = utils.is_primary(args)
        if args.distributed:
            _logger.info(f'Distributed training: process {args.rank} of {args.world_size}, device {args.device}.')
        else:
            _logger.info(f'Training with a single process on {args.device}.')

        self.elastic = replan_for_resume(args, self.resumed, self.given, self.device) if (
            self.resumed is not None) else None
        if self.elastic is not None and self.elastic.layout_changed:  # the checkpoint's global batch on our ranks
            args.batch_size, args.grad_accum_steps = self.elastic.now.micro_batch, self.elastic.now.accum_steps
            # args.yaml says what this run trains with, so `-c args.yaml --resume` of its checkpoints replays it
            self.args_text = args_to_yaml({**yaml.safe_load(self.args_text), 'batch_size': args.batch_size,
                                           'grad_accum_steps': args.grad_accum_steps})
        utils.random_seed(args.seed, args.rank)
        if args.fuser:
            utils.set_jit_fuser(args.fuser)
        if args.fast_norm:
            set_fast_norm()

        self.stack = build_training_stack(args, self.device, resumed=self.resumed, verbose=self.primary)
        vars(args).update(dataclasses.asdict(self.stack.resolved))  # args as stock keeps them, for checkpoints
        self.lr = resumed_lr(args, self.stack, self.elastic, self.resumed)
        args.lr = self.lr  # args as stock keeps them: checkpoints hold the LR the run used
        if self.stack.lr_choice.from_base:
            args.lr_base_scale = self.stack.lr_choice.scale
        self.validate_loss_fn = torch.nn.CrossEntropyLoss().to(device=self.device)
        loader_train = self.stack.data.loader_train
        self.updates_per_epoch = len(accumulation_windows(len(loader_train), args.grad_accum_steps))
        self.eval_metric = args.eval_metric if self.stack.data.loader_eval is not None else 'loss'
        self.decreasing = self.eval_metric == 'loss'
        self.lr_scheduler, self.num_epochs = create_scheduler_v2(
            self.stack.optimizer, **scheduler_kwargs(args, decreasing_metric=self.decreasing),
            updates_per_epoch=self.updates_per_epoch)
        self.ramp = None
        if args.batch_ramp:  # the schedule runs in the recipe's updates, the epochs in the ramp's (a resume: its own)
            self.ramp = BatchRamp.for_run(args, self.stack.optimizer, self.lr_scheduler,
                                          TrainLoaderRebuild(args, self.stack, self.device), self.num_epochs,
                                          MIN_UPDATES, ckpt.saved_ramp_state(self.resumed), self.primary)
            self.lr_scheduler, self.updates_per_epoch = self.ramp.scheduler, self.ramp.updates_per_epoch

    def restore(self) -> None:
        """Where the run starts (epoch and update), the scheduler moved there, and the checkpoint's RNG."""
        args, resumed, elastic = self.args, self.resumed, self.elastic
        start = ckpt.resume_point(resumed) if resumed is not None else ckpt.ResumePoint(0)
        if elastic is not None and elastic.layout_changed and start.updates_done:
            # the same samples of the epoch are done, counted in this layout's updates
            start = dataclasses.replace(start, updates_done=min(self.updates_per_epoch, resume_updates(
                start.updates_done, elastic.saved.global_batch, elastic.now.global_batch)))
        if elastic is not None and self.primary and (elastic.layout_changed or elastic.device_changed):
            log_elastic_resume(elastic, resumed, self.lr, start, args.resume)
        if args.start_epoch is not None:
            start = ckpt.ResumePoint(args.start_epoch)  # an explicit start epoch wins, as stock
        self.start = start
        if self.lr_scheduler is not None:
            ckpt.position_scheduler(self.lr_scheduler, start, self.updates_per_epoch,
                                    resumed and resumed.get('scheduler'))
        if resumed is not None and not args.distributed and 'rng' in resumed:
            ckpt.set_rng_state(resumed['rng'])  # each rank seeds its own streams under DDP; only rank 0's is saved

    def open_outputs(self) -> None:
        """The run folder with args.yaml, the checkpoint saver and wandb, on the primary process only."""
        args = self.args
        if not self.primary:
            return
        exp_name = experiment_name(args, self.stack.data_config, datetime.now().strftime('%Y%m%d-%H%M%S'))
        self.output_dir = os.path.join(args.output or './output/train', exp_name)
        os.makedirs(self.output_dir, exist_ok=True)
        remove_stale_tmp_files(self.output_dir)
        atomic_text(self.args_text, os.path.join(self.output_dir, 'args.yaml'))
        self.saver = ckpt.CheckpointManager(self.output_dir, self.decreasing, args.checkpoint_hist,
                                            not args.no_safetensors)
        resume_dir = os.path.dirname(os.path.abspath(args.resume)) if self.resumed is not None else None
        if resume_dir is not None and os.path.samefile(resume_dir, self.output_dir):
            # continuing in the run's own folder: keep its checkpoint ranking, and its summary up to the restart
            self.saver.load_state_dict(self.resumed.get('saver'))
            drop_summary_rows(os.path.join(self.output_dir, 'summary.csv'), from_epoch=self.start.epoch)
        if args.log_wandb:
            if wandb is not None:
                wandb.init(project=args.wandb_project, name=exp_name, config=args, tags=args.wandb_tags,
                           resume='must' if args.wandb_resume_id else None, id=args.wandb_resume_id or None)
            else:
                _logger.warning('--log-wandb asked but wandb is not installed (pip install wandb); not logging.')

    def build_loop(self) -> None:
        """The training loop, with the checkpoint's loop state (micro-batch, noise-scale EMAs, epoch RNG)."""
        args, stack = self.args, self.stack
        self.hardware = device_name(self.device)
        self.stop = StopOnSignal()  # SIGTERM / SIGINT end the run after a complete update, saved for recovery
        cfg = LoopConfig(
            device=self.device, accum_steps=args.grad_accum_steps, batch_size=stack.data.reference_batch,
            loss_weighting=loss_weighting(args), clip_grad=args.clip_grad, clip_mode=args.clip_mode,
            log_interval=args.log_interval, recovery_interval=args.recovery_interval,
            channels_last=args.channels_last, model_dtype=stack.model_dtype, prefetcher=args.prefetcher,
            synchronize_step=args.synchronize_step, world_size=args.world_size, rank=args.rank,
            naflex=args.naflex_loader, save_images_dir=self.output_dir if args.save_images else None,
            oom_recover=args.oom_recover, oom_grow_back=args.oom_grow_back, log_noise_scale=args.log_noise_scale)
        self.loop = TrainLoop(
            stack.task, stack.optimizer, cfg, amp_autocast=stack.amp.autocast, grad_scaler=stack.grad_scaler,
            mixup_fn=stack.data.mixup_fn, lr_scheduler=self.lr_scheduler,
            save_recovery=self.save_recovery if self.saver is not None else None, stop=self.stop)
        if self.resumed is not None:
            self.loop.load_state_dict(ckpt.saved_loop_state(self.resumed, with_epoch_rng=not args.distributed))
        if self.primary:
            stepped = 'update' if self.lr_scheduler is not None and not self.lr_scheduler.t_in_epochs else 'epoch'
            _logger.info(f'Scheduled epochs: {self.num_epochs}, {self.updates_per_epoch} updates per epoch of '
                         f'{len(stack.data.loader_train)} batches (accumulation {args.grad_accum_steps}); LR stepped '
                         f'per {stepped}.')

    def checkpoint_state(self, epoch: int, metric: Optional[float] = None,
                         updates_done: Optional[int] = None) -> Dict[str, Any]:
        """The checkpoint of the run at ``epoch`` (a recovery checkpoint after ``updates_done`` updates of it)."""
        stack = self.stack
        return ckpt.training_state(stack.task, stack.optimizer, self.args, epoch, metric, stack.grad_scaler,
                                   self.lr_scheduler, self.hardware, loop_state=self.loop.state_dict(),
                                   updates_done=updates_done,
                                   ramp_state=self.ramp.state_dict() if self.ramp is not None else None)

    def save_recovery(self, epoch: int, update_idx: int) -> os.PathLike:
        """Save a recovery checkpoint after update ``update_idx`` of ``epoch``; returns its path."""
        return self.saver.save_recovery(self.checkpoint_state(epoch, updates_done=update_idx + 1), epoch, update_idx)

    def run_epochs(self) -> None:
        """Train from the resume point to the last scheduled epoch; a signal between epochs saves and stops."""
        with self.stop:
            for epoch in range(self.start.epoch, self.num_epochs):
                signum = self.stop.requested(self.device)
                if signum:  # asked between epochs (during evaluation or saving): save where the next one starts
                    resumable = self.saver is not None and epoch > self.start.epoch
                    saved = self.save_recovery(epoch - 1, self.updates_per_epoch - 1) if resumable else None
                    raise TrainingStopped(signum, f'epoch {epoch - 1}', saved)
                self.replan_batch(epoch)
                self.run_epoch(epoch)

    def replan_batch(self, epoch: int) -> None:
        """--batch-ramp: before ``epoch``, grow the global batch (and move the LR) from the B_simple so far; a new
        micro-batch comes with a new ``stack.data.loader_train``. Decided at the epoch's start, so a resume from the
        last checkpoint decides the same from the same restored estimate; an epoch resumed inside decided before."""
        if self.ramp is None:
            return
        resumed_inside = epoch == self.start.epoch and self.start.updates_done > 0
        if self.ramp.before_epoch(epoch, self.loop, decide=not resumed_inside):
            self.updates_per_epoch = self.ramp.updates_per_epoch

    def run_epoch(self, epoch: int) -> None:
        """One epoch: train, noise-scale row, BN sync, eval, summary row, checkpoint, scheduler step."""
        args, loader_train = self.args, self.stack.data.loader_train
        set_loader_epoch(loader_train, epoch)
        if args.mixup_off_epoch and epoch >= args.mixup_off_epoch:
            disable_mixup(loader_train, self.stack.data.mixup_fn)
        start_update = self.start.updates_done if epoch == self.start.epoch else 0
        train_metrics = self.loop.train_one_epoch(epoch, loader_train, start_update)
        noise = self.loop.noise_scale_summary()
        if noise is not None and self.primary:
            global_batch = round(self.loop.cfg.batch_size) * args.world_size * self.loop.cfg.accum_steps  # ramped
            _logger.info(f'Epoch {epoch}: {noise.message(global_batch)}')
            write_noise_scale_row(os.path.join(self.output_dir, 'noise_scale.csv'), epoch, noise, global_batch)
        self._distribute_bn(self.stack.task.get_trainable_module())

        if (epoch + 1) % args.val_interval != 0 and epoch + 1 != self.num_epochs:
            if self.primary:
                _logger.info('Skipping eval and checkpointing this epoch (--val-interval).')
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(epoch + 1, metric=None)
            return

        eval_metrics = self.evaluate()
        metric = (eval_metrics or train_metrics)[self.eval_metric]
        if self.output_dir is not None:
            lrs = [g['lr'] for g in self.stack.optimizer.param_groups]
            row = summary_row(epoch, train_metrics, eval_metrics, sum(lrs) / len(lrs))
            if args.log_wandb and wandb is not None:
                wandb.log(row)
            append_csv_row(os.path.join(self.output_dir, 'summary.csv'), row)
        if self.saver is not None:
            epoch_state = self.checkpoint_state(epoch, metric)
            weights = epoch_state.get('state_dict_ema', epoch_state['state_dict'])
            self.best_metric, self.best_epoch = self.saver.save_epoch(epoch_state, epoch, metric, weights)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(epoch + 1, metric)
        self.results.append({'epoch': epoch, 'train': train_metrics,
                             **({'validation': eval_metrics} if eval_metrics is not None else {})})

    def _distribute_bn(self, module: torch.nn.Module) -> None:
        """--dist-bn: share batch-norm statistics over the ranks (broadcast rank 0's, or average them)."""
        args = self.args
        if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
            utils.distribute_bn(module, args.world_size, args.dist_bn == 'reduce')

    def evaluate(self) -> Optional[Dict[str, float]]:
        """The eval split's metrics (the EMA model's where it is on the device), or None without one."""
        args, task, loader_eval = self.args, self.stack.task, self.stack.data.loader_eval
        if loader_eval is None:
            return None
        loss_fn = self.validate_loss_fn
        eval_metrics = self.loop.evaluate(task.get_eval_model(), loader_eval, loss_fn, args.tta)
        ema_module = task.get_trainable_module(ema=True)
        if ema_module is not None and not args.model_ema_force_cpu:
            self._distribute_bn(ema_module)
            eval_metrics = self.loop.evaluate(task.get_eval_model(ema=True), loader_eval, loss_fn, args.tta, ' (EMA)')
        return eval_metrics

    def finish(self) -> None:
        """The best metric, and stock's ``--result`` JSON of the ten best epochs."""
        if self.best_metric is not None:
            _logger.info(f'*** Best metric: {self.best_metric} (epoch {self.best_epoch})')
        if self.primary:
            ranked = sorted(self.results, key=lambda r: r.get('validation', r['train']).get(self.eval_metric, 0),
                            reverse=self.decreasing)
            print(f'--result\n{json.dumps(ranked[-10:], indent=4)}')


def replan_for_resume(args: argparse.Namespace, resumed: Dict[str, Any], given: AbstractSet[str],
                      device: torch.device) -> Optional[ElasticResume]:
    """The layout to resume with: the checkpoint's global batch on this run's ranks, unless the user set a new
    micro-batch or accumulation (None: the checkpoint does not say how its batch was built)."""
    saved = ckpt.batch_layout(resumed)
    if saved is None:
        return None
    user_flags = layout_flags_set_anew(sorted(given), vars(args), saved)
    return plan_elastic_resume(saved, args.world_size, device_name(device), args.batch_size, args.grad_accum_steps,
                               user_flags)


def resumed_lr(args: argparse.Namespace, stack: TrainingStack, elastic: Optional[ElasticResume],
               resumed: Optional[Dict[str, Any]]) -> float:
    """The LR of the run: the stack's, or, where an elastic resume moved the global batch, the checkpoint's moved by
    the run's rule; the optimizer's groups are scaled to it (a resumed optimizer carries the checkpoint's LR in its
    groups, a fresh one train.py's for this layout)."""
    if elastic is None or not elastic.global_changed:
        return stack.lr
    scale = args.lr_base_scale or default_lr_scale(args.opt)
    checkpoint_lr = ckpt.saved_lr(resumed) or stack.lr
    lr = elastic_lr(elastic, checkpoint_lr, stack.lr, scale)
    scale_group_lrs(stack.optimizer, lr / (stack.lr if args.no_resume_opt else checkpoint_lr))
    return lr


def log_elastic_resume(elastic: ElasticResume, resumed: Dict[str, Any], lr: float, start: ckpt.ResumePoint,
                       resume_path: str) -> None:
    """One line on what changed since the checkpoint, and a warning with the probe command on other hardware."""
    saved_updates = ckpt.resume_point(resumed).updates_done
    checkpoint_lr = ckpt.saved_lr(resumed) or lr
    lr_now = lr if elastic.global_changed else checkpoint_lr
    _logger.info(describe_change(elastic, checkpoint_lr, lr_now, start.epoch, saved_updates, start.updates_done))
    if elastic.device_changed:
        args_yaml = os.path.join(os.path.dirname(os.path.abspath(resume_path)), 'args.yaml')
        hint = tune_hint(args_yaml if os.path.exists(args_yaml) else None, elastic.now.global_batch,
                         elastic.now.world_size, current_topology())
        _logger.warning(device_note(elastic, hint))


def summary_row(epoch: int, train_metrics: dict, eval_metrics: dict | None, lr: float) -> dict:
    """One summary.csv row with stock's columns: epoch, train_<metric>..., eval_<metric>..., lr."""
    row = {'epoch': epoch, **{f'train_{k}': v for k, v in train_metrics.items()}}
    row.update({f'eval_{k}': v for k, v in (eval_metrics or {}).items()})
    row['lr'] = lr
    return row


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """Tell the dataset and sampler the epoch (distributed shuffling, scheduled resolutions)."""
    if hasattr(loader.dataset, 'set_epoch'):
        loader.dataset.set_epoch(epoch)
    if hasattr(loader.batch_sampler, 'set_epoch'):
        loader.batch_sampler.set_epoch(epoch)
    elif hasattr(loader.sampler, 'set_epoch'):
        loader.sampler.set_epoch(epoch)


def drop_summary_rows(path: str, from_epoch: int) -> None:
    """Remove summary.csv rows of epochs a resumed run will train again, keeping the one header."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    kept = lines[:1] + [line for line in lines[1:] if int(line.split(',', 1)[0]) < from_epoch]
    if len(kept) != len(lines):
        atomic_text(''.join(kept), path)
