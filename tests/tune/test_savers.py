"""The memory savers' prices (timm_ext.tune.savers): each row's arithmetic, the rules that price a saver from the
run's own trace against a trace of that saver, the table (where it is shown), --apply-saver's config as stock
train.py reads it, and the nothing-fits error. The traces are shared by module fixtures, traced side by side."""
import importlib.util
import re

import pytest
import timm
import torch
import yaml

from conftest import REPO_ROOT, run_script
from stock_spec import load_spec, read_like_stock
from timm_ext.memory_model.predict import CudaReplay
from timm_ext.memory_model.devices import device_model, onednn_runs
from timm_ext.memory_model.estimate import MemoryEstimate
from timm_ext.memory_model.trace_pool import estimate_each
from timm_ext.memory_model.kernel_limits import CONVOLUTION, KernelSizes, as_channels_last
from timm_ext.memory_model.live_bytes import CATEGORIES
from timm_ext.train.args import given_dests, parse_args
from timm_ext.tune import estimate_plan
from timm_ext.tune.plan import plan_run
from timm_ext.tune.saver_rules import host_ema, momentum_sgd, same_layout_bytes
from timm_ext.tune.savers import (
    PricedSaver, Saver, apply_savers, candidate_savers, cheapest, nothing_fits_advice, price_savers, savers_table,
)

VIT = ['--model', 'test_vit', '--num-classes', '10', '--opt', 'adamw']
RECIPE = 64
RULE_TOLERANCE = 0.01  # a rule's peak against the saver's own trace: within 1% (2 MiB segments on CUDA)


