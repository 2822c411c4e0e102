import pytest
from timm.utils import decay_batch_step as timm_decay_batch_step

from timm_ext.batch_decay import batch_descent, decay_batch_step


@pytest.mark.parametrize('no_odd', [False, True])
@pytest.mark.parametrize('num_intra_steps', [1, 2, 3, 4, 8])
def test_matches_timm_for_every_size(num_intra_steps, no_odd):
    mismatches = [
        bs for bs in range(0, 10001)
        if decay_batch_step(bs, num_intra_steps, no_odd) != timm_decay_batch_step(bs, num_intra_steps, no_odd)
    ]
    assert mismatches == []


def test_known_grids():
    assert batch_descent(1024) == [1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert batch_descent(64, num_intra_steps=1) == [64, 32, 16, 8, 4, 2, 1]
    assert batch_descent(20, num_intra_steps=4, no_odd=True) == [20, 16, 14, 12, 10, 8, 6, 4, 2]
    assert batch_descent(1) == [1]
    # A size that is not on the grid steps onto it first.
    assert batch_descent(1000)[:3] == [1000, 768, 512]


def test_descent_is_timm_sequence_from_odd_start():
    seq, bs = [], 777
    while bs > 0:
        seq.append(bs)
        bs = timm_decay_batch_step(bs, 3)
    assert batch_descent(777, 3) == seq


@pytest.mark.parametrize('bad', [0, -4, 2.5])
def test_descent_rejects_bad_start(bad):
    with pytest.raises(ValueError, match='start'):
        batch_descent(bad)


@pytest.mark.parametrize('bad', [0, -1])
def test_rejects_bad_intra_steps(bad):
    with pytest.raises(ValueError, match='num_intra_steps'):
        decay_batch_step(64, bad)
