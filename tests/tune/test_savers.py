"""The memory savers' prices (timm_ext.tune.savers): each row's arithmetic, the table, --apply-saver's config as stock
train.py reads it, and the nothing-fits error."""
import re

import pytest
import yaml

from conftest import run_script
from stock_spec import load_spec, read_like_stock
from timm_ext.memory_model.predict import CudaReplay
from timm_ext.memory_model.devices import device_model, onednn_runs
from timm_ext.memory_model.estimate import MemoryEstimate, estimate_memory
from timm_ext.train.args import parse_args
from timm_ext.tune.plan import plan_run
from timm_ext.tune.savers import (
    PricedSaver, Saver, apply_savers, candidate_savers, cheapest, nothing_fits_advice, price_savers, savers_table,
)

VIT = ['--model', 'test_vit', '--num-classes', '10', '--opt', 'adamw']
RECIPE = 64


def run_args(*argv):
    args, _ = parse_args([*VIT, *argv])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    return args


def test_each_row_is_its_own_trace_planned_for_the_recipe():
    args = run_args('--device', 'cpu', '-b', str(RECIPE))
    base = estimate_memory(args, 'cpu')
    limit = base.peak(24) + 1  # the run as it is fits 24: it must accumulate for the recipe's 64
    seen = []

    def plan_for(estimate):
        seen.append(estimate)
        micro = estimate.largest_batch(limit)
        return micro, plan_run(args, micro, 1, RECIPE) if micro else None

    rows = {row.saver.name: row for row in price_savers(args, 'cpu', False, base, plan_for)}
    assert list(rows) == ['amp-float16', 'amp-bfloat16', 'grad-checkpointing', 'channels-last', 'opt-sgd',
                          'smaller-img-size']  # CPU: no host EMA, no CUDA allocator; adamw holds two states
    for row, estimate in zip(rows.values(), seen):
        assert row.micro_batch == estimate.largest_batch(limit) and not row.problem
        assert row.plan.micro_batch * row.plan.accum_steps == RECIPE and row.plan.micro_batch <= row.micro_batch
        assert row.extra_compute == pytest.approx(estimate.flops_per_sample / base.flops_per_sample - 1)
    assert base.largest_batch(limit) == 24
    checkpointing = rows['grad-checkpointing']
    assert checkpointing.micro_batch > 24  # activations dropped in the forward
    assert 0.05 < checkpointing.extra_compute <= 0.34  # the recomputed forward: at most a third of a step's FLOPs
    assert rows['channels-last'].extra_compute == 0 and rows['channels-last'].saver.math == 'same'
    assert rows['opt-sgd'].micro_batch >= 24 and rows['opt-sgd'].saver.math.startswith('changes')
    smaller = rows['smaller-img-size']  # 160 -> 96 px: 36 patches instead of 100, FLOPs in proportion or less
    assert smaller.saver.values['img_size'] == 96 and smaller.saver.values['model_kwargs'] == {'img_size': 96}
    assert -0.75 < smaller.extra_compute < -0.55 and smaller.micro_batch > 2 * 24
    assert smaller.one_step and smaller.plan.micro_batch == RECIPE


def _estimate(device_type, optimizer_bytes, replay=None):
    lines = {'optimizer': (optimizer_bytes, 0.0)}
    return MemoryEstimate(lines, {}, device_model(device_type), '', 0.0, grad_bytes=1000, replay=replay)


def test_savers_offered_are_those_the_run_lacks_and_its_device_has(monkeypatch):
    monkeypatch.delenv('PYTORCH_ALLOC_CONF', raising=False)
    monkeypatch.delenv('PYTORCH_CUDA_ALLOC_CONF', raising=False)
    cuda = run_args('--device', 'cuda', '--model-ema')
    names = [s.name for s in candidate_savers(cuda, 'cuda', _estimate('cuda', 2000, CudaReplay({})))]
    assert names == ['amp-float16', 'amp-bfloat16', 'grad-checkpointing', 'channels-last', 'model-ema-force-cpu',
                     'opt-sgd', 'expandable-segments', 'smaller-img-size']
    monkeypatch.setenv('PYTORCH_CUDA_ALLOC_CONF', 'expandable_segments:True')
    assert 'expandable-segments' not in [s.name for s in candidate_savers(cuda, 'cuda', _estimate('cuda', 2000,
                                                                                                  CudaReplay({})))]
    cpu = run_args('--device', 'cpu', '--model-ema', '--amp', '--amp-dtype', 'bfloat16', '--grad-checkpointing')
    names = [s.name for s in candidate_savers(cpu, 'cpu', _estimate('cpu', 1000))]  # one state: SGD saves nothing
    assert names == ['amp-float16', 'channels-last', 'smaller-img-size']


