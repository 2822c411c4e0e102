"""tune_batch.py on a --train-img-sizes schedule: the per-size planning (pure), and a real dry-run under a real
RLIMIT_DATA cap whose train_batch_sizes train.py then runs under the same cap, at each size, without running out."""
import argparse
import importlib.util
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import yaml

from timm_ext.distributed import init_device
from timm_ext.errors import UsageError
from timm_ext.probe.grids import MultipleGrid
from timm_ext.probe.selection import Selection
from timm_ext.probe.table import FIT, Trial
from timm_ext.probe.train_probe import ProbeOutcome
from timm_ext.probe.trial import build_train_trial
from timm_ext.synthetic_data import make_image_folder
from timm_ext.train.args import parse_args
from timm_ext.tune import tuner
from timm_ext.tune.img_sizes import (
    EQUALISE, KEPT, RECIPE, SizeResult, average_batch, check_kept_fits, format_size_table, plan_schedule,
    probe_schedule, scaled_start, schedule_inputs, schedule_mode, shape_cache_note, size_trial_args,
)

from conftest import REPO_ROOT, run_script, tuned_flags

SIZES = ['--train-img-sizes', '32', '48', '64']


def load_tune_batch():
    spec = importlib.util.spec_from_file_location('tune_batch_script', REPO_ROOT / 'tune_batch.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def namespace(*argv: str) -> argparse.Namespace:
    """tune_batch.py's arguments (train.py's and the tuning group)."""
    args, _ = parse_args(['--model', 'test_resnet', *argv], parser=load_tune_batch().build_tune_parser())
    return args


# ---- planning (pure) ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize('argv, given, mode', [
    ([], set(), None),
    (SIZES, set(), EQUALISE),
    ([*SIZES, '--select', 'max'], set(), EQUALISE),
    ([*SIZES, '--train-batch-sizes', '8', '8', '8'], {'train_batch_sizes'}, KEPT),
    ([*SIZES, '-b', '16'], {'batch_size'}, RECIPE),
    ([*SIZES, '-b', '16', '--select', 'max'], {'batch_size'}, EQUALISE),  # max: the largest that fits, at each size
    ([*SIZES, '--target-global-batch', '64'], set(), RECIPE),
    ([*SIZES, '--grad-accum-steps', '2'], {'grad_accum_steps'}, EQUALISE),  # accumulation alone sets no batch
])
def test_schedule_mode(argv, given, mode):
    assert schedule_mode(namespace(*argv), given) == mode


@pytest.mark.parametrize('argv, given, fragment', [
    ([*SIZES, '--select', 'throughput'], set(), '--select throughput chooses one batch'),
    ([*SIZES, '--select', 'critical'], set(), '--select critical chooses one batch'),
    ([*SIZES, '--train-batch-sizes', '8', '8', '8', '--target-global-batch', '64'], {'train_batch_sizes'},
     'drop it'),
])
def test_schedules_it_cannot_honour_are_usage_errors(argv, given, fragment):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        schedule_mode(namespace(*argv), given)


def test_size_trial_args_is_a_copy_at_one_size():
    args = namespace(*SIZES, '--img-size', '64')
    sized = size_trial_args(args, (3, 48, 48))
    assert sized.input_size == [3, 48, 48] and sized.train_img_sizes is None and sized.img_size is None
    assert args.train_img_sizes == [32, 48, 64] and args.img_size == 64  # the caller's namespace is untouched
    assert schedule_inputs(args, 3) == [(3, 32, 32), (3, 48, 48), (3, 64, 64)]


def test_scaled_start_keeps_the_activation_memory_on_the_grid_and_within_the_limit():
    grid = MultipleGrid(8)
    assert scaled_start(16, 64 * 64, 32 * 32, grid, 1000) == 64  # a quarter of the pixels: four times the batch
    assert scaled_start(16, 64 * 64, 48 * 48, grid, 1000) == 24  # 28.4 snapped down to the grid
    assert scaled_start(16, 64 * 64, 32 * 32, grid, 40) == 40  # the limit, as the search itself treats it
    assert scaled_start(1, 64 * 64, 63 * 63, MultipleGrid(1), 10) == 1


def outcome(batch: int) -> ProbeOutcome:
    trial = Trial(batch, FIT, peak_bytes=batch << 20, ms_per_step=1.0, samples_per_s=1.0, accepted=True)
    return ProbeOutcome(Selection(batch, 'test', trial, [trial]), 64 << 20, 'test', 'cpu')


