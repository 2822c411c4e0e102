"""Command line of our train.py: every flag of timm's stock train.py, our extensions, and `-c/--config` YAML defaults.

One definition shared by `train.py` and `tune_batch.py`. Callers build the parser, may add their own argument
groups, then parse::

    parser = build_parser()
    group = parser.add_argument_group('Batch tuning')          # optional: caller's own flags
    group.add_argument('--budget', default=None)
    args, args_text = parse_args(parser=parser)                 # args_text is the YAML written to args.yaml

As in stock timm, a pre-parser reads only `-c/--config FILE`; the YAML keys (dest names) become defaults of the
main parser and the command line wins over them. Unlike stock, bad input is a one-line argument error (exit 2):
an unreadable or malformed config, config values of the wrong kind, and any value outside its flag's domain
(`timm_ext.arg_checks`). Config keys that are not flags are named in one warning and ignored.
"""
import argparse
import logging
from typing import Any, Mapping, NoReturn, Sequence

import yaml
from timm.utils import ParseKwargs as _TimmParseKwargs

from ..arg_checks import TRAIN_DOMAINS, Domain, check_values, flag_defaults, flag_names
from ..errors import TimmExtError
from .batch_ramp import RAMP_FACTOR

__all__ = [
    'EXTENSIONS_GROUP', 'ConfigError', 'ParseKwargs', 'TrainArgumentParser', 'args_to_yaml', 'build_config_parser',
    'build_parser', 'config_keys', 'given_dests', 'group_dests', 'parse_args', 'read_config', 'validate_args',
]

_logger = logging.getLogger(__name__)

EXTENSIONS_GROUP = 'timm_ext extensions'

# Values argparse and yaml.safe_dump both handle; anything else in --model-kwargs/--opt-kwargs is refused.
_PLAIN_SCALARS = (type(None), bool, int, float, str)


class ConfigError(TimmExtError, ValueError):
    """A `-c/--config` file that cannot be used; the message is one line naming the file and the problem."""
    exit_status = 2


class TrainArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (`prog: error: ...`) instead of a page of usage."""

    def error(self, message: str) -> NoReturn:
        message = ' '.join(str(message).split())
        self.exit(2, f'{self.prog}: error: {message} (see {self.prog} --help)\n')


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to help lines, except where the default is empty (None, False, '', [], {})."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default = action.default
        empty = default is None or default is False or (isinstance(default, (str, list, dict)) and not default)
        if empty or default is argparse.SUPPRESS:
            return action.help or ''
        return super()._get_help_string(action)


class ParseKwargs(_TimmParseKwargs):
    """`KEY=VALUE ...` into a dict, exactly as timm's ParseKwargs, but a malformed pair is an argument error.

    Stock raises a bare ValueError (a traceback) on a token without `=`; values that YAML cannot store (sets,
    bytes, complex numbers) would later break writing args.yaml, so both are refused here.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Sequence[str],
                 option_string: str | None = None) -> None:
        for value in values:
            if value and '=' not in value:
                raise argparse.ArgumentError(self, f'expected KEY=VALUE pairs, got {value!r}')
        super().__call__(parser, namespace, values, option_string)
        for key, value in getattr(namespace, self.dest).items():
            if not _is_plain(value):
                raise argparse.ArgumentError(
                    self, f'value of {key!r} must be a number, string, bool, None, list or dict, got {value!r}')


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN_SCALARS) and _is_plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN_SCALARS)


def build_config_parser(prog: str | None = None) -> TrainArgumentParser:
    """The pre-parser: it takes only `-c/--config FILE` and leaves every other argument for the main parser.

    Args:
        prog: Program name used in error messages (default: the running script's name).
    """
    parser = TrainArgumentParser(prog=prog, description='Config pre-parser', add_help=False)
    parser.add_argument('-c', '--config', default='', type=str, metavar='FILE',
                        help='YAML file of defaults, keyed by argument dest names (e.g. a previous args.yaml)')
    return parser


