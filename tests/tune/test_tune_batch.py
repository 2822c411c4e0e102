"""tune_batch.py: accumulation/LR planning, the YAML read back by train.py, dry-run report, cache, failures, and a
short real tune -> train -> validate run. Probes run under real RLIMIT_DATA caps in subprocesses."""
import argparse
import json
import re
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from timm_ext.train.args import EXTENSIONS_GROUP, build_parser, parse_args
from timm_ext.tune.plan import plan_run
from timm_ext.tune.tuned_config import (
    config_values, extension_flags, planned_command, tuned_config, tuned_config_text, write_tuned_config,
)

from conftest import REPO_ROOT, run_script, tuned_flags
from timm_ext.synthetic_data import make_image_folder

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason='CPU memory caps need Linux')

# test_resnet at 32 px: a 44 MiB budget binds at a micro-batch of about 15 on CPU, below the 24-image train split
# (24 peaks at ~43 MiB, over the 41.8 MiB the 5% headroom leaves; the steady heap makes that the same in every run),
# and leaves the eval probe room for 2x the micro-batch
RUN = ['--model', 'test_resnet', '--device', 'cpu', '--num-classes', '3', '--img-size', '32', '-j', '0']
BUDGET = ['--mem-budget', '44MiB']


def train_namespace(*argv: str) -> argparse.Namespace:
    args, _ = parse_args(list(argv))
    return args


# ---- planning (pure) ---------------------------------------------------------------------------------------------

def test_plan_exact_global_batch_keeps_lr():
    args = train_namespace('--lr', '0.4', '--opt', 'sgd')
    plan = plan_run(args, max_micro_batch=20, world_size=2, target_global=96)
    assert (plan.micro_batch, plan.accum_steps, plan.global_batch, plan.exact) == (16, 3, 96, True)
    assert plan.lr == 0.4 and plan.lr_to_write == 0.4


def test_plan_exact_global_batch_lr_from_base():
    args = train_namespace('--opt', 'sgd', '--lr-base', '0.1', '--lr-base-size', '256')
    plan = plan_run(args, max_micro_batch=64, world_size=1, target_global=512)
    assert (plan.micro_batch, plan.accum_steps, plan.exact) == (64, 8, True)
    assert plan.lr == pytest.approx(0.2) and plan.lr_to_write is None  # train.py computes the same itself
    assert plan.lr_rule == 'linear'


def test_plan_inexact_global_batch_rescales_given_lr():
    args = train_namespace('--lr', '0.001', '--opt', 'adamw')  # sqrt rule for ada* optimizers
    plan = plan_run(args, max_micro_batch=20, world_size=1, target_global=97)  # prime: no split with b >= 10
    assert not plan.exact and plan.global_batch != 97
    assert plan.lr == pytest.approx(0.001 * (plan.global_batch / 97) ** 0.5)
    assert plan.lr_to_write == plan.lr and plan.lr_rule == 'sqrt'
    assert 'rescaled by the sqrt rule' in plan.lr_reason


def test_plan_inexact_global_batch_lr_from_base_follows_real_global():
    args = train_namespace('--opt', 'sgd')
    plan = plan_run(args, max_micro_batch=20, world_size=1, target_global=97)
    assert plan.lr == pytest.approx(0.1 * plan.global_batch / 256)
    assert 'instead of 97' in plan.lr_reason


def test_plan_keeps_two_batch_sizes_per_update_for_the_noise_scale_on_one_process():
    args = train_namespace('--log-noise-scale')
    plan = plan_run(args, max_micro_batch=20, world_size=1, target_global=16)
    assert (plan.micro_batch, plan.accum_steps) == (8, 2) and '--log-noise-scale' in plan.reason
    two_ranks = plan_run(args, max_micro_batch=20, world_size=2, target_global=16)  # rank vs ranks: no accumulation
    assert (two_ranks.micro_batch, two_ranks.accum_steps) == (8, 1)
    assert plan_run(train_namespace(), max_micro_batch=20, world_size=1, target_global=16).accum_steps == 1


def test_plan_without_target_keeps_accumulation():
    args = train_namespace('--grad-accum-steps', '3')
    plan = plan_run(args, max_micro_batch=40, world_size=2)
    assert (plan.micro_batch, plan.accum_steps, plan.global_batch, plan.exact) == (40, 3, 240, None)


