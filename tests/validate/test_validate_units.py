"""validate.py's library parts on their own: metrics, results files, job expansion, weights, argument checks."""
import argparse
import csv
import io
import json
import os

import pytest
import torch
from safetensors.torch import save_file
from timm.models import create_model

from timm_ext.validate.metrics import precision_recall_f1
from timm_ext.validate.results import results_text, write_results
from timm_ext.validate.args import build_validate_parser, check_validate_args
from timm_ext.validate.jobs import JobsError, resolve_jobs
from timm_ext.validate.evaluate import next_smaller_batch
from timm_ext.validate.weights import WeightsError, load_weights, read_weights


# ---- precision / recall / F1 (hand-computed; scikit-learn gives the same with zero_division=0)

TARGETS = torch.tensor([0, 0, 1, 1, 2])
PREDS = torch.tensor([0, 1, 1, 1, 0])
# per class: 0: tp 1, predicted 2, support 2 | 1: tp 2, predicted 3, support 2 | 2: tp 0, predicted 0, support 1


@pytest.mark.parametrize('average,want', [
    ('micro', (0.6, 0.6, 0.6)),
    ('macro', ((0.5 + 2 / 3) / 3, (0.5 + 1.0) / 3, (0.5 + 0.8) / 3)),
    ('weighted', ((0.5 * 2 + 2 / 3 * 2) / 5, (0.5 * 2 + 1.0 * 2) / 5, (0.5 * 2 + 0.8 * 2) / 5)),
])
def test_precision_recall_f1_match_hand_computation(average, want):
    got = precision_recall_f1(PREDS, TARGETS, average)
    assert got == pytest.approx(dict(zip(('precision', 'recall', 'f1'), want)))


def test_precision_recall_f1_counts_classes_only_predicted():
    # class 3 is predicted but never true: it enters the macro mean with precision 0 and recall 0
    got = precision_recall_f1(torch.tensor([3, 1]), torch.tensor([0, 1]), 'macro')
    assert got == pytest.approx({'precision': 1 / 3, 'recall': 1 / 3, 'f1': 1 / 3})
    with pytest.raises(ValueError):
        precision_recall_f1(PREDS, TARGETS, 'samples')


# ---- results files

ROWS = [
    {'model': 'a', 'top1': 90.0, 'top5': 99.0, 'checkpoint': 'a.pth.tar'},
    {'model': 'b', 'checkpoint': 'b.pth.tar', 'error': 'cannot read checkpoint b.pth.tar'},
]


def test_csv_results_take_the_union_of_keys_in_first_seen_order():
    rows = list(csv.DictReader(io.StringIO(results_text(ROWS, 'csv'))))
    assert list(rows[0]) == ['model', 'top1', 'top5', 'checkpoint', 'error']
    assert rows[0]['error'] == '' and rows[1]['top1'] == '' and rows[1]['error'].startswith('cannot read')
    assert results_text([], 'csv') == ''
    single = list(csv.DictReader(io.StringIO(results_text(ROWS[0], 'csv'))))
    assert single == [{k: str(v) for k, v in ROWS[0].items()}]


def test_results_file_is_replaced_whole_or_left_alone(tmp_path):
    path = tmp_path / 'results.json'
    write_results(str(path), ROWS, 'json')
    assert json.loads(path.read_text()) == ROWS
    with pytest.raises(TypeError):  # not JSON serialisable: fails before the old file is touched
        write_results(str(path), [{'model': object()}], 'json')
    assert json.loads(path.read_text()) == ROWS
    assert [p.name for p in tmp_path.iterdir()] == ['results.json'], 'no temporary file left behind'
    with pytest.raises(ValueError):
        write_results(str(path), ROWS, 'xml')


# ---- model / checkpoint expansion (stock bulk rules)

