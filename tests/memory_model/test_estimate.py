"""The memory estimate: train.py's step traced on fake tensors, fitted per category, against real CPU trials."""
import json
import os
import subprocess
import sys

import pytest
import timm
import torch
import torch.nn as nn
from timm.models import register_model

from conftest import REPO_ROOT
from timm_ext.memory import PeakMeter, data_and_stack, memory_cap, steady_cpu_heap
from timm_ext.memory_model.devices import CPU_ESTIMATE_MARGIN
from timm_ext.memory_model.estimate import TRACE_BATCHES, EstimateError, _traced_reply, estimate_memory, in_child
from timm_ext.child_process import fork_runs_autograd
from timm_ext.probe.forked import isolate_trials
from timm_ext.memory_model.live_bytes import CATEGORIES, LiveBytes
from timm_ext.probe.measure import measured_trial
from timm_ext.probe.trial import build_train_trial
from timm_ext.probe.trial_host import hosted_trials
from timm_ext.train.args import parse_args

CPU = torch.device('cpu')


def run_args(*argv: str):
    args, _ = parse_args(['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
                          *argv])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    return args


class _ReadsValues(nn.Module):
    """A model whose forward reads a tensor's value, which fake tensors refuse."""

    def __init__(self, num_classes: int = 3, **kwargs):
        super().__init__()
        self.num_classes = num_classes
        self.fc = nn.Linear(3, num_classes)
        self.default_cfg = self.pretrained_cfg = {'input_size': (3, 8, 8), 'num_classes': num_classes}

    def forward(self, x):
        scale = float(x.abs().max().item())  # data-dependent: a real value is needed
        return self.fc(x.mean((2, 3)) / max(scale, 1.0))


@register_model
def estimate_test_reads_values(pretrained=False, **kwargs):
    return _ReadsValues(**kwargs)


def test_categories_add_up_to_the_traced_peak():
    estimate = estimate_memory(run_args('--opt', 'adamw'), 'cpu')
    assert sorted(estimate.traced) == sorted(TRACE_BATCHES)
    for batch_size, split in estimate.traced.items():
        assert set(split) == set(CATEGORIES)
        fitted = sum(estimate.lines[name][0] + estimate.lines[name][1] * batch_size for name in CATEGORIES)
        assert fitted == pytest.approx(sum(split.values()), rel=0.02)  # the lines are the traced peaks, fitted
    split = estimate.traced[TRACE_BATCHES[-1]]
    assert split['optimizer'] == pytest.approx(2 * split['weights'], rel=0.05)  # AdamW: two moments per weight
    assert split['activations'] > 0 and estimate.lines['activations'][1] > 0  # activations grow with the batch


def _known_step() -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        layer = nn.Linear(256, 128)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
        tracker = LiveBytes(layer.parameters(), [*layer.parameters()])
        with tracker:
            layer(torch.randn(64, 256)).sum().backward()
            optimizer.step()
        tracker.remove_hooks()
    return dict(peak=dict(tracker.peak), live=dict(tracker.live), total=tracker.peak_total)  # copies: frees follow


def test_the_tracker_counts_a_known_step_exactly():
    counted = in_child(_known_step)  # a fake backward here would keep this process from forking CPU trials
    weights = (256 * 128 + 128) * 4
    assert counted['peak']['weights'] == weights
    assert counted['live']['gradients'] == weights and counted['live']['optimizer'] == weights
    assert counted['total'] >= weights * 2 + 64 * 256 * 4  # weights, gradients and the input at least


def _measured_peaks(model: str) -> dict:
    """Real CPU trials as the probe makes them (steady heap, here oneDNN off, under a cap far above the step):
    forked from this process where it can fork them, else from a trial host (`hosted_trials`)."""
    steady_cpu_heap()
    torch.backends.mkldnn.enabled = False
    setup = build_train_trial(run_args('--model', model, '--img-size', '64'), CPU)
    with hosted_trials(setup) as host, memory_cap(CPU, 4 << 30) as cap:
        trial = host.trial(cap.budget) if host else measured_trial(
            setup.step, CPU, PeakMeter(CPU, cap.baseline), warmup_steps=1, capped=True, before=setup.reset,
            isolate=isolate_trials(CPU), warmup=setup.warmup)
        return dict(hosted=host is not None, peaks={b: trial(b).peak_bytes for b in (16, 48)})


def _use_the_process() -> None:
    """What a notebook or a larger script may have done before it probes: a fake CUDA backward (torch then refuses
    autograd in any fork of this process) and a real CPU one that leaves free heap behind."""
    _traced_reply(run_args('--model', 'test_vit', '--amp'), 'cuda', False, TRACE_BATCHES, 'train')
    model = timm.create_model('test_resnet', num_classes=3)
    model(torch.randn(64, 3, 96, 96)).sum().backward()


MEASURE = 'import json, sys\nimport test_estimate as t\nif sys.argv[2] == "used":\n    t._use_the_process()\n' \
          'print(json.dumps(dict(forks=t.fork_runs_autograd(), **t._measured_peaks(sys.argv[1]))))'


