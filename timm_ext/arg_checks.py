"""The allowed values of every numeric and named flag of train.py, validate.py and tune_batch.py, checked in one place.

Each script's flags have a table here mapping the dest to its domain (a positive integer, a fraction in [0, 1), a
probability, one value per input channel, a timm optimizer name, ...). `check_values` applies a table to parsed
arguments after the `-c/--config` YAML is merged, so a bad value gets the same one-line error whether it came from
the command line or from a config file::

    argument --img-size: got 0; allowed: a positive integer

The domains keep every value stock timm accepts and does something sensible with (`--aug-splits 0` is off,
`--mean 0.5` is broadcast to every channel, `--seed 0` seeds); they refuse what stock crashes on later (a
traceback deep in the model, the loader or the scheduler) or silently trains on (a NaN learning rate, a clipping
threshold of 0, a mixup probability of 3). The checks of file and folder inputs shared by the scripts live here too
(`folder_problem`, `writable_file_problem`, `split_problem`); what only training refuses is in
`timm_ext.train.input_checks`, and validate.py's table in `timm_ext.validate.args`.
"""
import argparse
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple, Union

from PIL import Image

from .amp import AMP_DTYPES, MODEL_DTYPES

__all__ = [
    'COMMON_DOMAINS', 'DeviceName', 'Domain', 'Names', 'Number', 'Rule', 'Values', 'TRAIN_DOMAINS', 'TUNE_DOMAINS',
    'check_values', 'flag_defaults', 'flag_names', 'folder_problem', 'split_problem', 'writable_file_problem',
]

Count = Union[int, Tuple[int, int], None]


class Domain:
    """What values one flag may take."""

    def allowed(self, args: argparse.Namespace) -> str:
        """What the flag takes, in words (the end of the error message)."""
        raise NotImplementedError

    def admits(self, value: Any, args: argparse.Namespace) -> bool:
        """Whether `value` (never None: unset flags are not checked) is allowed, given the other arguments."""
        raise NotImplementedError


@dataclass(frozen=True)
class Number(Domain):
    """A finite number (or integer) within optional bounds; `also` lists extra values that mean 'off'.

    Args:
        low: Lower bound (None: unbounded).
        high: Upper bound (None: unbounded).
        low_open: The lower bound itself is excluded.
        high_open: The upper bound itself is excluded.
        integer: Whole numbers only.
        also: Values allowed besides the range, e.g. 0 for "off".
        words: How the range reads in messages, when the bounds do not say it well.
    """
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    also: Tuple[float, ...] = ()
    words: str = ''

    def admits(self, value: Any, args: argparse.Namespace = None) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if value in self.also:
            return True
        if not math.isfinite(value) or (self.integer and value != int(value)):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def allowed(self, args: argparse.Namespace = None) -> str:
        text = self.words or self._range_words()
        return text + ''.join(f' or {v:g}' for v in self.also)

    def _range_words(self) -> str:
        kind = 'an integer' if self.integer else 'a number'
        if self.low is not None and self.high is not None:
            opening, closing = '(' if self.low_open else '[', ')' if self.high_open else ']'
            return f'{kind} in {opening}{self.low:g}, {self.high:g}{closing}'
        if self.low == 0:
            return f"a positive {kind.split()[-1]}" if self.low_open else f'{kind} >= 0'
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        return f'a finite {kind.split()[-1]}'


@dataclass(frozen=True)
class Values(Domain):
    """A list of numbers, each in `item`, with a count that is fixed, a range, or that of another flag.

    Args:
        item: Domain of each value.
        count: Exact count, (fewest, most), or None (any, at least one).
        count_of: Dest of a list flag whose length this one must have, when that flag is set.
        per_channel: 1 value (used for every channel) or one per input channel.
        ascending: Values must not decrease (a min/max pair).
    """
    item: Number
    count: Count = None
    count_of: str = ''
    per_channel: bool = False
    ascending: bool = False

    def _counts(self, args: argparse.Namespace) -> Tuple[int, ...]:
        if self.per_channel:
            return (1, input_channels(args))
        if self.count_of and getattr(args, self.count_of, None) is not None:
            return (len(getattr(args, self.count_of)),)
        if isinstance(self.count, int):
            return (self.count,)
        if isinstance(self.count, tuple):
            return tuple(range(self.count[0], self.count[1] + 1))
        return ()

    def admits(self, value: Any, args: argparse.Namespace) -> bool:
        if not isinstance(value, (list, tuple)) or not value:
            return False
        counts = self._counts(args)
        if counts and len(value) not in counts:
            return False
        if self.ascending and list(value) != sorted(value):
            return False
        return all(self.item.admits(v) for v in value)

    def allowed(self, args: argparse.Namespace) -> str:
        if self.per_channel:
            how_many = f'1 or {input_channels(args)} values (one per input channel)'
        elif self.count_of and getattr(args, self.count_of, None) is not None:
            how_many = f'{len(getattr(args, self.count_of))} values (one per --{self.count_of.replace("_", "-")} value)'
        elif isinstance(self.count, int):
            how_many = f'{self.count} values'
        elif isinstance(self.count, tuple):
            how_many = f'{self.count[0]} to {self.count[1]} values'
        else:
            how_many = '1 or more values'
        return f'{how_many}, each {self.item.allowed()}' + (', smallest first' if self.ascending else '')


