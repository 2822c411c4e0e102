"""The probe cache keys a schedule's sizes apart: one entry per input size, the same entry for the same size."""
import pytest

from timm_ext.probe.cache import ProbeCache, probe_key
from timm_ext.probe.table import FIT, Trial
from timm_ext.train.args import parse_args
from timm_ext.tune.img_sizes import schedule_inputs


@pytest.fixture
def args():
    parsed, _ = parse_args(['--model', 'test_resnet', '--train-img-sizes', '32', '48', '64'])
    return parsed


def key(args, input_size):
    return probe_key(args, input_size, 'cpu', 1 << 34, 1, {'budget': 48 << 20, 'start': 2})


def test_each_size_of_a_schedule_has_its_own_cache_entry(args, tmp_path):
    cache = ProbeCache(tmp_path)
    sizes = schedule_inputs(args, 3)
    for batch, size in zip((60, 24, 16), sizes):
        cache.put(key(args, size), [Trial(batch, FIT, peak_bytes=1, accepted=True)])
    assert len({cache.path(key(args, size)) for size in sizes}) == 3
    assert [cache.get(key(args, size))[0].batch_size for size in sizes] == [60, 24, 16]
    assert cache.get(key(args, (3, 40, 40))) is None