def load_tune_batch():
    spec = importlib.util.spec_from_file_location('tune_batch_script', REPO_ROOT / 'tune_batch.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_args(*argv, model=VIT):
    args, _ = parse_args([*model, *argv])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    return args


def _traced(*runs, model=VIT):
    """Each (device type, flags) traced, side by side (onednn as tune_batch.py traces)."""
    estimates = estimate_each([dict(args=run_args('--device', device, *flags, model=model), device_type=device,
                                    onednn=onednn_runs(device)) for device, flags in runs])
    assert all(isinstance(e, MemoryEstimate) for e in estimates), estimates
    return estimates


@pytest.fixture(scope='module')
def cpu_rows():
    """The CPU run (test_vit, AdamW) as it is, every saver priced and planned under a limit it needs 24 samples for,
    the estimates each row was planned from, and a real trace of SGD."""
    args = run_args('--device', 'cpu', '-b', str(RECIPE))
    base, sgd = _traced(('cpu', ()), ('cpu', ('--opt', 'sgd')))
    limit = base.peak(24) + 1  # the run as it is fits 24: it must accumulate for the recipe's 64
    seen = []

    def plan_for(estimate):
        seen.append(estimate)
        micro = estimate.largest_batch(limit)
        return micro, plan_run(args, micro, 1, RECIPE) if micro else None

    rows = price_savers(args, 'cpu', onednn_runs('cpu'), base, plan_for)
    return dict(args=args, base=base, limit=limit, rows={row.saver.name: row for row in rows},
                seen=dict(zip([row.saver.name for row in rows], seen)), sgd=sgd)


def test_each_row_is_its_own_trace_planned_for_the_recipe(cpu_rows):
    base, limit, rows, seen = cpu_rows['base'], cpu_rows['limit'], cpu_rows['rows'], cpu_rows['seen']
    assert list(rows) == ['amp-float16', 'amp-bfloat16', 'grad-checkpointing', 'channels-last', 'opt-sgd',
                          'smaller-img-size']  # CPU: no host EMA, no CUDA allocator; adamw holds two states
    for name, row in rows.items():
        estimate = seen[name]
        assert row.micro_batch == estimate.largest_batch(limit) and not row.problem
        assert row.plan.micro_batch * row.plan.accum_steps == RECIPE and row.plan.micro_batch <= row.micro_batch
        assert row.extra_compute == pytest.approx(estimate.flops_per_sample / base.flops_per_sample - 1)
    assert base.largest_batch(limit) == 24
    assert seen['amp-float16'] is seen['amp-bfloat16']  # one trace prices both AMP dtypes
    checkpointing = rows['grad-checkpointing']
    assert checkpointing.micro_batch > 24  # activations dropped in the forward
    assert 0.05 < checkpointing.extra_compute <= 0.34  # the recomputed forward: at most a third of a step's FLOPs
    assert rows['channels-last'].extra_compute == 0 and rows['channels-last'].saver.math == 'same'
    assert rows['opt-sgd'].micro_batch >= 24 and rows['opt-sgd'].saver.math.startswith('changes')
    smaller = rows['smaller-img-size']  # 160 -> 96 px: 36 patches instead of 100, FLOPs in proportion or less
    assert smaller.saver.values['img_size'] == 96 and smaller.saver.values['model_kwargs'] == {'img_size': 96}
    assert -0.75 < smaller.extra_compute < -0.55 and smaller.micro_batch > 2 * 24
    assert smaller.one_step and smaller.plan.micro_batch == RECIPE


def _same_peaks(derived: MemoryEstimate, traced: MemoryEstimate, limit: float) -> None:
    for batch in (8, 64, 256):
        assert derived.peak(batch) == pytest.approx(traced.peak(batch), rel=RULE_TOLERANCE), batch
    assert derived.largest_batch(limit) == traced.largest_batch(limit)


def test_sgd_priced_on_the_cpu_run_as_its_own_trace_prices_it(cpu_rows):
    """torch/optim/sgd.py, `_single_tensor_sgd`: one momentum buffer a parameter (`torch.clone(grad).detach()` on
    the first step), no other state; timm's create_optimizer_v2 builds 'sgd' with momentum. On CPU the rule replaces
    the optimizer category of the peak."""
    _same_peaks(cpu_rows['seen']['opt-sgd'], cpu_rows['sgd'], cpu_rows['limit'])
    assert cpu_rows['seen']['opt-sgd'].peak(64) < cpu_rows['base'].peak(64)  # AdamW's two states against one


RESNET = ['--model', 'test_resnet', '--num-classes', '10']
AMP = ('--amp', '--amp-dtype', 'float16')
CUDA_RUN = ('--opt', 'adamw', '--model-ema', *AMP)


@pytest.fixture(scope='module')
def cuda_traces():
    """A CUDA run (test_resnet, AdamW, the EMA on the card, float16 autocast) traced as it is and with each rule's
    saver on."""
    flags = {'base': CUDA_RUN, 'opt-sgd': ('--opt', 'sgd', '--model-ema', *AMP),
             'channels-last': (*CUDA_RUN, '--channels-last'),
             'model-ema-force-cpu': (*CUDA_RUN, '--model-ema-force-cpu'),
             'amp-bfloat16': ('--opt', 'adamw', '--model-ema', '--amp', '--amp-dtype', 'bfloat16')}
    return dict(zip(flags, _traced(*[('cuda', f) for f in flags.values()], model=RESNET)))


@pytest.mark.parametrize('name, rule', [('opt-sgd', momentum_sgd), ('model-ema-force-cpu', host_ema),
                                        ('channels-last', same_layout_bytes)])
def test_a_rule_prices_its_saver_as_the_savers_own_trace_does(cuda_traces, name, rule):
    """The rules of timm_ext/tune/saver_rules.py, each against a trace of the run with that saver on:
    opt-sgd: torch/optim/sgd.py `_single_tensor_sgd`, one momentum buffer a parameter (a clone of its gradient);
    model-ema-force-cpu: timm/utils/model_ema.py `ModelEmaV3` (its update lerps in place: the copy's weights are
    all it holds on the device); channels-last: the same bytes a tensor (strides permuted)."""
    base = cuda_traces['base']
    derived = rule(base)
    _same_peaks(derived, cuda_traces[name], base.peak(100))
    if name != 'channels-last':  # each changes what the run holds
        assert derived.peak(8) < base.peak(8)


def test_channels_last_depthwise_convolutions_lose_the_native_kernels_launch_limit():
    """aten/src/ATen/native/Convolution.cpp, `use_cudnn_depthwise`, v2.14.1 (timm_ext/memory_model/kernel_limits.py):
    with cuDNN 9.24 cuDNN takes every channels-last depthwise convolution, so the 32-bit limit of PyTorch's own kernel
    (an output larger than its input: padding 3 around a 3x3 filter) goes: the rule's launch limits are what the
    trace's recorder (`KernelSizes`) records for the channels-last input."""
    conv = torch.nn.Conv2d(32, 32, 3, padding=3, groups=32)
    recorded = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        with torch.no_grad(), KernelSizes() as sizes:
            conv(torch.zeros(2, 32, 8, 8).contiguous(memory_format=memory_format))
        recorded.append({name: size / 2 for name, size in sizes.sizes.items()})
    as_is, channels_last = recorded
    facts = 'float32 cudnn-shape'  # float32: cuDNN's float16 shape rule does not take it
    assert as_is == {f'depthwise contiguous {facts} input': 32 * 8 * 8, f'depthwise contiguous {facts} output': 32 * 144,
                     f'depthwise contiguous {facts} grown': 32 * 144, CONVOLUTION: 32 * 144}
    assert channels_last == as_channels_last(as_is) != as_is
    run = MemoryEstimate({}, {}, device_model('cuda'), '', 0.0, kernel_sizes=as_is)
    assert same_layout_bytes(run).kernel_sizes == channels_last
    assert run.launch_limit[0] is not None and same_layout_bytes(run).launch_limit[0] is None  # 2**31, then cuDNN


def test_one_amp_trace_prices_both_half_dtypes(cuda_traces):
    """aten/src/ATen/autocast_mode.cpp: the cast lists are per device, whichever lower-precision dtype autocast
    uses (float16 and bfloat16 are both 2 bytes); timm_ext/memory_model/autocast_casts.py's float32 list too."""
    float16, bfloat16 = cuda_traces['base'], cuda_traces['amp-bfloat16']
    assert float16.lines == bfloat16.lines
    _same_peaks(float16, bfloat16, float16.peak(100))


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
                      '--savers', '--tuned-config', config)  # it fits in one step: the table on request
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


