"""Every numeric flag of train.py, tune_batch.py and validate.py refuses bad values with one line, exit status 2.

The walk below states, independently of `timm_ext.arg_checks`, which flags stock timm gives a sensible meaning to 0,
to negative numbers, and to values above 1; every other combination of flag and bad value must be refused, on the
command line and from a `-c` YAML alike. Most of it runs the parsers in this process; a handful of real processes
check the whole contract (status, one line, no traceback, no output folder).
"""
import argparse
import importlib.util
import math
import os
from typing import List

import pytest
import torch
import yaml

from conftest import REPO_ROOT, run_script
from timm_ext.arg_checks import (
    TRAIN_DOMAINS, TUNE_DOMAINS, folder_problem, split_problem, writable_file_problem,
)
from timm_ext.atomic_files import atomic_torch_save
from timm_ext.train.args import build_parser, parse_args
from timm_ext.train.input_checks import train_input_problem
from timm_ext.train.setup import SetupError, UsageError, build_datasets, check_arg_combinations
from timm_ext.validate.args import VALIDATE_DOMAINS, build_validate_parser, parse_validate_args


def _tune_module():
    spec = importlib.util.spec_from_file_location('tune_batch_script', REPO_ROOT / 'tune_batch.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TUNE = _tune_module()

# Where stock gives the value a meaning (off, none, a plain number), by script.
ZERO_OK = {
    'workers', 'local_rank', 'weight_decay', 'layer_decay_min_scale', 'layer_decay_no_opt_scale', 'lr_noise',
    'lr_noise_pct', 'lr_noise_std', 'warmup_lr', 'min_lr', 'epoch_repeats', 'start_epoch', 'decay_milestones',
    'warmup_epochs', 'cooldown_epochs', 'patience_epochs', 'hflip', 'vflip', 'color_jitter', 'color_jitter_prob',
    'grayscale_prob', 'gaussian_blur_prob', 'aug_repeats', 'aug_splits', 'bce_target_thresh', 'reprob', 'mixup',
    'cutmix', 'cutmix_minmax', 'mixup_prob', 'mixup_switch_prob', 'mixup_off_epoch', 'smoothing', 'drop',
    'drop_connect', 'drop_path', 'drop_block', 'bn_momentum', 'model_ema_decay', 'seed', 'recovery_interval', 'tta',
    'train_size_probs', 'train_size_random_mix', 'naflex_patch_size_probs', 'distill_loss_weight',
    'task_loss_weight', 'momentum', 'opt_betas', 'head_init_scale', 'head_init_bias', 'mean',
    'mem_headroom', 'throughput_tol', 'crop_border_pixels',
}
NEGATIVE_OK = {'head_init_scale', 'head_init_bias', 'mean'}
ABOVE_ONE_BAD = {
    'hflip', 'vflip', 'color_jitter_prob', 'grayscale_prob', 'gaussian_blur_prob', 'bce_target_thresh', 'reprob',
    'mixup_prob', 'mixup_switch_prob', 'smoothing', 'drop', 'drop_connect', 'drop_path', 'drop_block', 'bn_momentum',
    'model_ema_decay', 'momentum', 'train_size_random_mix', 'opt_betas', 'scale', 'cutmix_minmax', 'mem_headroom',
    'throughput_tol',
}
# Values a list flag needs to be given alone, and flags it needs beside it.
LIST_COUNT = {'input_size': 3, 'scale': 2, 'ratio': 2, 'cutmix_minmax': 2, 'opt_betas': 2}
COMPANIONS = {'train_batch_sizes': ['--train-img-sizes', '32'], 'train_size_probs': ['--train-img-sizes', '32'],
              'naflex_patch_size_probs': ['--naflex-patch-sizes', '16']}
# Wrong counts and wrong orders, as full command lines.
WRONG_COUNTS = [
    ['--scale', '0.5'], ['--scale', '0.1', '0.5', '1'], ['--ratio', '1'], ['--cutmix-minmax', '0.1', '0.2', '0.3'],
    ['--opt-betas', '0.9'], ['--opt-betas', '0.9', '0.9', '0.9', '0.9'], ['--lr-noise', '0.1', '0.2', '0.3'],
    ['--mean', '0.5', '0.5'], ['--std', '0.2', '0.2', '0.2', '0.2'], ['--in-chans', '1', '--mean', '0.5', '0.5'],
    ['--input-size', '1', '32', '32', '--std', '0.2', '0.2', '0.2'],
    ['--train-img-sizes', '32', '64', '--train-batch-sizes', '8'],
    ['--train-img-sizes', '32', '--train-size-probs', '0.5', '0.5'],
    ['--naflex-patch-sizes', '16', '--naflex-patch-size-probs', '0.5', '0.5'],
    ['--scale', '1', '0.5'], ['--ratio', '2', '1'], ['--cutmix-minmax', '0.9', '0.1'], ['--lr-noise', '0.9', '0.1'],
    ['--decay-milestones', '20', '10'],
]
BAD_NAMES = [
    ('--opt', 'adamx'), ('--opt', 'fancy_adamw'), ('--sched', 'cosine2'), ('--model', 'no_such_model'),
    ('--clip-mode', 'l2'), ('--dist-bn', 'mean'), ('--mixup-mode', 'all'), ('--remode', 'noise'),
    ('--worker-seeding', 'none'), ('--eval-metric', 'acc'), ('--interpolation', 'cubic'),
    ('--train-interpolation', 'area'), ('--model-dtype', 'int8'), ('--lr-base-scale', 'cubic'),
    ('--amp-dtype', 'float8'), ('--mem-budget', '12'), ('--mem-budget', '0'), ('--mem-budget', '-1GiB'),
    ('--train-crop-mode', 'centre'), ('--fuser', 'llvm'), ('--input-img-mode', 'L'), ('--input-img-mode', 'XYZ'),
    ('--dataset', 'folder2/x'),
]


def _scripts():
    """(name, parser, domains, parse function that raises SystemExit on a bad value)."""
    train = build_parser(prog='train.py')
    tune = TUNE.build_tune_parser()
    validate = build_validate_parser(prog='validate.py')
    return [
        ('train.py', train, TRAIN_DOMAINS, lambda argv: parse_args(argv, parser=build_parser(prog='train.py'))),
        ('tune_batch.py', tune, {**TRAIN_DOMAINS, **TUNE_DOMAINS},
         lambda argv: parse_args(argv, parser=TUNE.build_tune_parser(), domains={**TRAIN_DOMAINS, **TUNE_DOMAINS})),
        ('validate.py', validate, VALIDATE_DOMAINS, lambda argv: parse_validate_args(['--data-dir', '.', *argv])),
    ]


def _bad_values(dest: str, action: argparse.Action) -> list:
    """The values of the walk this flag must refuse."""
    candidates = [0, -1] if action.type is int else [0, -1, -0.5, math.nan, math.inf, -math.inf, 1.5]
    if action.nargs is not None:
        candidates = [c for c in candidates if c != -math.inf]  # a list value '-inf' reads as an option
    if dest == 'seed':
        candidates.append(2 ** 40)
    bad = []
    for value in candidates:
        ok = ((value == 0 and dest in ZERO_OK) or (value == -1 and dest in NEGATIVE_OK)
              or (value == -0.5 and dest in NEGATIVE_OK) or (value == 1.5 and dest not in ABOVE_ONE_BAD))
        if not ok:
            bad.append(value)
    return bad


def _walk():
    for script, parser, _, _ in _scripts():
        for action in parser._actions:
            if action.type in (int, float):
                for value in _bad_values(action.dest, action):
                    yield pytest.param(script, action.dest, value, id=f'{script}-{action.dest}-{value}')


def _argv(action: argparse.Action, value) -> list:
    if action.nargs is None:  # FLAG=VALUE: argparse would take '-inf' for an option
        return [f'{action.option_strings[-1]}={value}']
    return [*COMPANIONS.get(action.dest, []), action.option_strings[-1], *[str(value)] * LIST_COUNT.get(action.dest, 1)]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1 and 'Traceback' not in err, err
    return err


def _script(name):
    return next(s for s in _scripts() if s[0] == name)


def numeric_dests(parser: argparse.ArgumentParser) -> List[str]:
    """Dests of `parser` that take numbers (int or float type): each must have a domain."""
    return [a.dest for a in parser._actions if a.type in (int, float)]


def test_every_numeric_flag_has_a_domain():
    for script, parser, domains, _ in _scripts():
        missing = [d for d in numeric_dests(parser) if d not in domains]
        assert not missing, f'{script}: numeric flags without a domain: {missing}'


@pytest.mark.parametrize('script, dest, value', list(_walk()))
def test_bad_number_on_command_line_and_in_yaml_is_one_line(script, dest, value, capsys, tmp_path):
    _, parser, _, parse = _script(script)
    action = next(a for a in parser._actions if a.dest == dest)
    flag = '/'.join(action.option_strings)
    with pytest.raises(SystemExit) as exc:
        parse(_argv(action, value))
    assert exc.value.code == 2
    line = _one_error_line(capsys)
    assert flag in line or action.option_strings[-1] in line, line

    if script == 'validate.py':
        return  # stock validate.py has no -c/--config
    config = tmp_path / 'c.yaml'
    count = LIST_COUNT.get(dest, 1)
    value = action.type(value)  # as the command line gives it: 0.0 for a float flag
    config.write_text(yaml.safe_dump({dest: [value] * count if action.nargs is not None else value}))
    companions = COMPANIONS.get(dest, [])
    with pytest.raises(SystemExit) as exc:
        parse(['-c', str(config), *companions])
    assert exc.value.code == 2
    assert _one_error_line(capsys) == line  # the same message as on the command line


@pytest.mark.parametrize('argv', WRONG_COUNTS, ids=[' '.join(a) for a in WRONG_COUNTS])
def test_wrong_count_or_order_of_values_is_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, parser=build_parser(prog='train.py'))
    assert exc.value.code == 2
    line = _one_error_line(capsys)
    named = [a for a in argv if a.startswith('--')][-1]
    assert named in line and 'allowed:' in line