@dataclass(frozen=True)
class Names(Domain):
    """One of a fixed set of names."""
    names: Tuple[str, ...]

    def admits(self, value: Any, args: argparse.Namespace = None) -> bool:
        return value in self.names

    def allowed(self, args: argparse.Namespace = None) -> str:
        return 'one of ' + ', '.join(repr(n) for n in self.names)


@dataclass(frozen=True)
class Rule(Domain):
    """A domain decided by a function (e.g. a name timm must know); `words` says what it admits."""
    test: Callable[[Any], bool]
    words: str

    def admits(self, value: Any, args: argparse.Namespace = None) -> bool:
        return self.test(value)

    def allowed(self, args: argparse.Namespace = None) -> str:
        return self.words


_DEVICE_RE = re.compile(r'^[a-z_][a-z0-9_]*(:[0-9]+)?$')


class DeviceName(Domain):
    """A torch device name: a type torch knows and an optional index >= 0 ('cpu', 'cuda', 'cuda:1', 'mps').

    Whether this machine has that device is `timm_ext.distributed.check_device`'s question, asked only where the run
    needs it (tune_batch.py --estimate plans for another machine). A type that a --device-modules package registers
    is known to torch only once that package is imported: with --device-modules any 'type[:index]' is admitted here.
    """

    def admits(self, value: Any, args: argparse.Namespace = None) -> bool:
        import torch
        if not isinstance(value, str):
            return False
        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            return bool(getattr(args, 'device_modules', None)) and bool(_DEVICE_RE.match(value))
        return True

    def allowed(self, args: argparse.Namespace = None) -> str:
        return 'a torch device name: cpu, cuda, cuda:<index>, mps, xpu, ... (index >= 0)'


class ImageMode(Domain):
    """A PIL image mode with one band per input channel (the loader's normalisation needs one of each)."""

    def admits(self, value: Any, args: argparse.Namespace) -> bool:
        return value in Image.MODES and Image.getmodebands(value) == input_channels(args)

    def allowed(self, args: argparse.Namespace) -> str:
        channels = input_channels(args)
        modes = [m for m in Image.MODES if Image.getmodebands(m) == channels]
        return f'a PIL mode with {channels} band(s), one per input channel: ' + ', '.join(repr(m) for m in modes)


def input_channels(args: argparse.Namespace) -> int:
    """Input channels as timm's data config resolves them: --input-size C, else --in-chans, else 3."""
    if getattr(args, 'input_size', None):
        return int(args.input_size[0])
    return int(getattr(args, 'in_chans', None) or 3)


def _is_optimizer(name: Any) -> bool:
    from timm.optim import get_optimizer_info
    if not isinstance(name, str) or not name:
        return False
    parts = name.lower().split('_')  # timm reads 'lookahead_<name>' as <name> wrapped in Lookahead
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != 'lookahead'):
        return False
    try:
        get_optimizer_info(parts[-1])
    except ValueError:
        return False
    return True


def _is_model(name: Any) -> bool:
    from timm.models import is_model
    if not isinstance(name, str) or not name:
        return False
    if name.startswith(('hf-hub:', 'hf_hub:', 'local-dir:')):
        return True  # resolved by timm from the hub or a folder, checked when the model is built
    return is_model(name.split('.', 1)[0])  # 'resnet50.a1_in1k': the name before the pretrained tag


def _is_dataset(name: Any) -> bool:
    """'' or a bare name (a folder or tar under --data-dir), or one of the prefixes timm's create_dataset knows.

    Any other 'prefix/name' would fall through to the folder reader and read --data-dir instead, silently.
    """
    if not isinstance(name, str):
        return False
    prefix, sep, _ = name.partition('/')
    return not sep or prefix.lower() in DATASET_PREFIXES


