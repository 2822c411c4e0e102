"""One build of the training stack from train.py's arguments: model, data, LR, task, optimizer, EMA, compile, DDP.

train.py, the probe's training trial (`timm_ext.probe.trial`) and the noise-scale measurement
(`timm_ext.tune.critical_batch`) all call `build_training_stack`, so what the probe measures and the estimate trains is
what train.py runs: the same model construction, loss, optimizer factory, EMA and compile checks. They differ only in
what they ask for: the probe needs no data (it times random inputs of the run's largest size) and no DDP wrapper
(a trial must hold no collective), the estimate no EMA and no compile (neither changes gradients).

The order is stock's: the model first (it decides the data config), then data and the LR (from the loader's reference
batch), the task and optimizer, a checkpoint's weights and optimizer state, the EMA copy (after the model is on its
device, before DDP), compile, and DDP last.
"""
import argparse
import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from timm.data import resolve_data_config
from timm.optim import create_optimizer_v2, optimizer_kwargs

from . import checkpoint as ckpt
from ..amp import AmpChoice, resolve_amp
from ..distributed import ddp_device_ids
from ..lr import LrChoice, resolve_lr
from .setup import (
    ResolvedArgs, build_datasets, build_eval_loader, build_model, build_task, build_train_loader, build_train_loss,
    check_compile_backend, input_img_mode, resolve_args, resolve_model_dtype, with_values,
)

__all__ = ['DataStack', 'ResolvedArgs', 'TrainingStack', 'build_optimizer', 'build_training_stack']

_logger = logging.getLogger(__name__)


@dataclass
class DataStack:
    """The run's datasets and loaders.

    Attributes:
        dataset_train: The training split.
        dataset_eval: The validation split, or None.
        loader_train: The training loader.
        loader_eval: The evaluation loader, or None.
        mixup_fn: Mixup/CutMix applied in the loop, or None.
        reference_batch: The batch size the LR and loss weights refer to (--batch-size, or a schedule's average).
    """
    dataset_train: Any
    dataset_eval: Any
    loader_train: Any
    loader_eval: Any
    mixup_fn: Any
    reference_batch: float


@dataclass
class TrainingStack:
    """Everything a training step needs, built once.

    Attributes:
        model: The model (inside `task`).
        task: The timm training task (loss, EMA, compile, DDP wrapper).
        optimizer: The optimizer, at `lr`.
        amp: The precision choice (autocast, whether a loss scaler is needed).
        model_dtype: --model-dtype as a torch dtype (None: float32).
        data_config: timm's resolved data config.
        lr: The optimizer's LR.
        lr_choice: How the LR was reached (None when the caller fixed it).
        grad_scaler: The float16 loss scaler when the precision needs one (stock's), else None.
        data: Datasets and loaders (None when not asked for).
        resolved: The values the build settled that the run's arguments record (class count, --dist-bn, data
            folder); train.py copies them into the arguments its checkpoints save.
    """
    model: torch.nn.Module
    task: Any
    optimizer: torch.optim.Optimizer
    amp: AmpChoice
    model_dtype: Optional[torch.dtype]
    data_config: Dict[str, Any]
    lr: float
    lr_choice: Optional[LrChoice]
    grad_scaler: Optional[torch.amp.GradScaler]
    data: Optional[DataStack]
    resolved: ResolvedArgs


def _build_data(args: argparse.Namespace, data_config: dict, device: torch.device, model_dtype: Optional[torch.dtype],
                model: torch.nn.Module, with_eval: bool) -> DataStack:
    dataset_train, dataset_eval = build_datasets(args, input_img_mode(args.input_img_mode, data_config))
    loader_train, mixup_fn, reference_batch = build_train_loader(args, dataset_train, data_config, device,
                                                                 model_dtype, model)
    loader_eval = None
    if with_eval and dataset_eval is not None:
        loader_eval = build_eval_loader(args, dataset_eval, data_config, device, model_dtype, model)
    return DataStack(dataset_train, dataset_eval if with_eval else None, loader_train, loader_eval, mixup_fn,
                     reference_batch)


def build_optimizer(args: argparse.Namespace, task: Any, lr: float) -> torch.optim.Optimizer:
    """The run's optimizer over the task's trainable module (timm's factory, --opt and its settings) at `lr`."""
    return create_optimizer_v2(task.get_trainable_module(), **optimizer_kwargs(cfg=with_values(args, lr=lr)),
                               **args.opt_kwargs)