def fake_probe(calls: list, fixed: float = 20.0, per_pixel: float = 1e-3, budget: float = 100.0):
    """A probe whose memory is fixed + per_pixel x batch x pixels; records (size, start, limit)."""
    def probe_at(size, start, limit):
        calls.append((size, start, limit))
        return outcome(min(limit, int((budget - fixed) / (per_pixel * size[1] * size[2]))))
    return probe_at


def test_probe_schedule_starts_at_the_largest_size_and_scales_the_others_from_it():
    calls = []
    inputs = [(3, 32, 32), (3, 48, 48), (3, 64, 64), (3, 48, 48)]
    results = probe_schedule(inputs, fake_probe(calls), 2, MultipleGrid(1), 10_000, 1)
    assert [c[0] for c in calls] == [(3, 64, 64), (3, 48, 48), (3, 32, 32)], 'largest first, a repeat probed once'
    assert calls[0][1] == 2 and calls[1][1] == scaled_start(19, 64 * 64, 48 * 48, MultipleGrid(1), 10_000)
    assert [r.batch for r in results] == [78, 34, 19, 34]  # in the schedule's order
    assert results[0].label == '32x32'


def test_probe_schedule_keeps_batches_even_under_mixup_and_within_max_batch():
    results = probe_schedule([(3, 32, 32), (3, 64, 64)], fake_probe([]), 2, MultipleGrid(1), 50, 2)
    assert [r.batch for r in results] == [50, 18]


def test_given_batches_are_each_tried_once_and_refused_when_they_do_not_fit():
    calls = []
    results = probe_schedule([(3, 32, 32), (3, 64, 64)], fake_probe(calls), 2, MultipleGrid(1), 50, 1, [60, 10])
    assert sorted((c[1], c[2]) for c in calls) == [(10, 10), (60, 60)]
    check_kept_fits(results, [60, 10])
    with pytest.raises(UsageError, match=r'100 at 64x64 \(fits 19\)'):
        check_kept_fits(probe_schedule([(3, 64, 64)], fake_probe([]), 2, MultipleGrid(1), 50, 1, [100]), [100])


def test_average_batch_is_timms_weighted_mean():
    assert average_batch(namespace(*SIZES), [60, 24, 16]) == pytest.approx(100 / 3)
    weighted = namespace(*SIZES, '--train-size-probs', '1', '1', '2')
    assert average_batch(weighted, [60, 24, 16]) == pytest.approx((60 + 24 + 2 * 16) / 4)
    progressive = namespace(*SIZES, '--train-size-schedule', 'progressive', '--epochs', '10')
    assert 16 < average_batch(progressive, [60, 24, 16]) < 60


def test_plan_schedule_scales_lr_to_the_average_global_batch():
    args = namespace(*SIZES, '--grad-accum-steps', '2', '--lr-base', '0.1', '--lr-base-size', '256')
    plan, average = plan_schedule(args, [60, 24, 16], 4, 16, 'test')
    assert average == pytest.approx(100 / 3)
    assert plan.lr == pytest.approx(0.1 * (100 / 3) * 4 * 2 / 256)  # sgd: the linear rule
    assert plan.lr_to_write is None and plan.accum_steps == 2 and plan.micro_batch == 16
    assert '266.667 samples per update' in plan.reason
    given_lr, _ = plan_schedule(namespace(*SIZES, '--lr', '0.5'), [60, 24, 16], 1, 16, 'test')
    assert given_lr.lr == given_lr.lr_to_write == 0.5


def test_size_table_has_a_row_per_size():
    results = [SizeResult((3, 32, 32), 60, outcome(60)), SizeResult((3, 64, 64), 16, outcome(16))]
    table = format_size_table(results, [60, 16]).splitlines()
    assert len(table) == 3 and 'given' in table[0] and '32x32' in table[1] and '16.00 MiB' in table[2]


def test_the_cpu_shape_cache_note_only_where_the_cache_is_on(monkeypatch):
    import torch
    monkeypatch.delenv('ONEDNN_PRIMITIVE_CACHE_CAPACITY', raising=False)
    assert 'ONEDNN_PRIMITIVE_CACHE_CAPACITY=0' in shape_cache_note(torch.device('cpu'))[0]
    assert shape_cache_note(torch.device('cuda')) == []
    monkeypatch.setenv('ONEDNN_PRIMITIVE_CACHE_CAPACITY', '0')
    assert shape_cache_note(torch.device('cpu')) == []


