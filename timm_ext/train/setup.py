"""Builders for train.py: model, datasets, loaders, mixup, losses and the training task, from parsed arguments.

Each builder does what timm's stock train.py does for the same flags, through the timm library, and turns the
failures a user can cause (a missing data folder, a model that cannot be built, a flag combination that cannot
work) into :class:`UsageError` (exit status 2) or :class:`SetupError` (exit status 1) with a one-line message,
before any output is written.
"""
import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
from timm.data import AugMixDataset, FastCollateMixup, Mixup, create_dataset, create_loader, create_naflex_loader
from timm.layers import convert_splitbn_model, convert_sync_batchnorm
from timm.loss import BinaryCrossEntropy, JsdCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import create_model, safe_model_name
from timm.task import ClassificationTask, FeatureDistillationTask, LogitDistillationTask, TokenDistillationTask
from timm.utils import world_info_from_env

from ..amp import MODEL_DTYPES
from .input_checks import extension_problem, train_input_problem
from .augment_fixes import patch_posterize
from ..errors import TimmExtError, UsageError

_logger = logging.getLogger('train')


class SetupError(TimmExtError):
    """A run that cannot be set up: missing data, unknown model, unusable weights (exit status 1)."""


def with_values(args: argparse.Namespace, **values: Any) -> argparse.Namespace:
    """A copy of `args` with `values` in place of its own (`args` is left alone).

    The copy is shallow: the builders read list and dict values (--model-kwargs, --opt-kwargs) but never change them.
    """
    return argparse.Namespace(**{**vars(args), **values})


@dataclass(frozen=True)
class ResolvedArgs:
    """What train.py's flags leave open and the build settles, as the run's own arguments record it.

    Stock train.py writes these into its namespace, so its checkpoints and args hold them; the builders here leave the
    namespace alone and return them instead, for train.py to copy into the arguments it saves.

    Attributes:
        num_classes: --num-classes, else the model's own.
        dist_bn: --dist-bn, or '' when distributed --sync-bn keeps the statistics in step (nothing to distribute).
        data_dir: --data-dir, else the deprecated positional DIR.
    """
    num_classes: int
    dist_bn: str
    data_dir: Optional[str]

    def applied_to(self, args: argparse.Namespace) -> argparse.Namespace:
        """A copy of `args` holding these values, for the builders that read them after the model."""
        return with_values(args, **dataclasses.asdict(self))


def resolve_args(args: argparse.Namespace, num_classes: int) -> ResolvedArgs:
    """The run's resolved values, given the model's class count (`build_model`)."""
    return ResolvedArgs(num_classes=num_classes, dist_bn=resolve_dist_bn(args), data_dir=resolve_data_dir(args))


def resolve_dist_bn(args: argparse.Namespace) -> str:
    """--dist-bn, or '' under distributed --sync-bn: synced statistics need no end-of-epoch distribution."""
    return '' if args.distributed and args.sync_bn else args.dist_bn


def resolve_data_dir(args: argparse.Namespace) -> Optional[str]:
    """--data-dir, else the deprecated positional DIR."""
    return args.data if args.data and not args.data_dir else args.data_dir