def build_training_stack(args: argparse.Namespace, device: torch.device, *, lr: Optional[float] = None,
                         with_data: bool = True, with_eval: bool = True, ema: bool = True,
                         compile_mode: Optional[str] = None, compile_model: bool = True, ddp: bool = True,
                         resumed: Optional[Dict[str, Any]] = None, verbose: bool = False) -> TrainingStack:
    """Build the run described by `args` (train.py's namespace after `init_device`).

    Args:
        args: The run's arguments (not modified: what the build settles comes back in `TrainingStack.resolved`).
        device: The device to train on.
        lr: A fixed LR for the optimizer; None: train.py's rule from --lr / --lr-base and the loader's reference
            batch (needs `with_data`).
        with_data: Build datasets and loaders.
        with_eval: Also the evaluation loader.
        ema: Set up --model-ema when asked for.
        compile_mode: The torch.compile mode to use instead of --torchcompile-mode (the probe drops CUDA graphs).
        compile_model: Apply --torchcompile when asked for.
        ddp: Wrap in DDP when the run is distributed.
        resumed: A loaded training checkpoint whose weights (and, unless --no-resume-opt, optimizer state) go in
            before EMA and DDP.
        verbose: Log the model, precision, LR and optimizer lines (rank 0 of train.py).

    Raises:
        SetupError / UsageError: see `timm_ext.train.setup`.
    """
    if lr is None and not with_data:
        raise ValueError('the LR rule needs the training loader: pass lr= or with_data=True')
    model_dtype = resolve_model_dtype(args.model_dtype)
    amp = resolve_amp(device, args.amp, args.amp_dtype)
    model, num_classes = build_model(args, device, model_dtype)
    resolved = resolve_args(args, num_classes)
    args = resolved.applied_to(args)  # what stock's builders read after the model: its class count, the data folder
    if verbose:
        _logger.info(f'Model {args.model} created, param count: {sum(p.numel() for p in model.parameters())}')
        _logger.info(amp.message)
    data_config = resolve_data_config(vars(args), model=model, verbose=verbose)
    data = _build_data(args, data_config, device, model_dtype, model, with_eval) if with_data else None

    lr_choice = None
    if lr is None:
        lr_choice = resolve_lr(args.lr, args.lr_base, args.lr_base_size, args.lr_base_scale, args.opt,
                               data.reference_batch, args.world_size, args.grad_accum_steps)
        lr = lr_choice.lr
        if verbose:
            _logger.info(lr_choice.message)
            if lr_choice.hint:
                _logger.info(lr_choice.hint)

    task = build_task(args, model, build_train_loss(args).to(device=device), device, model_dtype, verbose)
    optimizer = build_optimizer(args, task, lr)
    if verbose:
        _logger.info(f'Created {type(optimizer).__name__} ({args.opt}) optimizer, lr {lr:g}, '
                     f'weight decay {args.weight_decay:g}.')
    grad_scaler = torch.amp.GradScaler(device.type) if amp.use_grad_scaler else None
    if resumed is not None:
        ckpt.restore_model(task, resumed)
        if not args.no_resume_opt:
            ckpt.restore_optimizer(optimizer, resumed, grad_scaler)
    if ema and args.model_ema:
        task.setup_ema(decay=args.model_ema_decay, use_warmup=args.model_ema_warmup,
                       device='cpu' if args.model_ema_force_cpu else None)
        if resumed is not None:
            ckpt.restore_model(task, resumed, ema=True)
    if compile_model and args.torchcompile:
        check_compile_backend(args.torchcompile, device, args.torchcompile_mode)
        mode = compile_mode if compile_mode is not None else args.torchcompile_mode
        task.compile(backend=args.torchcompile, mode=mode)
        if task.has_ema():
            task.compile_ema(backend=args.torchcompile, mode=mode)
    if ddp and args.distributed:
        # broadcast_buffers is DDP's default; naming it only to turn it off avoids torch's deprecation warning
        ddp_kwargs = {'broadcast_buffers': False} if args.no_ddp_bb else {}
        task.prepare_distributed(device_ids=ddp_device_ids(device), **ddp_kwargs)
    return TrainingStack(model, task, optimizer, amp, model_dtype, data_config, lr, lr_choice, grad_scaler, data,
                         resolved)
