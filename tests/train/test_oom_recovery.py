"""--oom-recover: a real out-of-memory (RLIMIT_DATA) mid-training splits micro-batches and keeps every update exact.

In process: the splitter, the loop's replay under a real in-process cap, errors that must not be swallowed. End to
end (train.py under `tests/train/oom_cap_train.py`, which sets a real RLIMIT_DATA cap when a training epoch starts): the
capped run equals a run started at the smaller micro-batch, resume keeps the micro-batch and grows back, one sample
that does not fit is a clear error that leaves checkpoints intact, and two gloo ranks split together.

Measured (test_vit, 224 px, peak data segment above the epoch start, glibc mmap threshold fixed at 256 KiB): a
loader batch of 48 needs ~240 MB, 24 needs ~140 MB (+15 MB: the kept batch of 48 the pieces are cut from); the caps
below sit ~40 MB from each. A smaller micro-batch than expected would still give the same weights.
"""
import csv
import logging
import os
import resource
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.task import ClassificationTask

from conftest import REPO_ROOT, train_in_process
from timm_ext.train.checkpoint import load_training_checkpoint
from timm_ext.memory import memory_cap
from timm_ext.train.oom_recovery import (
    GradientAllReduce,
    MicroBatchSplitter, OomRecoveryError, is_recoverable_oom, split_batch,
)
from timm_ext.synthetic_data import make_image_folder
from timm_ext.train.loop import LoopConfig, TrainLoop

CPU = torch.device('cpu')
MB = 2 ** 20
# glibc otherwise serves freed activations from a growing, fragmented heap that RLIMIT_DATA keeps counting; a fixed
# mmap threshold hands them back to the OS, as a device allocator's empty_cache does
CAP_ENV = {'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'MALLOC_MMAP_THRESHOLD_': '262144'}
VIT = ['--model', 'test_vit', '--num-classes', '3', '--img-size', '224', '--device', 'cpu', '--workers', '0',
       '--val-split', '', '--lr', '0.1', '--warmup-epochs', '0', '--seed', '1', '--log-interval', '1']


# ---- splitter -----------------------------------------------------------------------------------------------------

def test_gradient_allreduce_allocates_every_missing_gradient_before_its_first_collective(tmp_path, monkeypatch):
    params = [nn.Parameter(torch.randn(n)) for n in (64, 8, 300, 5)]
    for p in params[:2]:
        p.grad = torch.ones_like(p)  # the others got no gradient this window: zeros must be made for them
    dist.init_process_group('gloo', init_method=f'file://{tmp_path / "store"}', rank=0, world_size=1)
    try:
        reduce = GradientAllReduce(params, 1, bucket_bytes=64 * 4)
        seen = []
        real = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            seen.append([p.grad is not None for p in params])
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, 'all_reduce', all_reduce)
        reduce()
    finally:
        dist.destroy_process_group()
    assert len(seen) == len(reduce.buckets) > 1
    assert all(seen[0]), 'a gradient was allocated after a collective had started'
    assert [p.grad.sum().item() for p in params] == [64.0, 8.0, 0.0, 0.0]


def test_split_batch_cuts_tensors_and_dicts_into_views():
    x, y = torch.arange(14.).view(7, 2), torch.arange(7)
    pieces = split_batch(x, y, 3)
    assert [p.shape[0] for p, _ in pieces] == [3, 2, 2]
    assert torch.equal(torch.cat([t for _, t in pieces]), y)
    assert pieces[0][0].data_ptr() == x.data_ptr()  # views, no copies
    batch = {'patches': torch.zeros(4, 5, 6), 'patch_coord': torch.zeros(4, 5, 2), 'note': 'kept'}
    dict_pieces = split_batch(batch, torch.arange(4), 2)
    assert [p['patches'].shape[0] for p, _ in dict_pieces] == [2, 2]
    assert dict_pieces[1][0]['note'] == 'kept'


def test_splitter_halves_micro_batch_down_to_one_then_refuses():
    splitter = MicroBatchSplitter(48)
    steps = [splitter.shrink() for _ in range(6)]
    assert steps == [(48, 24), (24, 12), (12, 6), (6, 3), (3, 2), (2, 1)]
    with pytest.raises(OomRecoveryError):
        splitter.shrink()
    odd = MicroBatchSplitter(6)
    assert [odd.shrink()[1] for _ in range(3)] == [3, 2, 1]
    assert [p.shape[0] for p, _ in odd.split(torch.zeros(6, 1), torch.zeros(6), 6)] == [1] * 6