def _row(name, math, micro, extra, args):
    return PricedSaver(Saver(name, f'--{name}', math=math), micro, plan_run(args, micro, 1, RECIPE) if micro else None,
                       extra)


def test_table_names_the_one_step_row_at_least_compute_keeping_the_training():
    args = run_args('--device', 'cpu', '-b', str(RECIPE))
    rows = [_row('slow', 'same', 64, 0.30, args), _row('cheap', 'same', 70, 0.10, args),
            _row('accumulates', 'same', 40, 0.0, args), _row('smaller', 'changes: 96 px', 200, -0.6, args)]
    lines = savers_table(rows, (24, plan_run(args, 24, 1, RECIPE)), RECIPE)
    table = '\n'.join(lines)
    assert re.search(r'\(as is\)\s+-\s+24\s+16 x 4\s+\+0%', table)  # 24 fits: 64 = 16 x 4 exactly
    assert re.search(r'cheap\s+--cheap\s+70\s+64 x 1\s+\+10%\s+same', table)
    assert re.search(r'accumulates\s+--accumulates\s+40\s+32 x 2\s+\+0%', table)
    assert 'least extra compute: cheap (+10%' in lines[-1]  # one step, the training kept; 'smaller' changes it
    assert cheapest(rows, one_step=True).saver.name == 'cheap'
    only_changing = [rows[2], rows[3]]
    assert cheapest(only_changing, one_step=True).saver.name == 'smaller'
    assert 'No saver alone' in savers_table([rows[2]], (24, None), RECIPE)[-1]


def test_nothing_fits_names_the_cheapest_saver_that_fits_one_line_a_saver():
    args = run_args('--device', 'cpu', '-b', str(RECIPE))
    rows = [_row('amp', 'rounding', 0, 0.0, args), _row('ckpt', 'same', 3, 0.21, args),
            _row('smaller', 'changes', 9, -0.6, args)]
    summary, details = nothing_fits_advice(rows)
    assert 'cheapest saver that fits is --ckpt (micro-batch 3; --apply-saver ckpt)' in summary
    assert details == ('--amp: nothing fits, +0% compute, training math: rounding',
                       '--ckpt: micro-batch 3, plan 2 x 32, +21% compute, training math: same',
                       '--smaller: micro-batch 9, plan 8 x 8, -60% compute, training math: changes')
    summary, _ = nothing_fits_advice(rows[:1])
    assert summary.startswith('no saver alone fits a batch of 1')


def test_applied_saver_is_in_the_config_stock_train_reads(tmp_path, monkeypatch):
    monkeypatch.delenv('PYTORCH_CUDA_ALLOC_CONF', raising=False)
    config = tmp_path / 'ckpt.yaml'
    done = run_script('tune_batch.py', *VIT, '--amp', '--device', 'cuda', '--mem-budget', '2GiB', '-b', '512',
                      '--estimate', '--apply-saver', 'grad-checkpointing', '--apply-saver', 'amp-bfloat16',
                      '--tuned-config', config)
    assert done.returncode == 0, done.stderr
    spec = load_spec('train')
    values = yaml.safe_load(config.read_text())
    assert set(values) <= {entry['dest'] for entry in spec}  # stock keys only
    stock = read_like_stock(spec, config.read_text())
    assert stock.grad_checkpointing is True and stock.amp is True and stock.amp_dtype == 'bfloat16'
    assert stock.batch_size * stock.grad_accum_steps == 512
    table = done.stdout[done.stdout.index('Memory savers'):]
    assert 'grad-checkpointing ' not in table and 'amp-bfloat16 ' not in table  # applied: no longer offered
    for name in ('channels-last', 'expandable-segments', 'amp-float16'):  # each row: batch, plan, compute
        assert re.search(rf'^  {name}\s+.*\s\d+\s+\d+ x \d+\s+[+-]\d+%', table, re.M), table