def test_the_largest_sizes_setup_is_released_before_the_smaller_sizes_are_probed(tmp_path):
    args, _ = init_device(namespace('--device', 'cpu', '--num-classes', '3', '--img-size', '64', *SIZES))
    setup = build_train_trial(args, torch.device('cpu'))
    largest = weakref.ref(setup)
    seen = []

    class Recording(tuner.ProbeRequest):
        def run(self, select, max_batch, start=None):
            seen.append((self.setup.input_size, largest() is not None))
            trial = Trial(4, FIT, peak_bytes=1, ms_per_step=1.0, samples_per_s=4000.0)
            return ProbeOutcome(Selection(4, 'fits', trial, [trial]), 1 << 30, 'stub', 'cpu')

    request = Recording(args, setup, torch.device('cpu'), None, 1 << 30, MultipleGrid(2), 1, str(tmp_path / 't.json'))
    del setup
    tuned = tuner.tune_schedule(request, EQUALISE, 64, set())
    assert seen == [((3, 64, 64), True), ((3, 48, 48), False), ((3, 32, 32), False)]
    assert tuned.size_batches == [4, 4, 4]


# ---- a real schedule under a real cap ----------------------------------------------------------------------------

linux_only = pytest.mark.skipif(sys.platform != 'linux', reason='CPU memory caps need Linux')

# On CPU oneDNN keeps each input shape's kernels and their buffers cached, so in one process a schedule's sizes add up
# (test_resnet at 32/48/64 px: 87 MiB of data segment alternating sizes, 50-55 MiB at any one size alone); with the
# cache off, memory follows the batch as a GPU allocator's does, and a batch that fits at its size fits in the mix.
CPU_ENV = {'ONEDNN_PRIMITIVE_CACHE_CAPACITY': '0'}
# test_resnet under 40 MiB (steady heap, cache off): about 28 / 50 / 100 fit at 64 / 48 / 32 px, below the 120-image
# train split (120 at 32 px peaks at ~35 MiB, over the 30 MiB the headroom leaves). The headroom
# covers what train.py's steps hold beyond the probe's trial on CPU (its data pipeline and a longer run's heap: up
# to ~15% here, with or without a schedule)
RUN = ['--model', 'test_resnet', '--device', 'cpu', '--num-classes', '3', '--img-size', '64', '-j', '0',
       '--mem-headroom', '0.25']
BUDGET_MIB = 40


@pytest.fixture(scope='module')
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp('data'), size=64, per_class=40)


def tune(tmp_path: Path, folder: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_script('tune_batch.py', '--data-dir', folder, *RUN, '--mem-budget', f'{BUDGET_MIB}MiB', *extra,
                      env={'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache'), **CPU_ENV}, cwd=tmp_path)


@pytest.fixture(scope='module')
def scheduled(tmp_path_factory, folder):
    tmp_path = tmp_path_factory.mktemp('sched')
    config = tmp_path / 'tuned.yaml'
    result = tune(tmp_path, folder, *SIZES, '--epochs', '1', '--tuned-config', config, '--dry-run')
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path, config, result.stdout