def test_splitter_grows_back_after_clean_updates_and_round_trips():
    splitter = MicroBatchSplitter(8, grow_back=2)
    splitter.shrink(), splitter.shrink()
    assert splitter.micro_batch == 2
    assert splitter.after_clean_update() is None
    assert splitter.after_clean_update() == (2, 4)
    assert [splitter.after_clean_update() for _ in range(2)] == [None, (4, 8)]
    assert all(splitter.after_clean_update() is None for _ in range(5))  # whole batches: nothing to grow
    splitter.shrink()
    resumed = MicroBatchSplitter(8)
    resumed.load_state_dict(splitter.state_dict())
    assert (resumed.splits, resumed.micro_batch) == (2, 4)
    other_loader = MicroBatchSplitter(12)  # resumed with another -b: keep the micro-batch that fitted
    other_loader.load_state_dict(splitter.state_dict())
    assert other_loader.micro_batch == 4


def test_oom_classification_for_recovery():
    assert is_recoverable_oom(torch.OutOfMemoryError('CUDA out of memory'))
    assert not is_recoverable_oom(RuntimeError('mat1 and mat2 shapes cannot be multiplied'))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    assert soft == resource.RLIM_INFINITY, 'test needs an uncapped process'
    for message in ('could not create a primitive', 'could not execute a primitive'):
        primitive = RuntimeError(message)
        assert not is_recoverable_oom(primitive)  # without a cap, oneDNN's failure may be anything
        resource.setrlimit(resource.RLIMIT_DATA, (1 << 50, hard))
        try:
            assert is_recoverable_oom(primitive)  # under a data cap it is how oneDNN reports a failed allocation
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


# ---- the loop, in process -----------------------------------------------------------------------------------------

class Wide(nn.Module):
    """Few parameters, ~40 MB per activation per sample (above glibc's mmap threshold), cheap elementwise work."""

    def __init__(self, width: int = 2 ** 21, features: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.linspace(-2, 2, width))
        self.head = nn.Linear(features, 3)

    def forward(self, x):
        return self.head(torch.tanh(x[:, :, None] * self.scale).mean(-1))


def wide_batches(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))


def make_loop(model, **cfg):
    task = ClassificationTask(model, nn.CrossEntropyLoss(), device=CPU, verbose=False)
    return TrainLoop(task, torch.optim.SGD(model.parameters(), lr=1.0), LoopConfig(device=CPU, **cfg))


def trained(model, batches, **cfg):
    loop = make_loop(model, **cfg)
    loop.train_one_epoch(0, batches)
    return loop, [p.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize('weighting', ['samples', 'none'])
def test_split_batches_give_the_same_update(weighting):
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (6, 6, 6, 6, 5)]
    _, want = trained(small_model(), batches, accum_steps=2, batch_size=6, loss_weighting=weighting)
    model = small_model()
    loop = make_loop(model, accum_steps=2, batch_size=6, loss_weighting=weighting, oom_recover=True)
    loop.splitter.splits = 4  # pieces of 2, 2, 1, 1 (and 2, 1, 1, 1 for the last batch of 5)
    sizes = []
    loop.forward_backward = lambda i, t, w, s, _f=loop.forward_backward: (sizes.append(i.shape[0]), _f(i, t, w, s))[1]
    loop.train_one_epoch(0, batches)
    assert sizes == [2, 2, 1, 1] * 4 + [2, 1, 1, 1]
    assert max_diff([p.detach() for p in model.parameters()], want) < 1e-6


def test_real_oom_in_process_replays_the_window_with_the_same_update(caplog):
    batches = wide_batches([4, 4, 4])  # windows [4, 4] and [4]
    _, want = trained(Wide(), batches, accum_steps=2, batch_size=4)
    model = Wide()
    loop = make_loop(model, accum_steps=2, batch_size=4, oom_recover=True)
    with caplog.at_level(logging.WARNING, logger='train'), memory_cap(CPU, 450 * MB):
        loop.train_one_epoch(0, batches)  # a batch of 4 needs ~650 MB
    adjustments = [r.getMessage() for r in caplog.records if 'OOM recovery' in r.getMessage()]
    assert adjustments and 'epoch 0 update 0' in adjustments[0] and 'micro-batch 4 -> 2' in adjustments[0]
    assert loop.splitter.micro_batch < 4
    assert max_diff([p.detach() for p in model.parameters()], want) < 1e-5


def test_one_sample_that_does_not_fit_is_a_clear_error_and_changes_nothing():
    model = Wide()
    before = [p.detach().clone() for p in model.parameters()]
    loop = make_loop(model, accum_steps=1, batch_size=4, oom_recover=True)
    with memory_cap(CPU, 60 * MB), pytest.raises(OomRecoveryError, match='even with a micro-batch of 1 sample'):
        loop.train_one_epoch(0, wide_batches([4]))
    assert max_diff([p.detach() for p in model.parameters()], before) == 0
    assert all(p.grad is None for p in model.parameters())


