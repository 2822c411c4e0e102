"""Tests of timm_ext.train.args: stock flag parity, -c/--config YAML handling, and our argument checks."""
import argparse
import logging
import subprocess
import sys

import pytest
import yaml
from timm.utils import ParseKwargs as TimmParseKwargs

from conftest import REPO_ROOT
from stock_spec import group_title, load_spec, spec_mismatches
from timm_ext.train.args import (
    EXTENSIONS_GROUP, ConfigError, args_to_yaml, build_config_parser, build_parser, config_keys, parse_args,
    read_config,
)

EXTENSION_DESTS = {'oom_recover', 'oom_grow_back', 'steady_cpu_heap', 'log_noise_scale', 'no_safetensors', 'batch_ramp',
                   'batch_ramp_factor', 'batch_ramp_max', 'batch_ramp_max_micro', 'batch_ramp_min_updates',
                   'dist_timeout'}


@pytest.fixture(scope='module')
def spec() -> list:
    return load_spec('train')


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    return build_parser(prog='train.py')


def _parse(argv, parser=None):
    args, _ = parse_args(argv, parser=parser if parser is not None else build_parser(prog='train.py'))
    return args


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f'expected a one-line error, got:\n{err}'
    return lines[0]


# --- flag parity with stock ---

def test_every_stock_flag_matches_spec(spec, parser):
    mismatches = spec_mismatches(spec, {'parser': parser, 'config_parser': build_config_parser()})
    assert not mismatches, '\n'.join(mismatches)
    assert len(spec) == 173


def test_only_extensions_added_beyond_stock(spec, parser):
    stock_dests = {e['dest'] for e in spec}
    ours = {a.dest for a in parser._actions} - {'help'}
    assert ours - stock_dests == EXTENSION_DESTS
    assert stock_dests - ours == set()  # config is on the pre-parser and listed on the main one for --help only
    stock_flags = {f for e in spec for f in e['flags']}
    for action in parser._actions:
        if action.dest in EXTENSION_DESTS:
            assert not set(action.option_strings) & stock_flags
            assert group_title(parser, action) == EXTENSIONS_GROUP


def test_parsed_defaults_equal_stock(spec):
    args = _parse([])
    parsed = vars(args)
    for entry in spec:
        if entry['dest'] == 'config':
            assert 'config' not in parsed  # stock's namespace (and args.yaml) has no config entry either
            continue
        value, want = parsed[entry['dest']], entry['default']
        assert value == want and type(value) is type(want), f"{entry['dest']}: {value!r} != stock {want!r}"
    assert {k: parsed[k] for k in EXTENSION_DESTS} == {
        'oom_recover': False, 'oom_grow_back': None, 'steady_cpu_heap': False, 'log_noise_scale': False,
        'no_safetensors': False, 'batch_ramp': False, 'batch_ramp_factor': None, 'batch_ramp_max': None,
        'batch_ramp_max_micro': None,
        'batch_ramp_min_updates': None, 'dist_timeout': None}


def test_model_kwargs_parse_like_stock():
    args = _parse(['--model-kwargs', 'drop_rate=0.2', 'act=gelu', 'dims=[1, 2]', '--opt-kwargs', 'foreach=False'])
    assert args.model_kwargs == {'drop_rate': 0.2, 'act': 'gelu', 'dims': [1, 2]}
    assert args.opt_kwargs == {'foreach': False}
    assert isinstance(build_parser()._option_string_actions['--model-kwargs'], TimmParseKwargs)


def test_torchcompile_const_and_exclusion(capsys):
    assert _parse(['--torchcompile']).torchcompile == 'inductor'
    assert _parse(['--torchcompile', 'eager']).torchcompile == 'eager'
    with pytest.raises(SystemExit) as exc:
        _parse(['--torchscript', '--torchcompile'])
    assert exc.value.code == 2
    assert 'not allowed with' in _error_line(capsys)