def _is_budget(text: Any) -> bool:
    """A budget, or several comma-separated ones (tune_batch.py --estimate's table)."""
    from .memory import BudgetError, parse_budget
    try:
        for part in str(text).split(','):
            parse_budget(part)
    except BudgetError:
        return False
    return True


# ---- domains, one per kind of value -------------------------------------------------------------------------------
POSITIVE_INT = Number(0, low_open=True, integer=True)
NON_NEGATIVE_INT = Number(0, integer=True)
POSITIVE = Number(0, low_open=True)
NON_NEGATIVE = Number(0)
FINITE = Number()
PROBABILITY = Number(0, 1)
FRACTION = Number(0, 1, high_open=True)  # a share of something that cannot be all of it: dropout, smoothing
DECAY = Number(0, 1)  # a moving-average keep factor
# numpy's seed range: stock seeds numpy with seed + rank, and a negative seed is a traceback there
SEED = Number(0, 2 ** 32 - 1, integer=True, words='an integer in [0, 2**32 - 1]')
INTERPOLATIONS = ('bilinear', 'bicubic', 'nearest', 'box', 'hamming', 'lanczos')  # timm's resize modes
DATASET_PREFIXES = ('torch', 'hfds', 'hfids', 'tfds', 'wds')  # timm.data.create_dataset's

# Shared by train.py and validate.py, where the flag means the same in both.
COMMON_DOMAINS: Mapping[str, Domain] = {
    'batch_size': POSITIVE_INT,
    'workers': NON_NEGATIVE_INT,
    'img_size': POSITIVE_INT,
    'in_chans': POSITIVE_INT,
    'input_size': Values(POSITIVE_INT, 3),
    'crop_pct': Number(0, low_open=True),
    'mean': Values(FINITE, per_channel=True),
    'std': Values(POSITIVE, per_channel=True),
    'num_classes': POSITIVE_INT,
    'interpolation': Names(('',) + INTERPOLATIONS),
    'amp_dtype': Names(tuple(AMP_DTYPES)),
    'model_dtype': Names(tuple(MODEL_DTYPES)),
    'seed': SEED,
    'naflex_max_seq_len': POSITIVE_INT,
    'fuser': Names(('', 'te', 'old', 'nvfuser')),  # timm.utils.set_jit_fuser's names
    'dataset': Rule(_is_dataset, f"'' or a folder/tar reader name, or {'/, '.join(DATASET_PREFIXES)}/<name>"),
    'input_img_mode': ImageMode(),
    'device': DeviceName(),
}