def test_config_holds_only_stock_keys_and_reads_back_identically(tmp_path):
    parser = build_parser()
    argv = ['--data-dir', '/data', '--model', 'test_vit', '--opt', 'adamw', '--model-ema', '--smoothing', '0.0',
            '--input-size', '3', '48', '48', '--model-kwargs', 'depth=2', '--log-noise-scale']
    args = train_namespace(*argv)
    plan = plan_run(args, max_micro_batch=24, world_size=1, target_global=97)
    ext = [a.dest for g in parser._action_groups if g.title == EXTENSIONS_GROUP for a in g._group_actions]
    stock = [a.dest for a in parser._actions if a.dest not in ext and a.dest not in ('help', 'config')]
    values = config_values(args, parser, stock, plan)
    assert not set(values) & set(ext), 'extension keys must stay out of the YAML'
    path = tmp_path / 'tuned.yaml'
    path.write_text(tuned_config_text(values, ['report line', 'log_noise_scale: true']))
    assert yaml.safe_load(path.read_text()) == values
    flags = extension_flags(args, parser, ext)
    assert flags == ['--log-noise-scale']
    read_back, _ = parse_args(['-c', str(path), *flags])
    expected = vars(args) | {'batch_size': plan.micro_batch, 'grad_accum_steps': plan.accum_steps,
                             'lr': plan.lr_to_write}
    assert vars(read_back) == expected



def test_the_tuned_config_is_written_and_its_command_printed_in_one_place(tmp_path, capsys):
    args = train_namespace('--data-dir', '/data', '--model', 'test_vit', '--log-noise-scale')
    plan = plan_run(args, max_micro_batch=24, world_size=1)
    path = str(tmp_path / 'made' / 'tuned.yaml')
    config = tuned_config(args, build_parser(), plan, path, '/scripts', 1, values={'epochs': 7},
                          flags=['--batch-ramp-max-micro', '8'])
    assert config.flags == ['--log-noise-scale', '--batch-ramp-max-micro', '8']
    assert config.command == [sys.executable, '/scripts/train.py', '-c', path, *config.flags]
    write_tuned_config(config, ['report line'], ['a note'], ['Summary:'])
    assert capsys.readouterr().out.splitlines() == [
        'report line', 'a note', '', 'Summary:', f'Config: {path}', f'Train command: {config.command_line}']
    text = Path(path).read_text()
    assert yaml.safe_load(text) == config.values and config.values['epochs'] == 7
    assert 'log_noise_scale' not in config.values, 'extension keys stay on the command line'
    assert text.startswith('# report line\n') and planned_command(text) == config.command

# ---- the script ---------------------------------------------------------------------------------------------------

