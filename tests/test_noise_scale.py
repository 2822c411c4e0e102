import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO_ROOT
from timm_ext.noise_scale import AccumGradNorms, NoiseScaleEstimator, two_batch_estimates

# Linear regression y = x.w* + eps with x ~ N(0, I_d), eps ~ N(0, sigma^2), loss 0.5 (x.w - y)^2, evaluated at
# w = w* + delta. Per-sample gradient g = x x^T delta - x eps, so G = E[g] = delta and, by Isserlis' theorem,
# Sigma = Cov[g] = |delta|^2 I + delta delta^T + sigma^2 I:
#     |G|^2 = |delta|^2,   tr(Sigma) = (d + 1) |delta|^2 + d sigma^2.
DIM, SIGMA = 8, 1.0


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(DIM, generator=gen)
    delta = torch.randn(DIM, generator=gen)
    delta = delta / delta.norm()  # |delta|^2 = 1
    model = torch.nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_true + delta)[None])
    true_g_sq = 1.0
    true_trace = (DIM + 1) * 1.0 + DIM * SIGMA ** 2
    return gen, w_true, model, true_g_sq, true_trace


def test_two_batch_estimates_solve_the_two_equations():
    g_sq, trace = 3.0, 40.0
    small, big = g_sq + trace / 4, g_sq + trace / 32
    assert two_batch_estimates(small, 4, big, 32) == pytest.approx((g_sq, trace))
    with pytest.raises(ValueError, match='b_small < b_big'):
        two_batch_estimates(small, 32, big, 32)


@pytest.mark.parametrize('micro_sizes', [[4] * 8, [6, 6, 6, 2]])
def test_accumulation_estimate_within_20_percent_of_closed_form(micro_sizes):
    gen, w_true, model, true_g_sq, true_trace = _problem()
    estimator = NoiseScaleEstimator(ema_decay=0.999)
    norms = AccumGradNorms(model.parameters())
    window = sum(micro_sizes)
    for _ in range(1500):
        model.zero_grad(set_to_none=True)
        for n in micro_sizes:
            x = torch.randn(n, DIM, generator=gen)
            y = x @ w_true + SIGMA * torch.randn(n, generator=gen)
            loss = 0.5 * (model(x).squeeze(1) - y).pow(2).mean()
            (loss * n / window).backward()  # true-mean weighting, as the training loop does
            norms.after_micro_batch(n)
        norms.end_window(estimator)
    true_b_simple = true_trace / true_g_sq
    assert estimator.g_sq == pytest.approx(true_g_sq, rel=0.2)
    assert estimator.trace_sigma == pytest.approx(true_trace, rel=0.2)
    assert estimator.b_simple == pytest.approx(true_b_simple, rel=0.2)


def test_grad_scale_is_divided_out():
    gen, w_true, model, _, _ = _problem(1)
    plain, scaled = NoiseScaleEstimator(0.9), NoiseScaleEstimator(0.9)
    x = torch.randn(2, 4, DIM, generator=gen)
    y = x @ w_true
    for estimator, scale in ((plain, 1.0), (scaled, 1024.0)):
        norms = AccumGradNorms(model.parameters())
        model.zero_grad(set_to_none=True)
        for i in range(2):
            (0.5 * scale * (model(x[i]).squeeze(1) - y[i]).pow(2).mean() / 2).backward()
            norms.after_micro_batch(4)
        norms.end_window(estimator, grad_scale=scale)
    assert scaled.g_sq == pytest.approx(plain.g_sq, rel=1e-4)
    assert scaled.trace_sigma == pytest.approx(plain.trace_sigma, rel=1e-4)


def test_single_micro_batch_window_gives_no_estimate():
    _, _, model, _, _ = _problem()
    estimator = NoiseScaleEstimator()
    norms = AccumGradNorms(model.parameters())
    model(torch.randn(4, DIM)).sum().backward()
    norms.after_micro_batch(4)
    norms.end_window(estimator)
    assert estimator.num_updates == 0 and math.isnan(estimator.b_simple)


def test_rejects_bad_decay():
    with pytest.raises(ValueError, match='ema_decay'):
        NoiseScaleEstimator(1.0)


def test_ddp_local_vs_global_estimate_two_ranks(tmp_path):
    # Two gloo ranks, each with its own data stream: local gradients (before the all-reduce, 16 samples) against
    # the averaged one (32 samples) recover the closed form.
    script = tmp_path / 'ddp_noise.py'
    script.write_text(textwrap.dedent(f'''
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from timm_ext.noise_scale import LocalGradNormHook, NoiseScaleEstimator
        dist.init_process_group('gloo')
        rank = dist.get_rank()
        torch.manual_seed(0)
        w_true = torch.randn({DIM}); delta = torch.randn({DIM}); delta = delta / delta.norm()
        model = torch.nn.Linear({DIM}, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_((w_true + delta)[None])
        ddp = DDP(model)
        hook = LocalGradNormHook(model.parameters())
        hook.register(ddp)
        est = NoiseScaleEstimator(0.999)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(1500):
            ddp.zero_grad(set_to_none=True)
            x = torch.randn(16, {DIM}, generator=gen)
            y = x @ w_true + {SIGMA} * torch.randn(16, generator=gen)
            (0.5 * (ddp(x).squeeze(1) - y).pow(2).mean()).backward()
            hook.end_window(est, local_samples=16)
        print(f'RANK{{rank}}', est.g_sq, est.trace_sigma, est.b_simple, flush=True)
        # Drop DDP (and the hook's futures) while the group is alive: gloo threads holding Python-side futures at
        # interpreter exit can abort the process.
        dist.barrier()
        del ddp, hook
        dist.destroy_process_group()
    '''))
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT)}
    out = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[:4000]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith('RANK')]
    assert len(rows) == 2
    true_trace = (DIM + 1) + DIM * SIGMA ** 2
    for _, g_sq, trace, b_simple in rows:
        assert float(g_sq) == pytest.approx(1.0, rel=0.2)
        assert float(trace) == pytest.approx(true_trace, rel=0.2)
        assert float(b_simple) == pytest.approx(true_trace, rel=0.2)