TRAIN_DOMAINS: Mapping[str, Domain] = {
    **COMMON_DOMAINS,
    'model': Rule(_is_model, "a timm model name (timm.list_models() lists them), or 'hf-hub:...'"),
    'train_num_samples': POSITIVE_INT,
    'val_num_samples': POSITIVE_INT,
    'validation_batch_size': POSITIVE_INT,
    'grad_accum_steps': POSITIVE_INT,
    'head_init_scale': FINITE,
    'head_init_bias': FINITE,
    'local_rank': NON_NEGATIVE_INT,
    # optimizer
    'opt': Rule(_is_optimizer, "a timm optimizer name, optionally 'lookahead_<name>' (timm.optim.list_optimizers())"),
    'opt_eps': POSITIVE,
    'opt_betas': Values(FRACTION, (2, 3)),
    'momentum': FRACTION,
    'weight_decay': NON_NEGATIVE,
    'clip_grad': POSITIVE,  # unset turns clipping off; 0 would clip every gradient to nothing
    'clip_mode': Names(('norm', 'value', 'agc')),
    'layer_decay': POSITIVE,
    'layer_decay_min_scale': NON_NEGATIVE,
    'layer_decay_no_opt_scale': NON_NEGATIVE,
    # schedule
    'sched': Names(('cosine', 'tanh', 'step', 'multistep', 'plateau', 'poly', 'constant', 'wsd', 'rsqrt', 'none')),
    'lr': POSITIVE,
    'lr_base': POSITIVE,
    'lr_base_size': POSITIVE_INT,
    'lr_base_scale': Names(('', 'linear', 'sqrt')),
    'lr_noise': Values(NON_NEGATIVE, (1, 2), ascending=True),
    'lr_noise_pct': NON_NEGATIVE,
    'lr_noise_std': NON_NEGATIVE,
    'lr_cycle_mul': POSITIVE,
    'lr_cycle_decay': POSITIVE,
    'lr_cycle_limit': POSITIVE_INT,
    'lr_k_decay': POSITIVE,
    'warmup_lr': NON_NEGATIVE,
    'min_lr': NON_NEGATIVE,
    'epochs': POSITIVE_INT,
    'epoch_repeats': NON_NEGATIVE,
    'start_epoch': NON_NEGATIVE_INT,
    'decay_milestones': Values(NON_NEGATIVE_INT, ascending=True),
    'decay_epochs': POSITIVE,
    'warmup_epochs': NON_NEGATIVE_INT,
    'cooldown_epochs': NON_NEGATIVE_INT,
    'patience_epochs': NON_NEGATIVE_INT,
    'decay_rate': POSITIVE,
    # augmentation and regularization
    'scale': Values(Number(0, 1, low_open=True), 2, ascending=True),
    'ratio': Values(POSITIVE, 2, ascending=True),
    'hflip': PROBABILITY,
    'vflip': PROBABILITY,
    'color_jitter': NON_NEGATIVE,
    'color_jitter_prob': PROBABILITY,
    'grayscale_prob': PROBABILITY,
    'gaussian_blur_prob': PROBABILITY,
    'aug_repeats': NON_NEGATIVE,
    'aug_splits': Number(2, integer=True, also=(0,), words='an integer >= 2 (the number of splits)'),
    'bce_target_thresh': PROBABILITY,
    'bce_pos_weight': POSITIVE,
    'reprob': PROBABILITY,
    'remode': Names(('const', 'rand', 'pixel')),
    'recount': POSITIVE_INT,
    'mixup': NON_NEGATIVE,
    'cutmix': NON_NEGATIVE,
    'cutmix_minmax': Values(PROBABILITY, 2, ascending=True),
    'mixup_prob': PROBABILITY,
    'mixup_switch_prob': PROBABILITY,
    'mixup_mode': Names(('batch', 'pair', 'elem')),
    'mixup_off_epoch': NON_NEGATIVE_INT,
    'smoothing': FRACTION,
    'train_interpolation': Names(('', 'random') + INTERPOLATIONS),
    'train_crop_mode': Names(('rrc', 'rkrc', 'rkrr')),  # random-resized, keep-ratio crop, keep-ratio resize
    'drop': FRACTION,
    'drop_connect': FRACTION,
    'drop_path': FRACTION,
    'drop_block': FRACTION,
    # batch norm, EMA
    'bn_momentum': PROBABILITY,
    'bn_eps': POSITIVE,
    'dist_bn': Names(('reduce', 'broadcast', '')),
    'model_ema_decay': DECAY,
    # misc
    'worker_seeding': Names(('all', 'part')),
    'log_interval': POSITIVE_INT,
    'val_interval': POSITIVE_INT,
    'recovery_interval': NON_NEGATIVE_INT,
    'checkpoint_hist': POSITIVE_INT,
    'eval_metric': Names(('top1', 'top5', 'loss')),
    'tta': NON_NEGATIVE_INT,
    'train_img_sizes': Values(POSITIVE_INT),
    'train_batch_sizes': Values(POSITIVE_INT, count_of='train_img_sizes'),
    'train_size_probs': Values(NON_NEGATIVE, count_of='train_img_sizes'),
    'train_size_schedule_spread': POSITIVE,
    'train_size_random_mix': PROBABILITY,
    'train_batches_per_epoch': POSITIVE_INT,
    'naflex_train_seq_lens': Values(POSITIVE_INT),
    'naflex_patch_sizes': Values(POSITIVE_INT),
    'naflex_patch_size_probs': Values(NON_NEGATIVE, count_of='naflex_patch_sizes'),
    # distillation
    'distill_loss_weight': NON_NEGATIVE,
    'task_loss_weight': NON_NEGATIVE,
    'kd_temperature': POSITIVE,
    'kd_student_feature_dim': POSITIVE_INT,
    'kd_teacher_feature_dim': POSITIVE_INT,
    # our extensions
    'oom_grow_back': POSITIVE_INT,
    'batch_ramp_factor': POSITIVE,
    'batch_ramp_max': POSITIVE_INT,
    'batch_ramp_max_micro': POSITIVE_INT,
    'batch_ramp_min_updates': POSITIVE_INT,
    'dist_timeout': POSITIVE,
}