def test_single_model_and_unknown_model():
    plan = resolve_jobs('test_resnet', 'w.pth.tar')
    assert plan.jobs == [('test_resnet', 'w.pth.tar')] and not plan.bulk
    assert resolve_jobs('test_resnet', '').jobs == [('test_resnet', None)]
    with pytest.raises(JobsError, match="unknown model 'no_such_net'"):
        resolve_jobs('no_such_net', '')


def test_wildcard_and_names_file_are_bulk_with_pretrained_weights(tmp_path):
    plan = resolve_jobs('test_res*', '')
    assert plan.bulk and plan.jobs == [('test_resnet.r160_in1k', None)]  # pretrained tags, as stock
    names = tmp_path / 'models.txt'
    names.write_text('test_resnet\n\n  test_vit  \n')
    plan = resolve_jobs(str(names), '')
    assert plan.bulk and plan.jobs == [('test_resnet', None), ('test_vit', None)]
    names.write_text('\n')
    with pytest.raises(JobsError, match='names no models'):
        resolve_jobs(str(names), '')


def test_checkpoint_folder_lists_weight_files_in_natural_order(tmp_path):
    for name in ('checkpoint-10.pth.tar', 'checkpoint-9.pth.tar', 'model_best.safetensors', 'plain.pth',
                 'args.yaml', '.last.pth.tar.123.tmp'):
        (tmp_path / name).write_bytes(b'')
    plan = resolve_jobs('test_resnet', str(tmp_path))
    assert plan.bulk
    assert [os.path.basename(c) for _, c in plan.jobs] == [
        'checkpoint-9.pth.tar', 'checkpoint-10.pth.tar', 'model_best.safetensors', 'plain.pth']
    with pytest.raises(JobsError, match='unknown model'):
        resolve_jobs('no_such_net', str(tmp_path))
    empty = tmp_path / 'empty'
    empty.mkdir()
    with pytest.raises(JobsError, match='no checkpoints'):
        resolve_jobs('test_resnet', str(empty))


def test_all_lists_pretrained_in1k_models():
    plan = resolve_jobs('all', '')
    names = [m for m, _ in plan.jobs]
    assert plan.bulk and len(names) > 100 and 'resnet50.a1_in1k' in names
    assert not any(n.endswith('_in22k') for n in names)


# ---- weights

@pytest.fixture(scope='module')
def weight_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp('weights')
    model = create_model('test_resnet', num_classes=3)
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save({'epoch': 0, 'arch': 'test_resnet', 'state_dict': {f'module.{k}': v for k, v in
                                                                   model.state_dict().items()},
                'state_dict_ema': ema, 'args': argparse.Namespace(num_classes=3), 'version': 2},
               folder / 'stock.pth.tar')
    torch.save({'state_dict': model.state_dict()}, folder / 'no_ema.pth.tar')
    save_file({k: v.contiguous() for k, v in ema.items()}, str(folder / 'ema.safetensors'))
    (folder / 'corrupt.pth.tar').write_bytes((folder / 'stock.pth.tar').read_bytes()[:2000])
    vit = create_model('test_vit', num_classes=3)
    torch.save({'arch': 'test_vit', 'state_dict': vit.state_dict()}, folder / 'vit.pth.tar')
    return folder, model.state_dict(), ema


def test_read_weights_picks_regular_or_ema_entries(weight_files, caplog):
    folder, regular, ema = weight_files
    got = read_weights(str(folder / 'stock.pth.tar'))
    assert got.source == 'state_dict' and got.arch == 'test_resnet' and got.num_classes == 3
    assert all(torch.equal(got.state_dict[k], regular[k]) for k in regular), 'module. prefix cleaned'
    got = read_weights(str(folder / 'stock.pth.tar'), use_ema=True)
    assert got.source == 'state_dict_ema' and all(torch.equal(got.state_dict[k], ema[k]) for k in ema)
    got = read_weights(str(folder / 'no_ema.pth.tar'), use_ema=True)
    assert got.source == 'state_dict' and 'no EMA weights' in caplog.text
    got = read_weights(str(folder / 'ema.safetensors'))
    assert got.source == 'weights' and all(torch.equal(got.state_dict[k], ema[k]) for k in ema)


