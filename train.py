#!/usr/bin/env python3
"""Train a timm image model: a drop-in replacement for timm's train.py.

Every stock flag and `-c/--config` YAML works as in timm; what differs is fixed behaviour: exactly ceil(n/k)
optimizer updates per epoch with gradient accumulation (a true mean in the shorter last window), no host sync per
micro-batch, crash-safe checkpoints with a resume that continues inside an interrupted epoch, DDP on CPU (gloo),
safetensors export of the best and last weights, one-line errors for bad input (`timm_ext.arg_checks`), a full disk
or a lost DDP rank, and SIGTERM / SIGINT ending the run after a complete update saved as a recovery checkpoint
(exit 128 + signal; stock exits 0 on Ctrl-C and dies mid-step on SIGTERM). Beyond stock: `--oom-recover`
survives out-of-memory errors with the same updates (smaller micro-batches, more accumulation), and
`--log-noise-scale` estimates the critical batch size (noise_scale.csv).

    python train.py --data-dir /data/imagenet --model resnet50 -b 128 --amp
    ./distributed_train.sh 8 -c recipe.yaml

The script wires timm and `timm_ext` together; the loop is `timm_ext.train.loop.TrainLoop`.
"""
import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
from datetime import datetime
from typing import AbstractSet, Any, Dict, Optional

import torch
import yaml
from timm import utils
from timm.layers import set_fast_norm
from timm.scheduler import create_scheduler_v2, scheduler_kwargs

from timm_ext.train import checkpoint as ckpt
from timm_ext.accum import accumulation_windows
from timm_ext.train.input_checks import loss_weighting
from timm_ext.atomic_files import append_csv_row, atomic_text, remove_stale_tmp_files
from timm_ext.cuda_backends import configure_cuda_backends
from timm_ext.distributed import init_device, lost_peer
from timm_ext.train.elastic import (
    ElasticResume, describe_change, device_note, elastic_lr, layout_flags_set_anew, plan_elastic_resume,
    resume_updates, tune_hint,
)
from timm_ext.errors import TimmExtError, report
from timm_ext.launch import current_topology
from timm_ext.lr import default_lr_scale
from timm_ext.memory import device_name
from timm_ext.train.noise_monitor import write_noise_scale_row
from timm_ext.train.batch_ramp import BatchRamp
from timm_ext.tune.batch_choice import MIN_UPDATES
from timm_ext.train.stop_signal import StopOnSignal, TrainingStopped
from timm_ext.train.args import args_to_yaml, build_parser, given_dests, parse_args
from timm_ext.train.loop import LoopConfig, TrainLoop
from timm_ext.train.setup import check_arg_combinations, check_inputs, disable_mixup, experiment_name
from timm_ext.train.stack import build_training_stack

try:
    import wandb
except ImportError:
    wandb = None

_logger = logging.getLogger('train')


