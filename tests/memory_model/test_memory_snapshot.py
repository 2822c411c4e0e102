"""The predicted memory snapshot: PyTorch's own viewer reads it, and its segments are the replay's reserved memory."""
import os
import pickle
import stat
import subprocess
import sys

from conftest import run_script


def _viz(action: str, path, home) -> subprocess.CompletedProcess:
    env = {**os.environ, 'HOME': str(home)}
    return subprocess.run([sys.executable, '-m', 'torch.cuda._memory_viz', action, str(path)], capture_output=True,
                          text=True, env=env, timeout=120)


def test_validate_writes_a_snapshot_that_memory_viz_reads_and_whose_segments_add_up(tmp_path):
    path = tmp_path / 's.pickle'
    done = run_script('validate.py', '--model', 'resnet50', '--amp', '--device', 'cuda', '--gpu', 'rtx3090',
                      '--estimate', '--memory-snapshot', path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    command = done.stdout.split('command:')[1]
    assert 'Memory snapshot (predicted' in done.stdout and '--memory-snapshot' not in command and '--gpu' not in command
    snapshot = pickle.loads(path.read_bytes())
    segments = snapshot['segments']
    assert segments and all(sum(b['size'] for b in s['blocks']) == s['total_size'] for s in segments)
    assert sum(s['total_size'] for s in segments) == snapshot['predicted']['reserved_at_peak']
    live = sum(b['size'] for s in segments for b in s['blocks'] if b['state'] == 'active_allocated')
    assert live == snapshot['predicted']['peak_allocated']
    frames = [b['frames'] for s in segments for b in s['blocks'] if b['state'] == 'active_allocated']
    assert any(f and f[0]['name'].startswith('convolution') for f in frames)  # the op that made each block
    actions = {e['action'] for e in snapshot['device_traces'][0]}
    assert {'alloc', 'free_requested', 'free_completed', 'segment_alloc'} <= actions

    stats = _viz('stats', path, tmp_path)
    assert stats.returncode == 0, stats.stderr
    assert f'segments: {len(segments)}' in stats.stdout
    # `segments` renders a flame graph with flamegraph.pl, which it downloads on first use: here a stand-in that
    # passes its input through (the snapshot's parsing is what is checked)
    script = tmp_path / '.cache' / 'flamegraph.pl'
    script.parent.mkdir()
    script.write_text('#!/bin/sh\ncat\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / 'segments.txt'
    drawn = subprocess.run([sys.executable, '-m', 'torch.cuda._memory_viz', 'segments', str(path), '-o', str(out)],
                           capture_output=True, text=True, env={**os.environ, 'HOME': str(tmp_path)}, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    assert 'active_allocated' in out.read_text()
    assert (tmp_path / 's.png').stat().st_size > 10_000  # matplotlib is in the test requirements


def test_a_snapshot_needs_the_estimate_and_a_cuda_device(tmp_path):
    without = run_script('validate.py', '--model', 'resnet18', '--device', 'cuda', '--memory-snapshot',
                         tmp_path / 's.pickle', '--data-dir', tmp_path)
    assert without.returncode != 0 and 'add --estimate' in without.stderr and 'Traceback' not in without.stderr
    cpu = run_script('tune_batch.py', '--model', 'resnet18', '--device', 'cpu', '--estimate', '--memory-snapshot',
                     tmp_path / 's.pickle')
    assert cpu.returncode != 0 and 'add --device cuda' in cpu.stderr and 'Traceback' not in cpu.stderr
    assert not (tmp_path / 's.pickle').exists()
