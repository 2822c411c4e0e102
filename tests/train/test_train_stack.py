"""The one builder of the training stack: what train.py, the probe trial and the noise-scale estimate build agrees."""
import copy

import pytest
import torch

from timm_ext.distributed import init_device
from timm_ext.train.args import parse_args
from timm_ext.train.setup import UsageError, resolve_args
from timm_ext.train.stack import ResolvedArgs, build_training_stack


def args_of(image_folder, *argv):
    args, _ = parse_args(['--data-dir', str(image_folder), '--model', 'test_resnet', '--num-classes', '3',
                          '--img-size', '32', '--device', 'cpu', '-j', '0', *argv])
    args, _ = init_device(args)
    args.prefetcher = not args.no_prefetcher  # set by train.py before it builds
    return args


def test_lr_follows_train_rule_from_the_loader_and_args_are_left_alone(image_folder):
    args = args_of(image_folder, '-b', '8', '--grad-accum-steps', '2', '--opt', 'adamw', '--model-ema')
    before = vars(args).copy()
    stack = build_training_stack(args, torch.device('cpu'))
    assert vars(args) == before, 'the builder must not write into the arguments'
    assert stack.lr_choice.scale == 'sqrt' and stack.lr == pytest.approx(0.1 * (16 / 256) ** 0.5)
    assert stack.optimizer.param_groups[0]['lr'] == pytest.approx(stack.lr)
    assert stack.data.reference_batch == 8 and len(stack.data.loader_train) == 3  # 24 images, drop_last
    assert stack.data.loader_eval is not None and stack.task.has_ema()


def test_what_the_build_settles_comes_back_and_the_arguments_stay_as_given(image_folder):
    # no --num-classes and the positional DIR: stock writes the model's class count and the folder into its args
    args, _ = parse_args([str(image_folder), '--model', 'test_resnet', '--img-size', '32', '--device', 'cpu',
                          '-j', '0', '-b', '8', '--mixup', '0.5', '--opt-kwargs', 'eps=1e-6'])
    args, _ = init_device(args)
    args.prefetcher = not args.no_prefetcher
    before = copy.deepcopy(vars(args))
    stack = build_training_stack(args, torch.device('cpu'))
    assert vars(args) == before, 'the builder must not write into the arguments, nor into their lists and dicts'
    assert stack.resolved == ResolvedArgs(num_classes=stack.model.num_classes, dist_bn='reduce',
                                          data_dir=str(image_folder))
    assert stack.model.num_classes == 1000 and args.num_classes is None and args.data_dir is None


def test_distributed_sync_bn_resolves_dist_bn_to_nothing_and_given_values_win(image_folder):
    args, _ = parse_args(['--data-dir', str(image_folder), str(image_folder / 'train'), '--sync-bn',
                          '--num-classes', '3'])
    args.distributed = False
    assert resolve_args(args, 3) == ResolvedArgs(num_classes=3, dist_bn='reduce', data_dir=str(image_folder))
    args.distributed = True
    assert resolve_args(args, 3).dist_bn == '' and args.dist_bn == 'reduce'


def test_probe_and_estimate_variants_build_the_same_model_and_optimizer(image_folder):
    args = args_of(image_folder, '-b', '8', '--opt', 'sgd', '--momentum', '0.8', '--weight-decay', '0.01',
                   '--model-ema')
    device = torch.device('cpu')
    full = build_training_stack(args, device)
    probe = build_training_stack(args, device, lr=0.5, with_data=False, ddp=False)
    estimate = build_training_stack(args, device, lr=0.5, with_eval=False, ema=False, compile_model=False)
    count = lambda stack: sum(p.numel() for p in stack.model.parameters())
    assert count(full) == count(probe) == count(estimate)
    for stack in (full, probe, estimate):
        group = stack.optimizer.param_groups[0]
        assert type(stack.optimizer) is type(full.optimizer) and group['momentum'] == 0.8
    assert probe.data is None and probe.task.has_ema() and not estimate.task.has_ema()
    assert estimate.data.loader_eval is None and probe.lr == estimate.lr == 0.5


def test_every_entry_point_gets_the_compile_backend_check(image_folder):
    args = args_of(image_folder, '--torchcompile', 'no_such_backend')
    with pytest.raises(UsageError, match='not a torch.compile backend'):
        build_training_stack(args, torch.device('cpu'), lr=0.1, with_data=False, ddp=False)


@pytest.mark.parametrize('script, flags, needle', [
    ('train.py', ['--torchcompile', 'no_such_backend'], "'no_such_backend' is not a torch.compile backend"),
    ('tune_batch.py --estimate', ['--torchcompile', '--torchcompile-mode', 'fastest'],
     "'fastest' is not a torch.compile mode"),
    ('validate.py --estimate', ['--torchcompile', 'cudagraphs'], 'cudagraphs needs a CUDA device')])
def test_a_bad_compile_flag_ends_every_script_in_one_line_before_any_work(tmp_path, script, flags, needle):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    name, *extra = script.split()
    argv = [sys.executable, str(root / name), '--model', 'test_resnet', '--device', 'cpu', *extra, *flags]
    if name == 'train.py':
        argv += ['--data-dir', str(tmp_path), '--output', str(tmp_path / 'out')]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and needle in done.stderr and 'Traceback' not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_lr_rule_needs_the_loader(image_folder):
    with pytest.raises(ValueError, match='needs the training loader'):
        build_training_stack(args_of(image_folder), torch.device('cpu'), with_data=False)


def test_every_user_facing_error_has_one_base_and_an_exit_status():
    from timm_ext.train.checkpoint import CheckpointError
    from timm_ext.distributed import DeviceError
    from timm_ext.errors import TimmExtError, UsageError
    from timm_ext.memory import BudgetError
    from timm_ext.probe.table import NothingFitsError
    from timm_ext.train.stop_signal import TrainingStopped
    from timm_ext.train.args import ConfigError
    from timm_ext.train.setup import SetupError
    from timm_ext.validate.evaluate import ValidationError
    statuses = {cls: cls('x').exit_status for cls in (CheckpointError, DeviceError, BudgetError, NothingFitsError,
                                                      ConfigError, SetupError, UsageError, ValidationError)}
    assert all(issubclass(cls, TimmExtError) for cls in statuses)
    assert statuses[UsageError] == statuses[BudgetError] == statuses[ConfigError] == 2
    assert statuses[SetupError] == statuses[DeviceError] == statuses[CheckpointError] == 1
    import signal
    assert TrainingStopped(signal.SIGTERM, 'update 3').exit_status == 128 + signal.SIGTERM


def test_report_prints_one_line_and_returns_the_status(capsys):
    from timm_ext.errors import UsageError, report
    assert report('train.py', UsageError('bad\n  thing')) == 2
    assert capsys.readouterr().err == 'train.py: error: bad thing\n'