def build_parser(description: str = 'Train a timm image model (drop-in for timm train.py)',
                 prog: str | None = None) -> TrainArgumentParser:
    """The main parser: all stock timm train.py arguments, in stock groups, plus our extension group.

    Callers may add their own arguments or groups before passing it to `parse_args`.

    Args:
        description: Text shown at the top of `--help`.
        prog: Program name used in usage and error messages (default: the running script's name).
    """
    parser = TrainArgumentParser(prog=prog, description=description, formatter_class=_HelpFormatter)
    # Listed for --help only: the pre-parser of parse_args() consumes -c/--config before this parser runs.
    parser.add_argument('-c', '--config', default=argparse.SUPPRESS, metavar='FILE',
                        help='YAML file of defaults keyed by dest name (e.g. an args.yaml); the command line wins')
    _add_dataset_args(parser)
    _add_model_args(parser)
    _add_device_args(parser)
    _add_optimizer_args(parser)
    _add_schedule_args(parser)
    _add_augmentation_args(parser)
    _add_batch_norm_args(parser)
    _add_ema_args(parser)
    _add_misc_args(parser)
    _add_distillation_args(parser)
    _add_extension_args(parser)
    return parser


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('data', nargs='?', metavar='DIR', help='dataset root (same as --data-dir)')
    group = parser.add_argument_group('Dataset parameters')
    group.add_argument('--data-dir', metavar='DIR', help='dataset root folder')
    group.add_argument('--dataset', metavar='NAME', default='',
                       help="dataset type, e.g. 'torch/cifar10' or 'hfds/NAME'; empty means an image folder")
    group.add_argument('--train-split', metavar='NAME', default='train', help='split (or subfolder) to train on')
    group.add_argument('--val-split', metavar='NAME', default='validation', help='split (or subfolder) to validate on')
    group.add_argument('--train-num-samples', default=None, type=int, metavar='N',
                       help='number of training samples, for iterable datasets')
    group.add_argument('--val-num-samples', default=None, type=int, metavar='N',
                       help='number of validation samples, for iterable datasets')
    group.add_argument('--dataset-download', action='store_true', default=False,
                       help='download the dataset if the dataset type supports it')
    group.add_argument('--class-map', default='', type=str, metavar='FILENAME',
                       help='file mapping class folder names to indices')
    group.add_argument('--input-img-mode', default=None, type=str, metavar='MODE',
                       help="PIL mode images are converted to, e.g. 'RGB' or 'L'")
    group.add_argument('--input-key', default=None, type=str, metavar='KEY',
                       help='image field name in dict-style datasets')
    group.add_argument('--target-key', default=None, type=str, metavar='KEY',
                       help='label field name in dict-style datasets')
    group.add_argument('--dataset-trust-remote-code', action='store_true', default=False,
                       help='let Hugging Face datasets run code shipped with the dataset')


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('Model parameters')
    group.add_argument('--model', default='resnet50', type=str, metavar='MODEL', help='timm model name')
    group.add_argument('--pretrained', action='store_true', default=False, help='start from pretrained weights')
    group.add_argument('--pretrained-path', default=None, type=str, metavar='PATH',
                       help='load pretrained weights from this file instead of the hub (implies --pretrained)')
    group.add_argument('--initial-checkpoint', default='', type=str, metavar='PATH',
                       help='load model weights from this checkpoint before training')
    group.add_argument('--resume', default='', type=str, metavar='PATH',
                       help='continue training from this checkpoint (weights, optimizer, epoch)')
    group.add_argument('--no-resume-opt', action='store_true', default=False,
                       help='with --resume, start with a fresh optimizer state')
    group.add_argument('--num-classes', type=int, default=None, metavar='N',
                       help="number of output classes (default: the model's or the dataset's)")
    group.add_argument('--gp', default=None, type=str, metavar='POOL',
                       help="global pooling type, e.g. 'avg', 'max', 'avgmax', 'catavgmax'")
    group.add_argument('--img-size', type=int, default=None, metavar='N', help='square input image size')
    group.add_argument('--in-chans', type=int, default=None, metavar='N', help='number of input image channels')
    group.add_argument('--input-size', default=None, nargs=3, type=int, metavar='N',
                       help='input shape as C H W (overrides --img-size and --in-chans)')
    group.add_argument('--crop-pct', default=None, type=float, metavar='N',
                       help='center crop fraction for validation images')
    group.add_argument('--mean', type=float, nargs='+', default=None, metavar='MEAN',
                       help="per-channel mean for normalization (default: the model's)")
    group.add_argument('--std', type=float, nargs='+', default=None, metavar='STD',
                       help="per-channel std for normalization (default: the model's)")
    group.add_argument('--interpolation', default='', type=str, metavar='NAME',
                       help="resize interpolation (default: the model's)")
    group.add_argument('-b', '--batch-size', type=int, default=128, metavar='N',
                       help='micro-batch size per process (per device)')
    group.add_argument('-vb', '--validation-batch-size', type=int, default=None, metavar='N',
                       help='images per process in each evaluation step (default: -b)')
    group.add_argument('--channels-last', action='store_true', default=False,
                       help='keep activations and weights in NHWC (channels_last) order')
    group.add_argument('--fuser', default='', type=str, metavar='NAME',
                       help="TorchScript fuser: 'te', 'old' or 'nvfuser'")
    group.add_argument('--grad-accum-steps', type=int, default=1, metavar='N',
                       help='micro-batches accumulated per optimizer step')
    group.add_argument('--grad-checkpointing', action='store_true', default=False,
                       help='recompute activations in backward to save memory, if the model supports it')
    group.add_argument('--fast-norm', action='store_true', default=False,
                       help='use the fast (lower precision) normalization layers')
    group.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                       help='extra keyword arguments for timm.create_model')
    group.add_argument('--head-init-scale', default=None, type=float, metavar='S',
                       help='multiply the initial classifier weights by S')
    group.add_argument('--head-init-bias', default=None, type=float, metavar='B',
                       help='initial value of the classifier bias')
    group.add_argument('--torchcompile-mode', type=str, default=None, metavar='MODE',
                       help="torch.compile mode, e.g. 'reduce-overhead' or 'max-autotune'")
    compile_choice = group.add_mutually_exclusive_group()
    compile_choice.add_argument('--torchscript', dest='torchscript', action='store_true',
                                help='script the model with torch.jit')
    compile_choice.add_argument('--torchcompile', nargs='?', type=str, default=None, const='inductor',
                                metavar='BACKEND', help="torch.compile the model with BACKEND (alone: 'inductor')")