def test_oom_in_the_optimizer_step_is_a_clear_error_not_a_replay():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 3))  # 16 MB in the middle layer
    task = ClassificationTask(model, nn.CrossEntropyLoss(), device=CPU, verbose=False)
    loop = TrainLoop(task, torch.optim.Adam(model.parameters()), LoopConfig(device=CPU, batch_size=4, oom_recover=True))
    # the backward's gradients (~16 MB) fit; Adam's two state buffers per parameter (~32 MB) do not
    with memory_cap(CPU, 24 * MB), pytest.raises(OomRecoveryError, match='optimizer step at epoch 0 update 0') as err:
        loop.train_one_epoch(0, wide_batches([4]))
    assert 'does not shrink' in str(err.value) and '\n' not in str(err.value)
    assert loop.splitter.micro_batch == 4, 'the update was not replayed with smaller micro-batches'


def test_errors_other_than_oom_are_not_swallowed():
    calls = []

    class Broken(nn.Module):
        def forward(self, x):
            calls.append(x.shape[0])
            raise RuntimeError('mat1 and mat2 shapes cannot be multiplied (4x6 and 5x3)')

    model = nn.Sequential(Broken(), nn.Linear(1, 1))
    loop = make_loop(model, batch_size=4, oom_recover=True)
    with pytest.raises(RuntimeError, match='shapes cannot be multiplied'):
        loop.train_one_epoch(0, wide_batches([4]))
    assert calls == [4]  # tried once, not split


# ---- train.py end to end under a real cap -----------------------------------------------------------------------