def measured_in_a_new_process(model: str, history: str = 'fresh') -> dict:
    """`_measured_peaks` in an interpreter of its own (the heap setting is process-wide; this one's history is the
    suite's), after `_use_the_process` when `history` is 'used'."""
    env = {**os.environ, 'PYTHONPATH': f'{REPO_ROOT}:{REPO_ROOT / "tests"}:{REPO_ROOT / "tests" / "memory_model"}',
           'OMP_NUM_THREADS': '1'}
    done = subprocess.run([sys.executable, '-c', MEASURE, model, history], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize('model', ['test_resnet', 'test_efficientnet', 'test_vit'])
def test_a_measured_trial_is_not_predicted_below_its_peak_by_more_than_the_margin(model):
    estimate = estimate_memory(run_args('--model', model, '--img-size', '64'), 'cpu')
    measured = measured_in_a_new_process(model)['peaks']
    for batch_size, peak in measured.items():
        assert peak, (model, batch_size)
        assert estimate.peak(int(batch_size)) >= (1 - CPU_ESTIMATE_MARGIN) * peak, (model, batch_size, peak)


def test_trials_measure_the_same_peaks_whatever_the_process_did_before():
    # a used process cannot fork trials that run autograd; run in it, its free heap served their blocks and they read
    # 0.3 MB at both batches (free heap held: 17 MB at batch 16) where a fresh process reads 28 and 61 MB
    fresh, used = measured_in_a_new_process('test_resnet'), measured_in_a_new_process('test_resnet', 'used')
    assert (fresh['forks'], fresh['hosted'], used['forks'], used['hosted']) == (True, False, False, True)
    for batch_size, peak in fresh['peaks'].items():
        assert used['peaks'][batch_size] == pytest.approx(peak, rel=0.05), batch_size


def test_a_model_that_reads_values_cannot_be_traced_and_says_so_in_one_line():
    assert 'estimate_test_reads_values' in timm.list_models('estimate_test_*')
    with pytest.raises(EstimateError, match='cannot be traced on fake tensors') as info:
        estimate_memory(run_args('--model', 'estimate_test_reads_values', '--img-size', '8'), 'cpu')
    assert '\n' not in str(info.value)


def test_a_cuda_estimate_runs_without_a_gpu_and_its_rounding_is_the_replays():
    args = run_args('--amp')
    cuda = estimate_memory(args, 'cuda')
    cpu = estimate_memory(args, 'cpu')
    assert 'not yet measured on a GPU' in cuda.device.assumptions
    split = cuda.categories(64)
    # one allocator model: the trace logs the bytes asked, and the replay rounds them into blocks and segments
    assert 'allocator' not in split and split['segments'] > 0
    assert cuda.peak(64) == cuda.replay.least_memory(64)  # one answer, the replay's
    assert cuda.device.counted(split) == pytest.approx(sum(split.values()))  # a CUDA budget counts the weights too
    assert cpu.device.counted(split) == pytest.approx(sum(split.values()) - split['weights'])  # a CPU one does not


def _nnpack_rule_and_real_peak() -> dict:
    """nnpack_kept on fake tensors at batch 14 and 16, and what the same convolution really holds (oneDNN off)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from timm_ext.memory_model.devices import nnpack_kept
    steady_cpu_heap()
    torch.backends.mkldnn.enabled = False
    args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    rule = {}
    with FakeTensorMode():
        weight = torch.empty(1280, 960, 1, 1)
        for batch in (14, 16):
            input = torch.empty(batch, 960, 1, 1)
            out = torch.ops.aten.convolution.default(input, weight, None, *args)
            rule[batch] = nnpack_kept(torch.ops.aten.convolution.default, (input, weight, None, *args), out)
    input, weight = torch.randn(16, 960, 1, 1), torch.randn(1280, 960, 1, 1)
    meter = PeakMeter(CPU, data_and_stack())
    meter.reset()
    out = torch.nn.functional.conv2d(input, weight)
    return dict(rule=rule, beside_output=meter.peak() - out.numel() * 4)


def test_nnpack_keeps_its_kernel_transform_from_batch_16_as_the_rule_says():
    found = in_child(_nnpack_rule_and_real_peak)
    kernel_tiles = 1280 * 960 * 64 * 4  # 300 MiB
    assert found['rule']['14'] == 0 and found['rule']['16'] >= kernel_tiles
    assert found['beside_output'] >= 0.9 * kernel_tiles  # measured for real: what the rule predicts is there
    assert found['beside_output'] <= 1.15 * found['rule']['16']


AFTER_A_BACKWARD = '''
import json, sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from timm_ext.memory_model.estimate import estimate_memory
from timm_ext.child_process import fork_runs_autograd
from timm_ext.train.args import parse_args
if sys.argv[1] == 'after':  # a fake backward, as a notebook that estimated before would have run
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.nn.Linear(8, 2)(torch.randn(4, 8, requires_grad=True)).sum().backward()
args, _ = parse_args(['--model', 'test_resnet', '--img-size', '32', '--num-classes', '3'])
args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
e = estimate_memory(args, 'cuda')
print(json.dumps(dict(forks=fork_runs_autograd(), peaks=[e.peak(b) for b in (1, 8, 64)])))
'''


def test_the_estimate_runs_in_a_process_that_has_run_a_backward_already():
    # torch refuses autograd in a child forked after a backward: the trace cannot fork there, and runs in-process
    def run(when: str) -> dict:
        done = subprocess.run([sys.executable, '-c', AFTER_A_BACKWARD, when], capture_output=True, text=True,
                              timeout=300, cwd=REPO_ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    clean, after = run('clean'), run('after')
    assert clean['forks'] and not after['forks']  # the case is real: the second process could not fork a trace
    assert after['peaks'] == clean['peaks']
