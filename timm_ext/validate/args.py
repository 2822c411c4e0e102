"""Command line of validate.py: every stock timm validate.py flag (same strings, dests, defaults, types), checked.

The flags are interface facts and match the stock spec (`tests/data/timm_validate_args.json`); the help texts are
ours. `parse_validate_args` adds what stock argparse leaves to asserts deep in the run: each flag's domain
(`VALIDATE_DOMAINS`) and the files and folders named, each a one-line error and exit status 2
before anything is built.
"""
import argparse
import os
import sys
from typing import Mapping, NoReturn, Optional, Sequence

from timm.utils import ParseKwargs

from ..arg_checks import (
    COMMON_DOMAINS, NON_NEGATIVE_INT, POSITIVE_INT, Domain, Names, check_values, flag_names, split_problem,
    writable_file_problem,
)
from ..memory_model.cards import CARDS, card_flag_problem
from ..memory_model.snapshot import add_snapshot_argument, snapshot_flag_problem
from ..memory_model.versions import add_software_argument, software_flag_problem
from ..memory import BudgetError, parse_budget
from ..train.args import EXTENSIONS_GROUP
from ..train.setup import compile_flags_problem
from .results import RESULT_FORMATS

__all__ = [
    'VALIDATE_DOMAINS', 'OneLineArgumentParser', 'build_validate_parser', 'check_validate_args', 'parse_validate_args',
]


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f'{self.prog}: error: {message} (see --help)\n')


# validate.py's flags: the common ones, then its own.
VALIDATE_DOMAINS: Mapping[str, Domain] = {
    **COMMON_DOMAINS,
    'num_samples': POSITIVE_INT,
    'crop_mode': Names(('center', 'squash', 'border')),
    'crop_border_pixels': NON_NEGATIVE_INT,
    'log_freq': POSITIVE_INT,
    'num_gpu': POSITIVE_INT,
    'results_format': Names(RESULT_FORMATS),
}


