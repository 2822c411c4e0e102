"""bench/gpu_check.sh without a GPU: --dry-run prints every command it would run and runs none, and each printed
command is one our parsers accept with the settings the device check is about; a real run refuses a CPU machine."""
import importlib.util
import os
import shlex
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from timm_ext.train.args import parse_args
from timm_ext.validate.args import parse_validate_args

SCRIPT = REPO_ROOT / 'bench' / 'gpu_check.sh'


def run_check(*argv: str) -> subprocess.CompletedProcess:
    """Run the script with this interpreter (a real run stops at its GPU check on this machine)."""
    return subprocess.run(['bash', str(SCRIPT), *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, 'PYTHON': sys.executable}, cwd=REPO_ROOT)


def load_script(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3] + '_script', REPO_ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_tune_batch():
    return load_script('tune_batch.py')


@pytest.fixture(scope='module')
def commands(tmp_path_factory):
    out = tmp_path_factory.mktemp('gpu_check') / 'out'
    result = run_check('--dry-run', '--out', str(out))
    assert result.returncode == 0, result.stderr
    assert not out.exists(), '--dry-run runs nothing, writes nothing'
    printed = [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith('+ ')]
    assert all(cmd[0] == sys.executable for cmd in printed)
    return printed, result.stdout


def script_argv(cmd):
    """(script name, its arguments, memory fraction or None) of a printed command."""
    fraction = None
    if cmd[1] == '-c':
        code, rest = cmd[2], cmd[3:]
        compile(code, '<gpu_check -c>', 'exec')  # the helper is valid Python
        if 'set_per_process_memory_fraction' in code:
            fraction, rest = float(rest[0]), rest[1:]
        else:
            return 'python -c', rest, None
    else:
        rest = cmd[1:]
    return os.path.basename(rest[0]), rest[1:], fraction


def test_dry_run_prints_every_part_of_the_check(commands):
    printed, stdout = commands
    names = [script_argv(cmd)[0] for cmd in printed]
    assert names == ['python -c', 'tune_batch.py', 'tune_batch.py', 'train.py', 'validate.py', 'train.py', 'train.py',
                     'cuda_defects.py', 'cuda_defects.py', 'cuda_defects.py', 'bench_estimate.py', 'snapshot_check.py']
    assert 'which then becomes: ' in stdout and 'train.py -c' in stdout


def test_printed_commands_parse_with_the_settings_of_each_part(commands):
    printed, _ = commands
    tune_batch = load_tune_batch()
    parsed, checks = [], []
    for cmd in printed[1:]:
        name, argv, fraction = script_argv(cmd)
        if name == 'cuda_defects.py':
            checks.append(load_script('bench/cuda_defects.py').build_parser().parse_args(argv).check)
            continue
        if name == 'bench_estimate.py':
            assert argv == ['--device', 'cuda']  # the estimate against max_memory_reserved
            continue
        if name == 'snapshot_check.py':  # the predicted snapshot of issue 31's resnet50 case against the real one
            snapshot = load_script('bench/snapshot_check.py').build_parser().parse_args(argv)
            assert (snapshot.model, snapshot.mem_budget) == ('resnet50', '24GiB') and snapshot.out.endswith('snapshot')
            continue
        if name == 'tune_batch.py':
            parser = tune_batch.build_tune_parser()
            args, _ = parse_args(argv, parser=parser)
            tune_batch._check_tune_args(parser, args)
        elif name == 'train.py':
            args, _ = parse_args(argv)
        else:
            # validate.py checks that its inputs exist: the data part and the -b 128 run make them first
            checkpoint = argv[argv.index('--checkpoint') + 1]
            os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
            os.makedirs(argv[argv.index('--data-dir') + 1], exist_ok=True)
            open(checkpoint, 'wb').close()
            args = parse_validate_args(argv)
        parsed.append((name, args, fraction))
    (_, tune_max, _), (_, tune_tput, _), (_, b128, _), (_, val, val_fraction), (_, oom, oom_fraction), \
        (_, noise, _) = parsed
    for args in (tune_max, tune_tput, b128, oom, noise):
        assert (args.model, args.img_size, args.amp) == ('resnet50', 224, True)
    assert (tune_max.select, tune_max.mem_budget, tune_max.dry_run) == ('max', '0.5', False)  # it trains, too
    assert (tune_tput.select, tune_tput.mem_budget, tune_tput.dry_run) == ('throughput', '0.5', True)
    assert b128.batch_size == 128
    assert (val.retry, val.batch_size, val.model) == (True, 4096, 'resnet50') and 0 < val_fraction < 1
    assert oom.oom_recover and 0 < oom_fraction < 1
    assert noise.log_noise_scale and noise.amp_dtype == 'float16' and noise.grad_accum_steps > 1
    assert checks == ['peak', 'stop-cost', 'sticky-error']  # the CUDA defects only a GPU shows


def test_a_real_run_needs_a_gpu_and_bad_arguments_are_one_line(tmp_path):
    result = run_check('--out', str(tmp_path / 'out'))
    assert result.returncode == 2 and result.stderr.strip().endswith('this check needs one GPU')
    bad = run_check('--fast')
    assert bad.returncode == 2 and bad.stderr.strip() == 'gpu_check.sh: error: unknown argument --fast (see --help)'
