"""--oom-recover under DDP, on 2 gloo ranks: one status agreement per window, gradients all-reduced in buckets, BN
buffers broadcast where stock DDP broadcasts them, and a lone real OOM mid-window replayed by both ranks with the
update of one process training all their samples (`tests/train/oom_recovery_ddp_worker.py` runs on each rank)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason='the lone OOM is a real RLIMIT_DATA cap')


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp('ddp') / 'report'
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT),
           'MALLOC_MMAP_THRESHOLD_': '262144'}  # freed activations go back to the OS, as in test_oom_recovery
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                             str(REPO_ROOT / 'tests' / 'train' / 'oom_recovery_ddp_worker.py'), str(out)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(out.with_name(f'report.{rank}.json').read_text()) for rank in (0, 1)], result.stderr


def test_gradients_are_averaged_in_buckets(ranks):
    for report in ranks[0]:
        buckets = report['buckets']
        assert buckets['max_error'] < 1e-6
        assert buckets['collectives'] == buckets['buckets'] < buckets['params']  # one collective per bucket
        assert buckets['channels_last_kept']
        # two buffers made up front, the size of the largest bucket copied through them (float32 only: the float64
        # gradient is alone and contiguous, reduced in place)
        assert buckets['buffered'] == 2 * buckets['largest_copied_bucket'] == 2 * 48  # the channels_last weight


def test_ranks_agree_once_per_window_not_per_micro_batch(ranks):
    assert [report['agreements'] for report in ranks[0]] == [2, 2]  # 8 micro-batches, accumulation 4


def test_buffers_come_from_rank_0_at_the_first_forward_of_every_window(ranks):
    first, second = (report['buffers'] for report in ranks[0])
    assert len(first) == len(second) == 4  # two windows of two forwards
    assert first[0] == second[0] and first[2] == second[2], 'broadcast at each window\'s first forward'
    assert first[1] != second[1] and first[3] != second[3], 'each rank\'s own statistics inside a window'


def test_lone_oom_mid_window_is_replayed_by_both_ranks_with_the_same_update(ranks):
    reports, stderr = ranks
    for report in reports:
        assert report['lone_oom']['micro_batch'] == 2, 'both ranks split, though only rank 0 ran out'
        assert report['lone_oom']['max_diff'] < 1e-5
    replays = [line for line in stderr.splitlines() if 'OOM recovery at epoch 0 update 0' in line]
    assert len(replays) == 2 and all('out of memory on rank 0;' in line for line in replays), replays