def build_validate_parser(prog: Optional[str] = None) -> OneLineArgumentParser:
    """Build the validate.py parser with every stock flag, in stock's order."""
    p = OneLineArgumentParser(prog=prog, description='Validate timm image classification models on a dataset, '
                                                     'with a probe-first batch-size retry on out-of-memory.')
    for add_group in (_add_dataset_args, _add_model_args, _add_run_args, _add_results_args, _add_naflex_args,
                      _add_extension_args):
        add_group(p)
    return p


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The dataset: where it lives, which split, how samples are read."""
    p.add_argument('data', nargs='?', metavar='DIR', const=None,
                   help='dataset root (deprecated positional form of --data-dir)')
    p.add_argument('--data-dir', metavar='DIR', help='dataset root folder')
    p.add_argument('--dataset', metavar='NAME', default='',
                   help='dataset as "<type>/<name>" (torch/, hfds/, tfds/, wds/); empty: an ImageFolder or tar')
    p.add_argument('--split', metavar='NAME', default='validation', help='dataset split to evaluate')
    p.add_argument('--num-samples', default=None, type=int, metavar='N',
                   help='number of samples in the split, for iterable datasets that cannot count them')
    p.add_argument('--dataset-download', action='store_true', default=False,
                   help='let torch/ and tfds/ datasets download themselves when supported')
    p.add_argument('--class-map', default='', type=str, metavar='FILENAME', help='file mapping class names to indices')
    p.add_argument('--input-key', default=None, type=str, help='sample key holding the image (hfds/wds datasets)')
    p.add_argument('--input-img-mode', default=None, type=str,
                   help='PIL mode images are converted to (default: RGB, or L for 1-channel input)')
    p.add_argument('--target-key', default=None, type=str, help='sample key holding the label (hfds/wds datasets)')
    p.add_argument('--dataset-trust-remote-code', action='store_true', default=False,
                   help="allow a Hugging Face dataset to run code from its repository")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and its input: name, weights source, batch, sizes, crop, normalization, head."""
    p.add_argument('--model', '-m', metavar='NAME', default='dpn92',
                   help='timm model name; or "all", a wildcard, or a file of names for bulk validation')
    p.add_argument('--pretrained', dest='pretrained', action='store_true',
                   help='load the pretrained weights of the model (implied when no --checkpoint is given)')
    p.add_argument('-j', '--workers', default=4, type=int, metavar='N', help='data loader worker processes')
    p.add_argument('-b', '--batch-size', default=256, type=int, metavar='N',
                   help='batch size; with --retry, the largest one tried')
    p.add_argument('--img-size', default=None, type=int, metavar='N', help='square input size (default: model\'s)')
    p.add_argument('--in-chans', type=int, default=None, metavar='N', help='input channels (default: 3)')
    p.add_argument('--input-size', default=None, nargs=3, type=int, metavar='N',
                   help='full input size as C H W, e.g. 3 224 224 (default: model\'s)')
    p.add_argument('--use-train-size', action='store_true', default=False,
                   help='evaluate at the training input size even when the model names a larger test size')
    p.add_argument('--crop-pct', default=None, type=float, metavar='N', help='center crop fraction')
    p.add_argument('--crop-mode', default=None, type=str, metavar='N',
                   help='crop mode: center, squash or border (default: model\'s)')
    p.add_argument('--crop-border-pixels', type=int, default=None, help='pixels to cut from each image border')
    p.add_argument('--mean', type=float, nargs='+', default=None, metavar='MEAN', help='normalization mean override')
    p.add_argument('--std', type=float, nargs='+', default=None, metavar='STD', help='normalization std override')
    p.add_argument('--interpolation', default='', type=str, metavar='NAME',
                   help='resize interpolation (default: model\'s)')
    p.add_argument('--num-classes', type=int, default=None, help='classifier outputs (default: model\'s)')
    p.add_argument('--gp', default=None, type=str, metavar='POOL',
                   help='global pool type: fast, avg, max, avgmax or avgmaxc (default: model\'s)')


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """How the evaluation runs: logging, checkpoint, device, precision, layout, compilation."""
    p.add_argument('--log-freq', default=10, type=int, metavar='N', help='log every N batches')
    p.add_argument('--checkpoint', default='', type=str, metavar='PATH',
                   help='weights to validate: a .pth.tar/.pth/.safetensors file, or a folder of checkpoints')
    p.add_argument('--num-gpu', type=int, default=1, help='GPUs to split each batch over (DataParallel)')
    p.add_argument('--test-pool', dest='test_pool', action='store_true',
                   help='test-time pooling: evaluate larger inputs than the model was trained on')
    p.add_argument('--no-prefetcher', action='store_true', default=False, help='turn off the device prefetcher')
    p.add_argument('--pin-mem', action='store_true', default=False, help='pin host memory in the data loader')
    p.add_argument('--channels-last', action='store_true', default=False, help='run in channels_last memory layout')
    p.add_argument('--device', default='cuda', type=str, help='device to run on, e.g. cuda, cuda:1, cpu')
    p.add_argument('--amp', action='store_true', default=False,
                   help='mixed precision with torch autocast (CPU float16 falls back to bfloat16 where unsupported)')
    p.add_argument('--amp-dtype', default='float16', type=str, help='autocast dtype: float16 or bfloat16')
    p.add_argument('--model-dtype', default=None, type=str,
                   help='model and input dtype without AMP: float32, float16 or bfloat16 (default: float32)')
    p.add_argument('--tf-preprocessing', action='store_true', default=False,
                   help='TensorFlow-style preprocessing (needs TensorFlow installed)')
    p.add_argument('--use-ema', dest='use_ema', action='store_true',
                   help='use the EMA weights of the checkpoint when it holds them')
    p.add_argument('--fuser', default='', type=str, help="TorchScript fuser: '', te, old or nvfuser")
    p.add_argument('--fast-norm', default=False, action='store_true', help='use timm\'s experimental fast norm layers')
    p.add_argument('--reparam', default=False, action='store_true',
                   help='fuse re-parameterizable branches before evaluation')
    p.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs,
                   help='extra model constructor arguments as key=value')
    p.add_argument('--torchcompile-mode', type=str, default=None, help='torch.compile mode')
    compile_group = p.add_mutually_exclusive_group()
    compile_group.add_argument('--torchscript', default=False, action='store_true', help='run the model scripted')
    compile_group.add_argument('--torchcompile', nargs='?', type=str, default=None, const='inductor',
                               help='torch.compile the model with this backend (default when given: inductor)')
    compile_group.add_argument('--aot-autograd', default=False, action='store_true',
                               help='compile with functorch memory-efficient fusion')


