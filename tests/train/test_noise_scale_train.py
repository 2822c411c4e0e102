"""--log-noise-scale: the training loop's B_simple estimate against the closed form, and on a real small run.

Linear regression y = x.w* + eps, x ~ N(0, I_d), eps ~ N(0, sigma^2), loss 0.5 (x.w - y)^2 at w = w* + delta with
|delta| = 1: the per-sample gradient x x^T delta - x eps has mean G = delta and, by Isserlis' theorem, covariance
Sigma = |delta|^2 I + delta delta^T + sigma^2 I, so |G|^2 = 1 and tr(Sigma) = (d + 1) + d sigma^2 = B_simple.
SGD with lr 0 keeps the weights (and so the true values) fixed while the loop runs many windows.
"""
import csv
import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from timm.task import ClassificationTask

from conftest import REPO_ROOT, train_in_process
from timm_ext.train.noise_monitor import CSV_FIELDS
from timm_ext.train.noise_scale import NoiseScaleEstimator
from timm_ext.synthetic_data import make_image_folder
from timm_ext.train.loop import LoopConfig, TrainLoop

CPU = torch.device('cpu')
DIM, SIGMA = 8, 1.0
TRUE_B_SIMPLE = (DIM + 1) + DIM * SIGMA ** 2


class HalfSquaredError(nn.Module):
    def forward(self, output, target):
        return 0.5 * (output.squeeze(1) - target).pow(2).mean()


def regression_loop(micro_sizes, splits=1, windows=800, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(DIM, generator=gen)
    delta = torch.randn(DIM, generator=gen)
    model = nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_true + delta / delta.norm())[None])
    task = ClassificationTask(model, HalfSquaredError(), device=CPU, verbose=False)
    loop = TrainLoop(task, torch.optim.SGD(model.parameters(), lr=0.0), LoopConfig(
        device=CPU, accum_steps=len(micro_sizes), batch_size=max(micro_sizes), log_interval=10 ** 9,
        log_noise_scale=True, oom_recover=splits > 1))
    loop.noise.estimator = NoiseScaleEstimator(0.999)
    if splits > 1:
        loop.splitter.splits = splits
    batches = []
    for _ in range(windows):
        for n in micro_sizes:
            x = torch.randn(n, DIM, generator=gen)
            batches.append((x, x @ w_true + SIGMA * torch.randn(n, generator=gen)))
    return loop, batches


@pytest.mark.parametrize('micro_sizes,splits', [([6, 6, 6, 2], 1), ([8, 8], 4)],
                         ids=['short-last-micro-batch', 'oom-split-pieces'])
def test_loop_estimate_within_20_percent_of_closed_form(micro_sizes, splits):
    # a shorter last micro-batch exercises the window correction; split pieces give more, smaller micro-batches
    loop, batches = regression_loop(micro_sizes, splits)
    loop.train_one_epoch(0, batches)
    summary = loop.noise_scale_summary()
    pairs_per_window = len(micro_sizes) * splits
    assert summary.pairs == 800 * pairs_per_window
    assert summary.grad_sq == pytest.approx(1.0, rel=0.2)
    assert summary.trace_sigma == pytest.approx(TRUE_B_SIMPLE, rel=0.2)
    assert summary.b_simple == pytest.approx(TRUE_B_SIMPLE, rel=0.2)


def test_ddp_estimate_within_20_percent_of_closed_form(tmp_path):
    report = tmp_path / 'noise.json'
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
         str(REPO_ROOT / 'tests' / 'train' / 'noise_scale_ddp_worker.py'), str(report)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(report.read_text())
    # per window and rank, both micro-batches (parameter hooks see local gradients, also in DDP's synchronising
    # backward) against the global gradient
    assert got['ddp_sync'][3] == got['explicit_allreduce'][3] == 2 * 400 * 2
    for mode, (grad_sq, trace_sigma, b_simple, _) in got.items():
        assert grad_sq == pytest.approx(1.0, rel=0.2), mode
        assert trace_sigma == pytest.approx(TRUE_B_SIMPLE, rel=0.2), mode
        assert b_simple == pytest.approx(TRUE_B_SIMPLE, rel=0.2), mode


def test_short_run_writes_noise_scale_csv(tmp_path):
    # 96 images, micro-batches of 4 against windows of 16: 24 pairs an epoch, enough for a positive |G|² estimate at
    # these small batches (at 2 vs 4 and 6 pairs, noise can still dominate it: "no positive estimate yet")
    data = make_image_folder(tmp_path / 'data', per_class=32)
    result = train_in_process('--data-dir', data, '--output', tmp_path, '--experiment', 'run', '--val-split', '',
                              '--model', 'test_vit', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
                              '--workers', '0', '-b', '4', '--grad-accum-steps', '4', '--epochs', '1',
                              '--log-noise-scale')
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / 'run'
    with open(run / 'noise_scale.csv', newline='') as f:
        rows = list(csv.DictReader(f))
    assert [r['epoch'] for r in rows] == ['0'] and tuple(rows[0]) == CSV_FIELDS
    for row in rows:
        b_simple = float(row['b_simple'])
        assert math.isfinite(b_simple) and b_simple > 0, row
        assert int(row['pairs']) == 24 and row['global_batch'] == '16'  # 6 updates x 4 micro-batches
    logged = [line for line in result.stderr.splitlines() if 'Gradient noise scale B_simple' in line]
    assert len(logged) == 1 and logged[0].startswith('Epoch 0:'), result.stderr[-2000:]
    with open(run / 'summary.csv', newline='') as f:
        assert next(csv.reader(f)) == ['epoch', 'train_loss', 'lr']  # stock columns (no eval split here)

    # resume for a second epoch: the EMAs continue from the checkpoint instead of starting over
    resumed = train_in_process('--data-dir', data, '--output', tmp_path, '--experiment', 'run', '--val-split',
                               '', '--model', 'test_vit', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
                               '--workers', '0', '-b', '4', '--grad-accum-steps', '4', '--epochs', '2',
                               '--log-noise-scale',
                               '--resume', str(run / 'last.pth.tar'))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(run / 'noise_scale.csv', newline='') as f:
        rows = list(csv.DictReader(f))
    assert [(r['epoch'], r['pairs']) for r in rows] == [('0', '24'), ('1', '48')]


def test_noise_scale_without_two_batch_sizes_is_one_line_error(image_folder, tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(REPO_ROOT))
    import train as train_script
    monkeypatch.setattr(sys, 'argv', ['train.py', '--data-dir', str(image_folder), '--model', 'test_vit',
                                      '--device', 'cpu', '--output', str(tmp_path / 'out'), '--log-noise-scale'])
    monkeypatch.setattr(logging.root, 'handlers', [])
    assert train_script.main() == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error' in line.lower()]
    assert 'Traceback' not in err and len(lines) == 1, err
    assert 'two batch sizes' in lines[0] and '--grad-accum-steps 2' in lines[0]
    assert not (tmp_path / 'out').exists()