def test_help_lists_config_and_extensions(capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(['--help'])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ('-c FILE', '--oom-recover', '--oom-grow-back N', '--log-noise-scale', '--no-safetensors',
                 EXTENSIONS_GROUP, '--kd-token-distill-type'):
        assert flag in out


# --- config files ---

def test_yaml_round_trip(tmp_path):
    argv = ['/data/set', '--model', 'test_vit', '-b', '24', '--lr', '0.05', '--mean', '0.4', '0.5', '0.6',
            '--input-size', '3', '48', '48', '--model-kwargs', 'drop_rate=0.1', 'act_layer=gelu', '--amp',
            '--amp-dtype', 'bfloat16', '--torchcompile', '--wandb-tags', 'a', 'b', '--oom-recover',
            '--oom-grow-back', '50', '--no-safetensors', '--lr-base-scale', 'sqrt', '--dataset', '']
    args, text = parse_args(argv, parser=build_parser())
    config = tmp_path / 'args.yaml'
    config.write_text(text)
    again, text_again = parse_args(['-c', str(config)], parser=build_parser())
    assert vars(again) == vars(args)
    assert text_again == text
    assert yaml.safe_load(text) == vars(args)
    assert args.data == '/data/set' and args.input_size == [3, 48, 48] and args.torchcompile == 'inductor'


def test_stock_args_yaml_is_accepted(spec, tmp_path):
    # What stock train.py writes for `train.py /data --model test_resnet -b 64 --amp`: every dest but config.
    stock = {e['dest']: e['default'] for e in spec if e['dest'] != 'config'}
    stock.update(data='/data', model='test_resnet', batch_size=64, amp=True)
    config = tmp_path / 'args.yaml'
    config.write_text(yaml.safe_dump(stock, default_flow_style=False))
    args = _parse(['-c', str(config)])
    assert {k: v for k, v in vars(args).items() if k in stock} == stock
    assert not EXTENSION_DESTS & set(stock) and args.oom_recover is False


def test_command_line_beats_yaml(tmp_path):
    config = tmp_path / 'cfg.yaml'
    config.write_text('batch_size: 64\nlr: 0.5\nmodel: test_convnext\namp: true\nscale: [0.5, 1.0]\n'
                      'model_kwargs: {drop_rate: 0.3}\n')
    args = _parse(['-b', '32', '--config', str(config), '--model', 'test_vit', '--scale', '0.2', '0.9'])
    assert args.batch_size == 32 and args.model == 'test_vit' and args.scale == [0.2, 0.9]
    assert args.lr == 0.5 and args.amp is True and args.model_kwargs == {'drop_rate': 0.3}
    assert args.epochs == 300  # untouched stock default


def test_yaml_strings_are_converted_like_stock(tmp_path):
    # argparse converts string defaults with the flag's type, so stock reads `lr: '0.5'` as 0.5.
    config = tmp_path / 'cfg.yaml'
    config.write_text("lr: '0.5'\nepochs: '3'\n")
    args = _parse(['-c', str(config)])
    assert args.lr == 0.5 and args.epochs == 3


def test_unknown_yaml_keys_warned_once(tmp_path, caplog):
    config = tmp_path / 'cfg.yaml'
    config.write_text('batch_size: 16\nmystery: 1\nbatch-size: 8\n')
    with caplog.at_level(logging.WARNING):
        args = _parse(['-c', str(config)])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert 'mystery' in message and 'batch-size (did you mean batch_size?)' in message and '\n' not in message
    assert args.batch_size == 16 and not hasattr(args, 'mystery')


def test_caller_flags_are_config_keys_and_defaults_restored(tmp_path, caplog):
    parser = build_parser()
    group = parser.add_argument_group('Batch tuning')
    group.add_argument('--budget', default='0.9')
    config = tmp_path / 'cfg.yaml'
    config.write_text("budget: 12GiB\nbatch_size: 8\n")
    with caplog.at_level(logging.WARNING):
        args, text = parse_args(['-c', str(config)], parser=parser)
    assert not caplog.records
    assert args.budget == '12GiB' and 'budget: 12GiB' in text
    again, _ = parse_args([], parser=parser)  # the config's defaults must not stick to the parser
    assert again.budget == '0.9' and again.batch_size == 128


def test_empty_config_is_no_defaults(tmp_path):
    config = tmp_path / 'empty.yaml'
    config.write_text('')
    assert vars(_parse(['-c', str(config)])) == vars(_parse([]))


@pytest.mark.parametrize('text, problem', [
    ('batch_size: [64\n', 'not valid YAML at line 2'),
    ('- 1\n- 2\n', 'must hold a mapping'),
    ('just a string\n', 'must hold a mapping'),
    ('mean: 0.5\n', 'mean must be a list'),
    ('input_size: [3, 32]\n', 'input_size must be a list of 3 values'),
    ('amp: yes please\n', 'amp must be true or false'),
    ('model_kwargs: [a]\n', 'model_kwargs must be a mapping'),
    ('batch_size: 1.5\n', 'batch_size must be an integer'),
    ('experiment: 2024\n', 'experiment must be a string'),
    ('train_size_schedule: sometimes\n', "one of 'constant', 'progressive'"),
    ('epochs: ten\n', 'invalid int value'),
])
def test_bad_config_is_one_line_error(tmp_path, capsys, text, problem):
    config = tmp_path / 'cfg.yaml'
    config.write_text(text)
    with pytest.raises(SystemExit) as exc:
        _parse(['-c', str(config)])
    assert exc.value.code == 2
    line = _error_line(capsys)
    assert line.startswith('train.py: error: ') and problem in line


def test_missing_config_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(['-c', str(tmp_path / 'nope.yaml')])
    assert exc.value.code == 2
    assert 'nope.yaml' in _error_line(capsys)
    with pytest.raises(ConfigError, match='not found'):
        read_config(str(tmp_path / 'nope.yaml'))


def test_malformed_config_in_subprocess_has_no_traceback(tmp_path):
    config = tmp_path / 'bad.yaml'
    config.write_text('model: test_vit\n  batch_size: 4\n')
    code = 'from timm_ext.train.args import parse_args; parse_args()'
    proc = subprocess.run([sys.executable, '-c', code, '-c', str(config)], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert 'Traceback' not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and 'bad.yaml' in lines[0] and 'not valid YAML' in lines[0]


# --- our argument checks ---

@pytest.mark.parametrize('argv, flag, allowed', [
    (['-b', '0'], '-b/--batch-size', 'positive integer'),
    (['--batch-size', '-4'], '-b/--batch-size', 'positive integer'),
    (['--grad-accum-steps', '0'], '--grad-accum-steps', 'positive integer'),
    (['-vb', '0'], '-vb/--validation-batch-size', 'positive integer'),
    (['--lr-base-scale', 'cubic'], '--lr-base-scale', "one of '', 'linear', 'sqrt'"),
    (['--amp-dtype', 'fp16'], '--amp-dtype', "one of 'float16', 'bfloat16'"),
    (['--oom-grow-back', '0'], '--oom-grow-back', 'positive integer'),
    (['--model-kwargs', 'drop_rate'], '--model-kwargs', 'KEY=VALUE'),
    (['--model-kwargs', 'x={1, 2}'], '--model-kwargs', 'must be a number'),
])
def test_bad_values_rejected(capsys, argv, flag, allowed):
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    line = _error_line(capsys)
    assert f'argument {flag}:' in line and allowed in line


def test_bad_value_from_config_rejected(tmp_path, capsys):
    config = tmp_path / 'cfg.yaml'
    config.write_text('grad_accum_steps: 0\n')
    with pytest.raises(SystemExit) as exc:
        _parse(['-c', str(config)])
    assert exc.value.code == 2
    assert '--grad-accum-steps' in _error_line(capsys)
    assert _parse(['-c', str(config), '--grad-accum-steps', '2']).grad_accum_steps == 2


def test_good_values_accepted():
    args = _parse(['-b', '1', '--grad-accum-steps', '3', '--lr-base-scale', 'linear', '--amp-dtype', 'bfloat16',
                   '--oom-grow-back', '100', '--oom-recover', '--log-noise-scale'])
    assert (args.batch_size, args.grad_accum_steps, args.lr_base_scale, args.amp_dtype) == (1, 3, 'linear', 'bfloat16')
    assert args.oom_grow_back == 100 and args.oom_recover and args.log_noise_scale and not args.no_safetensors


def test_args_to_yaml_matches_stock_format():
    args = _parse(['--model', 'test_resnet'])
    text = args_to_yaml(args)
    assert text == yaml.safe_dump(vars(args), default_flow_style=False)
    assert 'model: test_resnet\n' in text


def test_config_keys_are_the_parsed_dests():
    parser = build_parser()
    parser.add_argument('--budget', default=None)
    keys = config_keys(parser)
    assert keys == set(vars(parse_args([], parser=parser)[0]))
    assert 'budget' in keys and 'config' not in keys and 'help' not in keys
