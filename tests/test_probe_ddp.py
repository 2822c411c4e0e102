"""The probe under torchrun (2 processes, gloo on CPU): ranks agree on every trial and on the final batch."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, run_script

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason='CPU memory caps need Linux')


def torchrun(*argv, cwd, timeout=300, env=None):
    full_env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT), **(env or {})}
    return subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)


def test_ranks_agree_when_one_rank_runs_out_alone(tmp_path):
    report = tmp_path / 'probe'
    result = torchrun(REPO_ROOT / 'tests' / 'probe_ddp_worker.py', report, '160MiB', '40MiB', cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f'probe.{r}.json').read_text()) for r in (0, 1)]
    assert ranks[0]['world_size'] == 2
    assert ranks[0]['chosen'] == ranks[1]['chosen']
    assert ranks[0]['trials'] == ranks[1]['trials'], 'every trial outcome is shared'
    assert all(r['restored'] for r in ranks)
    lone = [t for t in ranks[0]['trials'] if t['status'] == 'oom' and t['error'].startswith('rank 1:')]
    assert lone, 'rank 1 (smaller budget) must be the one that ran out'
    # the agreed choice is what the small budget allows: every larger size tried failed
    chosen = ranks[0]['chosen']
    assert all(t['status'] == 'oom' for t in ranks[0]['trials'] if t['batch_size'] > chosen)


def test_tune_batch_nproc_probes_on_every_rank(tmp_path, image_folder):
    config = tmp_path / 'tuned.yaml'
    result = run_script('tune_batch.py', '--data-dir', image_folder, '--model', 'test_resnet', '--device', 'cpu',
                        '--num-classes', '3', '--img-size', '32', '-j', '0', '--mem-budget', '48MiB', '--nproc', '2',
                        '--target-global-batch', '16', '--tuned-config', config, '--dry-run', cwd=tmp_path,
                        env={'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache')})
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'distributed_train.sh 2 -c' in result.stdout
    assert '2 rank(s): global batch 16' in result.stdout
    text = config.read_text()
    assert 'batch_size:' in text and 'grad_accum_steps:' in text