def test_apply_saver_without_a_form_is_a_one_line_error(tmp_path):
    done = run_script('tune_batch.py', *VIT, '--img-size', '32', '--device', 'cpu', '--estimate',
                      '--apply-saver', 'smaller-img-size', '--tuned-config', tmp_path / 'x.yaml')
    assert done.returncode != 0 and 'Traceback' not in done.stderr
    assert done.stderr.strip().splitlines() == ["tune_batch.py: error: --apply-saver smaller-img-size: the run's input "
                                                'is already the smallest it offers; drop it']


def test_nothing_fits_error_lists_every_saver_and_the_cheapest_that_fits(tmp_path):
    onednn = onednn_runs('cpu')  # as tune_batch.py traces
    as_is = estimate_memory(run_args('--device', 'cpu'), 'cpu', onednn).peak(1)
    smaller = estimate_memory(run_args('--device', 'cpu', '--img-size', '96', '--model-kwargs', 'img_size=96'), 'cpu',
                              onednn)
    budget_kib = int((as_is + smaller.peak(1)) / 2) // 1024  # batch 1 fits at 96 px, not as the run is
    done = run_script('tune_batch.py', *VIT, '-b', '1', '--device', 'cpu', '--mem-budget', f'{budget_kib}KiB',
                      '--mem-headroom', '0', '--estimate', '--tuned-config', tmp_path / 'n.yaml')
    assert done.returncode != 0 and 'Traceback' not in done.stderr
    error, *details = done.stderr.strip().splitlines()
    assert error.startswith('tune_batch.py: error: nothing fits') and 'the cheapest saver that fits is' in error
    flags = [line.split(':')[0].strip() for line in details]
    assert flags == ['--amp --amp-dtype float16', '--amp --amp-dtype bfloat16', '--grad-checkpointing',
                     '--channels-last', '--opt sgd', '--img-size 96 --model-kwargs img_size=96']
    fitting = [line for line in details if 'micro-batch' in line]
    assert fitting and '--img-size 96' in fitting[-1]
    keeping = [line for line in fitting if 'training math: changes' not in line]
    named = re.search(r'fits is (.+?) \(micro-batch', error).group(1)
    expected = min(keeping or fitting, key=lambda line: int(re.search(r'([+-]\d+)% compute', line).group(1)))
    assert expected.strip().startswith(named + ':')
    assert not (tmp_path / 'n.yaml').exists()


def test_a_probed_plan_that_accumulates_for_memory_prices_the_savers(tmp_path, image_folder):
    config = tmp_path / 'probed.yaml'
    done = run_script('tune_batch.py', '--data-dir', image_folder, '--model', 'test_resnet', '--num-classes', '3',
                      '--img-size', '64', '--device', 'cpu', '--workers', '0', '--mem-budget', '40MiB', '-b', '16',
                      '--dry-run', '--no-cache', '--tuned-config', config, '--output', tmp_path)
    assert done.returncode == 0, done.stderr
    values = yaml.safe_load(config.read_text())
    assert values['grad_accum_steps'] > 1  # 16 at 64 px does not fit 40 MiB: a trial failed it
    probed = re.search(r'The probe measured (\d+) for the run as it is, the estimate predicts (\d+)', done.stdout)
    assert probed and int(probed.group(1)) == values['batch_size']
    rows = dict(re.findall(r'^  (grad-checkpointing|amp-bfloat16|channels-last|smaller-img-size)\s+.*?\s(\d+)\s+\d+ x '
                           r'\d+\s+[+-]\d+%', done.stdout, re.M))
    assert set(rows) == {'grad-checkpointing', 'amp-bfloat16', 'channels-last', 'smaller-img-size'}
    assert int(rows['smaller-img-size']) > int(probed.group(2))  # 48 px: fewer activations a sample
    header = '# Memory savers the run does not use yet, priced by the estimate'
    assert header in config.read_text()  # the config's header holds the table


def test_a_saver_named_in_a_recipe_yaml_is_applied(tmp_path):
    recipe = tmp_path / 'recipe.yaml'
    recipe.write_text('apply_saver: grad-checkpointing\n')  # one name: the config reader takes a single value
    done = run_script('tune_batch.py', '-c', recipe, *VIT, '--device', 'cpu', '--estimate',
                      '--tuned-config', tmp_path / 'o.yaml')
    assert done.returncode == 0, done.stderr
    assert read_like_stock(load_spec('train'), (tmp_path / 'o.yaml').read_text()).grad_checkpointing is True
