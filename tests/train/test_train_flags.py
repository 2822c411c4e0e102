"""train.py runs with the stock flags that change how it trains (in process, one short epoch each)."""
import logging
import sys

import pytest

from conftest import REPO_ROOT
from timm_ext.train.checkpoint import load_training_checkpoint

BASE = ['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu', '--workers', '0',
        '-b', '4', '--epochs', '1', '--log-interval', '100']

FLAG_CASES = {
    'amp': (['--amp'], 'Using native torch AMP'),
    'amp-bf16-channels-last': (['--amp', '--amp-dtype', 'bfloat16', '--channels-last'], 'autocast to bfloat16'),
    'model-dtype-bf16': (['--model-dtype', 'bfloat16'], None),
    'grad-checkpointing': (['--grad-checkpointing', '--model', 'test_vit'], None),
    'mixup-cutmix-bce': (['--mixup', '0.8', '--cutmix', '1.0', '--bce-loss'], 'BinaryCrossEntropy'),
    'mixup-no-prefetcher': (['--mixup', '0.8', '--no-prefetcher', '--mixup-off-epoch', '1'], 'SoftTargetCrossEntropy'),
    'jsd-split-bn': (['--aug-splits', '2', '--jsd-loss', '--split-bn', '--no-prefetcher'], 'JsdCrossEntropy'),
    'scheduled-sizes': (['--train-img-sizes', '32', '48', '--train-batch-sizes', '4', '2'], 'Scheduled training sizes'),
    'lamb-sqrt-step-sched': (['--opt', 'lamb', '--sched', 'step', '--decay-epochs', '1'], 'by sqrt rule'),
    'clip-agc-ema-cpu': (['--clip-grad', '0.01', '--clip-mode', 'agc', '--model-ema', '--model-ema-force-cpu'], None),
    'compile-eager-accum': (['--torchcompile', 'eager', '--grad-accum-steps', '2'], None),
}


@pytest.mark.parametrize('extra,expect', FLAG_CASES.values(), ids=FLAG_CASES.keys())
def test_flag_trains_one_epoch(image_folder, tmp_path, monkeypatch, capsys, extra, expect):
    sys.path.insert(0, str(REPO_ROOT))
    import train as train_script
    argv = ['train.py', '--data-dir', str(image_folder), '--output', str(tmp_path), '--experiment', 'run', *BASE,
            *extra]
    monkeypatch.setattr(sys, 'argv', argv)
    monkeypatch.setattr(logging.root, 'handlers', [])  # main() adds a handler on this test's captured stderr
    assert train_script.main() == 0
    log = capsys.readouterr().err
    if expect is not None:
        assert expect in log, log[-3000:]
    last = load_training_checkpoint(tmp_path / 'run' / 'last.pth.tar')
    assert last['epoch'] == 0 and last['optimizer']['state']  # the optimizer really stepped
    assert ('state_dict_ema' in last) == ('--model-ema' in extra)
