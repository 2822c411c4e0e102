"""The probe's promise under a real RLIMIT_DATA cap: the micro-batch tune_batch.py chooses at the default headroom
trains in train.py under the same cap, for two epochs with an eval pass and checkpoints after each, when the cap comes
only after train.py has started (prlimit, a ulimit in a job script, another process taking the rest).

The trials measure their peaks on the steady heap (`timm_ext.memory.steady_cpu_heap`); a train.py started uncapped
keeps glibc's dynamic heap unless the tuned command's ``--steady-cpu-heap`` says otherwise. Without it, here: the
probe chose 47 (peak 90.6 MiB of 96) and train.py at -b 47 ran out of memory in its first epoch.

On CPU oneDNN keeps every shape's kernels and buffers for the life of the process, so train.py's second epoch trains
with its eval pass's shapes resident (the eval batch and the split's smaller last batch). A trial of updates alone
chose 19-20 at 32 px under 48 MiB (peak 42-43 MiB) and train.py then peaked 49 MiB after its first eval, out of memory.
"""
import sys
from pathlib import Path

import pytest
import yaml

from timm_ext.synthetic_data import make_image_folder

from conftest import run_script, tuned_flags

BUDGET_MIB = 96
# test_resnet at 64 px: about 47 images fit the 96 MiB budget, well below the 120-image train split
RUN = ['--model', 'test_resnet', '--device', 'cpu', '--num-classes', '3', '--img-size', '64', '-j', '0']


@pytest.fixture(scope='module')
def folder(tmp_path_factory) -> Path:
    """120 training images and 127 eval images: 127 is prime, so every eval batch leaves a smaller last batch."""
    root = tmp_path_factory.mktemp('data')
    make_image_folder(root, per_class=40, splits=('train',))
    make_image_folder(root, per_class=43, splits=('validation',))
    for image in sorted((root / 'validation' / 'circle').iterdir())[:2]:
        image.unlink()
    return root


@pytest.mark.skipif(sys.platform != 'linux', reason='CPU memory caps need Linux')
def test_the_chosen_micro_batch_trains_two_epochs_with_eval_and_checkpoints_under_the_same_cap(tmp_path, folder):
    config = tmp_path / 'tuned.yaml'
    tuned = run_script('tune_batch.py', '--data-dir', folder, *RUN, '--mem-budget', f'{BUDGET_MIB}MiB', '--select',
                       'max', '--epochs', '2', '--tuned-config', config, '--dry-run', '--no-cache', cwd=tmp_path,
                       env={'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache')})
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    batch = yaml.safe_load(config.read_text())['batch_size']
    assert batch < 120, 'the cap, not the train split, must bind'
    probe_peak = next(line for line in tuned.stdout.splitlines() if line.startswith('Select '))
    peak_file = tmp_path / 'peak'
    flags = tuned_flags(config)
    assert '--steady-cpu-heap' in flags, 'the trials measured the steady heap: the train command must train on it'
    # the train command as printed, its cap set only when the first epoch starts (as the probe sets it once the model
    # is built): a cap that comes after the start, as prlimit or another process taking the rest would bring it
    trained = run_script('tests/train/oom_cap_train.py', '-c', config, *flags, '--output', tmp_path / 'runs',
                         '--experiment', 'promise', cwd=tmp_path,
                         env={'OOM_CAP_MB': str(BUDGET_MIB), 'OOM_PEAK_FILE': str(peak_file)})
    log = trained.stdout + trained.stderr
    assert trained.returncode == 0, f'{probe_peak}\ntrain.py at -b {batch} under the same cap:\n{log[-3000:]}'
    assert log.count('Test: [') >= 2 and "can't allocate" not in log, 'an eval pass after each epoch'
    run = tmp_path / 'runs' / 'promise'
    assert (run / 'last.pth.tar').exists() and len(list(run.glob('checkpoint-*.pth.tar'))) == 2
    assert int(peak_file.read_text()) <= BUDGET_MIB << 20