def _add_device_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('Device parameters')
    group.add_argument('--device', default='cuda', type=str, metavar='DEVICE',
                       help="device type to run on, e.g. 'cuda', 'cpu', 'mps'")
    group.add_argument('--amp', action='store_true', default=False, help='train with automatic mixed precision')
    group.add_argument('--amp-dtype', default='float16', type=str, metavar='DTYPE',
                       help="autocast dtype with --amp: 'float16' or 'bfloat16'")
    group.add_argument('--model-dtype', default=None, type=str, metavar='DTYPE',
                       help="dtype of model weights and inputs, e.g. 'bfloat16' (instead of AMP)")
    group.add_argument('--no-ddp-bb', action='store_true', default=False,
                       help='disable DistributedDataParallel broadcast_buffers')
    group.add_argument('--synchronize-step', action='store_true', default=False,
                       help='synchronize the device after every step (for accurate timings)')
    group.add_argument('--local_rank', default=0, type=int, metavar='RANK',
                       help='rank within the node, set by older launchers (torchrun uses LOCAL_RANK)')
    group.add_argument('--device-modules', default=None, type=str, nargs='+', metavar='MODULE',
                       help='python modules to import to register extra device backends')


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('Optimizer parameters')
    group.add_argument('--opt', default='sgd', type=str, metavar='OPTIMIZER',
                       help="timm optimizer name, e.g. 'sgd', 'adamw', 'lamb'")
    group.add_argument('--opt-eps', default=None, type=float, metavar='EPSILON',
                       help="epsilon term of adaptive optimizers (unset: the optimizer's own)")
    group.add_argument('--opt-betas', default=None, type=float, nargs='+', metavar='BETA',
                       help="optimizer betas (default: the optimizer's)")
    group.add_argument('--momentum', type=float, default=0.9, metavar='M', help='SGD-style momentum')
    group.add_argument('--weight-decay', type=float, default=2e-5, metavar='WD', help='weight decay')
    group.add_argument('--clip-grad', type=float, default=None, metavar='NORM',
                       help='gradient clipping threshold (unset: gradients are not clipped)')
    group.add_argument('--clip-mode', type=str, default='norm', metavar='MODE',
                       help="what --clip-grad limits: 'norm' (total norm), 'value' (each element) or 'agc' (adaptive)")
    group.add_argument('--layer-decay', type=float, default=None, metavar='RATE',
                       help='per-layer LR multiplier, applied from the head towards the stem')
    group.add_argument('--layer-decay-min-scale', type=float, default=0, metavar='SCALE',
                       help='lower bound of the layer-wise learning rate scale')
    group.add_argument('--layer-decay-no-opt-scale', type=float, default=None, metavar='SCALE',
                       help='layers whose scale falls below this are frozen')
    group.add_argument('--opt-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                       help='extra keyword arguments for the optimizer')


def _add_schedule_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('Learning rate schedule parameters')
    group.add_argument('--sched', type=str, default='cosine', metavar='SCHEDULER',
                       help="learning rate schedule, e.g. 'cosine', 'step', 'plateau', 'none'")
    group.add_argument('--sched-on-updates', action='store_true', default=False,
                       help='step the schedule on every optimizer update, not every epoch')
    group.add_argument('--lr', type=float, default=None, metavar='LR',
                       help='learning rate (default: --lr-base scaled by the global batch size)')
    group.add_argument('--lr-base', type=float, default=0.1, metavar='LR',
                       help='learning rate at a global batch of --lr-base-size, used when --lr is not given')
    group.add_argument('--lr-base-size', type=int, default=256, metavar='DIV',
                       help='global batch size that --lr-base refers to')
    group.add_argument('--lr-base-scale', type=str, default='', metavar='SCALE',
                       help="how the LR follows the batch size: 'linear', 'sqrt', or '' (sqrt for ada*/lamb "
                            "optimizers, else linear)")
    group.add_argument('--lr-noise', type=float, nargs='+', default=None, metavar='PCT',
                       help='epoch fraction(s) between which LR noise is added')
    group.add_argument('--lr-noise-pct', type=float, default=0.67, metavar='PERCENT',
                       help='bound of the LR noise, as a fraction of the LR')
    group.add_argument('--lr-noise-std', type=float, default=1.0, metavar='STDDEV', help='std of the LR noise')
    group.add_argument('--lr-cycle-mul', type=float, default=1.0, metavar='MULT',
                       help='length multiplier of each new LR cycle')
    group.add_argument('--lr-cycle-decay', type=float, default=0.5, metavar='MULT',
                       help='peak LR multiplier of each new LR cycle')
    group.add_argument('--lr-cycle-limit', type=int, default=1, metavar='N', help='number of LR cycles')
    group.add_argument('--lr-k-decay', type=float, default=1.0, metavar='K', help='k-decay exponent of the LR curve')
    group.add_argument('--warmup-lr', type=float, default=1e-5, metavar='LR', help='learning rate at warmup start')
    group.add_argument('--min-lr', type=float, default=0, metavar='LR', help='floor of the cyclic schedules')
    group.add_argument('--epochs', type=int, default=300, metavar='N', help='length of the run, in epochs')
    group.add_argument('--epoch-repeats', type=float, default=0., metavar='N',
                       help='repeat each epoch this many times (a multiplier of the epoch length)')
    group.add_argument('--start-epoch', default=None, type=int, metavar='N',
                       help='epoch to start at (default: 0, or the epoch after a resumed checkpoint)')
    group.add_argument('--decay-milestones', default=[90, 180, 270], type=int, nargs='+', metavar='EPOCH',
                       help="epochs at which the 'multistep' schedule decays the LR")
    group.add_argument('--decay-epochs', type=float, default=90, metavar='N', help='epochs between LR decays')
    group.add_argument('--warmup-epochs', type=int, default=5, metavar='N', help='epochs of LR warmup')
    group.add_argument('--warmup-prefix', action='store_true', default=False,
                       help='run warmup before the schedule instead of inside it')
    group.add_argument('--cooldown-epochs', type=int, default=0, metavar='N',
                       help='epochs at the minimum LR after the schedule ends')
    group.add_argument('--patience-epochs', type=int, default=10, metavar='N',
                       help="epochs without improvement before the 'plateau' schedule decays the LR")
    group.add_argument('--decay-rate', '--dr', type=float, default=0.1, metavar='RATE',
                       help='LR multiplier at each decay')


def _add_augmentation_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('Augmentation and regularization parameters')
    group.add_argument('--no-aug', action='store_true', default=False, help='turn off all training augmentation')
    group.add_argument('--train-crop-mode', type=str, default=None, metavar='MODE', help='training crop mode')
    group.add_argument('--scale', type=float, nargs='+', default=[0.08, 1.0], metavar='PCT',
                       help='area range of random-resized crops, as fractions of the image')
    group.add_argument('--ratio', type=float, nargs='+', default=[3. / 4., 4. / 3.], metavar='RATIO',
                       help='aspect ratio range of random-resized crops')
    group.add_argument('--hflip', type=float, default=0.5, metavar='P',
                       help='chance of mirroring a training image left-right')
    group.add_argument('--vflip', type=float, default=0., metavar='P',
                       help='chance of mirroring a training image upside down')
    group.add_argument('--color-jitter', type=float, default=0.4, metavar='PCT', help='color jitter strength')
    group.add_argument('--color-jitter-prob', type=float, default=None, metavar='PCT',
                       help='chance that a training image gets color jitter (unset: always)')
    group.add_argument('--grayscale-prob', type=float, default=None, metavar='PCT',
                       help='probability of converting to grayscale')
    group.add_argument('--gaussian-blur-prob', type=float, default=None, metavar='PCT',
                       help='chance that a training image is blurred')
    group.add_argument('--aa', type=str, default=None, metavar='NAME',
                       help="auto-augment policy, e.g. 'rand-m9-mstd0.5'")
    group.add_argument('--aug-repeats', type=float, default=0, metavar='N',
                       help='repeated augmentation: copies of each sample per epoch (0 = off)')
    group.add_argument('--aug-splits', type=int, default=0, metavar='N',
                       help='number of augmentation splits (0 = off, else at least 2)')
    group.add_argument('--jsd-loss', action='store_true', default=False,
                       help='add a consistency (JS divergence) term between augmentation splits to the '
                            'cross-entropy; needs --aug-splits')
    group.add_argument('--bce-loss', action='store_true', default=False, help='binary cross-entropy loss')
    group.add_argument('--bce-sum', action='store_true', default=False,
                       help='sum the BCE loss over classes instead of averaging')
    group.add_argument('--bce-target-thresh', type=float, default=None, metavar='T',
                       help='binarize BCE targets at this threshold')
    group.add_argument('--bce-pos-weight', type=float, default=None, metavar='W', help='BCE positive class weight')
    group.add_argument('--reprob', type=float, default=0., metavar='PCT', help='random erasing probability')
    group.add_argument('--remode', type=str, default='pixel', metavar='MODE',
                       help="random erasing fill mode: 'const', 'rand' or 'pixel'")
    group.add_argument('--recount', type=int, default=1, metavar='N', help='random erasing count')
    group.add_argument('--resplit', action='store_true', default=False,
                       help='keep the first augmentation split free of random erasing')
    group.add_argument('--mixup', type=float, default=0.0, metavar='ALPHA', help='mixup alpha (0 = off)')
    group.add_argument('--cutmix', type=float, default=0.0, metavar='ALPHA', help='cutmix alpha (0 = off)')
    group.add_argument('--cutmix-minmax', type=float, nargs='+', default=None, metavar='RATIO',
                       help='cutmix min/max box ratio (overrides --cutmix alpha)')
    group.add_argument('--mixup-prob', type=float, default=1.0, metavar='P',
                       help='probability of applying mixup or cutmix to a batch')
    group.add_argument('--mixup-switch-prob', type=float, default=0.5, metavar='P',
                       help='probability of cutmix instead of mixup when both are on')
    group.add_argument('--mixup-mode', type=str, default='batch', metavar='MODE',
                       help="how often mixup/cutmix draws its mixing: once per 'batch', per 'pair' of samples, "
                            "or per sample ('elem')")
    group.add_argument('--mixup-off-epoch', default=0, type=int, metavar='N',
                       help='turn mixup off from this epoch on (0 = never)')
    group.add_argument('--smoothing', type=float, default=0.1, metavar='EPS', help='label smoothing')
    group.add_argument('--train-interpolation', type=str, default='random', metavar='NAME',
                       help='resize interpolation of training images')
    group.add_argument('--drop', type=float, default=0.0, metavar='PCT', help='classifier dropout rate')
    group.add_argument('--drop-connect', type=float, default=None, metavar='PCT',
                       help='drop connect rate (old name of --drop-path)')
    group.add_argument('--drop-path', type=float, default=None, metavar='PCT', help='stochastic depth rate')
    group.add_argument('--drop-block', type=float, default=None, metavar='PCT', help='DropBlock rate')


def _add_batch_norm_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('Batch norm parameters')
    group.add_argument('--bn-momentum', type=float, default=None, metavar='M',
                       help="BatchNorm momentum (default: the model's)")
    group.add_argument('--bn-eps', type=float, default=None, metavar='EPS',
                       help="BatchNorm epsilon (default: the model's)")
    group.add_argument('--sync-bn', action='store_true', default=False,
                       help='synchronize BatchNorm statistics across processes')
    group.add_argument('--dist-bn', type=str, default='reduce', metavar='MODE',
                       help="sync BatchNorm running stats across ranks at epoch end: 'reduce' (average), "
                            "'broadcast' (rank 0's) or '' (off)")
    group.add_argument('--split-bn', action='store_true', default=False,
                       help='give each augmentation split its own BatchNorm statistics')


def _add_ema_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('Model exponential moving average parameters')
    group.add_argument('--model-ema', action='store_true', default=False,
                       help='keep an exponential moving average of the weights')
    group.add_argument('--model-ema-force-cpu', action='store_true', default=False,
                       help='keep the EMA weights on the CPU (no EMA validation)')
    group.add_argument('--model-ema-decay', type=float, default=0.9998, metavar='DECAY', help='EMA decay factor')
    group.add_argument('--model-ema-warmup', action='store_true', default=False,
                       help='ramp the EMA decay up during early updates')


def _add_misc_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('Miscellaneous parameters')
    group.add_argument('--seed', type=int, default=42, metavar='S', help='random seed')
    group.add_argument('--worker-seeding', type=str, default='all', metavar='MODE',
                       help="data loader worker seeding: 'all' or 'part'")
    group.add_argument('--log-interval', type=int, default=50, metavar='N', help='log every N batches')
    group.add_argument('--val-interval', type=int, default=1, metavar='N', help='validate every N epochs')
    group.add_argument('--recovery-interval', type=int, default=0, metavar='N',
                       help='save a recovery checkpoint every N batches (0 = off)')
    group.add_argument('--checkpoint-hist', type=int, default=10, metavar='N',
                       help='how many top-scoring epoch checkpoints stay on disk')
    group.add_argument('-j', '--workers', type=int, default=4, metavar='N', help='data loader processes')
    group.add_argument('--save-images', action='store_true', default=False,
                       help='save images of the first training batches')
    group.add_argument('--pin-mem', action='store_true', default=False, help='pin data loader memory')
    group.add_argument('--no-prefetcher', action='store_true', default=False,
                       help='turn off the device-side prefetching loader')
    group.add_argument('--output', default='', type=str, metavar='PATH',
                       help='parent folder of run folders (default: ./output/train)')
    group.add_argument('--experiment', default='', type=str, metavar='NAME',
                       help='run folder name (default: date-time-model-size)')
    group.add_argument('--eval-metric', default='top1', type=str, metavar='EVAL_METRIC',
                       help="validation metric that picks the best checkpoint, e.g. 'top1' or 'loss'")
    group.add_argument('--tta', type=int, default=0, metavar='N', help='test-time augmentation factor (0 = off)')
    group.add_argument('--use-multi-epochs-loader', action='store_true', default=False,
                       help='keep data loader workers alive across epochs')
    group.add_argument('--log-wandb', action='store_true', default=False, help='log metrics to Weights & Biases')
    group.add_argument('--wandb-project', default=None, type=str, metavar='NAME',
                       help='Weights & Biases project to log into')
    group.add_argument('--wandb-tags', default=[], type=str, nargs='+', metavar='TAG', help='W&B run tags')
    group.add_argument('--wandb-resume-id', default='', type=str, metavar='ID', help='W&B run id to resume')
    # Variable image/batch size training
    group.add_argument('--train-img-sizes', type=int, nargs='+', default=None, metavar='N',
                       help='image sizes to train at (variable-size training)')
    group.add_argument('--train-batch-sizes', type=int, nargs='+', default=None, metavar='N',
                       help='batch size for each of --train-img-sizes')
    group.add_argument('--train-size-probs', type=float, nargs='+', default=None, metavar='P',
                       help='sampling probability of each of --train-img-sizes')
    group.add_argument('--train-size-schedule', type=str, default='constant', choices=['constant', 'progressive'],
                       help='how training sizes are chosen over the run')
    group.add_argument('--train-size-schedule-spread', type=float, default=0.65, metavar='F',
                       help='spread of the progressive size schedule')
    group.add_argument('--train-size-random-mix', type=float, default=0.1, metavar='F',
                       help='fraction of randomly drawn sizes mixed into the progressive schedule')
    group.add_argument('--train-batches-per-epoch', '--train-steps-per-epoch', type=int, default=None, metavar='N',
                       help='fix the number of training batches per epoch')
    group.add_argument('--variable-batch-loss-scale', type=str, default='none', choices=['none', 'sqrt', 'linear'],
                       help='loss scaling by batch size in variable-size training')
    # NaFlex (variable resolution, patch sequence) loading
    group.add_argument('--naflex-loader', action='store_true', default=False,
                       help='load variable-resolution patch sequences (NaFlex ViT models only)')
    group.add_argument('--naflex-train-seq-lens', type=int, nargs='+', default=[128, 256, 576, 784, 1024],
                       metavar='LEN', help='patch sequence lengths to train at')
    group.add_argument('--naflex-max-seq-len', type=int, default=576, metavar='LEN',
                       help='patch sequence length for validation')
    group.add_argument('--naflex-patch-sizes', type=int, nargs='+', default=None, metavar='N',
                       help='patch sizes to train with')
    group.add_argument('--naflex-patch-size-probs', type=float, nargs='+', default=None, metavar='P',
                       help='sampling probability of each of --naflex-patch-sizes')
    group.add_argument('--naflex-loss-scale', type=str, default='linear', choices=['none', 'sqrt', 'linear'],
                       help='loss scaling by sequence length in NaFlex training')
    group.add_argument('--naflex-patchify-channels-first', action='store_true', default=False,
                       help='flatten NaFlex patches channels first (C-P-P) instead of P-P-C')


def _add_distillation_args(parser: argparse.ArgumentParser) -> None:
    # Stock keeps these in the parser's general options group, not in a named group.
    parser.add_argument('--kd-model-name', default=None, type=str, metavar='MODEL',
                        help='teacher model for knowledge distillation (default: no distillation)')
    parser.add_argument('--kd-distill-type', default='logit', type=str, choices=['logit', 'feature', 'token'],
                        help='what is distilled: output logits, pooled features, or a distillation token')
    parser.add_argument('--kd-loss-type', default='kl', type=str, metavar='TYPE', help='logit distillation loss')
    parser.add_argument('--distill-loss-weight', default=None, type=float, metavar='W',
                        help='weight of the distillation loss')
    parser.add_argument('--task-loss-weight', default=None, type=float, metavar='W',
                        help='weight of the classification loss')
    parser.add_argument('--kd-temperature', default=4.0, type=float, metavar='T', help='distillation temperature')
    parser.add_argument('--kd-student-feature-dim', default=None, type=int, metavar='N',
                        help="student feature size for feature distillation (default: the model's)")
    parser.add_argument('--kd-teacher-feature-dim', default=None, type=int, metavar='N',
                        help="teacher feature size for feature distillation (default: the model's)")
    parser.add_argument('--kd-token-distill-type', default='soft', type=str, choices=['soft', 'hard'],
                        help="with 'token' distillation: 'soft' matches tempered teacher probabilities, "
                             "'hard' its top class")


def _add_extension_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(EXTENSIONS_GROUP, 'Flags of our tools that stock timm train.py lacks.')
    group.add_argument('--oom-recover', action='store_true', default=False,
                       help='on out-of-memory, shrink the micro-batch and raise accumulation (same global batch) '
                            'instead of crashing')
    group.add_argument('--oom-grow-back', type=int, default=None, metavar='N',
                       help='after an OOM shrink, try the larger micro-batch again after N good steps '
                            '(default: never)')
    group.add_argument('--steady-cpu-heap', action='store_true', default=False,
                       help='CPU: fix glibc\'s mmap threshold, so the run peaks as tune_batch.py\'s trials measured '
                            'whenever a memory cap comes (slower; tune_batch.py adds it under a CPU --mem-budget; on '
                            'by default under a data-segment limit set before the start)')
    group.add_argument('--log-noise-scale', action='store_true', default=False,
                       help='estimate and log the gradient noise scale (critical batch size)')
    group.add_argument('--batch-ramp', action='store_true', default=False,
                       help='grow the global batch at epoch boundaries as the measured B_simple grows, moving the '
                            'LR by the run\'s rule (turns --log-noise-scale on)')
    group.add_argument('--batch-ramp-factor', type=float, default=None, metavar='F',
                       help=f'--batch-ramp keeps the global batch within B_simple / F (default: {RAMP_FACTOR:g})')
    group.add_argument('--batch-ramp-max', type=int, default=None, metavar='N',
                       help='--batch-ramp never grows the global batch past N samples (default: no limit)')
    group.add_argument('--batch-ramp-max-micro', type=int, default=None, metavar='N',
                       help='--batch-ramp may grow the micro-batch per process up to N (the largest that fits, as '
                            'tune_batch.py --dry-run reports it) before more accumulation (default: the micro-batch '
                            'stays -b)')
    group.add_argument('--batch-ramp-min-updates', type=int, default=None, metavar='N',
                       help='--batch-ramp keeps at least N optimizer updates over the run at the grown batch '
                            '(default: the guard tune_batch.py applies to a bigger batch, its MIN_UPDATES)')
    group.add_argument('--dist-timeout', type=float, default=None, metavar='SECONDS',
                       help='under torchrun/SLURM: the longest any rank waits for the others in one collective '
                            '(a gradient all-reduce, an agreement, the exit barrier); a peer that stalls longer ends '
                            'every rank with one line naming it (default: the backend\'s, 30 min for gloo and 10 for '
                            'NCCL, as stock; tune_batch.py\'s probe: 600 s)')
    group.add_argument('--no-safetensors', action='store_true', default=False,
                       help='do not export best/last weights as .safetensors')


def read_config(path: str) -> dict[str, Any]:
    """Read a `-c/--config` YAML file: a mapping of dest names to values; an empty file is an empty mapping.

    Raises:
        ConfigError: the file is missing or unreadable, is not valid YAML, or does not hold a mapping.
    """
    try:
        with open(path, 'r', encoding='utf-8') as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f'config file {path!r} not found; pass an existing YAML file to -c/--config') from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f'cannot read config file {path!r}: {e}') from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, 'problem_mark', None)
        where = f' at line {mark.line + 1}, column {mark.column + 1}' if mark is not None else ''
        problem = getattr(e, 'problem', None) or str(e)
        raise ConfigError(f'config file {path!r} is not valid YAML{where}: {problem}') from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError(f'config file {path!r} must hold a mapping of argument names to values, '
                          f'got a {type(config).__name__}')
    return config


