"""validate.py --retry: the pass is the probe under a real RLIMIT_DATA cap, every sample is computed once, an OOM at
any point continues from the first unfinished sample, other failures are never retried."""
import json
import logging
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO_ROOT
from timm_ext.validate import evaluate as validation
from timm_ext.validate.args import build_validate_parser

# The cap is set after the imports, relative to what they take, so it does not depend on the size of torch. With
# FORWARD_COUNTS set, hooks on the model count, per sample (a fingerprint of its input row), the forwards that
# completed, and the rows of every forward started, and write both there at exit.
CAPPED_VALIDATE = textwrap.dedent('''
    import atexit, json, os, resource, runpy, sys
    import torch, timm, timm_ext.validate.evaluate as validation
    completed, started = {}, [0]
    def count_forwards(build):
        def built(*args, **kwargs):
            em = build(*args, **kwargs)
            def before(module, inputs):
                started[0] += inputs[0].shape[0]
            def after(module, inputs, output):
                for row in inputs[0].double():
                    key = f'{row.sum().item():.8e}/{row.square().sum().item():.8e}'
                    completed[key] = completed.get(key, 0) + 1
            em.model.register_forward_pre_hook(before)
            em.model.register_forward_hook(after)
            return em
        return built
    if os.environ.get('FORWARD_COUNTS'):
        validation.build_eval_model = count_forwards(validation.build_eval_model)
        atexit.register(lambda: open(os.environ['FORWARD_COUNTS'], 'w').write(
            json.dumps({'completed': completed, 'started_rows': started[0]})))
    with open('/proc/self/status') as f:
        vm_data = next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmData'))
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data + int(sys.argv[1]) * 2 ** 20, resource.RLIM_INFINITY))
    sys.argv = ['validate.py'] + sys.argv[2:]
    runpy.run_path('validate.py', run_name='__main__')
''')
# test_resnet at 512 px: the 24-image set needs ~650 MiB in one batch, 12 ~360 MiB, 8 ~250 MiB (measured)
CAPPED_ARGS = ['--model', 'test_resnet', '--num-classes', '3', '--device', 'cpu', '-j', '0', '--img-size', '512',
               '--log-freq', '1']
BUDGET_MIB = 300


