"""Faults lose nothing, tested with real faults: a full disk, SIGTERM / SIGINT, a killed DDP rank, a garbled or
contended probe cache, and SIGKILL during a probe."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from conftest import REPO_ROOT, train_in_process
from timm_ext.train.checkpoint import load_training_checkpoint
from timm_ext.probe.table import FIT, Trial
from timm_ext.probe.cache import ProbeCache
from timm_ext.synthetic_data import make_image_folder

pytestmark = pytest.mark.skipif(sys.platform != 'linux', reason='the faults are made with Linux tools')

BASE = ['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu', '-j', '0',
        '-b', '4', '--log-interval', '5']
# on the small disk: a constant LR and 2 kept epoch checkpoints of 3 MB each
DISK_RUN = [*BASE, '--sched', 'none', '--lr', '0.01', '--checkpoint-hist', '2']
ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}


@pytest.fixture(scope='module')
def long_folder(tmp_path_factory) -> Path:
    """120 training images: 30 updates of 4 per epoch, so a signal lands inside an epoch."""
    return make_image_folder(tmp_path_factory.mktemp('data40'), per_class=40)


def error_lines(stderr: str):
    assert 'Traceback' not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith('train.py:')]


def digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


def summary_epochs(path: Path) -> list:
    lines = path.read_text().splitlines()
    assert lines[0].startswith('epoch,') and sum(line.startswith('epoch,') for line in lines) == 1
    return [int(line.split(',', 1)[0]) for line in lines[1:]]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.1)


def children(pid: int) -> list:
    try:
        return [int(c) for c in Path(f'/proc/{pid}/task/{pid}/children').read_text().split()]
    except FileNotFoundError:
        return []


def running(pid: int) -> bool:
    try:
        state = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ('Z', 'X')  # a zombie has stopped; only its exit status waits for a reaper


# ---- a full disk -------------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs (needs root), room for a few test_resnet checkpoints of 3 MB; unmounted afterwards."""
    disk = tmp_path / 'disk'
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=32m', 'tmpfs', str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip('mounting a tmpfs needs root')
    yield disk
    subprocess.run(['umount', '-l', str(disk)], check=False)


def test_disk_full_while_saving_keeps_previous_files_and_resumes(image_folder, small_disk):
    run = small_disk / 'run'
    first = train_in_process('--data-dir', image_folder, '--output', small_disk, '--experiment', 'run',
                             *DISK_RUN, '--epochs', '3')
    assert first.returncode == 0, first.stderr[-3000:]
    before = digests(run)
    assert {'last.pth.tar', 'model_best.pth.tar', 'summary.csv', 'last.safetensors', 'model_best.safetensors'} <= set(
        before)

    # leave room for args.yaml and summary.csv, not for a checkpoint
    filler = small_disk / 'filler'
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b'\0' * (free - 64 * 1024))
    full = train_in_process('--data-dir', image_folder, '--output', small_disk, '--experiment', 'run',
                            *DISK_RUN, '--epochs', '5', '--resume', run / 'last.pth.tar')
    assert full.returncode == 1
    errors = error_lines(full.stderr)
    assert len(errors) == 1 and f'no space left in {run}: writing last.pth.tar needs about' in errors[0], errors
    assert 'bytes are free' in errors[0]
    after = digests(run)
    for name in before:
        if name not in ('summary.csv', 'args.yaml'):
            assert after[name] == before[name], f'{name} changed'
    assert not [p for p in run.iterdir() if p.name.endswith('.tmp')], 'no temporary file left behind'
    assert summary_epochs(run / 'summary.csv') == [0, 1, 2, 3]  # whole rows; epoch 3 is dropped on resume
    assert load_training_checkpoint(run / 'last.pth.tar')['epoch'] == 2

    filler.unlink()
    resumed = train_in_process('--data-dir', image_folder, '--output', small_disk, '--experiment', 'run',
                               *DISK_RUN, '--epochs', '5', '--resume', run / 'last.pth.tar')
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary_epochs(run / 'summary.csv') == [0, 1, 2, 3, 4]


