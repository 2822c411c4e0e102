"""The CUDA memory model's corrections, each checked against what it corrects (no GPU needed)."""
import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from timm_ext.memory import parse_budget
from timm_ext.memory_model.autocast_casts import CudaAutocastCasts
from timm_ext.memory_model.devices import device_model
from timm_ext.memory_model.estimate import MemoryEstimate, estimate_memory
from timm_ext.memory_model.live_bytes import CATEGORIES, LiveBytes
from timm_ext.tune.estimate_plan import plan_from_estimate
from timm_ext.train.args import parse_args

GiB = 1 << 30
MiB = 1 << 20


def run_args(*argv: str):
    args, _ = parse_args(['--model', 'test_convnext', '--num-classes', '3', '--img-size', '64', '--device', 'cuda',
                          *argv])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    return args


def _saved_by_layer_norm(casts: bool):
    """Bytes live after a half-precision linear layer and a LayerNorm, traced under CPU autocast."""
    with FakeTensorMode():
        fc, x = nn.Linear(256, 256), torch.randn(64, 256, requires_grad=True)
        tracker = LiveBytes(fc.parameters())
        with tracker, torch.autocast('cpu', dtype=torch.float16), (CudaAutocastCasts() if casts else nullcontext()):
            out = F.layer_norm(fc(x), (256,))
            dtype = out.dtype
            live = tracker.live['activations']
    return live, dtype


def test_cuda_autocast_runs_layer_norm_in_float32_and_the_trace_keeps_its_float32_input():
    cpu_bytes, cpu_dtype = _saved_by_layer_norm(casts=False)
    cuda_bytes, cuda_dtype = _saved_by_layer_norm(casts=True)
    assert cpu_dtype == torch.float16 and cuda_dtype == torch.float32
    # CUDA saves a float32 copy of the 64 x 256 input and returns float32, where CPU keeps both in half precision
    assert cuda_bytes - cpu_bytes >= 64 * 256 * (4 + 4 - 2 - 2)


def test_the_cuda_estimate_of_a_layer_norm_model_counts_the_float32_casts():
    cuda = estimate_memory(run_args('--amp'), 'cuda')
    cpu_casts = estimate_memory(run_args('--amp', '--device', 'cpu'), 'cpu')
    per_sample = {name: (e.peak(64) - e.peak(32)) / 32 for name, e in (('cuda', cuda), ('cpu', cpu_casts))}
    assert per_sample['cuda'] > 1.05 * per_sample['cpu']  # ConvNeXt's LayerNorms save float32 copies on CUDA


def _estimate(lines, grad_bytes: int = 0) -> MemoryEstimate:
    full = {name: (0.0, 0.0) for name in CATEGORIES}
    full.update(lines)
    device = dataclasses.replace(device_model('cuda'), fixed={})
    return MemoryEstimate(full, {}, device, 'synthetic', 0.0, grad_bytes)


def test_an_accumulating_micro_batch_starts_with_every_gradient_resident():
    estimate = _estimate({'weights': (100 * MiB, 0.0), 'activations': (0.0, 10 * MiB), 'gradients': (30 * MiB, 0.0)},
                         grad_bytes=100 * MiB)
    assert estimate.peak(10, accumulating=True) - estimate.peak(10) == pytest.approx(70 * MiB)
    assert estimate.largest_batch(1 * GiB, accumulating=True) < estimate.largest_batch(1 * GiB)


def test_a_plan_that_accumulates_is_held_to_the_peak_with_gradients_resident():
    # 64 fits without the gradients, not with them: a global batch of 256 on one rank accumulates, so 32 is planned
    estimate = _estimate({'weights': (100 * MiB, 0.0), 'activations': (0.0, 10 * MiB)}, grad_bytes=200 * MiB)
    args = parse_args(['--model', 'resnet50', '--device', 'cuda', '--batch-size', '64'])[0]
    args.mem_headroom, args.max_batch, args.batch_multiple, args.select = 0.0, None, 8, 'max'
    args.target_global_batch = 256
    budget = ('0.8GiB', parse_budget(f'{100 * MiB + 64 * 10 * MiB + 50 * MiB}B'))
    plan, = plan_from_estimate(args, 'cuda', estimate, [budget], 1, 256)
    assert plan.plan.accum_steps > 1
    assert plan.plan.micro_batch < 64
    assert estimate.peak(plan.plan.micro_batch, accumulating=True) <= plan.usable


def test_a_size_without_a_named_card_is_the_allocators_own_whatever_its_value():
    # one meaning of --mem-budget: no nominal card is guessed from '24GiB', and no context comes off it
    for text in ('24GiB', '80GB', '23.7GiB'):
        assert device_model('cuda').plan_in(parse_budget(text), text) == (parse_budget(text).num_bytes,) * 2


def test_a_fraction_of_the_device_here_is_not_taken_off_the_context_twice(monkeypatch):
    from timm_ext.memory import MemoryBudget
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(MemoryBudget, 'resolve', lambda self, device: int(self.fraction * 20 * GiB))
    num_bytes, usable = device_model('cuda').plan_in(parse_budget('0.5'), '0.5')
    assert num_bytes == usable == 10 * GiB  # what the device can still give has the context out of it already


def test_an_ema_kept_on_the_host_is_not_counted_on_the_card():
    plain = estimate_memory(run_args('--amp'), 'cuda')
    on_card = estimate_memory(run_args('--amp', '--model-ema'), 'cuda')
    on_host = estimate_memory(run_args('--amp', '--model-ema', '--model-ema-force-cpu'), 'cuda')
    # the EMA's copy is a few hundred KiB: it shows in the weights, and may fit in a segment's free tail
    assert on_card.categories(16)['weights'] > plain.categories(16)['weights']
    assert on_card.peak(16) >= plain.peak(16)
    assert on_host.categories(16)['weights'] == plain.categories(16)['weights']
    assert on_host.peak(16) == pytest.approx(plain.peak(16), rel=1e-6)
    assert on_host.grad_bytes == plain.grad_bytes > 0


def test_the_forward_only_estimates_hold_far_less_than_an_update():
    train = estimate_memory(run_args('--amp'), 'cuda')
    evaluate = estimate_memory(run_args('--amp'), 'cuda', step_kind='eval')
    validate = estimate_memory(run_args('--amp'), 'cuda', step_kind='validate')
    assert validate.peak(64) < evaluate.peak(64) < train.peak(64)
    # train.py's evaluation holds the optimizer state, validate.py's forward the weights alone
    assert evaluate.categories(64)['optimizer'] > 0 == validate.categories(64)['optimizer']
    assert validate.largest_batch(1 * GiB) > 2 * train.largest_batch(1 * GiB)


def test_attention_windows_limit_the_batch_to_65535_rows_whatever_the_card():
    # a windowed attention of 64 windows a sample: batch 1024 would be 65536 rows (timm's tables: davit_tiny, hieradet)
    estimate = _estimate({'activations': (0.0, 1 * MiB)})
    estimate = dataclasses.replace(estimate, kernel_sizes={'attention flash': 64.0})
    assert estimate.largest_batch(1000 * GiB) == 1023 == estimate.largest_batch(2000 * GiB)
    assert estimate.largest_batch(100 * MiB) == 100  # where memory binds first, memory decides
