"""validate.py end to end on CPU: flag parity, checkpoints from our train.py, safetensors/EMA, bulk mode, bad input.

Most runs call validate.py's `main` in this process (a few seconds of imports saved per run); the bad-input
contract (one line, exit status, no traceback) is also checked through real subprocesses.
"""
import csv
import importlib.util
import json
import logging
import re
import shutil

import pytest
import torch

from conftest import REPO_ROOT, run_script, train_in_process
from stock_spec import load_spec, spec_mismatches
from timm_ext.train.args import EXTENSIONS_GROUP
from timm_ext.validate.args import build_validate_parser

BASE = ['--device', 'cpu', '-j', '0', '--img-size', '32', '--log-freq', '1']
STOCK_FIELDS = ['model', 'top1', 'top1_err', 'top5', 'top5_err', 'param_count', 'img_size', 'crop_pct',
                'interpolation']


@pytest.fixture(scope='module')
def validate_main():
    spec = importlib.util.spec_from_file_location('validate_script', REPO_ROOT / 'validate.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.setup_default_logging = lambda: None  # pytest's caplog collects the log instead
    return module.main


def run_main(validate_main, capsys, *argv):
    """Run validate.py's main in-process; returns (exit status, printed results or None, stderr)."""
    try:
        status = validate_main([str(a) for a in argv])
    except SystemExit as e:  # argument errors exit from the parser
        status = e.code
    out, err = capsys.readouterr()
    results = json.loads(out.split('--result\n', 1)[1]) if '--result\n' in out else None
    return status, results, err


def last_loss(log: str) -> float:
    """The running mean loss of the last 'Test:' log line."""
    return float(re.findall(r'Loss:\s+\S+ \((\S+)\)', log)[-1])


@pytest.fixture(scope='module')
def trained_run(image_folder, tmp_path_factory):
    """Output folder of a 2-epoch run of our train.py with EMA (EMA decay 0.5 keeps it apart from the weights)."""
    out = tmp_path_factory.mktemp('train')
    result = train_in_process('--data-dir', image_folder, '--output', out, '--experiment', 'run',
                              '--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
                              '--workers', '0', '-b', '8', '--epochs', '2', '--lr', '0.05', '--warmup-epochs', '0',
                              '--model-ema', '--model-ema-decay', '0.5')
    assert result.returncode == 0, result.stderr[-2000:]
    run = out / 'run'
    rows = list(csv.DictReader((run / 'summary.csv').open()))
    best = max(rows, key=lambda r: float(r['eval_top1']))  # train.py keeps the first epoch on ties
    best = next(r for r in rows if r['eval_top1'] == best['eval_top1'])
    return run, best


def test_flag_parity_with_stock_validate():
    spec = load_spec('validate')
    mismatches = spec_mismatches(spec, {'parser': build_validate_parser()})
    assert not mismatches, '\n'.join(mismatches)
    parser = build_validate_parser()
    ours = {a.dest for a in parser._actions} - {'help'}
    extensions = {a.dest for g in parser._action_groups if g.title == EXTENSIONS_GROUP for a in g._group_actions}
    assert extensions == {'mem_budget', 'gpu', 'software', 'estimate', 'memory_snapshot'}
    assert ours - extensions == {e['dest'] for e in spec}  # nothing missing; what is added is in its own group


def test_train_checkpoint_validates_with_stock_fields(validate_main, capsys, caplog, image_folder, trained_run,
                                                      tmp_path):
    run, best = trained_run
    caplog.set_level(logging.INFO)
    results_file = tmp_path / 'results.csv'
    status, results, _ = run_main(validate_main, capsys, '--data-dir', image_folder, '--model', 'test_resnet',
                                  '--checkpoint', run / 'model_best.pth.tar', '--use-ema', *BASE,
                                  '--results-file', results_file)
    assert status == 0
    assert list(results) == STOCK_FIELDS  # no --retry: exactly the stock row
    assert results['model'] == 'test_resnet' and results['img_size'] == 32 and results['param_count'] > 0
    assert results['top1'] + results['top1_err'] == pytest.approx(100)
    # the EMA weights of the best epoch score what train.py measured for that epoch
    assert results['top1'] == pytest.approx(float(best['eval_top1']), abs=1e-3)
    assert last_loss(caplog.text) == pytest.approx(float(best['eval_loss']), abs=1e-4)
    assert 'Using the 3 classes' in caplog.text  # no --num-classes needed: the checkpoint records it
    assert list(csv.DictReader(results_file.open())) == [{k: str(v) for k, v in results.items()}]


def test_safetensors_export_and_ema_selection(validate_main, capsys, caplog, image_folder, trained_run):
    run, best = trained_run
    caplog.set_level(logging.INFO)
    common = ['--data-dir', image_folder, '--model', 'test_resnet', *BASE]
    losses = {}
    for name, flags in (('regular', []), ('ema', ['--use-ema'])):
        caplog.clear()
        status, results, _ = run_main(validate_main, capsys, *common, '--checkpoint', run / 'model_best.pth.tar',
                                      *flags)
        assert status == 0 and list(results) == STOCK_FIELDS
        assert ('state_dict_ema' in caplog.text) == (name == 'ema')
        losses[name] = last_loss(caplog.text)
    assert losses['regular'] != pytest.approx(losses['ema'], abs=1e-6), 'EMA weights differ from the weights'

    caplog.clear()  # the safetensors export holds the EMA weights and records no class count
    status, results, _ = run_main(validate_main, capsys, *common, '--checkpoint', run / 'model_best.safetensors',
                                  '--results-format', 'json')
    assert status == 0 and list(results) == STOCK_FIELDS
    assert last_loss(caplog.text) == pytest.approx(losses['ema'], abs=1e-6)
    assert results['top1'] == pytest.approx(float(best['eval_top1']), abs=1e-3)


def test_metrics_avg_adds_precision_recall_f1(validate_main, capsys, image_folder, trained_run):
    status, results, _ = run_main(validate_main, capsys, '--data-dir', image_folder, '--model', 'test_resnet',
                                  '--checkpoint', trained_run[0] / 'last.pth.tar', *BASE, '--metrics-avg', 'micro')
    assert status == 0
    assert list(results) == STOCK_FIELDS[:5] + ['micro_precision', 'micro_recall', 'micro_f1_score'] + STOCK_FIELDS[5:]
    assert results['micro_precision'] == results['micro_recall'] == pytest.approx(results['top1'], abs=1e-3)


def test_default_cuda_device_falls_back_to_cpu_with_amp(validate_main, capsys, caplog, image_folder, trained_run):
    if torch.cuda.is_available():
        pytest.skip('this machine has CUDA: the default device is usable')
    caplog.set_level(logging.INFO)
    no_device = [a for a in BASE if a not in ('--device', 'cpu')]
    status, results, _ = run_main(validate_main, capsys, '--data-dir', image_folder, '--model', 'test_resnet',
                                  '--checkpoint', trained_run[0] / 'last.pth.tar', *no_device, '--amp',
                                  '--amp-dtype', 'bfloat16', '--channels-last')
    assert status == 0 and 0 <= results['top1'] <= 100
    assert 'validating on the CPU instead of cuda' in caplog.text
    assert 'autocast to bfloat16 on cpu' in caplog.text


def test_bulk_checkpoint_folder_reports_failing_models_and_goes_on(validate_main, capsys, caplog, image_folder,
                                                                   trained_run, tmp_path):
    run, _ = trained_run
    folder = tmp_path / 'ckpts'
    folder.mkdir()
    shutil.copy(run / 'model_best.pth.tar', folder / 'checkpoint-1.pth.tar')
    shutil.copy(run / 'last.safetensors', folder / 'last.safetensors')
    (folder / 'checkpoint-2.pth.tar').write_bytes(b'not a checkpoint')
    results_file = tmp_path / 'bulk.csv'
    status, results, _ = run_main(validate_main, capsys, '--data-dir', image_folder, '--model', 'test_resnet',
                                  '--checkpoint', folder, *BASE, '-b', '16', '--results-file', results_file)
    assert status == 0
    by_file = {r['checkpoint'].rsplit('/', 1)[-1]: r for r in results}
    assert set(by_file) == {'checkpoint-1.pth.tar', 'checkpoint-2.pth.tar', 'last.safetensors'}
    assert 'cannot read checkpoint' in by_file['checkpoint-2.pth.tar']['error']
    assert 'top1' not in by_file['checkpoint-2.pth.tar']
    for name in ('checkpoint-1.pth.tar', 'last.safetensors'):
        assert 'error' not in by_file[name] and by_file[name]['batch_size'] == 16  # bulk mode probes
    assert 'error' in results[-1], 'failed models come after the ranked ones'
    assert 'test_resnet failed to validate: cannot read checkpoint' in caplog.text
    rows = list(csv.DictReader(results_file.open()))
    assert len(rows) == 3 and {'top1', 'checkpoint', 'error', 'batch_size'} <= set(rows[0])


@pytest.fixture
def hub_offline(monkeypatch):
    """The hub client in offline mode: no download is tried, whatever the machine's network."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)


def test_bulk_names_file_offline_gives_each_model_an_error(validate_main, capsys, image_folder, tmp_path,
                                                           hub_offline):
    names = tmp_path / 'models.txt'
    names.write_text('test_resnet\nno_such_net\ntest_vit\n')
    status, results, _ = run_main(validate_main, capsys, '--data-dir', image_folder, '--model', names, *BASE)
    assert status == 1  # nothing validated
    assert [r['model'] for r in results] == ['test_resnet', 'no_such_net', 'test_vit']
    assert "unknown model 'no_such_net'" in results[1]['error']
    for row in (results[0], results[2]):
        assert 'no pretrained weights' in row['error'] and '--checkpoint' in row['error']


def write_arch_mismatch(tmp_path):
    import torch
    from timm.models import create_model
    path = tmp_path / 'vit.pth.tar'
    torch.save({'arch': 'test_vit', 'state_dict': create_model('test_vit', num_classes=3).state_dict()}, path)
    return path


@pytest.mark.parametrize('case,status,words', [
    ('missing data', 2, 'data folder not found'),
    ('unknown model', 2, "unknown model 'no_such_net'"),
    ('other arch', 1, "saved from 'test_vit': pass --model test_vit"),
    ('corrupt', 1, 'cannot read checkpoint'),
    ('batch 0', 2, '-b/--batch-size: got 0; allowed: a positive integer'),
    ('xml', 2, "--results-format: got 'xml'; allowed: one of"),
    ('offline', 1, "no pretrained weights for 'test_resnet' in the local cache"),
])
def test_bad_input_is_one_line_with_status(validate_main, capsys, image_folder, tmp_path, hub_offline, case,
                                          status, words):
    corrupt = tmp_path / 'corrupt.pth.tar'
    corrupt.write_bytes(b'\x80\x02garbage')
    results_file = tmp_path / 'keep.csv'
    results_file.write_text('model,top1\nold,1\n')
    args = {
        'missing data': ['--data-dir', tmp_path / 'nope', '--model', 'test_resnet'],
        'unknown model': ['--data-dir', image_folder, '--model', 'no_such_net'],
        'other arch': ['--data-dir', image_folder, '--model', 'test_resnet', '--checkpoint',
                       write_arch_mismatch(tmp_path)],
        'corrupt': ['--data-dir', image_folder, '--model', 'test_resnet', '--checkpoint', corrupt],
        'batch 0': ['--data-dir', image_folder, '--model', 'test_resnet', '-b', '0'],
        'xml': ['--data-dir', image_folder, '--model', 'test_resnet', '--results-format', 'xml'],
        'offline': ['--data-dir', image_folder, '--model', 'test_resnet'],
    }[case]
    got, results, err = run_main(validate_main, capsys, *args, *BASE, '--results-file', results_file)
    assert got == status and results is None
    assert len(err.strip().splitlines()) == 1 and words in err, err
    assert results_file.read_text() == 'model,top1\nold,1\n', 'an earlier results file is left alone'


@pytest.mark.parametrize('extra,status,words', [
    (['--data-dir', '/no/such/data'], 2, 'data folder not found'),
    (['--checkpoint', 'CORRUPT'], 1, 'cannot read checkpoint'),
])
def test_bad_input_in_a_real_process_has_no_traceback(image_folder, tmp_path, extra, status, words):
    corrupt = tmp_path / 'c.pth.tar'
    corrupt.write_bytes(b'PK\x03\x04truncated')
    extra = [str(corrupt) if e == 'CORRUPT' else e for e in extra]
    if '--data-dir' not in extra:
        extra = ['--data-dir', image_folder] + extra
    result = run_script('validate.py', '--model', 'test_resnet', *BASE, *extra, timeout=120)
    assert result.returncode == status
    assert 'Traceback' not in result.stderr
    errors = [line for line in result.stderr.splitlines() if 'error' in line.lower()]
    assert len(errors) == 1 and words in errors[0], result.stderr[-2000:]


@pytest.mark.parametrize('flags', [['--torchscript'], ['--torchcompile', 'eager'], ['--channels-last']],
                         ids=['torchscript', 'torchcompile-eager', 'channels-last'])
def test_model_transforms_keep_the_scores(validate_main, capsys, caplog, image_folder, trained_run, flags):
    caplog.set_level(logging.INFO)
    common = ['--data-dir', image_folder, '--model', 'test_resnet', '--checkpoint', trained_run[0] / 'last.pth.tar',
              *BASE]
    status, plain, _ = run_main(validate_main, capsys, *common)
    plain_loss = last_loss(caplog.text)
    caplog.clear()
    status_t, transformed, _ = run_main(validate_main, capsys, *common, *flags)
    assert status == status_t == 0
    assert transformed == plain  # same row, same scores
    assert last_loss(caplog.text) == pytest.approx(plain_loss, abs=1e-5)


def test_test_pool_applies_above_the_model_input_size(validate_main, capsys, caplog, image_folder, trained_run):
    caplog.set_level(logging.INFO)
    common = ['--data-dir', image_folder, '--model', 'test_resnet', '--checkpoint', trained_run[0] / 'last.pth.tar',
              '--device', 'cpu', '-j', '0', '--test-pool']
    status, results, _ = run_main(validate_main, capsys, *common, '--img-size', '192')  # test_resnet's input is 160
    assert status == 0 and results['img_size'] == 192
    assert results['crop_pct'] == 1.0  # test-time pooling sees the whole image, as stock reports it
    assert 'test time pool' in caplog.text.lower()
    status, results, _ = run_main(validate_main, capsys, *common, '--img-size', '32')
    assert status == 0 and results['crop_pct'] != 1.0  # below the model's size the pool is not applied


def test_estimate_plans_the_batch_of_a_cuda_card_on_a_machine_without_one(validate_main, capsys):
    plan = ['--model', 'test_resnet', '--img-size', '32', '--num-classes', '3', '--device', 'cuda', '--amp',
            '--estimate']  # no data, no weights, no GPU
    status, _, err = run_main(validate_main, capsys, *plan, '--mem-budget', 'lots')
    assert status == 2 and '--mem-budget' in err and len(err.strip().splitlines()) == 1
    assert validate_main(plan + ['--mem-budget', '80GiB']) == 0
    out = capsys.readouterr().out
    assert 'Estimate (no real forward ran)' in out and 'Budget 80GiB' in out
    batch = int(re.search(r'--batch-size (\d+) --retry', out).group(1))
    assert batch > 1000 and batch % 8 == 0  # a tiny model on an 80 GB card, on the tensor-core grid


def test_retry_starts_where_the_estimate_predicts_a_fit(validate_main, capsys, caplog, image_folder, trained_run):
    from timm_ext.validate.batch_estimate import estimate_eval_batch, start_batch
    from timm_ext.validate.args import parse_validate_args
    run, _ = trained_run
    caplog.set_level(logging.INFO)
    argv = ['--data-dir', image_folder, '--model', 'test_resnet', '--checkpoint', run / 'model_best.pth.tar', *BASE,
            '--retry', '-b', '4096']
    args = parse_validate_args([str(a) for a in argv])
    # a budget that holds about 12 of the split's 24 images by the estimate (--retry takes no headroom)
    budget = f'{estimate_eval_batch(args, "test_resnet", "cpu", "1GiB").estimate.peak(12) / 2 ** 20 + 0.005:.2f}MiB'
    predicted = estimate_eval_batch(args, 'test_resnet', 'cpu', budget, steps_down=True)  # --retry: no headroom
    assert 1 < predicted.batch_size < 24
    argv += ['--mem-budget', budget]
    status, results, _ = run_main(validate_main, capsys, *argv)
    assert status == 0
    start = start_batch(4096, predicted.batch_size)
    said = f'predicted not to fit (the memory estimate: {predicted.batch_size}); the pass starts at {start}'
    assert said in caplog.text
    assert results['batch_size'] == start  # no cap in force here: the pass ran where it started