def run_capped(*args, cap_mb=None, cap_epoch=0, cap_ranks=None, nproc=1, timeout=300):
    env = {**os.environ, **CAP_ENV, 'PYTHONPATH': str(REPO_ROOT)}
    if cap_mb is not None:  # a capped run's heap, as tune_batch.py's train command for a CPU budget has it
        env.update(OOM_CAP_MB=str(cap_mb), OOM_CAP_EPOCH=str(cap_epoch))
        args = (*args, '--steady-cpu-heap')
    if cap_ranks is not None:
        env['OOM_CAP_RANKS'] = cap_ranks
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}']
    return subprocess.run([*launcher, str(REPO_ROOT / 'tests' / 'train' / 'oom_cap_train.py'), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)


def adjustments(stderr):
    return [line for line in stderr.splitlines() if 'OOM recovery at' in line]


def weights(path):
    return load_training_checkpoint(path)['state_dict']


def assert_same_weights(got, want, atol=1e-5):
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst <= atol, f'largest weight difference {worst:.3g}'


@pytest.fixture(scope='module')
def vit_data(tmp_path_factory):
    """96 training images: one update per epoch of all of them, whether -b 24 x 4, -b 48 x 2 or two ranks x 48.

    With --no-aug every image is the same in every run, so the one-process reference also stands for two ranks.
    """
    return make_image_folder(tmp_path_factory.mktemp('oomdata'), per_class=32)


@pytest.fixture(scope='module')
def capped_single(vit_data, tmp_path_factory):
    """(output root, capped run, reference run): one epoch of -b 48 x 2 under a 195 MB cap vs -b 24 x 4 uncapped."""
    out = tmp_path_factory.mktemp('oom')
    common = ['--data-dir', vit_data, '--output', out, *VIT, '--epochs', '1', '--no-aug']
    reference = train_in_process(*common, '--experiment', 'ref', '-b', '24', '--grad-accum-steps', '4')  # uncapped
    capped = run_capped(*common, '--experiment', 'cap', '-b', '48', '--grad-accum-steps', '2', '--oom-recover',
                        cap_mb=195)
    return out, capped, reference


def test_capped_run_finishes_with_the_weights_of_the_smaller_micro_batch(capped_single):
    out, capped, reference = capped_single
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert capped.returncode == 0, capped.stderr[-3000:]
    changes = adjustments(capped.stderr)
    assert changes and 'epoch 0 update 0' in changes[0] and 'micro-batch 48 -> 24' in changes[0], changes
    assert 'global batch, LR and schedule are unchanged' in changes[0]
    progress = [line for line in capped.stderr.splitlines() if line.startswith('Train:')]
    assert len(progress) == 1  # one update, as scheduled: a replay is not an extra update
    last = load_training_checkpoint(out / 'cap' / 'last.pth.tar')
    assert last['micro_batch']['batch_size'] == 48 and last['micro_batch']['micro_batch'] <= 24
    assert_same_weights(last['state_dict'], weights(out / 'ref' / 'last.pth.tar'))


def test_resume_starts_at_the_saved_micro_batch_and_grows_back(capped_single, vit_data):
    out, capped, _ = capped_single
    assert capped.returncode == 0, capped.stderr[-3000:]
    saved = load_training_checkpoint(out / 'cap' / 'last.pth.tar')['micro_batch']['micro_batch']
    resumed = train_in_process('--data-dir', vit_data, '--output', out, *VIT, '--experiment', 'resumed', '-b', '48',
                               '--grad-accum-steps', '2', '--no-aug', '--epochs', '2', '--oom-recover',
                               '--oom-grow-back', '1', '--resume', out / 'cap' / 'last.pth.tar')
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing with the checkpoint's micro-batch {saved}" in resumed.stderr
    grown = [line for line in resumed.stderr.splitlines() if 'trying the larger micro-batch again' in line]
    assert grown and f'{saved} -> {2 * saved}' in grown[0] and 'epoch 1 update 0' in grown[0], resumed.stderr[-2000:]
    assert load_training_checkpoint(out / 'resumed' / 'last.pth.tar')['micro_batch']['splits'] < 48 // saved
    # one update moves the weights by far more than the 1e-5 the capped and reference runs agree within
    with pytest.raises(AssertionError):
        assert_same_weights(weights(out / 'resumed' / 'last.pth.tar'), weights(out / 'cap' / 'last.pth.tar'), 1e-3)


def test_one_sample_that_does_not_fit_stops_with_a_clear_error(tmp_path):
    # epoch 0 trains uncapped and saves; epoch 1 starts under a cap that a 448 px sample cannot train in
    # (~40 MB) but the loader's batches fit (~16 MB)
    data = make_image_folder(tmp_path / 'data', per_class=2, splits=('train',))
    result = run_capped('--data-dir', data, '--output', tmp_path, '--experiment', 'run', *VIT, '--img-size', '448',
                        '-b', '2', '--epochs', '2', '--oom-recover', cap_mb=24, cap_epoch=1)
    assert result.returncode == 1, result.stderr[-3000:]
    assert 'Traceback' not in result.stderr
    errors = [line for line in result.stderr.splitlines() if 'error' in line.lower()]
    assert len(errors) == 1 and 'even with a micro-batch of 1 sample' in errors[0], result.stderr[-2000:]
    assert 'micro-batch 2 -> 1' in result.stderr
    run = tmp_path / 'run'
    assert load_training_checkpoint(run / 'last.pth.tar')['epoch'] == 0  # the last good checkpoint, intact
    assert not [p for p in os.listdir(run) if p.endswith('.tmp') or p.startswith('checkpoint-1')]


def test_two_ranks_split_together_when_one_runs_out(capped_single, vit_data, tmp_path):
    reference_dir = capped_single[0] / 'ref'
    capped = run_capped('--data-dir', vit_data, '--output', tmp_path, *VIT, '--epochs', '1', '--no-aug',
                        '--experiment', 'cap', '-b', '48', '--oom-recover', '--log-noise-scale', cap_mb=195,
                        cap_ranks='0', nproc=2)
    assert capped.returncode == 0, capped.stderr[-3000:]
    changes = adjustments(capped.stderr)
    for rank in (0, 1):  # rank 1 had memory to spare, and still split with rank 0
        mine = [c for c in changes if f'rank {rank}: OOM recovery' in c]
        assert mine and 'out of memory on rank 0;' in mine[0] and 'micro-batch 48 -> 24' in mine[0], changes
    assert len(changes) % 2 == 0  # every adjustment on both ranks
    # each update is the mean over the same 96 images: 24 x 4 on one process, (2 pieces of 24) x 2 ranks here
    assert_same_weights(weights(tmp_path / 'cap' / 'last.pth.tar'), weights(reference_dir / 'last.pth.tar'))
    # the noise scale rides along: on each rank, the 2 pieces against the global gradient
    with open(tmp_path / 'cap' / 'noise_scale.csv', newline='') as f:
        assert [int(r['pairs']) for r in csv.DictReader(f)] == [2 * 2]


# ---- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('extra,status,words', [
    (['--oom-grow-back', '0'], 2, '--oom-grow-back'),
    (['--oom-grow-back', '-3'], 2, '--oom-grow-back'),
    (['--oom-grow-back', '5'], 2, 'add --oom-recover'),
    (['--oom-recover', '--aug-splits', '2'], 2, '--aug-splits'),
])
def test_bad_oom_flags_are_one_line_errors(image_folder, tmp_path, monkeypatch, capsys, extra, status, words):
    sys.path.insert(0, str(REPO_ROOT))
    import train as train_script
    monkeypatch.setattr(sys, 'argv', ['train.py', '--data-dir', str(image_folder), '--model', 'test_vit',
                                      '--device', 'cpu', '--output', str(tmp_path / 'out'), *extra])
    monkeypatch.setattr(logging.root, 'handlers', [])
    try:
        code = train_script.main()
    except SystemExit as e:
        code = e.code
    assert code == status
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error' in line.lower()]
    assert 'Traceback' not in err and len(lines) == 1 and words in lines[0], err
    assert not (tmp_path / 'out').exists()