def _add_results_args(p: argparse.ArgumentParser) -> None:
    """What is reported and where: results file, label sets, retry, seed, metrics."""
    p.add_argument('--results-file', default='', type=str, metavar='FILENAME',
                   help='write the results to this file (replaced atomically)')
    p.add_argument('--results-format', default='csv', type=str, help='results file format: csv or json')
    p.add_argument('--real-labels', default='', type=str, metavar='FILENAME',
                   help='ImageNet "ReaL" labels JSON to score against')
    p.add_argument('--valid-labels', default='', type=str, metavar='FILENAME',
                   help='text file of class indices to restrict the outputs to (one per line)')
    p.add_argument('--retry', default=False, action='store_true',
                   help='on out-of-memory, probe the largest batch that fits and validate at it (always on in '
                        'bulk mode)')
    p.add_argument('--seed', type=int, default=42, metavar='S', help='random seed')
    p.add_argument('--metrics-avg', type=str, default=None, choices=['micro', 'macro', 'weighted'],
                   help='also report precision, recall and F1 with this averaging (needs scikit-learn)')


def _add_naflex_args(p: argparse.ArgumentParser) -> None:
    """The NaFlex variable-resolution loader."""
    p.add_argument('--naflex-loader', action='store_true', default=False,
                   help='variable-resolution NaFlex loader (NaFlex models only)')
    p.add_argument('--naflex-max-seq-len', type=int, default=576, help='NaFlex loader sequence length')


def _add_extension_args(p: argparse.ArgumentParser) -> None:
    """Beyond stock: the batch from the memory estimate."""
    group = p.add_argument_group(EXTENSIONS_GROUP, 'Flags stock validate.py does not have.')
    group.add_argument('--mem-budget', default=None, metavar='SIZE',
                       help="memory the forward may use, for the estimate: what the caching allocator may use, as a "
                            "size ('22GiB') or a fraction of the device (default: all of the device here, or of "
                            "--gpu)")
    group.add_argument('--gpu', default=None, metavar='NAME',
                       help='with --estimate: plan for this card (' + ', '.join(CARDS) + '): its memory as CUDA '
                            'reports it less the CUDA context, and its compute capability')
    add_software_argument(group)
    group.add_argument('--estimate', action='store_true', default=False,
                       help='plan only: print the largest batch the memory estimate predicts within --mem-budget '
                            'and the command to run; needs no data, weights or device (--device cuda on any machine)')
    add_snapshot_argument(group)


def check_validate_args(args: argparse.Namespace, flags: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Return a one-line complaint about argument values stock validate.py would only trip over later, or None.

    Args:
        args: Parsed arguments.
        flags: How each dest is written in messages (default: from validate.py's parser).
    """
    problem = check_values(args, VALIDATE_DOMAINS, flags or flag_names(build_validate_parser()))
    if problem:
        return problem
    if args.amp and args.model_dtype not in (None, 'float32'):
        return f'--amp needs a float32 model; drop --model-dtype {args.model_dtype} or --amp'
    for flag, path in (('--valid-labels', args.valid_labels), ('--real-labels', args.real_labels),
                       ('--class-map', args.class_map)):
        if path and not os.path.isfile(path):
            return f'argument {flag}: file not found: {path}'
    if args.results_file:
        problem = writable_file_problem('argument --results-file:', args.results_file)
        if problem:
            return problem
    if args.checkpoint and not os.path.exists(args.checkpoint):
        return f'argument --checkpoint: not found: {args.checkpoint}'
    if args.mem_budget:
        try:
            parse_budget(args.mem_budget)
        except BudgetError as e:
            return f'argument --mem-budget: {e}'
    problem = (snapshot_flag_problem(args.memory_snapshot, args.estimate, args.device)
               or card_flag_problem(args.gpu, args.device, args.estimate)
               or software_flag_problem(args.software, args.device, args.estimate)
               or compile_flags_problem(args.torchcompile, args.torchcompile_mode,
                                        'cuda' if str(args.device).startswith('cuda') else 'cpu'))
    if problem:
        return problem
    if args.estimate:  # a plan for another machine: its data need not be here
        return None
    root = args.data or args.data_dir
    if not args.dataset:  # folder or tar datasets need a root on disk; hub/torch datasets manage their own
        if not root:
            return 'no dataset given: pass --data-dir DIR (a folder holding the split, e.g. DIR/validation/)'
        if not os.path.exists(root):
            return f'data folder not found: {root}; pass --data-dir pointing at an existing dataset root'
        return split_problem('argument --split', root, args.split)
    return None


def parse_validate_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check validate.py's command line; bad values exit with status 2 and one line on stderr."""
    parser = build_validate_parser(prog=os.path.basename(sys.argv[0]) or 'validate.py')
    args = parser.parse_args(argv)
    problem = check_validate_args(args, flag_names(parser))
    if problem:
        parser.error(problem)
    return args
