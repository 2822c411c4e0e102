"""What only train.py refuses before any work: flag combinations of our extensions and unusable inputs.

Shared by train.py and tune_batch.py (through `timm_ext.train.setup`), so the probe never measures a command line
that train.py would refuse.
"""
import argparse
import os
from typing import Optional

from ..arg_checks import folder_problem, split_problem
from .checkpoint import CheckpointError, load_training_checkpoint
from .noise_monitor import noise_scale_problem
from .oom_recovery import sync_bn_problem

__all__ = ['batch_ramp_problem', 'extension_problem', 'loss_weighting', 'resume_problem', 'train_input_problem']


def loss_weighting(args: argparse.Namespace) -> str:
    """Micro-batch loss weighting: a true per-sample mean, unless a variable-batch loader asks for timm's modes."""
    if args.naflex_loader:
        return args.naflex_loss_scale or 'none'
    if args.train_img_sizes is not None:
        return args.variable_batch_loss_scale or 'none'
    return 'samples'


def extension_problem(args: argparse.Namespace, world_size: int) -> Optional[str]:
    """Why flags of OOM recovery, noise scale or batch ramp cannot work with the rest of the command line, or None."""
    if args.oom_grow_back is not None and not args.oom_recover:
        return '--oom-grow-back only acts after --oom-recover has shrunk the micro-batch; add --oom-recover'
    if args.oom_recover and args.aug_splits > 1:
        return ('--oom-recover cannot split batches of --aug-splits (the loss ties the augmented copies of each '
                'sample together); drop one of them')
    problem = sync_bn_problem(args.oom_recover, args.sync_bn, world_size)
    if problem:
        return problem
    problem = batch_ramp_problem(args)
    if problem:
        return problem
    if args.log_noise_scale:
        return noise_scale_problem(args.grad_accum_steps, world_size, loss_weighting(args))
    return None


def batch_ramp_problem(args: argparse.Namespace) -> Optional[str]:
    """Why the --batch-ramp flags cannot work: the ramp follows the B_simple that --log-noise-scale measures."""
    if not args.batch_ramp:
        options = (('--batch-ramp-factor', args.batch_ramp_factor), ('--batch-ramp-max', args.batch_ramp_max),
                   ('--batch-ramp-max-micro', args.batch_ramp_max_micro),
                   ('--batch-ramp-min-updates', args.batch_ramp_min_updates))
        given = [flag for flag, value in options if value is not None]
        return f'{given[0]} only acts with --batch-ramp; add --batch-ramp' if given else None
    if not args.log_noise_scale:
        return ('--batch-ramp follows the gradient noise scale that --log-noise-scale measures; add '
                '--log-noise-scale (with --grad-accum-steps 2 or more, or 2+ processes)')
    return None


def resume_problem(args: argparse.Namespace) -> Optional[str]:
    """Why --resume cannot be resumed from (missing, a folder, unreadable, another model's), or None when unset or
    usable: the one check of the file, for train.py, tune_batch.py's probe and its --estimate alike."""
    if not args.resume:
        return None
    try:
        checkpoint = load_training_checkpoint(args.resume)
    except CheckpointError as e:
        return str(e)
    arch = checkpoint.get('arch')
    if isinstance(arch, str) and arch.split('.', 1)[0] != str(args.model).split('.', 1)[0]:
        return f'--resume {args.resume} is a checkpoint of {arch!r}, not of --model {args.model!r}'
    return None


def train_input_problem(args: argparse.Namespace) -> Optional[str]:
    """Why the files and folders train.py reads or writes cannot be used, or None (checked before any work)."""
    for flag, path in (('--initial-checkpoint', args.initial_checkpoint), ('--pretrained-path', args.pretrained_path),
                       ('--class-map', args.class_map)):
        if path and not os.path.isfile(path):
            return f'{flag} file not found: {path}'
    output = args.output or os.path.join('output', 'train')
    problem = folder_problem('--output', output)
    if not problem and args.experiment:  # the run folder itself, when its name is known now
        problem = folder_problem('--output/--experiment', os.path.join(output, args.experiment))
    if problem:
        return problem
    root = args.data_dir or args.data
    if root and '/' not in args.dataset:  # a folder dataset: timm resolves the splits under the root
        for flag, split, hint in (('--train-split', args.train_split, ''),
                                  ('--val-split', args.val_split, "; pass --val-split '' to train without one")):
            problem = split_problem(flag, root, split, hint)
            if problem:
                return problem
    return resume_problem(args)