def _config_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Parser actions a config key may set, by dest (help and the help-only -c entry excluded)."""
    return {
        a.dest: a for a in parser._actions
        if a.dest not in (argparse.SUPPRESS, 'config') and not isinstance(a, argparse._HelpAction)
    }


def config_keys(parser: argparse.ArgumentParser) -> set[str]:
    """Dest names a `-c/--config` file may set for `parser`: every argument but help and config itself.

    Handy for writing a config for another parser, e.g. keeping only train.py's keys of tune_batch.py's args.
    """
    return set(_config_actions(parser))


def group_dests(parser: argparse.ArgumentParser, title: str) -> list[str]:
    """Dest names of the argument group `title` of `parser` (e.g. EXTENSIONS_GROUP: our train.py's own flags)."""
    group = next(g for g in parser._action_groups if g.title == title)
    return [a.dest for a in group._group_actions]


def _expected_kind(action: argparse.Action, value: Any) -> str | None:
    """What a config value for `action` should be, when `value` is not that; None when it is acceptable.

    Mirrors what the command line can produce, so a bad value fails here rather than deep inside training.
    A string for a scalar int/float flag passes: argparse converts string defaults with the flag's type, as stock.
    """
    if value is None:
        return None
    if isinstance(action, _TimmParseKwargs):
        return None if isinstance(value, dict) else 'a mapping of keyword arguments'
    if action.nargs == 0:
        return None if isinstance(value, bool) else 'true or false'
    many = action.nargs in ('+', '*') or isinstance(action.nargs, int)
    if many and not isinstance(value, list):
        return 'a list'
    if many and isinstance(action.nargs, int) and len(value) != action.nargs:
        return f'a list of {action.nargs} values'
    if not many and isinstance(value, (list, dict)):
        return 'a single value'
    kind = _KIND_NAMES.get(action.type)
    if kind is None:
        return None  # a caller's own type function: nothing to check against
    items = value if many else [value]
    if not all(_is_kind(item, kind, string_converts=not many) for item in items):
        return f'a list of {kind}s' if many else ('an ' if kind == 'integer' else 'a ') + kind
    if action.choices is not None and any(item not in action.choices for item in items):
        return 'one of ' + ', '.join(repr(c) for c in action.choices)
    return None


_KIND_NAMES = {int: 'integer', float: 'number', str: 'string', None: 'string'}


def _is_kind(item: Any, kind: str, string_converts: bool) -> bool:
    if isinstance(item, bool):  # YAML true/false is never a number or a string here
        return False
    if isinstance(item, str):
        return kind == 'string' or string_converts
    return (kind == 'integer' and isinstance(item, int)) or (kind == 'number' and isinstance(item, (int, float)))


def _check_config(parser: argparse.ArgumentParser, config: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Config entries that are flags of `parser`, type-checked; other keys are named in one warning and dropped."""
    actions = _config_actions(parser)
    unknown = [str(k) for k in config if k not in actions]
    if unknown:
        hints = [f'{k} (did you mean {k.replace("-", "_")}?)' if k.replace('-', '_') in actions else k
                 for k in unknown]
        _logger.warning(f'config {path}: ignoring keys that are not arguments of {parser.prog}: {", ".join(hints)}')
    known = {k: v for k, v in config.items() if k in actions}
    for key, value in known.items():
        expected = _expected_kind(actions[key], value)
        if expected is not None:
            parser.error(f'config {path}: {key} must be {expected}, got {value!r}')
    return known


def _parse_with_defaults(parser: argparse.ArgumentParser, argv: Sequence[str],
                         defaults: Mapping[str, Any]) -> argparse.Namespace:
    """`parser.parse_args(argv)` with `defaults` applied, leaving the parser's own defaults as they were."""
    saved_action_defaults = [(a, a.default) for a in parser._actions]
    saved_parser_defaults = dict(parser._defaults)
    try:
        parser.set_defaults(**defaults)
        return parser.parse_args(argv)
    finally:
        for action, default in saved_action_defaults:
            action.default = default
        parser._defaults = saved_parser_defaults


def given_dests(argv: Sequence[str] | None, parser: argparse.ArgumentParser) -> set[str]:
    """Dest names the command line or its `-c/--config` file sets explicitly, whatever the value (call after
    `parse_args` accepted the same `argv`). Tells a user's `-b 128` from the default 128."""
    config_args, remaining = build_config_parser(prog=parser.prog).parse_known_args(argv)
    given = set(read_config(config_args.config)) if config_args.config else set()
    unset = object()
    parsed = _parse_with_defaults(parser, remaining, {a.dest: unset for a in parser._actions})
    return given | {dest for dest, value in vars(parsed).items() if value is not unset}


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  domains: Mapping[str, Domain] = TRAIN_DOMAINS) -> None:
    """Reject a value outside its flag's domain as an argument error (exit 2) naming the flag, value and domain.

    Applies to the resolved values, so a bad value from a config file fails the same way. The domains are in
    `timm_ext.arg_checks`; stock timm accepts many of these values and fails later, or trains on them silently.
    """
    problem = check_values(args, domains, flag_names(parser), flag_defaults(parser))
    if problem:
        parser.error(problem)


def args_to_yaml(args: argparse.Namespace | Mapping[str, Any]) -> str:
    """The YAML text of resolved arguments, as stock writes to args.yaml (sorted keys, block style)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    return yaml.safe_dump(values, default_flow_style=False)


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None,
               domains: Mapping[str, Domain] = TRAIN_DOMAINS) -> tuple[argparse.Namespace, str]:
    """Parse the command line the way stock timm train.py does, with our checks.

    `-c/--config FILE` is read first; its keys become defaults and the command line overrides them.

    Args:
        argv: Arguments without the program name (default: `sys.argv[1:]`).
        parser: The main parser, possibly extended by the caller (default: `build_parser()`).
        domains: Allowed values by dest (default: train.py's; a caller adds those of its own flags).

    Returns:
        The parsed arguments and their YAML text (for args.yaml).
    """
    parser = parser if parser is not None else build_parser()
    config_args, remaining = build_config_parser(prog=parser.prog).parse_known_args(argv)
    defaults: dict[str, Any] = {}
    if config_args.config:
        try:
            config = read_config(config_args.config)
        except ConfigError as e:
            parser.error(str(e))
        defaults = _check_config(parser, config, config_args.config)
    args = _parse_with_defaults(parser, remaining, defaults)
    validate_args(parser, args, domains)
    return args, args_to_yaml(args)