def run_capped(budget_mib, *argv, counts=None):
    env = {'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT), 'PATH': '/usr/bin:/bin'}
    if counts is not None:
        env['FORWARD_COUNTS'] = str(counts)
    return subprocess.run([sys.executable, '-c', CAPPED_VALIDATE, str(budget_mib), *map(str, argv)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    from timm.models import create_model
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp('retry') / 'test_resnet.pth.tar'
    torch.save({'arch': 'test_resnet', 'state_dict': create_model('test_resnet', num_classes=3).state_dict()}, path)
    return path


def printed_result(proc):
    assert '--result\n' in proc.stdout, proc.stderr[-3000:]
    return json.loads(proc.stdout.split('--result\n', 1)[1])


def test_retry_under_a_real_memory_cap_computes_every_sample_once(image_folder, checkpoint, tmp_path):
    counts = tmp_path / 'forwards.json'
    proc = run_capped(BUDGET_MIB, '--data-dir', image_folder, '--checkpoint', checkpoint, *CAPPED_ARGS,
                      '-b', '64', '--retry', counts=counts)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = printed_result(proc)
    # the 24-image set caps the first batch at 24, which cannot fit: the pass steps down the decay grid
    steps = [(int(a), int(b)) for a, b in re.findall(r'Batch size (\d+) ran out of memory after \d+ samples '
                                                     r'.*; continuing at (\d+)', proc.stderr)]
    assert steps and steps[0][0] == 24
    sizes_run = [24] + [b for _, b in steps]
    assert [a for a, _ in steps] == sizes_run[:-1] and sizes_run == sorted(sizes_run, reverse=True)
    assert result['batch_size'] == sizes_run[-1] < 24
    assert f'validated at {sizes_run[-1]}; every sample computed once' in proc.stderr
    assert proc.stderr.count('Model test_resnet created') == 1, 'nothing is rebuilt'
    assert re.findall(r'Test: \[.*?\]\s+(\d+) samples', proc.stderr)[-1] == '24'

    forwards = json.loads(counts.read_text())
    assert len(forwards['completed']) == 24, 'each of the 24 images completes a forward, and nothing else does'
    assert set(forwards['completed'].values()) == {1}, 'a sample was evaluated twice'
    assert forwards['started_rows'] > 24  # the batches that ran out of memory started, and were not counted

    # same numbers as an uncapped plain run at the size it ended at
    plain = subprocess.run([sys.executable, 'validate.py', '--data-dir', str(image_folder), '--checkpoint',
                            str(checkpoint), *CAPPED_ARGS, '-b', str(result['batch_size'])],
                           capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    reference = printed_result(plain)
    assert result['top1'] == reference['top1'] and result['top5'] == reference['top5']


def test_without_retry_the_same_cap_is_a_one_line_oom_error(image_folder, checkpoint):
    proc = run_capped(BUDGET_MIB, '--data-dir', image_folder, '--checkpoint', checkpoint, *CAPPED_ARGS, '-b', '24')
    assert proc.returncode == 1
    assert 'Traceback' not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith('validate.py: error: out of memory at batch size 24')
    assert 'pass --retry' in proc.stderr


# ---- in-process: what happens after the probe

def parse(image_folder, *argv):
    return build_validate_parser().parse_args(['--data-dir', str(image_folder), '--model', 'test_resnet',
                                               '--num-classes', '3', '--device', 'cpu', '-j', '0',
                                               '--img-size', '32', '--log-freq', '1', *map(str, argv)])


class FailOnce(torch.nn.Module):
    """Wraps a model; the forward of the `fail_at`-th real (non-zero) batch raises `error` once.

    Probe trials feed zeros, so they pass; this stands in for memory that depends on the data, which a
    cap cannot produce on demand.
    """

    def __init__(self, model, error, fail_at=2):
        super().__init__()
        self.model, self.error, self.fail_at, self.real_batches = model, error, fail_at, 0
        self.completed = {}  # forwards completed per sample (a fingerprint of its input row)

    def forward(self, x):
        if x.abs().sum() > 0:
            self.real_batches += 1
            if self.real_batches == self.fail_at:
                raise self.error
        output = self.model(x)
        for row in x.double():
            key = (row.sum().item(), row.square().sum().item())
            self.completed[key] = self.completed.get(key, 0) + 1
        return output


@pytest.fixture
def wrap_model(monkeypatch):
    """Make validation.build_eval_model wrap its model in FailOnce(error); returns the list of wrapped models."""
    wrapped = []

    def install(error):
        real_build = validation.build_eval_model

        def build(*args, **kwargs):
            em = real_build(*args, **kwargs)
            em.model = FailOnce(em.model, error)
            wrapped.append(em.model)
            return em
        monkeypatch.setattr(validation, 'build_eval_model', build)
        return wrapped
    return install


def test_oom_mid_pass_continues_at_the_next_size_from_the_first_unfinished_sample(image_folder, checkpoint,
                                                                                  wrap_model, caplog):
    device = torch.device('cpu')
    reference = validation.validate_model(parse(image_folder, '-b', '8'), 'test_resnet', str(checkpoint), device,
                                          probe_first=False)
    wrapped = wrap_model(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes."))
    caplog.set_level(logging.INFO)
    result = validation.validate_model(parse(image_folder, '-b', '8', '--retry'), 'test_resnet', str(checkpoint),
                                       device, probe_first=True)
    assert 'Batch size 8 ran out of memory after 8 samples' in caplog.text and 'continuing at 6' in caplog.text
    assert 'Batch sizes run: 8 -> 6' in caplog.text
    assert result['batch_size'] == 6
    # 8 samples at 8, then the other 16 at 6: every sample computed once, same scores as a plain pass
    assert result['top1'] == reference['top1'] and result['top5'] == reference['top5']
    assert len(wrapped) == 1 and len(wrapped[0].completed) == 24 and set(wrapped[0].completed.values()) == {1}


@pytest.mark.parametrize('error', [
    RuntimeError('CUDA error: an illegal memory access was encountered'),
    RuntimeError('mat1 and mat2 shapes cannot be multiplied (8x3 and 4x3)'),
])
def test_non_oom_failures_are_not_retried(image_folder, checkpoint, wrap_model, caplog, error):
    wrap_model(error)
    with pytest.raises(RuntimeError) as info:
        validation.validate_model(parse(image_folder, '-b', '8', '--retry'), 'test_resnet', str(checkpoint),
                                  torch.device('cpu'), probe_first=True)
    assert info.value is error
    assert 'ran out of memory' not in caplog.text and 'continuing at' not in caplog.text


def test_real_non_oom_error_in_the_pass_is_one_line_and_not_retried(image_folder, checkpoint, tmp_path):
    labels = tmp_path / 'valid.txt'
    labels.write_text('0\n7\n')  # class 7 does not exist in a 3-class model: an indexing error, not an OOM
    proc = subprocess.run([sys.executable, 'validate.py', '--data-dir', str(image_folder), '--checkpoint',
                           str(checkpoint), '--model', 'test_resnet', '--device', 'cpu', '-j', '0', '--img-size', '32',
                           '-b', '8', '--retry', '--valid-labels', str(labels)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr
    assert 'ran out of memory' not in proc.stderr and 'continuing at' not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith('validate.py: error: ')
    assert proc.stderr.count('Test: [') == 0


def test_retry_starts_at_the_prediction_without_headroom_and_steps_down_from_it(image_folder, checkpoint, tmp_path):
    """--retry with --mem-budget: the pass starts at the estimate's own batch (no headroom: it can step down), here 12
    for 300 MiB where the estimate with validate's 5% CPU headroom gives 11 (start 8); under the real 300 MiB cap 12
    runs out of memory, the pass steps down to 8 and every sample is computed once."""
    from timm_ext.validate.batch_estimate import EVAL_HEADROOM, estimate_eval_batch, start_batch
    from timm_ext.validate.args import parse_validate_args
    argv = ['--data-dir', str(image_folder), '--checkpoint', str(checkpoint), *CAPPED_ARGS, '--mem-budget',
            f'{BUDGET_MIB}MiB', '-b', '64', '--retry']
    args = parse_validate_args(argv)
    bare = estimate_eval_batch(args, 'test_resnet', 'cpu', args.mem_budget, steps_down=True)
    margined = estimate_eval_batch(args, 'test_resnet', 'cpu', args.mem_budget)
    assert bare.headroom.fraction == 0 and margined.headroom.fraction == EVAL_HEADROOM
    start = start_batch(24, bare.batch_size)
    assert start > start_batch(24, margined.batch_size), 'the margin would have started the pass lower'

    counts = tmp_path / 'forwards.json'
    proc = run_capped(BUDGET_MIB, *argv, counts=counts)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f'(the memory estimate: {bare.batch_size}); the pass starts at {start}.' in proc.stderr
    steps = re.findall(r'Batch size (\d+) ran out of memory after \d+ samples .*; continuing at (\d+)', proc.stderr)
    assert steps and int(steps[0][0]) == start, 'the pass steps down from the prediction'
    result = printed_result(proc)
    assert result['batch_size'] < start
    forwards = json.loads(counts.read_text())
    assert len(forwards['completed']) == 24 and set(forwards['completed'].values()) == {1}
