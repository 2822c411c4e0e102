import math

import pytest
import torch

from timm_ext.train.noise_scale import NoiseScaleEstimator, grads_of, squared_norm, two_batch_estimates

# The estimate through the real training loop (one process, OOM-split pieces, two gloo ranks) is checked against the
# closed form of a linear regression in tests/test_noise_scale_train.py; these tests cover the estimator itself.


def test_two_batch_estimates_solve_the_two_equations():
    g_sq, trace = 3.0, 40.0
    small, big = g_sq + trace / 4, g_sq + trace / 32
    assert two_batch_estimates(small, 4, big, 32) == pytest.approx((g_sq, trace))
    with pytest.raises(ValueError, match='b_small < b_big'):
        two_batch_estimates(small, 32, big, 32)


def test_estimator_ema_recovers_noisy_pairs():
    # Squared norms drawn around their expectations E|G_B|^2 = |G|^2 + tr(Sigma) / B, with noise of the size real
    # small batches show; the bias-corrected EMAs land on the true terms and B_simple = tr / |G|^2 = 20.
    gen = torch.Generator().manual_seed(0)
    g_sq, trace = 2.0, 40.0
    estimator = NoiseScaleEstimator(ema_decay=0.99)
    for _ in range(2000):
        small = (g_sq + trace / 4) * (1 + 0.3 * torch.randn(1, generator=gen).item())
        big = (g_sq + trace / 32) * (1 + 0.1 * torch.randn(1, generator=gen).item())
        estimator.update(small, 4, big, 32)
    assert estimator.g_sq == pytest.approx(g_sq, rel=0.2)
    assert estimator.trace_sigma == pytest.approx(trace, rel=0.1)
    assert estimator.b_simple == pytest.approx(trace / g_sq, rel=0.2)


def test_bias_correction_makes_first_update_exact():
    estimator = NoiseScaleEstimator(ema_decay=0.95)
    assert math.isnan(estimator.b_simple) and math.isnan(estimator.g_sq)
    estimator.update(torch.tensor(13.0), 4, torch.tensor(4.25), 32)  # |G|^2 = 3, tr = 40
    assert estimator.g_sq == pytest.approx(3.0) and estimator.trace_sigma == pytest.approx(40.0)
    assert estimator.num_updates == 1


def test_b_simple_undefined_while_g_sq_not_positive():
    estimator = NoiseScaleEstimator()
    estimator.update(10.0, 4, 10.5, 32)  # big batch noisier than the small one: |G|^2 estimate > 0, tr < 0
    assert math.isnan(estimator.b_simple)


def test_squared_norm_over_grads():
    model = torch.nn.Linear(3, 2)
    assert grads_of(model.parameters()) == []
    model(torch.ones(1, 3)).sum().backward()
    # d/dW sum(Wx + b) = x for each row, d/db = 1: |grad|^2 = 2 * 3 + 2
    assert float(squared_norm(grads_of(model.parameters()))) == pytest.approx(8.0)


def test_rejects_bad_decay():
    with pytest.raises(ValueError, match='ema_decay'):
        NoiseScaleEstimator(1.0)


def test_state_dict_round_trip_continues_the_same_emas():
    pairs = [(torch.tensor(9.0), 4, torch.tensor(3.0), 16), (11.0, 4, 2.5, 16), (8.0, 4, 3.5, 16)]
    whole = NoiseScaleEstimator(0.9)
    for pair in pairs:
        whole.update(*pair)
    first = NoiseScaleEstimator(0.9)
    first.update(*pairs[0])
    resumed = NoiseScaleEstimator(0.9)
    resumed.load_state_dict(first.state_dict())
    for pair in pairs[1:]:
        resumed.update(*pair)
    assert resumed.num_updates == 3
    assert resumed.b_simple == pytest.approx(whole.b_simple, rel=1e-6)  # float32 tensors vs saved floats
    assert all(isinstance(v, (int, float)) for v in first.state_dict().values())  # no device tensors in checkpoints


def test_float16_windows_cost_no_host_read_and_an_overflow_is_skipped_on_the_device():
    from torch.utils._python_dispatch import TorchDispatchMode

    from timm_ext.train.noise_monitor import NoiseScaleMonitor

    class HostReads(TorchDispatchMode):  # every .item() / float() / bool() of a tensor goes through this op
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                HostReads.reads += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    monitor = NoiseScaleMonitor(model.parameters())
    scaler = torch.amp.GradScaler('cpu', init_scale=1024.0)

    def window(poison: bool = False) -> None:
        for _ in range(2):
            monitor.before_backward()
            loss = model(torch.randn(4, 6)).square().mean() * 0.5
            scaler.scale(loss).backward()
            monitor.after_backward(4, 0.5)
        if poison:
            model.weight.grad[0, 0] = math.inf  # what a float16 overflow leaves
        with HostReads():
            monitor.end_window(8, scaler._get_scale_async(), check_finite=True)
        model.zero_grad(set_to_none=True)

    window()
    window()
    assert HostReads.reads == 0
    before = monitor.estimator.state_dict()
    window(poison=True)
    assert HostReads.reads == 0
    assert monitor.estimator.state_dict() == before, 'the overflowed window must not move the estimate'
    assert monitor.estimator.pairs == 4 and math.isfinite(monitor.estimator.g_sq)