# ---- SIGTERM, SIGINT, and a DDP rank killed --------------------------------------------------------------------------

@contextmanager
def training_after_first_epoch(data: Path, out: Path, ranks: int = 1) -> Iterator[subprocess.Popen]:
    """A long train.py run (torchrun with `ranks` > 1), yielded once its first epoch is saved; killed at the end."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ['-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={ranks}']
    proc = subprocess.Popen(
        [*launcher, str(REPO_ROOT / 'train.py'), '--data-dir', str(data), '--output', str(out),
         '--experiment', 'run', *BASE, '--epochs', '100'],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, cwd=out.parent)
    try:
        wait_for(lambda: (out / 'run' / 'last.pth.tar').exists(), 180, 'the first epoch checkpoint')
        yield proc
    finally:
        proc.kill()


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_signal_stops_after_an_update_with_a_resumable_checkpoint(long_folder, tmp_path, signum):
    out = tmp_path / 'out'
    with training_after_first_epoch(long_folder, out) as proc:
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1 and f'stopped by {signal.Signals(signum).name} after epoch' in lines[0], lines
    recovery = Path(lines[0].rsplit('--resume ', 1)[1])
    state = load_training_checkpoint(recovery)
    epoch, updates_done = state['epoch'], state['updates_done']
    assert recovery.name == f'recovery-{epoch}-{updates_done - 1}.pth.tar'
    load_training_checkpoint(out / 'run' / 'last.pth.tar')
    if signum == signal.SIGINT:
        return  # the same checkpoint as SIGTERM's; resuming it is checked once
    resumed = train_in_process('--data-dir', long_folder, '--output', out, '--experiment', 'run', *BASE,
                               '--epochs', epoch + 1, '--resume', recovery)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f'Resuming epoch {epoch} at update {updates_done}/30' in resumed.stderr
    assert summary_epochs(out / 'run' / 'summary.csv') == list(range(epoch + 1))


def test_killed_rank_ends_the_other_within_bounded_time(long_folder, tmp_path):
    out = tmp_path / 'out'
    with training_after_first_epoch(long_folder, out, ranks=2) as proc:
        ranks = children(proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - killed_at
    assert proc.returncode != 0
    assert took < 60, f'the surviving rank took {took:.0f} s to stop'
    ours = [line for line in err.splitlines() if line.startswith('train.py:')]
    # DDP's all-reduce says the processes of the run, a bounded wait (a log line's loss) names the rank
    assert len(ours) == 1 and 'rank 0 lost contact with ' in ours[0], err[-3000:]
    assert not any(running(pid) for pid in ranks), 'both ranks have exited'
    load_training_checkpoint(out / 'run' / 'last.pth.tar')


def test_sigterm_to_torchrun_stops_both_ranks_after_the_same_update(long_folder, tmp_path):
    with training_after_first_epoch(long_folder, tmp_path / 'out', ranks=2) as proc:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
        _, err = proc.communicate(timeout=90)
    ours = [line for line in err.splitlines() if line.startswith('train.py:')]
    assert len(ours) == 2 and all('stopped by SIGTERM after epoch' in line for line in ours), err[-3000:]
    assert len({line.split('; resume')[0] for line in ours}) == 1, 'both ranks stopped after the same update'
    recovery = Path(next(line for line in ours if '--resume' in line).rsplit('--resume ', 1)[1])
    assert load_training_checkpoint(recovery)['updates_done'] >= 1


# ---- the probe cache ---------------------------------------------------------------------------------------------

KEY = {'model': 'test_resnet', 'budget': 1}
TRIALS = [Trial(b, FIT, peak_bytes=b * 1000, ms_per_step=1.0, samples_per_s=float(b)) for b in (2, 4, 8, 16)]


@pytest.mark.parametrize('damage', ['garbage', 'truncated', 'a list', 'bad trial'])
def test_damaged_cache_file_is_a_warning_and_a_miss(tmp_path, caplog, damage):
    cache = ProbeCache(tmp_path)
    path = cache.put(KEY, TRIALS)
    text = path.read_text()
    path.write_text({'garbage': '\x00\xff not json', 'truncated': text[:len(text) // 2], 'a list': '[1, 2]',
                     'bad trial': json.dumps({'key': KEY, 'trials': [{'batch_size': 'x'}]})}[damage])
    assert cache.get(KEY) is None
    assert 'Ignoring unreadable probe cache file' in caplog.text and 'probing afresh' in caplog.text
    cache.put(KEY, TRIALS)  # the fresh probe's result replaces it
    assert [t.batch_size for t in cache.get(KEY)] == [2, 4, 8, 16]


WRITER = """
import sys
from timm_ext.probe.table import FIT, Trial
from timm_ext.probe.cache import ProbeCache
cache, n = ProbeCache(sys.argv[1]), int(sys.argv[2])
for i in range(100):
    cache.put({'model': 'test_resnet', 'budget': 1}, [Trial(n, FIT, peak_bytes=i, error='x' * 5000)] * 50)
