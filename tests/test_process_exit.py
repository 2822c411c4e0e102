"""How a distributed rank's process ends: `exit_process` never lets the interpreter finalize around gloo's threads.

A gloo worker thread that wants the GIL while the interpreter finalizes (it drops the last reference to a collective's
tensor, or runs a future's callback) is killed there, and the forced unwind aborts the process with "terminate called
without an active exception": a rank that had finished well dies of SIGABRT (seen in the stop-flag test's rank 0).
DistributedDataParallel keeps the backend, and its threads, alive after `destroy_process_group`, so only ending the
process without finalizing is safe once the group is over.
"""
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason="reads gloo's threads from /proc")

SCRIPT = textwrap.dedent('''
    import atexit, sys
    import torch, torch.distributed as dist, torch.nn as nn
    from timm_ext.distributed import end_process_group, exit_process, gloo_threads_alive
    dist.init_process_group('gloo', init_method='file://' + sys.argv[1], rank=0, world_size=1)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    model(torch.randn(2, 4)).sum().backward()
    end_process_group()
    atexit.register(print, 'exit handlers ran', flush=True)
    print(f'threads after the end: {gloo_threads_alive()}')
    sys.stdout.write('unflushed')  # a buffered write os._exit alone would lose
    exit_process(3)
''')


def test_a_rank_whose_ddp_model_holds_gloo_ends_without_finalizing_and_loses_no_output(tmp_path):
    result = subprocess.run([sys.executable, '-c', SCRIPT, str(tmp_path / 'store')], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env={'PYTHONPATH': str(REPO_ROOT), 'OMP_NUM_THREADS': '1'})
    assert result.returncode == 3, result.stderr[-2000:]
    # the precondition of the abort: DDP still holds the backend (its threads run) once the group has ended
    assert result.stdout.splitlines()[0] == 'threads after the end: True', result.stdout
    assert 'unflushed' in result.stdout and 'exit handlers ran' in result.stdout
    assert 'terminate called' not in result.stderr