@pytest.mark.parametrize('flag, value', BAD_NAMES, ids=[f'{f}={v}' for f, v in BAD_NAMES])
def test_unknown_name_is_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([f'{flag}={value}'], parser=TUNE.build_tune_parser(), domains={**TRAIN_DOMAINS, **TUNE_DOMAINS})
    assert exc.value.code == 2
    line = _one_error_line(capsys)
    assert flag in line and repr(value) in line


@pytest.mark.parametrize('argv', [
    ['--aug-splits', '0'], ['--aug-splits', '3'], ['--mean', '0.5'], ['--mean', '0.5', '0.4', '0.3'],
    ['--in-chans', '1', '--std', '0.2'], ['--seed', '0'], ['--opt', 'lookahead_adamw'], ['--opt', 'AdamW'],
    ['--sched', 'none'], ['--model', 'resnet50.a1_in1k'], ['--model', 'hf-hub:timm/resnet18.a1_in1k'],
    ['--lr-noise', '0.4', '0.9'], ['--opt-betas', '0.9', '0.99', '0.999'], ['--clip-grad', '1'],
    ['--scale', '1', '1'], ['--mem-budget', '0.5'], ['--mem-budget', '2GiB'], ['--smoothing', '0'],
    ['--dataset', 'torch/cifar10'], ['--dataset', 'imagefolder'], ['--input-img-mode', 'L', '--in-chans', '1'],
    ['--input-img-mode', 'RGB'],
], ids=lambda a: ' '.join(a))
def test_values_stock_gives_a_meaning_are_kept(argv):
    parse_args(argv, parser=TUNE.build_tune_parser(), domains={**TRAIN_DOMAINS, **TUNE_DOMAINS})


