"""The probe under torchrun (2 processes, gloo on CPU): ranks agree on every trial and on the final batch; under a
2-node torchrun tune_batch.py prints the 2-node train command."""
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from conftest import REPO_ROOT, run_script, torchrun
from timm_ext.launch import topology_from_env, topology_from_torchrun_argv

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason='CPU memory caps need Linux')


def test_ranks_agree_when_one_rank_runs_out_alone(tmp_path):
    report = tmp_path / 'probe'
    result = torchrun(REPO_ROOT / 'tests' / 'probe' / 'probe_ddp_worker.py', report, '160MiB', '40MiB', cwd=tmp_path)
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


def test_torchrun_topology_is_read_from_its_command_line_and_environment():
    argv = [sys.executable, '-m', 'torch.distributed.run', '--nnodes', '2', '--nproc_per_node', '4', '--node_rank',
            '1', '--rdzv_backend', 'c10d', '--rdzv_endpoint', 'head:29400', '--rdzv_id', 'job7', 'tune_batch.py', '-b',
            '8']
    topology = topology_from_torchrun_argv(argv)
    assert topology.multi_node
    assert topology.torchrun_options() == ['--nnodes=2', '--nproc-per-node=4', '--rdzv-backend=c10d',
                                           '--rdzv-endpoint=head:29400', '--rdzv-id=job7']
    static = topology_from_torchrun_argv(['/venv/bin/torchrun', '--nnodes=2', '--node-rank=1', '--master-addr=head',
                                          '--master-port=1234', 'x.py'])
    assert static.torchrun_options() == ['--nnodes=2', '--nproc-per-node=1', '--node-rank=1', '--master-addr=head',
                                         '--master-port=1234']
    assert not topology_from_torchrun_argv(argv[:3] + ['--standalone', '--nproc_per_node=2', 'x.py']).multi_node
    assert topology_from_torchrun_argv([sys.executable, 'train.py']) is None
    env = {'GROUP_WORLD_SIZE': '3', 'LOCAL_WORLD_SIZE': '2', 'GROUP_RANK': '2', 'MASTER_ADDR': 'head',
           'MASTER_PORT': '29500'}
    assert topology_from_env(env).torchrun_options() == ['--nnodes=3', '--nproc-per-node=2', '--node-rank=2',
                                                         '--master-addr=head', '--master-port=29500']
    assert topology_from_env({}) is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_tune_batch_under_a_two_node_torchrun_prints_the_two_node_train_command(tmp_path, image_folder):
    endpoint = f'localhost:{free_port()}'
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'TIMM_EXT_CACHE_DIR': str(tmp_path / 'c')}
    config = tmp_path / 'tuned.yaml'
    nodes = [subprocess.Popen(
        [sys.executable, '-m', 'torch.distributed.run', '--nnodes', '2', '--nproc_per_node', '1', '--node_rank',
         str(node), '--rdzv_backend', 'c10d', '--rdzv_endpoint', endpoint, '--rdzv_id', 'tune15',
         str(REPO_ROOT / 'tune_batch.py'), '--data-dir', str(image_folder), '--model', 'test_resnet', '--device', 'cpu',
         '--num-classes', '3', '--img-size', '32', '-j', '0', '--mem-budget', '48MiB', '--target-global-batch', '16',
         '--tuned-config', str(config), '--dry-run'],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env) for node in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    text = '\n'.join(outputs)
    assert '2 rank(s): global batch 16' in text and 'distributed_train.sh' not in text
    commands = [line.split(': ', 1)[1] for line in text.splitlines()
                if line.startswith(('Train command: ', 'Train command on this node: '))]
    assert len(commands) == 2 and commands[0] == commands[1], commands  # each node prints its own, the same here
    launched = shlex.split(commands[0])
    assert launched[1:3] == ['-m', 'torch.distributed.run']
    parsed = get_args_parser().parse_args(launched[3:])
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id) == (
        '2', '1', 'c10d', endpoint, 'tune15')
    assert parsed.training_script == str(REPO_ROOT / 'train.py')
    assert parsed.training_script_args == ['-c', str(config), '--steady-cpu-heap']  # a CPU budget: the trials' heap
    assert f'Train with: {commands[0]}' in config.read_text()