# tune_batch.py's own flags (it also takes every train.py flag, checked with TRAIN_DOMAINS).
TUNE_DOMAINS: Mapping[str, Domain] = {
    'mem_budget': Rule(_is_budget, "a size with a unit ('12GiB', '500MB') or a fraction of the device in (0, 1]; "
                                   "with --estimate several, comma-separated"),
    'mem_headroom': FRACTION,
    'throughput_tol': FRACTION,
    'batch_multiple': POSITIVE_INT,
    'max_batch': POSITIVE_INT,
    'probe_start': POSITIVE_INT,
    'target_global_batch': POSITIVE_INT,
    'nproc': POSITIVE_INT,
    'nnodes': POSITIVE_INT,
}


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """How each dest is written in messages: its option strings joined by '/' ('-b/--batch-size')."""
    return {a.dest: '/'.join(a.option_strings) or a.dest for a in parser._actions}


def flag_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Each dest's own default in `parser` (for `check_values`)."""
    return {a.dest: a.default for a in parser._actions}


def check_values(args: argparse.Namespace, domains: Mapping[str, Domain], flags: Mapping[str, str],
                 defaults: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """The first flag whose value is outside its domain, as a one-line message; None when all are allowed.

    Args:
        args: Parsed arguments (after the config merge).
        domains: Domain by dest; dests missing from `args` are skipped.
        flags: How each dest is written in messages (`flag_names`).
        defaults: The parser's own default by dest. Unset (None) is allowed where the default is None (the flag
            has an 'unset' meaning); elsewhere only a YAML `null` can make it None, and stock would crash on it.
    """
    defaults = defaults or {}
    for dest in [*domains, *(d for d in defaults if d not in domains)]:
        if not hasattr(args, dest):
            continue
        value, domain = getattr(args, dest), domains.get(dest)
        if value is None:
            if defaults.get(dest) is not None:
                allowed = domain.allowed(args) if domain is not None else f'a value like the default {defaults[dest]!r}'
                return f'argument {flags.get(dest, dest)}: got None (null); allowed: {allowed}'
        elif domain is not None and not domain.admits(value, args):
            shown = list(value) if isinstance(value, tuple) else value
            return f'argument {flags.get(dest, dest)}: got {shown!r}; allowed: {domain.allowed(args)}'
    return None


# ---- combinations and inputs that are files or folders ------------------------------------------------------------

def _nearest_existing(path: str) -> str:
    """`path` itself if it exists, else its closest existing ancestor."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def folder_problem(flag: str, path: str) -> Optional[str]:
    """Why `path` cannot be (or be created as) a writable folder, or None."""
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        what = 'is a file' if existing == os.path.abspath(path) else f'is below the file {existing}'
        return f'{flag} {path} {what}; pass a folder'
    if not os.access(existing, os.W_OK | os.X_OK):
        return f'{flag} {path}: cannot write in {existing}'
    return None


def writable_file_problem(flag: str, path: str) -> Optional[str]:
    """Why the file `path` cannot be written (its folder created if needed), or None."""
    if os.path.isdir(path):
        return f'{flag} {path} is a folder; pass a file name'
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f'{flag} {path}: the file is not writable'
    existing = _nearest_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(existing):
        return f'{flag} {path} is below the file {existing}; pass a path in a folder'
    if not os.access(existing, os.W_OK | os.X_OK):
        return f'{flag} {path}: cannot write in {existing}'
    return None


def split_problem(flag: str, root: str, split: str, hint: str = '') -> Optional[str]:
    """Why a folder dataset's split cannot be read as asked, or None.

    timm looks for the split (or a synonym: 'val' for 'validation', ...) under the root and silently reads the root
    itself when there is none. That is right for a root of class folders, but a root that holds other splits would
    have them read as classes: refused.

    Args:
        flag: The flag that names the split, for the message.
        root: The dataset root.
        split: The split's name.
        hint: What else the user may pass, appended to the message.
    """
    from timm.data.dataset_factory import _EVAL_SYNONYM, _TRAIN_SYNONYM
    if not split or not os.path.isdir(root):
        return None
    name = split.split('[')[0]
    synonyms = next((s for s in (_TRAIN_SYNONYM, _EVAL_SYNONYM) if name in s), {})
    if any(os.path.exists(os.path.join(root, s)) for s in (name, *synonyms)):
        return None
    splits = sorted(s for s in (*_TRAIN_SYNONYM, *_EVAL_SYNONYM) if os.path.isdir(os.path.join(root, s)))
    if splits:
        return (f'{flag} {split!r}: no such folder in {root} (it has {", ".join(s + "/" for s in splits)}); '
                f'timm would read those split folders as classes{hint}')
    return None