def test_zero_where_stock_means_off_is_accepted():
    for script, parser, _, parse in _scripts():
        for action in parser._actions:
            if action.type in (int, float) and action.dest in ZERO_OK:
                parse(_argv(action, 0))


# ---- files and folders ------------------------------------------------------------------------------------------

def test_folder_and_file_problems(tmp_path):
    a_file = tmp_path / 'file'
    a_file.write_text('x')
    assert 'is a file' in folder_problem('--output', str(a_file))
    assert f'below the file {a_file}' in folder_problem('--output', str(a_file / 'sub' / 'dir'))
    assert folder_problem('--output', str(tmp_path / 'new' / 'dir')) is None
    assert 'is a folder' in writable_file_problem('--results-file', str(tmp_path))
    assert 'below the file' in writable_file_problem('--results-file', str(a_file / 'r.csv'))
    assert writable_file_problem('--results-file', str(tmp_path / 'new' / 'r.csv')) is None


def test_missing_split_beside_other_splits_is_refused(image_folder, tmp_path):
    assert 'timm would read those split folders as classes' in split_problem('--val-split', str(image_folder), 'val2')
    assert split_problem('--val-split', str(image_folder), 'val') is None  # a synonym of validation/
    assert split_problem('--train-split', str(image_folder), 'train') is None
    classes = image_folder / 'train'  # a root of class folders: stock reads the root itself, kept
    assert split_problem('--train-split', str(classes), 'train') is None


