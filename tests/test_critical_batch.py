"""--select critical: the warm-up's B_simple on a real tiny run, and the plan built from it (global batch, LR, why)."""
import importlib
import math
import re

import pytest
import torch
import yaml

from conftest import REPO_ROOT, run_script
from timm_ext.critical_batch import WARMUP_ACCUM, CriticalEstimate, measure_noise_scale, plan_critical
from timm_ext.distributed import init_device
from timm_ext.noise_monitor import NoiseScaleSummary
from timm_ext.synthetic_data import make_image_folder
from timm_ext.train_args import parse_args

RUN = ['--model', 'test_vit', '--num-classes', '3', '--img-size', '32', '--device', 'cpu', '-j', '0']


def estimate(b_simple: float, micro: int = 48) -> CriticalEstimate:
    summary = NoiseScaleSummary(grad_sq=2.0, trace_sigma=2.0 * b_simple, b_simple=b_simple, pairs=128)
    return CriticalEstimate(summary, updates=32, micro_batch=micro, accum_steps=WARMUP_ACCUM, world_size=1, lr=1e-5,
                            seconds=1.0)


def args_of(*argv):
    args, _ = parse_args([*RUN, *argv])
    return args


def test_critical_above_memory_maximum_accumulates_with_lr_by_rule():
    plan, lines = plan_critical(args_of(), estimate(180.0), max_micro_batch=48, world_size=1)
    assert plan.global_batch == 180 and plan.exact and plan.micro_batch * plan.accum_steps == 180
    assert plan.micro_batch <= 48
    assert plan.lr == pytest.approx(0.1 * 180 / 256)  # sgd: linear rule from lr_base 0.1 at 256
    report = ' '.join(lines)
    assert 'B_simple ≈ 180' in report and 'Proposed global batch 180' in report
    assert '3.8x the largest batch one step fits (48 per rank x 1)' in report and 'wastes no samples' in report


def test_critical_below_memory_maximum_takes_smaller_steps():
    plan, lines = plan_critical(args_of('--opt', 'adamw'), estimate(20.4), max_micro_batch=48, world_size=2)
    assert (plan.micro_batch, plan.world_size, plan.accum_steps, plan.global_batch) == (10, 2, 1, 20)
    assert plan.lr == pytest.approx(0.1 * math.sqrt(20 / 256))  # adaptive optimizer: sqrt rule
    assert '0.21x the largest batch one step fits (48 per rank x 2)' in ' '.join(lines)


def test_inexact_critical_batch_says_so_and_given_lr_moves_from_its_recipe():
    # B_simple 97 (prime) cannot be split into micro-batches of 16..32: the nearest global batch is built instead;
    # --lr 0.4 was set for -b 64 x 2 = 128 and moves to the planned global batch by the linear rule
    plan, lines = plan_critical(args_of('--lr', '0.4', '-b', '64', '--grad-accum-steps', '2'), estimate(97.0),
                                max_micro_batch=32, world_size=1)
    assert not plan.exact and abs(plan.global_batch - 97) <= 3
    assert plan.lr == pytest.approx(0.4 * plan.global_batch / 128) and plan.lr_to_write == plan.lr
    assert 'nearest global batch the planner builds to 97' in ' '.join(lines)
    assert 'set for global batch 128' in plan.lr_reason


def test_no_positive_estimate_keeps_the_memory_maximum():
    plan, lines = plan_critical(args_of(), estimate(math.nan), max_micro_batch=48, world_size=1)
    assert (plan.micro_batch, plan.accum_steps) == (48, 1)
    assert 'no positive B_simple' in lines[0] and 'kept the memory maximum' in lines[1]


def test_warm_up_on_a_real_run_gives_a_finite_positive_estimate(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=32)
    args = args_of('--data-dir', str(data), '--seed', '3')
    device = init_device(args)
    torch.manual_seed(0)
    got = measure_noise_scale(args, device, micro_batch=4, updates=12)  # 48 micro-batches: twice over 96 images
    assert got.summary.pairs == 12 * WARMUP_ACCUM
    assert got.found and math.isfinite(got.summary.b_simple) and got.summary.b_simple > 0, got.describe()
    assert got.lr == args.warmup_lr  # the run warms up for 5 epochs (stock default): its first updates use 1e-5
    plan, lines = plan_critical(args, got, max_micro_batch=4, world_size=1)
    assert plan.global_batch >= 1 and f'B_simple ≈ {got.summary.b_simple:.0f}' in lines[0]


# ---- tune_batch.py --select critical --------------------------------------------------------------------------------

def test_tune_batch_select_critical_plans_the_estimated_global_batch(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=32)
    config = tmp_path / 'tuned.yaml'
    result = run_script('tune_batch.py', '--data-dir', data, *RUN, '--max-batch', '4', '--select', 'critical',
                        '--critical-updates', '12', '--dry-run', '--tuned-config', config,
                        env={'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache')}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    found = re.search(r'Critical batch: B_simple ≈ (\d+) samples .* 12 warm-up updates of 4 x 4', out)
    assert found, out[-3000:]
    proposed = re.search(r'Proposed global batch (\d+) = (\d+) x 1 x (\d+)', out)
    global_batch, micro, accum = map(int, proposed.groups())
    assert micro <= 4 and global_batch == micro * accum and abs(global_batch - int(found.group(1))) <= 2
    assert 'the largest batch one step fits (4 per rank x 1)' in out
    values = yaml.safe_load(config.read_text())
    assert (values['batch_size'], values['grad_accum_steps']) == (micro, accum)
    assert not (tmp_path / 'output' / 'train').exists(), '--dry-run must not train'


def test_select_critical_with_a_target_global_batch_is_an_argument_error(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    tune_batch = importlib.import_module('tune_batch')
    with pytest.raises(SystemExit) as exit_info:
        tune_batch.main([*RUN, '--select', 'critical', '--target-global-batch', '64'])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert 'Traceback' not in err and 'drop --target-global-batch' in err.strip().splitlines()[-1]