def test_nothing_fits_error_lists_every_saver_and_the_cheapest_that_fits(tmp_path, cpu_rows):
    as_is, smaller = cpu_rows['base'].peak(1), cpu_rows['seen']['smaller-img-size'].peak(1)
    budget_kib = int((as_is + smaller) / 2) // 1024  # batch 1 fits at 96 px, not as the run is
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


def _lines_only(per_sample: float) -> MemoryEstimate:
    """A CPU estimate of lines alone: `per_sample` bytes of activations a sample."""
    lines = {name: (0.0, 0.0) for name in CATEGORIES}
    lines['activations'] = (0.0, per_sample)
    return MemoryEstimate(lines, {1: {}, 2: {}}, device_model('cpu'), 'synthetic', 0.0)


@pytest.mark.parametrize('argv, shown', [(('-b', '64'), False), (('-b', '64', '--savers'), True),
                                         (('-b', '4096'), True)])
def test_the_table_is_shown_where_the_plan_accumulates_or_when_asked(monkeypatch, argv, shown):
    """A plan that runs the recipe's batch in one step has no saver to recommend: no table, no saver's trace,
    unless --savers asks; one that accumulates gets it (nothing fitting gets it too: the nothing-fits test)."""
    parser = load_tune_batch().build_tune_parser()
    argv = [*VIT, '--device', 'cpu', '--mem-budget', '1GiB', '--estimate', *argv]
    args, _ = parse_args(argv, parser=parser)
    priced, traced = [], []
    monkeypatch.setattr(estimate_plan, 'estimate_each',
                        lambda calls: traced.append(calls) or [_lines_only(2 ** 20)] * len(calls))
    monkeypatch.setattr(estimate_plan, 'price_savers', lambda *call: priced.append(call) or [])
    planned = estimate_plan.plan_with_estimate(args, given_dests(argv, parser))
    assert planned.plans[0].plan.accum_steps == (1 if '64' in argv else 8)  # about 900 samples fit 1 GiB
    assert bool(priced) == shown and any('Memory savers' in line for line in planned.lines) == shown
    # --savers: the savers that need a trace (one AMP, checkpointing, a smaller input) beside the run's two
    assert [len(calls) for calls in traced] == [5 if '--savers' in argv else 2]
    if '--savers' in argv:
        assert list(priced[0][-1]) == ['amp-float16', 'grad-checkpointing', 'smaller-img-size']


@pytest.mark.parametrize('name', ['xception', 'mnasnet_b1', 'resnet50.no_such_tag'])
def test_a_model_without_a_pretrained_config_gets_its_savers(name):
    """timm/models/_builder.py, `resolve_pretrained_cfg`: a name without a registered config is built with
    `PretrainedCfg()`'s defaults; timm/models/_registry.py, `_deprecated_model_shim`: a deprecated name (xception,
    mnasnet_b1) is built as its current name and tag, whose config holds its input size. An invalid tag, which timm
    refuses to build, gets the defaults here (the estimate refuses it in one line)."""
    assert timm.models.get_deprecated_models().get(name, name) != name or '.' in name
    args = run_args('--device', 'cuda', model=['--model', name])
    apply_savers(args, None)  # every saver's form, the smaller input's among them
    smaller = {s.name: s for s in candidate_savers(args, 'cuda', _estimate('cuda', 0))}['smaller-img-size']
    side = 224 if '.' in name else timm.create_model(name).pretrained_cfg['input_size'][-1]
    assert smaller.values['img_size'] == int(side * 0.75) // 32 * 32 and 'model_kwargs' not in smaller.values


def test_a_model_timm_refuses_to_build_ends_in_one_line(tmp_path):
    done = run_script('tune_batch.py', '--model', 'test_resnet.no_such_tag', '--num-classes', '10', '--device',
                      'cuda', '--mem-budget', '8GiB', '--estimate', '--tuned-config', tmp_path / 'x.yaml')
    assert done.returncode != 0 and 'Traceback' not in done.stderr
    assert done.stderr.strip().splitlines() == ["tune_batch.py: error: cannot create 'test_resnet.no_such_tag' "
                                                '(model): Invalid pretrained tag (no_such_tag) for test_resnet.']