@pytest.fixture(scope='module')
def other_model_checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp('ckpt') / 'other.pth.tar'
    atomic_torch_save({'epoch': 0, 'arch': 'test_vit', 'state_dict': {'w': torch.zeros(1)}, 'version': 2}, path)
    return str(path)


# ---- whole processes: status, one line, no traceback, no output folder --------------------------------------------

TRAIN_BASE = ['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu', '-j', '0',
              '--epochs', '1', '-b', '4']


def _assert_refused(result, status: int, words: str, output) -> None:
    assert result.returncode == status, result.stderr[-2000:]
    assert 'Traceback' not in result.stderr
    errors = [line for line in result.stderr.splitlines() if 'error' in line.lower()]
    assert len(errors) == 1 and words in errors[0], result.stderr[-2000:]
    assert not os.path.exists(output)


@pytest.mark.parametrize('case', ['img-size', 'lr-base-size', 'yaml', 'output-file', 'resume-other', 'val-split'])
def test_train_refuses_in_a_real_process(case, image_folder, tmp_path, other_model_checkpoint):
    out = tmp_path / 'out'
    (tmp_path / 'c.yaml').write_text('hflip: 2.0\n')
    (tmp_path / 'a_file').write_text('x')
    extra, status, words = {
        'img-size': (['--img-size', '0'], 2, 'argument --img-size: got 0; allowed: a positive integer'),
        'lr-base-size': (['--lr-base-size', '0'], 2, 'argument --lr-base-size: got 0'),
        'yaml': (['-c', tmp_path / 'c.yaml'], 2, 'argument --hflip: got 2.0; allowed: a number in [0, 1]'),
        'output-file': (['--output', tmp_path / 'a_file'], 1, 'is a file; pass a folder'),
        'resume-other': (['--resume', other_model_checkpoint], 1, "checkpoint of 'test_vit', not of --model"),
        'val-split': (['--val-split', 'holdout'], 1, "--val-split 'holdout': no such folder"),
    }[case]
    if case == 'output-file':
        out = tmp_path / 'a_file' / 'run'
    result = run_script('train.py', '--data-dir', image_folder, '--output', out, *TRAIN_BASE, *extra)
    _assert_refused(result, status, words, out)


def test_validate_refuses_in_a_real_process(image_folder, tmp_path):
    """(A checkpoint of another model: test_validate.py's bad-input cases.)"""
    result = run_script('validate.py', '--data-dir', image_folder, '--model', 'test_resnet', '--device', 'cpu',
                        '--crop-pct', '0')
    _assert_refused(result, 2, 'argument --crop-pct: got 0.0', tmp_path / 'none')
    result = run_script('validate.py', '--data-dir', image_folder, '--model', 'test_resnet', '--device', 'cpu',
                        '--results-file', tmp_path)
    _assert_refused(result, 2, 'is a folder; pass a file name', tmp_path / 'none')


def test_tune_refuses_before_probing(image_folder, tmp_path):
    """What train.py would refuse (a combination of our extensions, an unwritable config) stops tune_batch first."""
    config = tmp_path / 'tune' / 'c.yaml'
    common = ['--data-dir', image_folder, '--output', tmp_path / 'out', *TRAIN_BASE, '--tuned-config', config]
    result = run_script('tune_batch.py', *common, '--oom-grow-back', '5', env={'TIMM_EXT_CACHE_DIR': str(tmp_path)})
    _assert_refused(result, 2, '--oom-grow-back only acts after --oom-recover', tmp_path / 'tune')
    assert 'Probe' not in result.stdout and not list(tmp_path.glob('probe-*.json'))