def test_tune_batch_nproc_trains_with_the_command_its_ranks_planned(tmp_path, image_folder):
    # no --dry-run: the probe ranks exit, and this process becomes distributed_train.sh with the command rank 0
    # wrote into the config's header, --batch-ramp-max-micro (measured by the ranks) included
    config = tmp_path / 'tuned.yaml'
    result = run_script('tune_batch.py', '--data-dir', image_folder, '--model', 'test_resnet', '--device', 'cpu',
                        '--num-classes', '3', '--img-size', '32', '-j', '0', '--mem-budget', '48MiB', '--nproc', '2',
                        '-b', '2', '--epochs', '2', '--log-noise-scale', '--batch-ramp', '--val-split', '',
                        '--tuned-config', config, '--output', tmp_path / 'out', cwd=tmp_path,
                        env={'TIMM_EXT_CACHE_DIR': str(tmp_path / 'cache'),  # distributed_train.sh runs torchrun
                             'PATH': f'{Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}'})
    assert result.returncode == 0, result.stderr[-3000:]
    header = [line for line in config.read_text().splitlines() if line.startswith('# Train with: ')]
    assert len(header) == 1 and '--batch-ramp-max-micro' in header[0] and 'distributed_train.sh 2 -c' in header[0]
    runs = list((tmp_path / 'out').iterdir())
    assert len(runs) == 1 and (runs[0] / 'noise_scale.csv').exists() and (runs[0] / 'last.pth.tar').exists()
    planned = shlex.split(header[0][len('# Train with: '):])
    limit = int(planned[planned.index('--batch-ramp-max-micro') + 1])
    assert yaml.safe_load((runs[0] / 'args.yaml').read_text())['batch_ramp_max_micro'] == limit  # what it trained with
    assert 'Distributed training: process 0 of 2' in result.stderr


DIST_TIMEOUT_S = 3  # the stalled peer's wait; the other faults end the wait at once (the peer's sockets close)
STOPPED_LINE = ("tune_batch.py: rank 0 stopped by SIGTERM: torchrun ends every rank once one has failed (the failed "
                "rank's own line says why)")
FAULT_LINES = {
    'raise': 'rank 1: ValueError: this step cannot take a batch of 8',
    'stall': 'rank 0 waited for rank 1 (last in the trial at batch 8) in the agreement on the trial at batch 8: it '
             f'did not arrive within {DIST_TIMEOUT_S} s',
    'kill': 'rank 0 lost contact with rank 1 (last in the trial at batch 8) in the agreement on the trial at batch 8: '
            'it is gone',
    'exit': 'rank 0 lost contact with rank 1 (last in the trial at batch 8) in the agreement on the trial at batch 8: '
            'it is gone',
}


@pytest.mark.parametrize('fault', list(FAULT_LINES))
def test_a_peer_fault_in_a_trial_ends_every_rank_with_one_line_and_nothing_lost(tmp_path, image_folder, fault):
    # rank 1 fails in its first trial (batch 8): every rank must end, the survivors each with one line naming rank 1,
    # within the group's timeout of the fault; what was written before (a tuned YAML, the probe cache) stays whole
    logs, tune_dir, cache = tmp_path / 'logs', tmp_path / 'tune', tmp_path / 'cache'
    tune_dir.mkdir()
    cache.mkdir()
    config = tune_dir / 'tuned.yaml'
    config.write_text('batch_size: 4  # an earlier plan\n')
    (cache / 'earlier.json').write_text('{"earlier": true}')
    before = {p: p.read_bytes() for p in (config, cache / 'earlier.json')}
    result = torchrun('--log-dir', logs, '--redirects', '3', REPO_ROOT / 'tests' / 'probe' / 'peer_fault_worker.py',
                      fault, '--data-dir', image_folder, '--model', 'test_resnet', '--device', 'cpu', '--num-classes',
                      '3', '--img-size', '32', '-j', '0', '--mem-budget', '48MiB', '--target-global-batch', '16',
                      '--dist-timeout', DIST_TIMEOUT_S, '--tuned-config', config, '--dry-run', cwd=tmp_path,
                      timeout=240, env={'TIMM_EXT_CACHE_DIR': str(cache)})
    ended = time.time()
    assert result.returncode != 0
    if fault != 'raise':
        took = ended - float((tmp_path / 'fault_at').read_text())
        # the timeout, rank 0 ending its own trial and torchrun's teardown, on busy cores (gloo's default: 1800 s)
        assert took < DIST_TIMEOUT_S + 45, f'{took:.0f} s from the fault to the end of every rank'
    errors = {p.parent.name: p.read_text() for p in logs.rglob('stderr.log')}
    assert sorted(errors) == ['0', '1'], result.stderr[-2000:]
    for rank, text in errors.items():
        assert 'Traceback' not in text and 'terminate called' not in text, text[-2000:]
        ours = [line for line in text.splitlines() if line.startswith('tune_batch.py: ')]
        if fault == 'raise' or rank == '0' and fault != 'kill':
            assert len(ours) == 1 and FAULT_LINES[fault] in ours[0], (rank, ours)
        elif rank == '0':  # torchrun stops the survivor as soon as it sees rank 1 killed, unless it noticed first
            assert len(ours) == 1 and (FAULT_LINES[fault] in ours[0] or STOPPED_LINE in ours[0]), ours
        else:  # killed or ended early: silent; stalled: stopped by torchrun once rank 0 failed
            assert ours == ([STOPPED_LINE.replace('rank 0', 'rank 1')] if fault == 'stall' else []), ours
    assert {p: p.read_bytes() for p in before} == before, 'an earlier plan or cache entry changed'
    for written in [*tune_dir.rglob('*'), *cache.rglob('*')]:
        assert '.tmp' not in written.name, f'{written}: a half-written file was left'
        if written.suffix == '.json':
            json.loads(written.read_text())  # complete, or not there at all