def main(argv=None, prog: str = 'train.py') -> int:
    """Train from a command line (default `sys.argv[1:]`); tune_batch.py calls this in-process after probing."""
    if not logging.getLogger().handlers:  # a caller that set up logging keeps its handler (no doubled lines)
        utils.setup_default_logging()
    args, args_text = parse_args(argv)
    try:
        check_arg_combinations(args)
        check_inputs(args)
        return train(args, args_text, given_dests(argv, build_parser()))
    except TimmExtError as e:  # bad input, a device or checkpoint problem, a stop on a signal: one line
        return report(prog, e)
    except KeyboardInterrupt:
        print(f'{prog}: interrupted; the checkpoints on disk are complete, resume from the newest', file=sys.stderr)
        return 130
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        reason = ' '.join(str(e).split())[:160]
        print(f'{prog}: error: rank {args.rank} lost contact with the other processes of the run (one died or '
              f'the network failed: {reason}); stopping, the checkpoints on disk are complete', file=sys.stderr)
        return 1
    except torch._dynamo.exc.BackendCompilerFailed as e:
        reason = ' '.join(str(e).split())[:200]
        print(f'{prog}: error: --torchcompile {args.torchcompile} could not compile the model ({reason}); '
              f'run without --torchcompile or pick another backend', file=sys.stderr)
        return 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train(args, args_text: str, given: AbstractSet[str] = frozenset()) -> int:
    """Train the run `args` describes; `given` names the dests the command line or its -c YAML set."""
    for module in args.device_modules or ():
        importlib.import_module(module)
    args.prefetcher = not args.no_prefetcher
    resumed = ckpt.load_training_checkpoint(args.resume) if args.resume else None  # fail fast on a bad file

    device = init_device(args)
    configure_cuda_backends(device)
    primary = utils.is_primary(args)
    if args.distributed:
        _logger.info(f'Distributed training: process {args.rank} of {args.world_size}, device {args.device}.')
    else:
        _logger.info(f'Training with a single process on {args.device}.')

    elastic = replan_for_resume(args, resumed, given, device) if resumed is not None else None
    if elastic is not None and elastic.layout_changed:  # the checkpoint's global batch on this run's ranks
        args.batch_size, args.grad_accum_steps = elastic.now.micro_batch, elastic.now.accum_steps
        # args.yaml says what this run trains with, so `-c args.yaml --resume` of its checkpoints replays it
        args_text = args_to_yaml({**yaml.safe_load(args_text), 'batch_size': args.batch_size,
                                  'grad_accum_steps': args.grad_accum_steps})

    utils.random_seed(args.seed, args.rank)
    if args.fuser:
        utils.set_jit_fuser(args.fuser)
    if args.fast_norm:
        set_fast_norm()

    stack = build_training_stack(args, device, resumed=resumed, verbose=primary)
    task, optimizer, amp, model_dtype, grad_scaler = (stack.task, stack.optimizer, stack.amp, stack.model_dtype,
                                                      stack.grad_scaler)
    data_config, data = stack.data_config, stack.data
    loader_train, loader_eval, mixup_fn, reference_batch = (data.loader_train, data.loader_eval, data.mixup_fn,
                                                            data.reference_batch)
    lr = stack.lr
    if elastic is not None and elastic.global_changed:
        # the global batch moved (no exact split, or the user's new layout): the LR moves with it by the run's rule;
        # a resumed optimizer carries the checkpoint's LR in its groups, a fresh one train.py's for this layout
        scale = args.lr_base_scale or default_lr_scale(args.opt)
        checkpoint_lr = ckpt.saved_lr(resumed) or stack.lr
        lr = elastic_lr(elastic, checkpoint_lr, stack.lr, scale)
        scale_group_lrs(optimizer, lr / (stack.lr if args.no_resume_opt else checkpoint_lr))
    args.lr = lr  # args as stock keeps them: checkpoints hold the LR the run used
    if stack.lr_choice.from_base:
        args.lr_base_scale = stack.lr_choice.scale
    validate_loss_fn = torch.nn.CrossEntropyLoss().to(device=device)

    # ---- schedule and resume point ----------------------------------------------------------------------------
    updates_per_epoch = len(accumulation_windows(len(loader_train), args.grad_accum_steps))
    eval_metric = args.eval_metric if loader_eval is not None else 'loss'
    decreasing = eval_metric == 'loss'
    lr_scheduler, num_epochs = create_scheduler_v2(
        optimizer, **scheduler_kwargs(args, decreasing_metric=decreasing), updates_per_epoch=updates_per_epoch)
    ramp = BatchRamp.for_run(args, optimizer, lr_scheduler, len(loader_train), num_epochs, MIN_UPDATES, resumed,
                             primary) if args.batch_ramp else None
    if ramp is not None:  # the schedule runs in the recipe's updates; the epochs in the ramp's (a resume: its own)
        lr_scheduler, updates_per_epoch = ramp.scheduler, ramp.updates_per_epoch
    start = ckpt.ResumePoint(0)
    if resumed is not None:
        start = ckpt.resume_point(resumed)
    if elastic is not None and elastic.layout_changed and start.updates_done:
        # the same samples of the epoch are done, counted in this layout's updates
        start = dataclasses.replace(start, updates_done=min(updates_per_epoch, resume_updates(
            start.updates_done, elastic.saved.global_batch, elastic.now.global_batch)))
    if elastic is not None and primary and (elastic.layout_changed or elastic.device_changed):
        log_elastic_resume(elastic, resumed, lr, start, args.resume)
    if args.start_epoch is not None:
        start = ckpt.ResumePoint(args.start_epoch)  # an explicit start epoch wins, as stock
    if lr_scheduler is not None:
        ckpt.position_scheduler(lr_scheduler, start, updates_per_epoch, resumed and resumed.get('scheduler'))
    if resumed is not None and not args.distributed and 'rng' in resumed:
        ckpt.set_rng_state(resumed['rng'])  # each rank seeds its own streams under DDP; only rank 0's is saved

    # ---- outputs (only now: bad input above leaves nothing on disk) -------------------------------------------
    output_dir = saver = None
    if primary:
        exp_name = experiment_name(args, data_config, datetime.now().strftime('%Y%m%d-%H%M%S'))
        output_dir = os.path.join(args.output or './output/train', exp_name)
        os.makedirs(output_dir, exist_ok=True)
        remove_stale_tmp_files(output_dir)
        atomic_text(args_text, os.path.join(output_dir, 'args.yaml'))
        saver = ckpt.CheckpointManager(output_dir, decreasing, args.checkpoint_hist, not args.no_safetensors)
        if resumed is not None and os.path.samefile(os.path.dirname(os.path.abspath(args.resume)), output_dir):
            # continuing in the run's own folder: keep its checkpoint ranking, and its summary up to the restart
            saver.load_state_dict(resumed.get('saver'))
            drop_summary_rows(os.path.join(output_dir, 'summary.csv'), from_epoch=start.epoch)
        if args.log_wandb:
            if wandb is not None:
                wandb.init(project=args.wandb_project, name=exp_name, config=args, tags=args.wandb_tags,
                           resume='must' if args.wandb_resume_id else None, id=args.wandb_resume_id or None)
            else:
                _logger.warning('--log-wandb asked but wandb is not installed (pip install wandb); not logging.')

    hardware = device_name(device)

    def state(epoch, metric=None):
        extra = {'micro_batch': loop.splitter.state_dict()} if loop.splitter is not None else {}
        if loop.noise is not None:  # rank 0's EMAs; every rank continues from them on resume
            extra['noise_scale'] = loop.noise.estimator.state_dict()
        if ramp is not None:
            extra['batch_ramp'] = ramp.state_dict()
        return {**ckpt.training_state(task, optimizer, args, epoch, metric, grad_scaler, lr_scheduler, hardware),
                **extra}

    def save_recovery(epoch, update_idx):
        return saver.save_recovery(
            {**state(epoch), 'updates_done': update_idx + 1, 'epoch_rng': loop.epoch_rng}, epoch, update_idx)

    stop = StopOnSignal()  # SIGTERM / SIGINT end the run after a complete update, saved as a recovery checkpoint
    loop = TrainLoop(
        task, optimizer,
        LoopConfig(
            device=device,
            accum_steps=args.grad_accum_steps,
            batch_size=reference_batch,
            loss_weighting=loss_weighting(args),
            clip_grad=args.clip_grad,
            clip_mode=args.clip_mode,
            log_interval=args.log_interval,
            recovery_interval=args.recovery_interval,
            channels_last=args.channels_last,
            model_dtype=model_dtype,
            prefetcher=args.prefetcher,
            synchronize_step=args.synchronize_step,
            world_size=args.world_size,
            rank=args.rank,
            naflex=args.naflex_loader,
            save_images_dir=output_dir if args.save_images else None,
            oom_recover=args.oom_recover,
            oom_grow_back=args.oom_grow_back,
            log_noise_scale=args.log_noise_scale,
        ),
        amp_autocast=amp.autocast,
        grad_scaler=grad_scaler,
        mixup_fn=mixup_fn,
        lr_scheduler=lr_scheduler,
        save_recovery=save_recovery if saver is not None else None,
        stop=stop,
    )
    if loop.splitter is not None and resumed is not None and resumed.get('micro_batch'):
        loop.splitter.load_state_dict(resumed['micro_batch'])
        if primary and loop.splitter.splits > 1:
            _logger.info(f'OOM recovery: continuing with the checkpoint\'s micro-batch {loop.splitter.micro_batch} '
                         f'({loop.splitter.splits} pieces per loader batch of {loop.splitter.batch_size}).')
    if loop.noise is not None and resumed is not None and resumed.get('noise_scale'):
        loop.noise.estimator.load_state_dict(resumed['noise_scale'])
    if primary:
        stepped = 'update' if lr_scheduler is not None and not lr_scheduler.t_in_epochs else 'epoch'
        _logger.info(f'Scheduled epochs: {num_epochs}, {updates_per_epoch} updates per epoch of '
                     f'{len(loader_train)} batches (accumulation {args.grad_accum_steps}); LR stepped per {stepped}.')

    # ---- epochs ---------------------------------------------------------------------------------------------------
    results = []
    best_metric = best_epoch = None
    with stop:
        for epoch in range(start.epoch, num_epochs):
            signum = stop.requested(device)
            if signum:  # asked between epochs (during evaluation or saving): save where the next one starts
                resumable = saver is not None and epoch > start.epoch
                saved = save_recovery(epoch - 1, updates_per_epoch - 1) if resumable else None
                raise TrainingStopped(signum, f'epoch {epoch - 1}', saved)
            # the ramp re-plans from the B_simple so far (not inside an epoch resumed: it did before the checkpoint)
            mid_epoch = epoch == start.epoch and start.updates_done > 0
            if ramp is not None and ramp.before_epoch(epoch, loop, decide=not mid_epoch):
                updates_per_epoch = ramp.updates_per_epoch
            set_loader_epoch(loader_train, epoch)
            if args.mixup_off_epoch and epoch >= args.mixup_off_epoch:
                disable_mixup(loader_train, mixup_fn)
            start_update = 0
            if epoch == start.epoch and start.updates_done:
                start_update = start.updates_done
                if start.epoch_rng is not None and not args.distributed:
                    ckpt.set_rng_state(start.epoch_rng)  # replay the interrupted epoch's order and augmentation
            train_metrics = loop.train_one_epoch(epoch, loader_train, start_update)
            noise = loop.noise_scale_summary()
            if noise is not None and primary:
                global_batch = args.batch_size * args.world_size * loop.cfg.accum_steps
                _logger.info(f'Epoch {epoch}: {noise.message(global_batch)}')
                write_noise_scale_row(os.path.join(output_dir, 'noise_scale.csv'), epoch, noise, global_batch)

            if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
                utils.distribute_bn(task.get_trainable_module(), args.world_size, args.dist_bn == 'reduce')

            if (epoch + 1) % args.val_interval != 0 and epoch + 1 != num_epochs:
                if primary:
                    _logger.info('Skipping eval and checkpointing this epoch (--val-interval).')
                if lr_scheduler is not None:
                    lr_scheduler.step(epoch + 1, metric=None)
                continue

            eval_metrics = None
            if loader_eval is not None:
                eval_metrics = loop.evaluate(task.get_eval_model(), loader_eval, validate_loss_fn, args.tta)
                ema_module = task.get_trainable_module(ema=True)
                if ema_module is not None and not args.model_ema_force_cpu:
                    if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
                        utils.distribute_bn(ema_module, args.world_size, args.dist_bn == 'reduce')
                    eval_metrics = loop.evaluate(
                        task.get_eval_model(ema=True), loader_eval, validate_loss_fn, args.tta, ' (EMA)')

            metric = (eval_metrics or train_metrics)[eval_metric]
            if output_dir is not None:
                lrs = [g['lr'] for g in optimizer.param_groups]
                row = summary_row(epoch, train_metrics, eval_metrics, sum(lrs) / len(lrs))
                if args.log_wandb and wandb is not None:
                    wandb.log(row)
                append_csv_row(os.path.join(output_dir, 'summary.csv'), row)
            if saver is not None:
                epoch_state = state(epoch, metric)
                weights = epoch_state.get('state_dict_ema', epoch_state['state_dict'])
                best_metric, best_epoch = saver.save_epoch(epoch_state, epoch, metric, weights)
            if lr_scheduler is not None:
                lr_scheduler.step(epoch + 1, metric)
            results.append({'epoch': epoch, 'train': train_metrics,
                            **({'validation': eval_metrics} if eval_metrics is not None else {})})

    if best_metric is not None:
        _logger.info(f'*** Best metric: {best_metric} (epoch {best_epoch})')
    if primary:
        ranked = sorted(results, key=lambda r: r.get('validation', r['train']).get(eval_metric, 0),
                        reverse=decreasing)
        print(f'--result\n{json.dumps(ranked[-10:], indent=4)}')
    return 0


def replan_for_resume(args: argparse.Namespace, resumed: Dict[str, Any], given: AbstractSet[str],
                      device) -> Optional[ElasticResume]:
    """The layout to resume with: the checkpoint's global batch on this run's ranks, unless the user set a new
    micro-batch or accumulation (None: the checkpoint does not say how its batch was built)."""
    saved = ckpt.batch_layout(resumed)
    if saved is None:
        return None
    user_flags = layout_flags_set_anew(sorted(given), vars(args), saved)
    return plan_elastic_resume(saved, args.world_size, device_name(device), args.batch_size, args.grad_accum_steps,
                               user_flags)


def scale_group_lrs(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Scale every param group's LR and its scheduler base (initial_lr), before the scheduler is built."""
    if factor == 1.0:
        return
    for group in optimizer.param_groups:
        for key in ('lr', 'initial_lr'):
            if key in group:
                group[key] *= factor


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


def set_loader_epoch(loader, epoch: int) -> None:
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


if __name__ == '__main__':
    sys.exit(main())
