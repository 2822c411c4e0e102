import pytest

from timm_ext.accum import accumulation_windows, plan_accumulation


def test_fourteen_batches_accum_eight_is_two_updates():
    windows = accumulation_windows(14, 8)
    assert [list(w) for w in windows] == [list(range(8)), list(range(8, 14))]


@pytest.mark.parametrize('n', range(0, 40))
@pytest.mark.parametrize('k', [1, 2, 3, 8, 16])
def test_windows_cover_each_batch_once_in_ceil_n_over_k(n, k):
    windows = accumulation_windows(n, k)
    assert len(windows) == -(-n // k)
    assert [i for w in windows for i in w] == list(range(n))
    assert all(len(w) == k for w in windows[:-1])


def test_exact_plan_keeps_global_batch():
    plan = plan_accumulation(4096, world_size=8, max_micro_batch=192)
    assert (plan.micro_batch, plan.accum_steps, plan.global_batch, plan.exact) == (128, 4, 4096, True)
    plan = plan_accumulation(1024, world_size=1, max_micro_batch=300)
    assert (plan.micro_batch, plan.accum_steps) == (256, 4)
    # Everything fits: no accumulation.
    plan = plan_accumulation(256, world_size=2, max_micro_batch=1000)
    assert (plan.micro_batch, plan.accum_steps, plan.exact) == (128, 1, True)


def test_inexact_plan_is_nearest_and_says_why():
    # 1031 is prime: only micro-batch 1 would be exact. Nearest with micro-batch in [256, 512]:
    plan = plan_accumulation(1031, world_size=1, max_micro_batch=512)
    assert not plan.exact
    # 1030 has no divisor in [256, 512] (2 x 515 needs 515); 1032 = 3 x 344 is the nearest that can be built.
    assert (plan.micro_batch, plan.accum_steps, plan.global_batch) == (344, 3, 1032)
    assert 'rescaled' in plan.reason and '1031' in plan.reason


def test_global_smaller_than_world():
    plan = plan_accumulation(3, world_size=4, max_micro_batch=64)
    assert (plan.micro_batch, plan.accum_steps, plan.global_batch, plan.exact) == (1, 1, 4, False)


@pytest.mark.parametrize('kwargs, name', [
    (dict(target_global=0, world_size=1, max_micro_batch=8), 'target_global'),
    (dict(target_global=64, world_size=0, max_micro_batch=8), 'world_size'),
    (dict(target_global=64, world_size=1, max_micro_batch=0), 'max_micro_batch'),
])
def test_plan_rejects_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        plan_accumulation(**kwargs)


def test_windows_reject_bad_values():
    with pytest.raises(ValueError, match='accum_steps'):
        accumulation_windows(10, 0)


def test_mixup_plans_only_even_micro_batches():
    assert (plan_accumulation(18, 1, 16).micro_batch, plan_accumulation(18, 1, 16).accum_steps) == (9, 2)
    even = plan_accumulation(18, 1, 16, multiple=2)
    assert even.micro_batch % 2 == 0 and not even.exact and abs(even.global_batch - 18) <= 2
    assert plan_accumulation(64, 2, 15, multiple=2).micro_batch % 2 == 0