@pytest.mark.parametrize('name,match', [
    ('missing.pth.tar', 'checkpoint not found'),
    ('corrupt.pth.tar', 'cannot read checkpoint'),
])
def test_read_weights_errors_are_one_line(weight_files, name, match):
    with pytest.raises(WeightsError, match=match) as info:
        read_weights(str(weight_files[0] / name))
    assert '\n' not in str(info.value)


def test_load_weights_explains_architecture_and_class_count_mismatch(weight_files):
    folder = weight_files[0]
    model = create_model('test_resnet', num_classes=3)
    with pytest.raises(WeightsError, match="saved from 'test_vit': pass --model test_vit") as info:
        load_weights(model, read_weights(str(folder / 'vit.pth.tar')), 'vit.pth.tar', 'test_resnet')
    assert '\n' not in str(info.value)
    wide = create_model('test_resnet', num_classes=10)
    with pytest.raises(WeightsError, match='pass --num-classes 3'):
        load_weights(wide, read_weights(str(folder / 'stock.pth.tar')), 'stock.pth.tar', 'test_resnet')
    load_weights(model, read_weights(str(folder / 'stock.pth.tar')), 'stock.pth.tar', 'test_resnet')


# ---- probe sizes and argument checks

def test_after_an_oom_the_pass_continues_one_decay_step_below_the_failed_batch():
    assert [next_smaller_batch(b, None) for b in (1024, 768, 128, 96)] == [768, 512, 96, 64]
    assert next_smaller_batch(128, 100) == 96  # a full batch of 128 failed
    assert next_smaller_batch(96, 40) == 32  # the short last batch of 40 failed: below 40, not below 96
    assert next_smaller_batch(8, 1000) == 6 and next_smaller_batch(1, 5) == 0


@pytest.mark.parametrize('argv,problem', [
    (['-b', '0'], '-b/--batch-size: got 0; allowed: a positive integer'),
    (['--results-format', 'xml'], "--results-format: got 'xml'; allowed: one of 'csv', 'json'"),
    (['--amp-dtype', 'float8'], '--amp-dtype'),
    (['--model-dtype', 'int8'], '--model-dtype'),
    (['--amp', '--model-dtype', 'float16'], 'float32 model'),
    (['--data-dir', '/no/such/folder'], 'data folder not found: /no/such/folder'),
    ([], 'no dataset given'),
    (['--checkpoint', '/no/such.pth.tar'], '--checkpoint: not found'),
])
def test_argument_checks_name_the_problem(tmp_path, argv, problem):
    base = [] if '--data-dir' in argv or not argv else ['--data-dir', str(tmp_path)]
    args = build_validate_parser().parse_args(base + argv)
    assert problem in (check_validate_args(args) or '')


def test_stock_defaults_pass_the_checks(tmp_path):
    args = build_validate_parser().parse_args([str(tmp_path)])
    assert check_validate_args(args) is None
    assert (args.batch_size, args.model, args.device, args.results_format) == (256, 'dpn92', 'cuda', 'csv')


def test_validate_plans_the_compiled_forward_it_will_run():
    """validate.py --torchcompile --estimate (and --retry's starting batch, which reads the same estimate) traces the
    compiled forward: on test_convnext, whose LayerNorm and GELU chains inductor fuses, more fits than eager."""
    from timm_ext.validate.args import parse_validate_args
    from timm_ext.validate.batch_estimate import estimate_eval_batch
    base = ['--model', 'test_convnext', '--amp', '--device', 'cuda', '--gpu', 'rtx4090', '--estimate']
    eager = estimate_eval_batch(parse_validate_args(base), 'test_convnext', 'cuda')
    compiled = estimate_eval_batch(parse_validate_args(base + ['--torchcompile']), 'test_convnext', 'cuda')
    assert 'torch.compile inductor' in compiled.estimate.describe
    assert compiled.batch_size > eager.batch_size * 1.05