@pytest.mark.parametrize('target, words', [('folder', 'is a folder; pass a file name'),
                                           ('below a file', 'is below the file')])
def test_tune_refuses_an_unwritable_tuned_config_before_anything(tmp_path, capsys, target, words):
    a_file = tmp_path / 'a_file'
    a_file.write_text('x')
    path = tmp_path if target == 'folder' else a_file / 'tuned.yaml'
    with pytest.raises(SystemExit) as exc:
        TUNE.main(['--model', 'test_resnet', '--device', 'cpu', '--tuned-config', str(path)])
    assert exc.value.code == 2
    line = _one_error_line(capsys)
    assert '--tuned-config' in line and words in line


def test_validate_refuses_a_missing_split_beside_others(image_folder, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_validate_args(['--data-dir', str(image_folder), '--split', 'holdout'])
    assert exc.value.code == 2
    assert "--split 'holdout': no such folder" in _one_error_line(capsys)
    assert parse_validate_args(['--data-dir', str(image_folder), '--split', 'val']).split == 'val'  # a synonym


@pytest.mark.parametrize('argv, world, words', [
    (['--mixup', '0.5', '-b', '3'], 1, 'must be even'),
    (['--cutmix', '1', '--train-img-sizes', '32', '48', '--train-batch-sizes', '4', '3'], 1, 'must be even'),
    (['--aug-repeats', '3'], 1, 'only in distributed training'),
    (['--oom-grow-back', '5'], 1, 'add --oom-recover'),
    (['--log-noise-scale'], 1, 'pass --grad-accum-steps 2 or more'),
])
def test_combinations_stock_asserts_on_are_refused(argv, world, words):
    args = parse_args(argv, parser=build_parser(prog='train.py'))[0]
    with pytest.raises(UsageError, match=words):
        check_arg_combinations(args, world_size=world)


@pytest.mark.parametrize('argv, world', [(['--mixup', '0.5', '-b', '4'], 1), (['--aug-repeats', '3'], 2),
                                         (['--log-noise-scale'], 2)])
def test_combinations_that_work_pass(argv, world):
    check_arg_combinations(parse_args(argv, parser=build_parser(prog='train.py'))[0], world_size=world)


def test_fewer_classes_than_the_split_has_is_refused(image_folder):
    args = parse_args(['--data-dir', str(image_folder), '--num-classes', '2'], parser=build_parser())[0]
    with pytest.raises(SetupError, match="'train' split has 3 classes but the model has 2 outputs"):
        build_datasets(args, 'RGB')
    args.num_classes = 3
    assert len(build_datasets(args, 'RGB')[0]) == 24


def test_run_folder_that_is_a_file_and_a_missing_validation_split(image_folder, tmp_path):
    (tmp_path / 'exp').write_text('x')
    args = parse_args(['--data-dir', str(image_folder), '--output', str(tmp_path), '--experiment', 'exp'])[0]
    assert train_input_problem(args) == f'--output/--experiment {tmp_path / "exp"} is a file; pass a folder'
    only_train = tmp_path / 'only_train'
    (only_train / 'train').mkdir(parents=True)
    args = parse_args(['--data-dir', str(only_train), '--output', str(tmp_path / 'out')])[0]
    assert "pass --val-split '' to train without one" in train_input_problem(args)
    args = parse_args(['--data-dir', str(only_train), '--output', str(tmp_path / 'out'), '--val-split', ''])[0]
    assert train_input_problem(args) is None


def test_yaml_null_for_a_flag_without_an_unset_meaning_is_refused(tmp_path, capsys):
    parser = build_parser(prog='train.py')
    refused = 0
    for action in parser._actions:
        if action.dest in ('help', 'config'):
            continue
        config = tmp_path / f'{action.dest}.yaml'
        config.write_text(f'{action.dest}: null\n')
        if action.default is None:  # unset is the default: kept
            assert getattr(parse_args(['-c', str(config)], parser=parser)[0], action.dest) is None
            continue
        with pytest.raises(SystemExit):
            parse_args(['-c', str(config)], parser=parser)
        assert 'got None (null); allowed:' in _one_error_line(capsys)
        refused += 1
    assert refused > 100
