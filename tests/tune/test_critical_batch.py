"""The short noise-scale measurement on a real tiny run, and tune_batch.py --select critical judging bigger batches."""
import copy
import importlib
import re

import pytest
import torch
import yaml

from conftest import REPO_ROOT, run_script
from timm_ext.tune.critical_batch import ESTIMATE_ACCUM, ESTIMATE_WINDOWS, estimate_samples, measure_noise_scale
from timm_ext.distributed import init_device
from timm_ext.synthetic_data import make_image_folder
from timm_ext.train.args import parse_args

RUN = ['--model', 'test_vit', '--num-classes', '3', '--img-size', '32', '--device', 'cpu', '-j', '0']


def args_of(*argv):
    args, _ = parse_args([*RUN, *argv])
    return args


def test_measurement_on_a_real_run_gives_a_positive_estimate_with_a_spread(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=32)
    args = args_of('--data-dir', str(data), '--seed', '3')
    args, device = init_device(args)
    torch.manual_seed(0)
    before = copy.deepcopy(vars(args))
    got = measure_noise_scale(args, device, micro_batch=4)  # 64 micro-batches of 4: cycles over 96 images
    assert vars(args) == before, 'the estimate trains its own micro-batch and accumulation, not the caller\'s'
    assert got.windows == ESTIMATE_WINDOWS and got.samples == estimate_samples(4, 1) == 4 * ESTIMATE_ACCUM * 16
    assert got.found and got.low <= got.b_noise <= got.high, got.describe()
    assert f'B_noise ≈ {got.b_noise:.0f} samples' in got.describe() and 'bootstrap over 16 windows' in got.describe()


def test_tune_batch_select_critical_reports_the_estimate_and_the_candidates(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=32)
    config = tmp_path / 'tuned.yaml'
    result = run_script('tune_batch.py', '--data-dir', data, *RUN, '-b', '8', '--max-batch', '32', '--select',
                        'critical', '--dry-run', '--tuned-config', config,
                        env={'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache')}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r'Noise scale: (B_noise ≈ \d+ samples|no positive B_noise)', out), out[-3000:]
    assert 'Global batches considered' in out and re.search(r'^\s+8\s+8 x 1\s', out, re.M), out[-3000:]
    chosen = re.search(r'global batch (\d+) = (\d+) x 1 x (\d+),', out)
    global_batch, micro, accum = map(int, chosen.groups())
    values = yaml.safe_load(config.read_text())
    assert (values['batch_size'], values['grad_accum_steps']) == (micro, accum)
    if global_batch != 8:  # a bigger batch may only come with a longer run
        assert values['epochs'] > 300 and 'Schedule lengthened' in out
    assert 'Tuning cost' in out
    assert (tmp_path / 'tuned.png').read_bytes()[:4] == b'\x89PNG', 'several trials and candidates: a plot'
    assert not (tmp_path / 'output' / 'train').exists(), '--dry-run must not train'


def test_select_critical_with_a_target_global_batch_is_an_argument_error(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    tune_batch = importlib.import_module('tune_batch')
    with pytest.raises(SystemExit) as exit_info:
        tune_batch.main([*RUN, '--select', 'critical', '--target-global-batch', '64'])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert 'Traceback' not in err and 'drop --target-global-batch' in err.strip().splitlines()[-1]
