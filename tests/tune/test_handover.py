"""tune_batch.py hands the device over completely: training starts in the probe's own process (one interpreter start)
only once nothing the probe built is alive; the distributed launcher's exec marks device files close-on-exec and ends
worker processes first."""
import gc
import importlib
import multiprocessing
import os
import subprocess
import sys
import time
import types
import weakref

import pytest
import torch
import yaml

from conftest import REPO_ROOT, run_script
from timm_ext.probe import trial as probe_train
from timm_ext.tune import handover
from timm_ext.tune.handover import close_device_files_on_exec, end_child_processes
from timm_ext.train.stack import build_training_stack

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason='exec and /proc/self/fd hand-over are Linux paths')

# every interpreter start appends "<pid> <script>" to $TIMM_EXT_TEST_STARTS
START_HOOK = '''import os, sys
with open(os.environ['TIMM_EXT_TEST_STARTS'], 'a') as f:
    f.write(f'{os.getpid()} {os.path.basename(sys.argv[0])}\\n')
'''

TUNE = ['--model', 'test_resnet', '--device', 'cpu', '--num-classes', '3', '--img-size', '32', '-j', '0',
        '--mem-budget', '48MiB', '--max-batch', '4', '--epochs', '1']


def test_training_runs_in_the_probe_process_with_one_interpreter_start(tmp_path, image_folder):
    hook = tmp_path / 'hook'
    hook.mkdir()
    (hook / 'sitecustomize.py').write_text(START_HOOK)
    starts = tmp_path / 'starts.txt'
    env = {'PYTHONPATH': os.pathsep.join(filter(None, [str(hook), os.environ.get('PYTHONPATH')])),
           'TIMM_EXT_TEST_STARTS': str(starts), 'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache')}
    result = run_script('tune_batch.py', '--data-dir', image_folder, *TUNE, '--output', tmp_path / 'runs',
                        '--experiment', 'tuned', '--tuned-config', tmp_path / 'tuned.yaml', env=env, cwd=tmp_path,
                        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    scripts = [line.split()[1] for line in starts.read_text().splitlines()]
    assert scripts == ['tune_batch.py'], f'train.py must not pay a second interpreter start: {scripts}'
    trained = yaml.safe_load((tmp_path / 'runs' / 'tuned' / 'args.yaml').read_text())
    assert trained['batch_size'] == yaml.safe_load((tmp_path / 'tuned.yaml').read_text())['batch_size']


AFTER_A_BACKWARD = '''
import os, runpy, sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
if sys.argv[1] == 'after':  # a backward before the tuner, as in a notebook: forked children cannot run autograd now
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.nn.Linear(8, 2)(torch.randn(4, 8, requires_grad=True)).sum().backward()
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def test_the_probe_chooses_a_holding_batch_in_a_process_that_has_run_a_backward(tmp_path, image_folder):
    def tuned(when: str) -> int:
        config = tmp_path / f'{when}.yaml'
        done = subprocess.run([sys.executable, '-c', AFTER_A_BACKWARD, when, str(REPO_ROOT / 'tune_batch.py'),
                               '--data-dir', str(image_folder), *TUNE, '--dry-run', '--tuned-config', str(config)],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path,
                              env={**os.environ, 'TIMM_EXT_CACHE_DIR': str(tmp_path / when)})
        assert done.returncode == 0, done.stderr[-3000:]
        assert ('Probe trials run in a fresh interpreter' in done.stderr) == (when == 'after')
        return yaml.safe_load(config.read_text())['batch_size']

    assert tuned('after') == tuned('clean')  # the host's trials are a fresh process's


def test_nothing_of_the_probe_is_alive_when_training_starts(tmp_path, image_folder, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    monkeypatch.setenv('TIMM_EXT_CACHE_DIR', str(tmp_path / 'cache'))
    monkeypatch.chdir(tmp_path)
    tune_batch = importlib.import_module('tune_batch')
    built = []  # weak references to what the probe built: its model, task and optimizer

    def recording_builder(*args, **kwargs):
        stack = build_training_stack(*args, **kwargs)
        built.extend(weakref.ref(obj) for obj in (stack.model, stack.task, stack.optimizer))
        return stack

    seen = {}

    def fake_train(argv):
        gc.collect()
        seen['argv'] = argv
        seen['alive'] = [ref() for ref in built if ref() is not None]
        return 0

    monkeypatch.setattr(probe_train, 'build_training_stack', recording_builder)
    monkeypatch.setattr(tune_batch, 'load_train_script', lambda: types.SimpleNamespace(main=fake_train))
    config = tmp_path / 'tuned.yaml'
    assert tune_batch.main(['--data-dir', str(image_folder), *TUNE, '--tuned-config', str(config)]) == 0
    assert built and seen['argv'][:2] == ['-c', str(config)]
    assert seen['alive'] == [], 'the probe\'s model, task and optimizer must be released before training starts'


def test_device_files_are_marked_close_on_exec(tmp_path):
    device_file = tmp_path / 'nvidia0'
    device_file.write_bytes(b'')
    other = tmp_path / 'kept'
    other.write_bytes(b'')
    fd, kept_fd = os.open(device_file, os.O_RDONLY), os.open(other, os.O_RDONLY)
    try:
        os.set_inheritable(fd, True)
        os.set_inheritable(kept_fd, True)
        assert close_device_files_on_exec((str(device_file),)) == 1
        assert not os.get_inheritable(fd)
        assert os.get_inheritable(kept_fd), 'only the device files are touched'
    finally:
        os.close(fd)
        os.close(kept_fd)


def test_worker_processes_are_ended_before_the_exec():
    worker = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,), daemon=True)
    worker.start()
    assert end_child_processes() >= 1
    assert not worker.is_alive() and worker.exitcode is not None


class _Cycle:
    def __init__(self):
        self.me = self  # only the cycle collector frees it
        self.tensor = torch.ones(1024)


def test_in_process_handover_resets_dynamo_then_collects_then_frees_the_device(monkeypatch):
    order = []
    gc.disable()  # the cycle must not go by chance before the handover collects it
    leftover = weakref.ref(_Cycle().tensor)
    real_reset, real_collect, real_free = torch._dynamo.reset, gc.collect, handover.free_memory
    monkeypatch.setattr(torch._dynamo, 'reset', lambda: (order.append('dynamo reset'), real_reset())[1])
    monkeypatch.setattr(gc, 'collect', lambda *a: (order.append('gc'), real_collect(*a))[1])

    def free_memory(device):
        order.append('free_memory')
        assert leftover() is None, 'the probe\'s garbage must be gone before the allocator\'s cache is emptied'
        real_free(device)

    monkeypatch.setattr(handover, 'free_memory', free_memory)
    try:
        handover.release_probe(torch.device('cpu'), compiled=True)
    finally:
        gc.enable()
    assert order[:3] == ['dynamo reset', 'gc', 'free_memory']
    order.clear()
    handover.release_probe(torch.device('cpu'), compiled=False)
    assert order[:2] == ['gc', 'free_memory']