def tune(tmp_path: Path, image_folder: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache')}
    return run_script('tune_batch.py', '--data-dir', image_folder, *RUN, *extra, env=env, cwd=tmp_path,
                      timeout=timeout)


def trial_lines(stdout: str):
    return [line for line in stdout.splitlines() if line.startswith('  batch ')]


@pytest.fixture(scope='module')
def dry_run(tmp_path_factory, image_folder):
    tmp_path = tmp_path_factory.mktemp('tune')
    config = tmp_path / 'tuned.yaml'
    # --eval-probe on: whether the eval probe pays is predicted from measured times, that is from this machine's speed
    # (the rule is tested apart: `assert_eval_probe_follows_its_rule`)
    first = tune(tmp_path, image_folder, *DRY_RUN, '--tuned-config', config, '--dry-run')
    return tmp_path, config, first


# the micro-batch held under the budget by --max-batch, so the eval probe has room above it on every machine (at the
# budget's own limit, whether one more eval sample fits depends on oneDNN's kernels for the CPU at hand)
DRY_RUN = ['--mem-budget', '56MiB', '--max-batch', '8', '--target-global-batch', '96', '--eval-probe', 'on',
           '--opt', 'adamw']


def repeated_facts(stdout: str) -> list:
    """Lines of a report that say again what another line said: the same line twice, a split stated twice in a line,
    a fraction of memory not in percent."""
    lines = [line for line in stdout.splitlines() if line.strip() and not line.startswith('  batch ')]
    twice = [line for line in set(lines) if lines.count(line) > 1]
    splits = [line for line in lines if len(re.findall(r'global batch \d+ = \d+ x', line)) > 1]
    fractions = [line for line in lines if re.search(r'\(\d*\.?\d+ of available memory\)', line)]
    headers = [line for line in lines if line.startswith('tune_batch.py: ') or line.startswith('Budget ')]
    return twice + splits + fractions + headers


def test_dry_run_report(dry_run):
    tmp_path, config, result = dry_run
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    lines = trial_lines(out)
    assert lines and lines[-1].split()[:3] == ['batch', '8:', 'fit']  # up to --max-batch
    for needle in ('micro-batch', 'Accumulation', 'global batch 96', 'LR ', 'sqrt', 'Train command:'):
        assert needle in out
    # the table once: one line per trial run (the live lines), no second, sorted copy at the end
    ran = json.loads((tmp_path / 'tuned.trials.json').read_text())['trials']
    assert len(lines) == len(ran) and 'Trials:' not in out
    # the closing block: the layout, the LR and rule, the eval batch, the YAML and the command, last
    summary = out[out.rindex('Summary:'):].splitlines()
    values = yaml.safe_load(config.read_text())
    micro, accum = values['batch_size'], values['grad_accum_steps']
    assert summary[1] == f'  Global batch 96 = micro-batch {micro} x accumulation {accum} x 1 rank'
    assert summary[2].startswith('  LR ') and summary[2].endswith('(sqrt rule)')
    assert summary[3] == f'  Eval batch {values["validation_batch_size"]} (validation_batch_size)'
    spent = r'  Spent before training: probe \d+\.\d s, estimate (\d+\.\d s|none), judging none\.'
    assert re.fullmatch(spent, summary[4]), summary[4]
    assert summary[-2] == f'Config: {config}' and summary[-1].startswith('Train command: ') and len(summary) == 7
    assert config.exists() and (tmp_path / 'tuned.trials.json').exists()
    assert not (tmp_path / 'output' / 'train').exists(), '--dry-run must not train'


def test_dry_run_report_says_each_fact_once(dry_run):
    tmp_path, config, result = dry_run
    assert repeated_facts(result.stdout) == [], result.stdout
    assert 'ClassificationTask' not in result.stderr, 'the probe and the estimate build the task quietly'
    header = next(line for line in result.stdout.splitlines() if line.startswith('Probe: model test_resnet'))
    assert 'budget 56.00 MiB on cpu' in header and '(56.00 MiB)' not in header  # a size given is said once
    eval_header = next(line for line in result.stdout.splitlines() if line.startswith('Probe: evaluation forward'))
    assert 'test_resnet' not in eval_header and 'budget' not in eval_header, 'the eval probe names only its pass'
    text = config.read_text()  # the YAML's header is whole: what was probed and the budget, once each
    assert text.count('# tune_batch.py: model test_resnet') == 1 and text.count('# Budget 56.00 MiB on cpu') == 1


def test_the_checker_of_repeated_facts_finds_each_kind():
    report = '\n'.join([
        'Accumulation 8, 1 rank(s): global batch 128 = 16 x 1 x 8. global batch 128 = 16 x 1 ranks x 8 accum exactly',
        'Probe: budget 22.59 GiB (1 of available memory) on cpu', 'LR 0.1', 'LR 0.1', 'tune_batch.py: model x'])
    assert sorted(repeated_facts(report)) == sorted([report.splitlines()[i] for i in (0, 1, 2, 4)])

def test_dry_run_config_is_read_back_by_train_parser(dry_run, image_folder):
    tmp_path, config, result = dry_run
    values = yaml.safe_load(config.read_text())
    assert values['batch_size'] * values['grad_accum_steps'] == 96
    assert 'lr' not in values  # from --lr-base: train.py computes the same LR itself
    read_back, _ = parse_args(['-c', str(config)])
    expected, _ = parse_args(['--data-dir', str(image_folder), *RUN, '--opt', 'adamw',
                              '--validation-batch-size', str(values['validation_batch_size']),
                              '--batch-size', str(values['batch_size']),
                              '--grad-accum-steps', str(values['grad_accum_steps'])])
    assert vars(read_back) == vars(expected)


def test_second_identical_request_is_a_cache_hit(dry_run, image_folder):
    tmp_path, config, first = dry_run
    again = tmp_path / 'again.yaml'
    second = tune(tmp_path, image_folder, *DRY_RUN, '--tuned-config', again, '--dry-run')
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count('cached result') == 2
    assert trial_lines(second.stdout) == trial_lines(first.stdout)  # the cached table, printed once as the probe's was
    strip = lambda text: [ln for ln in text.splitlines() if not ln.startswith('# Train with')]
    assert strip(again.read_text()) == strip(config.read_text())
    # a different request (another optimizer) is not served from the cache
    other = tune(tmp_path, image_folder, *BUDGET, '--tuned-config', tmp_path / 'other.yaml', '--dry-run',
                 '--max-batch', '4')
    assert other.returncode == 0, other.stderr[-3000:]
    assert 'cached result' not in other.stdout and trial_lines(other.stdout)


def test_select_throughput_retimes_explains_its_choice_and_never_makes_the_global_batch_bigger(tmp_path, image_folder):
    # a wide tolerance makes every fitting size a candidate for re-timing, however the timings fall
    config = tmp_path / 't.yaml'
    out = report_of(tune(tmp_path, image_folder, '-b', '8', '--select', 'throughput', '--throughput-tol', '0.5',
                         '--tuned-config', config, '--dry-run'))
    lines = trial_lines(out)
    assert any('[re-timing 2]' in line for line in lines), 'the close sizes are timed again in interleaved rounds'
    report = next(line for line in out.splitlines() if 'Select throughput: micro-batch' in line)
    assert 'smallest batch within 50%' in report or 'the best throughput measured' in report
    micro, accum = planned(config)
    assert micro * accum == 8 and all(int(line.split()[1].rstrip(':')) <= 8 for line in lines)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if 'error' in line or 'interrupted' in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert 'Traceback' not in result.stderr
    return lines[0]


def test_nothing_fits_names_budget_model_input_and_suggestions(tmp_path, image_folder):
    # test_vit has no BatchNorm, so batch 1 is a real candidate (and runs out of memory too)
    result = tune(tmp_path, image_folder, '--model', 'test_vit', '--model-kwargs', 'img_size=32',
                  '--mem-budget', '2MiB', '--dry-run', '--no-cache')
    assert result.returncode == 1
    line = one_line_error(result)
    for needle in ('nothing fits', '2.00 MiB', 'test_vit', '3x32x32', 'no saver alone fits a batch of 1'):
        assert needle in line
    savers = result.stderr.strip().splitlines()[-4:]  # one line a saver under the error, each priced
    assert [s.split(':')[0].strip() for s in savers] == ['--amp --amp-dtype float16', '--amp --amp-dtype bfloat16',
                                                         '--grad-checkpointing', '--channels-last']
    assert all('nothing fits, ' in s and '% compute' in s for s in savers)
    assert not (tmp_path / 'cache').exists() or not any((tmp_path / 'cache').iterdir())


def test_budget_larger_than_device_is_an_error(tmp_path, image_folder):
    result = tune(tmp_path, image_folder, '--mem-budget', '100TiB', '--dry-run')
    assert result.returncode == 2
    assert 'larger than' in one_line_error(result)


@pytest.mark.parametrize('argv, fragment', [
    (['--mem-budget', '12'], 'a size with a unit'),
    (['--mem-budget', '0.5x'], 'a size with a unit'),
    (['--mem-headroom', '1.5'], 'in [0, 1)'),
    (['--batch-multiple', '0'], 'positive integer'),
])
def test_bad_tune_flags_are_one_line_argument_errors(capsys, argv, fragment):
    spec = importlib.util.spec_from_file_location('tune_batch_script', REPO_ROOT / 'tune_batch.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as info:
        module.main(['--model', 'test_resnet', *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err


def test_non_oom_failure_stops_without_retries(tmp_path, image_folder):
    # BatchNorm cannot train on one sample at 1x1 spatial size: a ValueError, not an OOM
    result = tune(tmp_path, image_folder, *BUDGET, '--probe-start', '1', '--max-batch', '1', '--dry-run')
    assert result.returncode == 1
    line = one_line_error(result)
    assert 'ValueError' in line and 'Expected more than 1 value per channel' in line
    lines = trial_lines(result.stdout)
    assert len(lines) == 1 and ': error ValueError' in lines[0], 'the failed size is not retried, nor a smaller one'


def _ctrl_c_as_in_a_terminal() -> None:
    # a suite started as a background job (`... &` in a script) inherits SIGINT ignored, and Python then keeps it
    # ignored: the child must get the disposition a terminal gives it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_mid_probe_lifts_cap_and_leaves_cache_untouched(tmp_path, image_folder):
    cache = tmp_path / 'cache'
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'TIMM_EXT_CACHE_DIR': str(cache)}
    proc = subprocess.Popen(
        # trials at 160 px take seconds, so the interrupt lands inside the probe (the aimed probe needs few trials, and
        # at 32 px a loaded machine could read the line after the run had ended)
        [sys.executable, str(REPO_ROOT / 'tune_batch.py'), '--data-dir', str(image_folder), *RUN, '--img-size', '160',
         '--mem-budget', '600MiB', '--select', 'max', '--dry-run'], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        # interrupt as the probe starts
        for line in proc.stdout:
            if line.startswith('Probe: '):
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert 'interrupted' in err and 'Traceback' not in err
    assert not cache.exists() or not any(cache.iterdir())
    assert not (tmp_path / 'output' / 'tune' / 'test_resnet-160.yaml').exists()


def test_tune_then_train_then_validate(tmp_path, image_folder):
    out_dir = tmp_path / 'runs'
    result = tune(tmp_path, image_folder, *BUDGET, '--target-global-batch', '32', '--epochs', '1',
                  '--output', out_dir, '--experiment', 'tuned', '--tuned-config', tmp_path / 'tuned.yaml',
                  timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    values = yaml.safe_load((tmp_path / 'tuned.yaml').read_text())
    run_dir = out_dir / 'tuned'
    args_yaml = yaml.safe_load((run_dir / 'args.yaml').read_text())
    assert args_yaml['batch_size'] == values['batch_size']
    assert args_yaml['grad_accum_steps'] == values['grad_accum_steps']
    assert values['batch_size'] * values['grad_accum_steps'] == 32
    assert (run_dir / 'model_best.pth.tar').exists()
    validated = run_script('validate.py', '--data-dir', image_folder, '--model', 'test_resnet', '--num-classes', '3',
                           '--checkpoint', run_dir / 'model_best.pth.tar', '--device', 'cpu', '--img-size', '32',
                           '-j', '0', '--results-file', tmp_path / 'results.csv', cwd=tmp_path)
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert 'top1' in (tmp_path / 'results.csv').read_text()


# ---- the recipe's global batch is the user's intent (--select auto) -----------------------------------------------

def report_of(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope='module')
def dry_runs(tmp_path_factory, image_folder):
    """`tune_batch.py ... --dry-run` with these flags, run once for every test of the module that asks for them."""
    done = {}

    def run(*flags: str) -> tuple:
        if flags not in done:
            tmp_path = tmp_path_factory.mktemp('dry')
            config = tmp_path / 't.yaml'
            done[flags] = report_of(tune(tmp_path, image_folder, *flags, '--tuned-config', config, '--dry-run')), config
        return done[flags]
    return run


def planned(config: Path) -> tuple:
    values = yaml.safe_load(config.read_text())
    return values['batch_size'], values.get('grad_accum_steps', 1)


@pytest.mark.parametrize('batch_flags, global_batch', [
    (['-b', '16'], 16),
    (['-b', '4', '--grad-accum-steps', '4'], 16),  # fits as one batch of 16: one trial, no accumulation needed
    (['--target-global-batch', '12'], 12),
])
def test_a_global_batch_set_on_the_command_line_is_kept_with_one_trial(dry_runs, batch_flags, global_batch):
    out, config = dry_runs(*batch_flags, '--mem-budget', '96MiB')
    assert len(trial_lines(out)) == 1 and 'one trial, nothing to search' in out
    assert planned(config) == (global_batch, 1) and 'Kept it exactly' in out
    # one trial decides: no estimate is traced to aim it (it would aim nothing)
    assert 'Estimate:' not in out and 'estimate none, judging none.' in out
    assert_eval_probe_follows_its_rule(out, yaml.safe_load(config.read_text()))


def assert_eval_probe_follows_its_rule(out: str, values: dict) -> None:
    """--eval-probe auto: probed exactly when the predicted cost of its trials is at most 5% of the evaluations.

    Both numbers are predicted from measured times, so which way it goes depends on the machine's speed; the rule
    that decides does not."""
    skipped = re.search(r'Eval batch: not probed: \d+ evaluations are predicted at ~([\d.]+) s and 3 forward-only '
                        r'trials would cost ~([\d.]+) s, more than 5% of that', out)
    if skipped:
        eval_s, cost_s = map(float, skipped.groups())
        assert cost_s > 0.05 * eval_s - 0.1  # the figures are printed to 0.1 s
        assert '  eval batch' not in out and 'validation_batch_size' not in values
    else:
        assert '  eval batch' in out, out


@pytest.mark.parametrize('flags, target', [
    (['--target-global-batch', '7', '--mixup', '0.2'], 7),  # odd under mixup: the nearest even plan
    (['--target-global-batch', '37', *BUDGET], 37),  # prime, more than fits: no exact split
    (['--target-global-batch', '12'], 12),  # splits exactly
])
def test_the_report_never_states_a_decision_and_then_its_opposite(dry_runs, flags, target):
    out, config = dry_runs(*flags)  # the last is the run of the test above: one run, both checks
    micro, accum = planned(config)
    exact = micro * accum == target
    lines = out.splitlines()
    said_exact = [i for i, line in enumerate(lines) if 'Kept it exactly' in line or 'exactly (' in line]
    said_other = [i for i, line in enumerate(lines) if f'instead of {target}' in line or 'no split' in line]
    assert bool(said_exact) is exact and bool(said_other) is not exact, out
    assert f'global batch {micro * accum} = {micro} x 1 x {accum}' in out
    if not exact:  # the first word on the global batch already names the one the run takes
        first = next(line for line in lines if line.startswith("The recipe's global batch"))
        assert f'the nearest, global batch {micro * accum}' in first and 'Kept the nearest' in out, out


def test_a_global_batch_set_in_the_yaml_is_kept_and_split_when_it_does_not_fit(tmp_path, image_folder):
    recipe = tmp_path / 'recipe.yaml'
    recipe.write_text('batch_size: 24\nopt: adamw\n')
    config = tmp_path / 't.yaml'
    out = report_of(tune(tmp_path, image_folder, '-c', recipe, *BUDGET, '--tuned-config', config, '--dry-run'))
    micro, accum = planned(config)
    assert micro * accum == 24 and accum > 1, 'the 44 MiB budget fits about 15, not 24: the recipe is accumulated'
    assert 'a batch of 24 per rank does not fit' in out and 'Kept it exactly' in out


def test_without_a_set_batch_a_short_run_keeps_stock_default_and_warns(tmp_path):
    data = make_image_folder(tmp_path / 'data', per_class=48)  # 144 training images: -b 128 fits as one batch
    config = tmp_path / 't.yaml'
    out = report_of(tune(tmp_path, data, '--epochs', '2', '--mem-budget', '1GiB', '--tuned-config', config,
                         '--dry-run'))
    assert "stock train.py's default -b 128" in out and 'too short for tuning to pay off' in out
    assert planned(config) == (128, 1) and len(trial_lines(out)) == 1
    assert 'Plot:' not in out and not (tmp_path / 't.png').exists(), 'one trial is one point: no plot'
    warning = next(line for line in out.splitlines() if line.startswith('Warning:'))
    assert 'only 2 optimizer updates' in warning and '-b/--batch-size' in warning


@pytest.mark.parametrize('flags, reason', [
    ((), 'judging a bigger global batch cannot pay'),  # stock's default -b 128, 2 epochs of 144 images
    (('-b', '32', '--grad-accum-steps', '2'), '--select auto keeps the global batch'),
])
def test_without_a_budget_on_the_cpu_the_recipe_trains_untried_with_oom_recovery(tmp_path, flags, reason):
    data = make_image_folder(tmp_path / 'data', per_class=48)
    config = tmp_path / 't.yaml'
    out = report_of(tune(tmp_path, data, '--epochs', '2', *flags, '--tuned-config', config, '--dry-run'))
    assert not trial_lines(out) and 'No trial: no --mem-budget on the CPU' in out and reason in out
    global_batch = 128 if not flags else 64
    assert planned(config) == (global_batch, 1)  # the recipe's global batch as one micro-batch
    assert tuned_flags(config) == ['--oom-recover']  # train.py's first update is the trial


def test_a_recipe_built_by_accumulation_is_not_made_bigger(tmp_path, image_folder):
    config = tmp_path / 't.yaml'
    out = report_of(tune(tmp_path, image_folder, '--epochs', '2', '--tuned-config', config, '--dry-run'))
    micro, accum = planned(config)
    assert micro * accum == 128  # stock's default on 24 images: built as 16 x 8, as far as the split allows
    assert 'the training split holds only 24 samples per rank' in out and 'adds no samples/s' in out


def test_select_max_warns_when_the_batch_leaves_few_updates(tmp_path, image_folder):
    out = report_of(tune(tmp_path, image_folder, '--select', 'max', '--epochs', '8', '--tuned-config',
                         tmp_path / 't.yaml', '--dry-run'))
    assert 'Warning: global batch 24 leaves the run only 8 optimizer updates' in out
    assert 'the validation split (24 per rank) is one batch of the micro-batch 24 already; not probed' in out


# ---- the eval batch ----------------------------------------------------------------------------------------------

def test_eval_probe_off_never_probes_it(tmp_path, image_folder):
    from timm_ext.tune.tuner import plan_eval_batch
    # decided before any prediction: the request and the outcome are never read
    args = argparse.Namespace(eval_probe='off')
    tuned = argparse.Namespace(plan=argparse.Namespace(micro_batch=4))
    request = argparse.Namespace(args=args, world_size=1)
    assert plan_eval_batch(request, tuned, 24, 100, None) == (
        None, None, ['Eval batch: not probed (--eval-probe off); train.py evaluates at the micro-batch 4.'])


def test_a_long_run_probes_the_eval_batch_and_writes_validation_batch_size(dry_run):
    tmp_path, config, result = dry_run
    out = report_of(result)
    eval_trials = [line for line in out.splitlines() if line.startswith('  eval batch ')]
    # forward-only trials from 2x the micro-batch (about 15 fits the 44 MiB budget in training), capped by the split
    assert 1 <= len(eval_trials) <= 4, eval_trials
    values = yaml.safe_load(config.read_text())
    assert values['validation_batch_size'] > values['batch_size']
    assert f'Eval batch {values["validation_batch_size"]} = ' in out and 'Eval trials:' not in out
    assert len(eval_trials) == len(json.loads((tmp_path / 'tuned.eval.trials.json').read_text())['trials'])
    assert (tmp_path / 'tuned.eval.trials.json').exists()


def test_train_evaluation_gives_the_same_results_at_the_tuned_eval_batch(tmp_path, image_folder):
    def start(name, *extra):  # both runs at once: each is mostly interpreter start-up
        return subprocess.Popen(
            [sys.executable, str(REPO_ROOT / 'train.py'), '--data-dir', str(image_folder), *RUN, '-b', '4', '--epochs',
             '2', '--seed', '3', '--output', str(tmp_path), '--experiment', name, '--log-interval', '1', *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
            env={**os.environ, 'OMP_NUM_THREADS': '1'})

    def eval_rows(name, proc):
        stderr = proc.communicate(timeout=300)[1]
        assert proc.returncode == 0, stderr[-3000:]
        batches = {line.split('[', 1)[1].split(']')[0] for line in stderr.splitlines() if line.startswith('Test: [')}
        rows = [line.split(',') for line in (tmp_path / name / 'summary.csv').read_text().splitlines()]
        header = rows[0]
        return batches, [{k: float(v) for k, v in zip(header, row) if k.startswith('eval_')} for row in rows[1:]]

    runs = {'stock': start('stock'), 'tuned': start('tuned', '--validation-batch-size', '24')}
    (stock_batches, stock), (tuned_batches, tuned) = (eval_rows(name, proc) for name, proc in runs.items())
    assert '   5/5' in stock_batches and tuned_batches == {'   0/0'}  # 24 images: 6 batches of 4, or one of 24
    for a, b in zip(stock, tuned):
        assert (a['eval_top1'], a['eval_top5']) == (b['eval_top1'], b['eval_top5'])
        assert a['eval_loss'] == pytest.approx(b['eval_loss'], abs=1e-6)


def test_real_digits_tune_then_train_is_well_above_chance(tmp_path):
    from timm_ext.packaged_data import write_image_folder
    data = write_image_folder('digits', tmp_path / 'digits')
    out_dir = tmp_path / 'runs'
    result = run_script('tune_batch.py', '--data-dir', data, '--model', 'test_resnet', '--num-classes', '10',
                        '--img-size', '32', '--device', 'cpu', '-j', '0', '-b', '32', '--epochs', '4',
                        '--opt', 'sgd', '--sched', 'cosine', '--lr-base', '0.4', '--warmup-epochs', '1',
                        '--output', out_dir, '--experiment', 'digits', '--tuned-config', tmp_path / 't.yaml',
                        env={'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache')}, cwd=tmp_path, timeout=600)
    out = report_of(result)
    # no budget on the CPU and a set batch: no trial, train.py's first update is the trial (with --oom-recover)
    assert 'Kept it exactly' in out and 'No trial' in out and not trial_lines(out)
    assert yaml.safe_load((out_dir / 'digits' / 'args.yaml').read_text())['oom_recover'] is True
    rows = (out_dir / 'digits' / 'summary.csv').read_text().splitlines()[1:]
    best = max(float(row.split(',')[3]) for row in rows)
    assert best > 50, f'10 classes: chance is 10%, got best top-1 {best}'


def test_mixup_runs_get_an_even_micro_batch_from_the_planner():
    args = train_namespace('--mixup', '0.2', '-b', '8')
    plan = plan_run(args, max_micro_batch=15, world_size=1)
    assert plan.micro_batch == 14 and 'even' in plan.reason
    assert plan_run(args, max_micro_batch=15, world_size=1, target_global=18).micro_batch % 2 == 0


def test_batch_ramp_gets_the_largest_micro_batch_that_fits(tmp_path, image_folder):
    ramp = ['--batch-ramp', '-b', '8', '--dry-run']  # the ramp alone: its noise scale is turned on, and said
    result = tune(tmp_path, image_folder, *BUDGET, *ramp, '--tuned-config', tmp_path / 'ramp.yaml')
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('--log-noise-scale turned on') == 1
    command = next(line for line in result.stdout.splitlines() if line.startswith('Train command:')).split()
    assert '--log-noise-scale' in command and '--batch-ramp' in command
    limit = int(command[command.index('--batch-ramp-max-micro') + 1])
    fits = [int(line.split()[1].rstrip(':')) for line in trial_lines(result.stdout)
            if ' fit ' in line and 'over headroom' not in line]
    assert limit > 4 and limit == max(fits), 'the largest probed micro-batch that fits is what the ramp may grow to'
    assert f'passed as --batch-ramp-max-micro {limit}' in result.stdout
    values = yaml.safe_load((tmp_path / 'ramp.yaml').read_text())  # one process: B_simple needs 2+ accumulation steps
    assert values['batch_size'] * values['grad_accum_steps'] == 8 and values['grad_accum_steps'] >= 2
    assert 'needs two batch sizes in every update' in result.stdout
    assert 'batch_ramp' not in yaml.safe_load((tmp_path / 'ramp.yaml').read_text()), 'extension keys stay off the YAML'

    given = tune(tmp_path, image_folder, *BUDGET, *ramp, '--batch-ramp-max-micro', '6', '--tuned-config',
                 tmp_path / 'given.yaml')
    assert given.returncode == 0, given.stderr[-3000:]
    command = next(line for line in given.stdout.splitlines() if line.startswith('Train command:')).split()
    assert command.count('--batch-ramp-max-micro') == 1 and command[command.index('--batch-ramp-max-micro') + 1] == '6'


def test_batch_ramp_under_select_max_reuses_its_probe(tmp_path, image_folder):
    result = tune(tmp_path, image_folder, *BUDGET, '--batch-ramp', '--log-noise-scale', '--grad-accum-steps', '2',
                  '--select', 'max', '--dry-run', '--tuned-config', tmp_path / 'max.yaml')
    assert result.returncode == 0, result.stderr[-3000:]
    reported = int(re.search(r'largest batch that fits within the headroom \((\d+) trials\)', result.stdout).group(1))
    assert len(trial_lines(result.stdout)) == reported, 'the largest micro-batch is --select max\'s own: no probe more'
    # near a 44 MiB cap oneDNN's per-shape buffers can let the split's size itself fit: then it is the largest too
    assert ('nothing above the micro-batch' in result.stdout or 'already the split per rank' in result.stdout)
    assert '--batch-ramp-max-micro' not in result.stdout