"""


def test_two_writers_at_once_never_leave_half_a_file(tmp_path):
    cache = ProbeCache(tmp_path)
    writers = [subprocess.Popen([sys.executable, '-c', WRITER, str(tmp_path), str(n)], env=ENV, cwd=REPO_ROOT)
               for n in (1, 2)]
    seen = set()
    while any(w.poll() is None for w in writers):
        path = cache.path(KEY)
        if path.exists():
            entry = json.loads(path.read_text())  # a torn file would fail here
            sizes = {t['batch_size'] for t in entry['trials']}
            assert len(entry['trials']) == 50 and len(sizes) == 1
            seen |= sizes
    assert [w.returncode for w in writers] == [0, 0]
    assert seen, 'the reader saw the file while it was being written'
    assert not list(tmp_path.glob('.*.tmp'))


# ---- SIGKILL during a probe ----------------------------------------------------------------------------------------

def test_sigkill_during_probe_leaves_no_trial_process(long_folder, tmp_path):
    """The trial after the first (a large batch at 160 px) takes seconds; its process must end with the killed probe.
    --select max: the search for the largest batch always checks above its first fit (a recipe's split may need one
    trial only)."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / 'tune_batch.py'), '--data-dir', str(long_folder), '--model', 'test_resnet',
         '--device', 'cpu', '--num-classes', '3', '--img-size', '160', '-j', '0', '--mem-budget', '600MiB',
         '--select', 'max', '--dry-run'], cwd=tmp_path, env={**ENV, 'TIMM_EXT_CACHE_DIR': str(tmp_path / 'c')},
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        next(line for line in proc.stdout if line.startswith('  batch '))  # the first trial is done
        wait_for(lambda: children(proc.pid), 60, 'the next trial process')
        trials = children(proc.pid)
        time.sleep(0.3)  # the trial is under way
        proc.kill()
        proc.wait(timeout=30)
        # 2 s: a SIGKILLed process holding hundreds of MiB can take a moment to be torn down and reaped on loaded
        # cores (0.3 s was tight); a trial left running would take longer than that to finish on its own
        wait_for(lambda: not any(running(pid) for pid in trials), 2, 'the trial processes to end')
    finally:
        proc.kill()
    assert not (tmp_path / 'c').exists() or not list((tmp_path / 'c').iterdir())


def descendants(pid: int) -> list:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def test_sigkill_during_a_two_rank_probe_leaves_no_process(long_folder, tmp_path):
    """tune_batch -> torchrun -> 2 probing ranks -> their trial processes: killing the top ends them all."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / 'tune_batch.py'), '--data-dir', str(long_folder), '--model', 'test_resnet',
         '--device', 'cpu', '--num-classes', '3', '--img-size', '160', '-j', '0', '--mem-budget', '600MiB',
         '--probe-start', '32', '--nproc', '2', '--dry-run'], cwd=tmp_path,
        env={**ENV, 'TIMM_EXT_CACHE_DIR': str(tmp_path / 'c')}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(descendants(proc.pid)) >= 5, 120, 'torchrun, 2 ranks and their trial processes')
        tree = descendants(proc.pid)
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not any(running(pid) for pid in tree), 5, 'every process under the probe to end')
    finally:
        proc.kill()