def capped_train(tmp_path: Path, config: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    """train.py from the config under the probe's cap (set when the epoch starts: `tests/train/oom_cap_train.py`)."""
    return run_script('tests/train/oom_cap_train.py', '-c', config, *tuned_flags(config), '--output',
                      tmp_path / 'runs', '--experiment', name, '--epochs', '3', *extra,
                      env={'OOM_CAP_MB': str(BUDGET_MIB), **CPU_ENV}, cwd=tmp_path)


@linux_only
def test_each_size_gets_its_own_batch_under_the_cap(scheduled):
    tmp_path, config, out = scheduled
    values = yaml.safe_load(config.read_text())
    batches = values['train_batch_sizes']
    assert values['train_img_sizes'] == [32, 48, 64] and len(batches) == 3
    assert batches[0] > batches[1] > batches[2], 'smaller images fit bigger batches'
    assert batches[0] < 120, 'the cap, not the 120-image split, must bind at 32 px'
    assert values['batch_size'] == batches[2] and 'lr' not in values  # train.py computes the LR from the average
    for size in ('32x32', '48x48', '64x64'):
        table = (tmp_path / f'tuned.trials.{size}.json').read_text()
        assert '"oom"' in table or '"accepted": false' in table, f'the cap must bind at {size}'
        assert re.search(rf'^\s+{size}\s+{batches[[32, 48, 64].index(int(size[:2]))]}\s+\d+\s', out, re.M)


@linux_only
def test_a_second_identical_schedule_is_served_from_the_cache_size_by_size(scheduled, folder):
    tmp_path, config, _ = scheduled
    again = tmp_path / 'again.yaml'
    result = tune(tmp_path, folder, *SIZES, '--epochs', '1', '--tuned-config', again, '--dry-run')
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('cached result') == 3, 'one cache entry per size: the key holds the input size'
    assert yaml.safe_load(again.read_text())['train_batch_sizes'] == yaml.safe_load(config.read_text())[
        'train_batch_sizes']


@linux_only
def test_lr_follows_timms_rule_for_the_average_batch(scheduled):
    tmp_path, config, out = scheduled
    batches = yaml.safe_load(config.read_text())['train_batch_sizes']
    expected = 0.1 * (sum(batches) / 3) / 256  # sgd: lr_base 0.1 x global / 256, the sizes equally likely
    header = config.read_text()
    written = float(re.search(r'^# LR: Learning rate ([0-9.e-]+) = lr_base 0.1 scaled by linear rule', header,
                              re.M).group(1))
    assert written == pytest.approx(expected, rel=1e-5)
    trained = capped_train(tmp_path, config, 'lr')
    assert trained.returncode == 0, trained.stderr[-3000:]
    logged = float(re.search(r'Learning rate ([0-9.e-]+) =', trained.stderr + trained.stdout).group(1))
    assert logged == pytest.approx(expected, rel=1e-5)


@linux_only
@pytest.mark.parametrize('index', [0, 1, 2])
def test_train_runs_each_size_at_its_batch_under_the_same_cap(scheduled, index):
    tmp_path, config, _ = scheduled
    only = ['1' if i == index else '0' for i in range(3)]  # every batch of the epoch at this one size
    trained = capped_train(tmp_path, config, f'size{index}', '--train-size-probs', *only)
    log = trained.stderr + trained.stdout
    assert trained.returncode == 0, log[-3000:]
    assert 'Train: 0 [' in log and 'out of memory' not in log.lower() and "can't allocate" not in log


@linux_only
def test_given_train_batch_sizes_are_kept_with_one_trial_each(tmp_path, folder):
    config = tmp_path / 't.yaml'
    result = tune(tmp_path, folder, *SIZES, '--train-batch-sizes', '16', '8', '4', '--tuned-config', config,
                  '--dry-run')
    assert result.returncode == 0, result.stderr[-3000:]
    assert yaml.safe_load(config.read_text())['train_batch_sizes'] == [16, 8, 4]
    assert len([line for line in result.stdout.splitlines() if line.startswith('  batch ')]) == 3
    assert 'as given, each checked to fit' in result.stdout


@linux_only
def test_a_recipes_batch_trains_at_every_size_as_in_stock(tmp_path, folder):
    config = tmp_path / 't.yaml'
    result = tune(tmp_path, folder, *SIZES, '-b', '8', '--tuned-config', config, '--dry-run')
    assert result.returncode == 0, result.stderr[-3000:]
    values = yaml.safe_load(config.read_text())
    assert values['batch_size'] == 8 and 'train_batch_sizes' not in values
    assert 'trains at every size, as in stock timm; probed at the largest size' in result.stdout
    assert len([line for line in result.stdout.splitlines() if line.startswith('  batch ')]) == 1


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if 'error' in line]
    assert len(lines) == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
    return lines[0]


@linux_only
def test_given_train_batch_sizes_that_do_not_fit_are_refused(tmp_path, folder):
    result = tune(tmp_path, folder, *SIZES, '--train-batch-sizes', '16', '8', '100', '--dry-run', '--tuned-config',
                  tmp_path / 't.yaml')
    assert result.returncode == 2
    assert re.search(r'100 at 64x64 \(fits \d+\)', one_line_error(result))


@pytest.mark.parametrize('argv, fragment', [
    (['--train-batch-sizes', '8', '8'], '3 values (one per --train-img-sizes value)'),
    (['--select', 'throughput'], 'chooses one batch for every size'),
    (['--mixup', '0.2', '--train-batch-sizes', '8', '7', '8'], 'must be even'),
])
def test_bad_schedules_are_one_line_errors(capsys, argv, fragment):
    try:
        code = load_tune_batch().main(['--model', 'test_resnet', '--device', 'cpu', *SIZES, *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err