def check_arg_combinations(args: argparse.Namespace, world_size: Optional[int] = None) -> None:
    """Reject flag combinations stock timm asserts on (or crashes later with), before anything is built.

    Each flag's own range is checked by the parser (`timm_ext.arg_checks`); these are rules between flags.

    Args:
        args: Parsed arguments.
        world_size: Processes the run will train on (default: from the launcher's environment, as timm reads it).
    """
    if world_size is None:
        world_size = world_info_from_env()[2]
    rules = [
        (args.naflex_loader and args.train_img_sizes is not None,
         '--naflex-loader and --train-img-sizes are alternative loader modes; pass one'),
        (args.naflex_loader and args.use_multi_epochs_loader,
         '--use-multi-epochs-loader does not work with --naflex-loader'),
        (args.amp and args.model_dtype not in (None, 'float32'),
         '--amp needs a float32 model; drop --model-dtype or --amp'),
        (args.split_bn and args.aug_splits < 2 and not args.resplit,
         '--split-bn needs --aug-splits >= 2 or --resplit'),
        (args.jsd_loss and args.aug_splits < 2, '--jsd-loss needs --aug-splits >= 2'),
        (args.sync_bn and args.split_bn, '--sync-bn and --split-bn cannot be combined'),
        (args.torchscript and args.torchcompile, '--torchscript and --torchcompile cannot be combined'),
        (args.torchscript and args.sync_bn, '--torchscript does not work with --sync-bn'),
        (args.log_wandb and args.wandb_resume_id and not args.resume, '--wandb-resume-id needs --resume'),
        (not args.no_prefetcher and args.aug_splits and mixup_active(args) and not args.naflex_loader,
         'mixup/cutmix with --aug-splits needs --no-prefetcher (the fast collate cannot de-interleave splits)'),
        (args.naflex_loader and args.aug_splits > 1, '--aug-splits does not work with --naflex-loader'),
        (any(b % batch_multiple(args) for b in [args.batch_size, *(args.train_batch_sizes or [])]),
         'mixup/cutmix mix each sample with another of its batch: -b/--batch-size (and --train-batch-sizes) must be '
         'even'),
        (args.aug_repeats > 0 and world_size < 2,
         '--aug-repeats shards repeated samples across processes (timm supports it only in distributed training); '
         'train on 2+ processes or drop it'),
    ]
    for failed, message in rules:
        if failed:
            raise UsageError(message)
    problem = extension_problem(args, world_size) or compile_flags_problem(
        args.torchcompile, args.torchcompile_mode, 'cuda' if str(args.device).startswith('cuda') else 'cpu')
    if problem:
        raise UsageError(problem)


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse files and folders the run cannot read or write (`timm_ext.train.input_checks.train_input_problem`).

    Raises:
        SetupError: One line naming the flag, the path and the problem.
    """
    problem = train_input_problem(args)
    if problem:
        raise SetupError(problem)


def compile_flags_problem(backend: Optional[str], mode: Optional[str], device_type: str) -> Optional[str]:
    """What is wrong with --torchcompile BACKEND --torchcompile-mode MODE on `device_type`, in one line (None: nothing).

    The backends are those torch._dynamo registers; the modes those torch.compile accepts for inductor (`default`
    and `torch._inductor.list_mode_options()`); other backends ignore the mode, as torch.compile does.
    """
    if not backend:
        return None
    import torch._dynamo
    import torch._inductor
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        return (f'--torchcompile {backend!r} is not a torch.compile backend; use inductor (the default), '
                f'aot_eager or eager (torch._dynamo.list_backends() lists the others)')
    if backend == 'cudagraphs' and device_type != 'cuda':
        return '--torchcompile cudagraphs needs a CUDA device; use inductor (the default) or eager'
    modes = ['default', *torch._inductor.list_mode_options()]
    if backend == 'inductor' and mode is not None and mode not in modes:
        return f'--torchcompile-mode {mode!r} is not a torch.compile mode; use one of {", ".join(dict.fromkeys(modes))}'
    return None


def check_compile_backend(backend: str, device: torch.device, mode: Optional[str] = None) -> None:
    """Refuse a --torchcompile backend or mode torch does not know, or one the device cannot run
    (`compile_flags_problem`)."""
    problem = compile_flags_problem(backend, mode, device.type)
    if problem:
        raise UsageError(problem)


def mixup_active(args: argparse.Namespace) -> bool:
    """Whether --mixup, --cutmix or --cutmix-minmax mixes samples (the targets are then soft)."""
    return args.mixup > 0 or args.cutmix > 0. or args.cutmix_minmax is not None


def batch_multiple(args: argparse.Namespace) -> int:
    """What every micro-batch must be a multiple of: 2 with mixup/cutmix (each sample is mixed with another of its
    batch, so timm's mixup refuses an odd batch), else 1."""
    return 2 if mixup_active(args) else 1


def resolve_model_dtype(model_dtype: Optional[str]) -> Optional[torch.dtype]:
    """The ``--model-dtype`` name as a torch dtype, None for the default (float32); warns on float16."""
    if not model_dtype:
        return None
    dtype = MODEL_DTYPES[model_dtype]
    if dtype == torch.float16:
        _logger.warning('Training a float16 model is fragile; bfloat16 (or --amp) is the usual half precision.')
    return dtype


def build_model(args: argparse.Namespace, device: torch.device,
                model_dtype: Optional[torch.dtype]) -> Tuple[nn.Module, int]:
    """Create the model as stock does (head init, grad checkpointing, split/sync BN, device, dtype, layout).

    Returns:
        (model, its class count: --num-classes, else the model's own).

    Raises:
        SetupError: Unknown model name, unreadable --initial-checkpoint / --pretrained-path, weights not loadable.
    """
    name = args.model  # a known name, and weight files that exist: checked with the arguments

    in_chans = args.in_chans if args.in_chans is not None else (args.input_size[0] if args.input_size else 3)
    factory_kwargs = {}
    if args.pretrained_path:
        # a local file wins over the model's hub location; num_classes=-1 lets timm adapt the head
        factory_kwargs['pretrained_cfg_overlay'] = dict(file=args.pretrained_path, num_classes=-1)
    try:
        model = create_model(
            name,
            pretrained=args.pretrained,
            in_chans=in_chans,
            num_classes=args.num_classes,
            drop_rate=args.drop,
            drop_path_rate=args.drop_path,
            drop_block_rate=args.drop_block,
            global_pool=args.gp,
            bn_momentum=args.bn_momentum,
            bn_eps=args.bn_eps,
            scriptable=args.torchscript,
            checkpoint_path=args.initial_checkpoint,
            **factory_kwargs,
            **args.model_kwargs,
        )
    except TypeError as e:  # an unexpected keyword from --model-kwargs or a flag the model does not take
        raise SetupError(f'model {name!r} cannot be built with these arguments: {_first_line(e)}') from None
    except (RuntimeError, OSError, ValueError, AssertionError) as e:  # timm asserts on e.g. an unknown --gp
        what = 'pretrained weights' if args.pretrained else 'weights' if args.initial_checkpoint else 'model'
        raise SetupError(f'cannot create {name!r} ({what}): {_first_line(e)}') from None

    if args.head_init_scale is not None:
        with torch.no_grad():
            model.get_classifier().weight.mul_(args.head_init_scale)
            model.get_classifier().bias.mul_(args.head_init_scale)
    if args.head_init_bias is not None:
        nn.init.constant_(model.get_classifier().bias, args.head_init_bias)
    num_classes = args.num_classes
    if num_classes is None:
        if not hasattr(model, 'num_classes'):
            raise SetupError(f'model {name!r} has no num_classes; pass --num-classes')
        num_classes = model.num_classes
    if args.grad_checkpointing:
        try:
            model.set_grad_checkpointing(enable=True)
        except (AssertionError, NotImplementedError, AttributeError) as e:
            raise SetupError(f'--grad-checkpointing is not supported by {name!r}: {_first_line(e)}') from None
    if args.split_bn:
        model = convert_splitbn_model(model, max(args.aug_splits, 2))

    model.to(device=device, dtype=model_dtype)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if args.distributed and args.sync_bn:
        if device.type == 'cpu':
            raise UsageError('--sync-bn needs accelerator devices (torch SyncBatchNorm refuses CPU modules); '
                             'drop it, --dist-bn reduce averages BN statistics after each epoch instead')
        model = convert_sync_batchnorm(model)
        if args.rank == 0:
            _logger.info('Converted model to use synchronized BatchNorm (zero-initialized BN layers may misbehave).')
    if args.torchscript:
        try:
            model = torch.jit.script(model)
        except Exception as e:  # torchscript reports failures with many exception types
            raise SetupError(f'--torchscript cannot script {name!r}: {_first_line(e)}') from None
    return model, num_classes


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def input_img_mode(mode: Optional[str], data_config: dict) -> str:
    """PIL mode images are read in: `mode` (--input-img-mode), else RGB for 3 channels and L otherwise."""
    if mode is not None:
        return mode
    return 'RGB' if data_config['input_size'][0] == 3 else 'L'


def _is_local_dataset(name: str) -> bool:
    # '', 'folder', 'imagefolder', 'tar' read files under --data-dir; 'torch/', 'hfds/', 'tfds/', 'wds/'... do not
    return '/' not in name


def build_datasets(args: argparse.Namespace, img_mode: str) -> Tuple[Any, Any]:
    """Train and (when --val-split is set) eval datasets via ``timm.data.create_dataset``.

    The class count checked against the splits' folders is ``args.num_classes`` (when set).

    Raises:
        SetupError: No --data-dir, a missing data folder, or a split without images.
    """
    data_dir = resolve_data_dir(args)
    if _is_local_dataset(args.dataset):
        if not data_dir:
            raise SetupError('no dataset given; pass --data-dir DIR (a folder with train/ and validation/)')
        if not os.path.exists(data_dir):
            raise SetupError(f'data folder not found: {data_dir}; pass an existing --data-dir')

    def make(split: str, is_training: bool, num_samples: Optional[int], **train_only):
        try:
            return create_dataset(
                args.dataset,
                root=data_dir,
                split=split,
                is_training=is_training,
                class_map=args.class_map,
                download=args.dataset_download,
                batch_size=args.batch_size,
                input_img_mode=img_mode,
                input_key=args.input_key,
                target_key=args.target_key,
                num_samples=num_samples,
                trust_remote_code=args.dataset_trust_remote_code,
                **train_only,
            )
        except (RuntimeError, OSError, ValueError, AssertionError, ImportError) as e:
            where = data_dir or args.dataset
            raise SetupError(f'cannot read the {split!r} split of {where}: {_first_line(e)}') from None

    dataset_train = make(args.train_split, True, args.train_num_samples, seed=args.seed, repeats=args.epoch_repeats)
    dataset_eval = make(args.val_split, False, args.val_num_samples) if args.val_split else None
    for split, dataset in ((args.train_split, dataset_train), (args.val_split, dataset_eval)):
        _check_class_count(args.num_classes, split, dataset)
    return dataset_train, dataset_eval


def _check_class_count(num_classes: Optional[int], split: str, dataset: Any) -> None:
    """A classifier with fewer outputs than a folder split has classes fails at the first loss (index error)."""
    classes = getattr(getattr(dataset, 'reader', None), 'class_to_idx', None)
    if num_classes is None or not classes:
        return
    needed = max(classes.values()) + 1
    if num_classes < needed:
        raise SetupError(f'the {split!r} split has {needed} classes but the model has {num_classes} outputs; '
                         f'pass --num-classes {needed}')


def mixup_kwargs(args: argparse.Namespace) -> Optional[dict]:
    """Mixup/CutMix settings, or None when neither is on."""
    if not mixup_active(args):
        return None
    return dict(
        mixup_alpha=args.mixup,
        cutmix_alpha=args.cutmix,
        cutmix_minmax=args.cutmix_minmax,
        prob=args.mixup_prob,
        switch_prob=args.mixup_switch_prob,
        mode=args.mixup_mode,
        label_smoothing=args.smoothing,
        num_classes=args.num_classes,
    )


def _loader_common(args: argparse.Namespace, data_config: dict, device: torch.device,
                   model_dtype: Optional[torch.dtype]) -> dict:
    """Loader settings the train and eval loaders share: normalisation, dtype, device, prefetcher, sampler."""
    return dict(
        mean=data_config['mean'],
        std=data_config['std'],
        pin_memory=args.pin_mem,
        img_dtype=model_dtype or torch.float32,
        device=device,
        distributed=args.distributed,
        use_prefetcher=args.prefetcher,
    )


def build_train_loader(
        args: argparse.Namespace, dataset: Any, data_config: dict, device: torch.device,
        model_dtype: Optional[torch.dtype], model: nn.Module,
) -> Tuple[Any, Optional[Mixup], float]:
    """The training loader (standard, resolution-scheduled or NaFlex) with augmentation and mixup.

    Returns:
        (loader, mixup_fn applied in the loop when the loader does not mix, reference batch size for loss
        weighting: --batch-size, or the schedule's average batch).

    Raises:
        SetupError: The split holds fewer samples than one batch (every batch would be dropped).
    """
    if args.aa:
        patch_posterize()  # timm's increasing posterize reaches 0 bits, which current Pillow refuses
    loader_kwargs = dict(**_loader_common(args, data_config, device, model_dtype),
                         **_train_augment_kwargs(args, data_config))
    if args.naflex_loader:  # NaFlex mixes inside the loader, so the loop has no mixup_fn
        loader = _naflex_train_loader(args, dataset, model, loader_kwargs)
        mixup_fn, reference_batch = None, float(args.batch_size)
    else:
        loader, mixup_fn, reference_batch = _image_train_loader(args, dataset, data_config, loader_kwargs)
    if len(loader) == 0:
        raise SetupError(f'the training split has fewer samples per process than one batch of {args.batch_size} '
                         f'(incomplete batches are dropped in training); lower -b/--batch-size')
    return loader, mixup_fn, reference_batch


def _train_augment_kwargs(args: argparse.Namespace, data_config: dict) -> dict:
    """The training loader's batch, augmentation and worker settings, shared by the standard and NaFlex loaders."""
    train_interpolation = args.train_interpolation
    if args.no_aug or not train_interpolation:
        train_interpolation = data_config['interpolation']
    return dict(
        batch_size=args.batch_size,
        is_training=True,
        no_aug=args.no_aug,
        re_prob=args.reprob,
        re_mode=args.remode,
        re_count=args.recount,
        re_split=args.resplit,
        train_crop_mode=args.train_crop_mode,
        scale=args.scale,
        ratio=args.ratio,
        hflip=args.hflip,
        vflip=args.vflip,
        color_jitter=args.color_jitter,
        color_jitter_prob=args.color_jitter_prob,
        grayscale_prob=args.grayscale_prob,
        gaussian_blur_prob=args.gaussian_blur_prob,
        auto_augment=args.aa,
        num_aug_repeats=args.aug_repeats,
        num_aug_splits=args.aug_splits,
        interpolation=train_interpolation,
        num_workers=args.workers,
        worker_seeding=args.worker_seeding,
    )


def _naflex_train_loader(args: argparse.Namespace, dataset: Any, model: nn.Module, loader_kwargs: dict) -> Any:
    """The NaFlex training loader: variable patch sequences, mixup inside the loader."""
    mix = mixup_kwargs(args)
    naflex_mixup = None
    if mix is not None:
        from timm.data import NaFlexMixup
        naflex_mixup = NaFlexMixup(**{k: v for k, v in mix.items() if k not in ('mode', 'cutmix_minmax')})
    if not hasattr(model, 'get_patch_size'):
        raise SetupError(f'--naflex-loader needs a NaFlex model (naflexvit_*) that takes patch dicts; '
                         f'{args.model!r} takes image tensors')
    patch_kwargs = {}
    if args.naflex_patch_sizes:
        patch_kwargs['patch_size_choices'] = args.naflex_patch_sizes
        if args.naflex_patch_size_probs:  # one per size: checked with the arguments
            patch_kwargs['patch_size_choice_probs'] = args.naflex_patch_size_probs
    else:
        patch_kwargs['patch_size'] = model.get_patch_size()
    return create_naflex_loader(
        dataset=dataset,
        train_seq_lens=args.naflex_train_seq_lens,
        mixup_fn=naflex_mixup,
        rank=args.rank,
        world_size=args.world_size,
        patchify_channels_last=not args.naflex_patchify_channels_first,
        **patch_kwargs,
        **loader_kwargs,
    )


def _image_train_loader(args: argparse.Namespace, dataset: Any, data_config: dict,
                        loader_kwargs: dict) -> Tuple[Any, Optional[Mixup], float]:
    """The image-tensor training loader, at one size or a --train-img-sizes schedule; see `build_train_loader`."""
    mix = mixup_kwargs(args)
    collate_fn = mixup_fn = None
    if mix is not None:
        if args.prefetcher:
            collate_fn = FastCollateMixup(**mix)
        else:
            mixup_fn = Mixup(**mix)
    if args.aug_splits > 1:
        dataset = AugMixDataset(dataset, num_splits=args.aug_splits)
    loader = create_loader(
        dataset,
        input_size=data_config['input_size'],
        input_size_choices=args.train_img_sizes,
        batch_size_choices=args.train_batch_sizes,
        batch_choice_weights=args.train_size_probs,
        batch_choice_seed=args.seed,
        batch_choice_schedule=args.train_size_schedule,
        batch_schedule_epochs=args.epochs if args.train_size_schedule == 'progressive' else None,
        batch_schedule_spread=args.train_size_schedule_spread,
        batch_schedule_random_mix=args.train_size_random_mix,
        num_batches=args.train_batches_per_epoch,
        collate_fn=collate_fn,
        use_multi_epochs_loader=args.use_multi_epochs_loader,
        **loader_kwargs,
    )
    reference_batch = float(args.batch_size)
    if args.train_img_sizes is not None:
        sampler = loader.batch_sampler
        reference_batch = sampler.average_batch_size
        if args.rank == 0:
            _logger.info(f'Scheduled training sizes {args.train_img_sizes} with batch sizes '
                         f'{sampler.batch_sizes}; {len(sampler)} batches/epoch, average batch '
                         f'{reference_batch:.2f}.')
    return loader, mixup_fn, reference_batch


def build_eval_loader(
        args: argparse.Namespace, dataset: Any, data_config: dict, device: torch.device,
        model_dtype: Optional[torch.dtype], model: nn.Module,
) -> Any:
    """The evaluation loader (NaFlex at its longest sequence when training with NaFlex)."""
    workers = args.workers
    if args.distributed and ('tfds' in args.dataset or 'wds' in args.dataset):
        workers = min(2, args.workers)  # fewer workers keep iterable-dataset padding across ranks small
    common = dict(
        **_loader_common(args, data_config, device, model_dtype),
        batch_size=args.validation_batch_size or args.batch_size,
        is_training=False,
        interpolation=data_config['interpolation'],
        num_workers=workers,
        crop_pct=data_config['crop_pct'],
    )
    if args.naflex_loader:
        return create_naflex_loader(
            dataset=dataset,
            patch_size=model.get_patch_size(),
            max_seq_len=args.naflex_max_seq_len,
            patchify_channels_last=not args.naflex_patchify_channels_first,
            **common,
        )
    return create_loader(dataset, input_size=data_config['input_size'], **common)


def build_train_loss(args: argparse.Namespace) -> nn.Module:
    """The training criterion stock picks from --jsd-loss, mixup/cutmix, --smoothing and --bce-loss."""
    bce = dict(target_threshold=args.bce_target_thresh, sum_classes=args.bce_sum, pos_weight=args.bce_pos_weight)
    if args.jsd_loss:
        return JsdCrossEntropy(num_splits=args.aug_splits, smoothing=args.smoothing)
    if mixup_active(args):
        # mixup produces smoothed soft targets itself
        return BinaryCrossEntropy(**bce) if args.bce_loss else SoftTargetCrossEntropy()
    if args.smoothing:
        if args.bce_loss:
            return BinaryCrossEntropy(smoothing=args.smoothing, **bce)
        return LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    return nn.CrossEntropyLoss()


def build_task(
        args: argparse.Namespace, model: nn.Module, criterion: nn.Module, device: torch.device,
        model_dtype: Optional[torch.dtype], verbose: bool = False,
) -> nn.Module:
    """A timm.task training task: classification, or logit / feature / token distillation from --kd-model-name.

    `verbose` lets timm log the task's criterion: train.py's rank 0 only, not each build of the probe and the
    estimate (tune_batch.py would print it once per build).
    """
    common = dict(criterion=criterion, device=device, dtype=model_dtype, verbose=verbose)
    if args.kd_model_name is None:
        return ClassificationTask(model=model, **common)
    weights = dict(distill_loss_weight=args.distill_loss_weight, task_loss_weight=args.task_loss_weight)
    try:
        if args.kd_distill_type == 'logit':
            return LogitDistillationTask(
                student_model=model, teacher_model=args.kd_model_name, loss_type=args.kd_loss_type,
                temperature=args.kd_temperature, **weights, **common)
        if args.kd_distill_type == 'feature':
            return FeatureDistillationTask(
                student_model=model, teacher_model=args.kd_model_name,
                student_feature_dim=args.kd_student_feature_dim, teacher_feature_dim=args.kd_teacher_feature_dim,
                **weights, **common)
        return TokenDistillationTask(
            student_model=model, teacher_model=args.kd_model_name, distill_type=args.kd_token_distill_type,
            temperature=args.kd_temperature, **weights, **common)
    except (RuntimeError, OSError, ValueError) as e:
        raise SetupError(f'cannot set up {args.kd_distill_type} distillation from teacher '
                         f'{args.kd_model_name!r}: {_first_line(e)}') from None


def disable_mixup(loader: Any, mixup_fn: Optional[Mixup]) -> None:
    """Turn mixup/cutmix off from --mixup-off-epoch on, in the loader's collate or in the loop's mixup_fn."""
    if getattr(loader, 'mixup_enabled', False):
        loader.mixup_enabled = False
    elif mixup_fn is not None:
        mixup_fn.mixup_enabled = False


def experiment_name(args: argparse.Namespace, data_config: dict, timestamp: str) -> str:
    """--experiment, else '<timestamp>-<model>-<img size>' as stock names output folders."""
    if args.experiment:
        return args.experiment
    return '-'.join([timestamp, safe_model_name(args.model), str(data_config['input_size'][-1])])
