"""tune_batch's decisions under torchrun (2 processes, gloo on CPU): ranks whose wall times differ decide alike."""
import json
import sys

import pytest

from conftest import REPO_ROOT, torchrun

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason='gloo ranks under torchrun')


def test_ranks_with_different_trial_times_take_rank_0s_branch(tmp_path):
    report = tmp_path / 'branch'
    result = torchrun(REPO_ROOT / 'tests' / 'tune' / 'rank_branch_worker.py', report, cwd=REPO_ROOT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads((tmp_path / f'branch.{rank}.json').read_text())['lines'] for rank in (0, 1)]
    # rank 0's trial was the slow one: judging a bigger batch does not pay there, so no rank judges it
    assert lines[0][-1].startswith('Kept it: the run is predicted'), lines[0]
    assert lines[1][-1].startswith('Kept it: the run is predicted'), lines[1]
