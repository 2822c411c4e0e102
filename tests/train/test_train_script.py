"""train.py and distributed_train.sh end to end on CPU: outputs, accumulation, resume, kill safety, DDP, bad input."""
import csv
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from timm.models import create_model, load_checkpoint

from conftest import REPO_ROOT, run_script, torchrun, train_in_process
from stock_spec import default_differences, load_spec
from timm_ext.train.checkpoint import load_training_checkpoint
from timm_ext.synthetic_data import make_image_folder

BASE = ['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu', '--workers', '0',
        '--log-interval', '1']


def train(data, out, exp, *extra, check=True, process=False):
    """train.py on BASE: its main in this process, or with `process` as its own interpreter (the module's short run
    is the end-to-end one; the other runs test what training does, not the process boundary)."""
    argv = ['--data-dir', data, '--output', out, '--experiment', exp, *BASE, *extra]
    result = run_script('train.py', *argv) if process else train_in_process(*argv)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def optimizer_steps(path) -> set:
    state = load_training_checkpoint(path)['optimizer']['state']
    return {int(s['step']) for s in state.values()}


def summary_rows(path):
    lines = Path(path).read_text().splitlines()
    assert sum(line.startswith('epoch,') for line in lines) == 1, lines  # one header, never repeated
    return list(csv.DictReader(lines))


@pytest.fixture(scope='module')
def short_run(image_folder, tmp_path_factory):
    """Two epochs with EMA, accumulation and recovery checkpoints: (run folder, completed process)."""
    out = tmp_path_factory.mktemp('short')
    result = train(image_folder, out, 'run', '-b', '4', '--epochs', '2', '--model-ema', '--model-ema-decay', '0.5',
                   '--recovery-interval', '1', '--grad-accum-steps', '2', process=True)
    return out / 'run', result


def test_short_run_writes_every_output(short_run):
    run, result = short_run
    names = {p.name for p in run.iterdir()}
    expected = {'args.yaml', 'summary.csv', 'last.pth.tar', 'checkpoint-0.pth.tar', 'checkpoint-1.pth.tar',
                'model_best.pth.tar', 'last.safetensors', 'model_best.safetensors'}
    assert expected <= names, names
    recovery = {n for n in names if n.startswith('recovery-')}
    assert recovery == {'recovery-1-1.pth.tar', 'recovery-1-2.pth.tar'}  # 24 images / 4 / accum 2: 3 updates
    assert names == expected | recovery, 'nothing else (no temp files) left behind'

    rows = summary_rows(run / 'summary.csv')
    assert [r['epoch'] for r in rows] == ['0', '1']
    assert set(rows[0]) == {'epoch', 'train_loss', 'eval_loss', 'eval_top1', 'eval_top5', 'lr'}
    printed = json.loads(result.stdout.split('--result\n', 1)[1])
    assert sorted(r['epoch'] for r in printed) == [0, 1] and 'top1' in printed[0]['validation']

    # every checkpoint loads with timm's own loader; the exports hold the EMA weights of the last epoch
    for ckpt_file in run.glob('*.pth.tar'):
        model = create_model('test_resnet', num_classes=3)
        load_checkpoint(model, str(ckpt_file), use_ema=True)
    last = load_training_checkpoint(run / 'last.pth.tar')
    assert set(last) >= {'epoch', 'arch', 'state_dict', 'optimizer', 'version', 'args', 'state_dict_ema', 'metric'}
    exported = load_file(run / 'last.safetensors')
    assert exported.keys() == last['state_dict_ema'].keys()
    assert all(torch.equal(exported[k], last['state_dict_ema'][k]) for k in exported)
    assert any(not torch.equal(last['state_dict'][k], last['state_dict_ema'][k]) for k in exported)
    best = create_model('test_resnet', pretrained=True, num_classes=3,
                        pretrained_cfg_overlay=dict(file=str(run / 'model_best.safetensors'), num_classes=3))
    best_ckpt = load_training_checkpoint(run / 'model_best.pth.tar')['state_dict_ema']
    assert all(torch.equal(best.state_dict()[k], v) for k, v in best_ckpt.items())

    given = {'data', 'data_dir', 'output', 'experiment', 'model', 'num_classes', 'img_size', 'device', 'workers',
             'log_interval', 'batch_size', 'epochs', 'model_ema', 'model_ema_decay', 'recovery_interval',
             'grad_accum_steps'}
    differences = default_differences(load_spec('train'), yaml.safe_load((run / 'args.yaml').read_text()), given)
    assert not differences, '\n'.join(differences)


def test_checkpoint_loads_as_stock_validate_loads_it(short_run):
    # stock validate.py is not in timm's wheel; it loads --checkpoint (with --use-ema) through timm's own
    # load_checkpoint, so that call on a fresh model is the check: both weight sets, every key, matching shapes
    assert 'state_dict_ema' in torch.load(short_run[0] / 'model_best.pth.tar', map_location='cpu', weights_only=False)
    for use_ema in (False, True):
        model = create_model('test_resnet', num_classes=3)
        load_checkpoint(model, str(short_run[0] / 'model_best.pth.tar'), use_ema=use_ema, strict=True)
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


@pytest.fixture(scope='module')
def fourteen_batch_folder(tmp_path_factory):
    """42 training images: 14 batches of 3."""
    return make_image_folder(tmp_path_factory.mktemp('data14'), per_class=14)


def test_fourteen_batches_accum_eight_take_two_optimizer_steps(fourteen_batch_folder, tmp_path):
    # stock timm takes 3 optimizer steps here (and logs [2/2 (150%)])
    result = train(fourteen_batch_folder, tmp_path, 'run', '-b', '3', '--grad-accum-steps', '8', '--opt', 'adamw',
                   '--epochs', '1', '--val-split', '', '--no-safetensors')
    assert optimizer_steps(tmp_path / 'run' / 'last.pth.tar') == {2}
    assert not list((tmp_path / 'run').glob('*.safetensors'))
    progress = [line for line in result.stderr.splitlines() if line.startswith('Train: 0 [')]
    assert len(progress) == 2 and '[   1/2 (100%)]' in progress[-1], progress


def test_recovery_checkpoint_resumes_inside_its_epoch(image_folder, tmp_path):
    # 24 images, batch 4, accumulation 2: 3 updates per epoch; recovery-1-1 is after 2 updates of epoch 1
    # LR changing every update and an EMA: both must continue exactly where the recovery checkpoint stopped
    train(image_folder, tmp_path, 'a', '-b', '4', '--grad-accum-steps', '2', '--epochs', '2', '--opt', 'adamw',
          '--recovery-interval', '1', '--val-split', '', '--sched-on-updates', '--warmup-epochs', '1',
          '--model-ema', '--model-ema-decay', '0.5')
    recovery = tmp_path / 'a' / 'recovery-1-1.pth.tar'
    assert optimizer_steps(recovery) == {5}
    result = train(image_folder, tmp_path, 'b', '-c', tmp_path / 'a' / 'args.yaml', '--resume', recovery)
    assert 'Resuming epoch 1 at update 2/3' in result.stderr
    assert (tmp_path / 'b' / 'model_best.pth.tar').exists()  # a new folder ranks its own checkpoints
    # stock resumes a recovery checkpoint at the next epoch: here, nothing left to train (5 steps)
    assert optimizer_steps(tmp_path / 'b' / 'last.pth.tar') == {6}
    # same sample order and augmentation as the uninterrupted run: the same weights
    want = load_training_checkpoint(tmp_path / 'a' / 'last.pth.tar')
    got = load_training_checkpoint(tmp_path / 'b' / 'last.pth.tar')
    for key in ('state_dict', 'state_dict_ema'):
        assert all(torch.allclose(got[key][k].float(), want[key][k].float(), atol=1e-6) for k in want[key]), key
    assert got['optimizer']['param_groups'][0]['lr'] == pytest.approx(want['optimizer']['param_groups'][0]['lr'])


def test_kill_during_training_then_resume(image_folder, tmp_path):
    cmd = [sys.executable, str(REPO_ROOT / 'train.py'), '--data-dir', str(image_folder), '--output', str(tmp_path),
           '--experiment', 'run', *BASE, '-b', '4', '--epochs', '50', '--recovery-interval', '1', '--model-ema',
           '--opt', 'adamw']
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO_ROOT,
                            env={**os.environ, 'OMP_NUM_THREADS': '1'})
    run = tmp_path / 'run'
    try:
        deadline = time.time() + 120
        while not (run / 'checkpoint-1.pth.tar').exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(0.05)  # into the next epoch's recovery saves
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    files = sorted(run.glob('*.pth.tar')) + sorted(run.glob('*.safetensors'))
    assert files
    for path in files:  # whatever the kill interrupted, every checkpoint and export on disk is complete
        if path.suffix == '.safetensors':
            load_file(path)
        else:
            load_training_checkpoint(path)
    killed_at = load_training_checkpoint(run / 'last.pth.tar')['epoch']

    epochs = killed_at + 2
    train(image_folder, tmp_path, 'run', '-b', '4', '--epochs', str(epochs), '--recovery-interval', '1',
          '--model-ema', '--opt', 'adamw', '--resume', run / 'last.pth.tar')
    assert not [p for p in os.listdir(run) if p.endswith('.tmp')]
    rows = summary_rows(run / 'summary.csv')
    assert [int(r['epoch']) for r in rows] == list(range(epochs))
    assert optimizer_steps(run / 'last.pth.tar') == {epochs * 6}


def test_distributed_train_sh_runs_two_cpu_processes(image_folder, tmp_path):
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PATH': f'{Path(sys.executable).parent}:{os.environ["PATH"]}'}
    result = subprocess.run(
        ['bash', str(REPO_ROOT / 'distributed_train.sh'), '2', '--data-dir', str(image_folder), '--output',
         str(tmp_path), '--experiment', 'ddp', *BASE, '-b', '4', '--epochs', '1', '--grad-accum-steps', '2',
         '--opt', 'adamw'],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'process 1 of 2' in result.stderr
    # 24 images over 2 ranks: 3 batches of 4 per rank, accumulation 2: 2 updates
    assert optimizer_steps(tmp_path / 'ddp' / 'last.pth.tar') == {2}
    assert (tmp_path / 'ddp' / 'model_best.safetensors').exists()


@pytest.mark.parametrize('rendezvous, standalone', [({}, True), ({'PET_NNODES': '2'}, False),
                                                    ({'PET_MASTER_PORT': '29611'}, False)])
def test_distributed_train_sh_takes_a_free_port_unless_a_rendezvous_is_named(tmp_path, rendezvous, standalone):
    """A one-node run gets --standalone (a free port: two runs on one machine never share 29500); a rendezvous
    named in torchrun's PET_* variables is left to torchrun."""
    fake = tmp_path / 'torchrun'  # stands in for torchrun on PATH and prints the arguments it was given
    fake.write_text('#!/bin/bash\necho "$@"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith('PET_')}
    env.update(rendezvous, PATH=f'{tmp_path}:{os.environ["PATH"]}')
    result = subprocess.run(['bash', str(REPO_ROOT / 'distributed_train.sh'), '2', '--epochs', '1'],
                            capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 0, result.stderr
    argv = result.stdout.split()
    assert ('--standalone' in argv) is standalone
    assert argv[-3:] == [str(REPO_ROOT / 'train.py'), '--epochs', '1'] and '--nproc_per_node=2' in argv


def test_ddp_accumulation_matches_one_big_batch(tmp_path):
    report = tmp_path / 'ddp.json'
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
         str(REPO_ROOT / 'tests' / 'train' / 'train_ddp_worker.py'), str(report)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got['world'] == 2
    assert got['max_abs_diff'] <= 1e-5
    # no_sync on all but the last micro-batch of the window: only that backward all-reduces
    assert [sync for sync, _ in got['syncs']] == [False, False, True]
    assert [reduces > 0 for _, reduces in got['syncs']] == [False, False, True]


BAD_INPUTS = [
    (['-b', '0'], 2, 'batch-size'),
    (['--grad-accum-steps', '0'], 2, 'grad-accum-steps'),
    (['--lr-base-scale', 'cubic'], 2, 'lr-base-scale'),
    (['--amp-dtype', 'float8'], 2, 'amp-dtype'),
    (['--model-dtype', 'int8'], 2, 'model-dtype'),
    (['-c', '{bad_yaml}'], 2, 'not valid YAML'),
    (['--model', 'not_a_model'], 2, 'timm model name'),
    (['--data-dir', '{missing}'], 1, 'data folder not found'),
    (['--data-dir', '{empty}'], 1, 'cannot read'),
    (['--resume', '{missing}/last.pth.tar'], 1, 'not found'),
    (['--resume', '{corrupt}'], 1, 'not a readable checkpoint'),
    (['--gp', 'nopool'], 1, 'Invalid pool type: nopool'),
]


def bad_input_args(tmp_path, image_folder, extra):
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'bad.yaml').write_text('model: [test_resnet\nbatch_size: 4\n')
    (tmp_path / 'corrupt.pth.tar').write_bytes(b'\x00' * 100)
    paths = dict(missing=tmp_path / 'nope', empty=tmp_path / 'empty', bad_yaml=tmp_path / 'bad.yaml',
                 corrupt=tmp_path / 'corrupt.pth.tar')
    extra = [e.format(**paths) for e in extra]
    if '--data-dir' not in extra:
        extra = ['--data-dir', str(image_folder), *extra]
    return [*BASE, '-b', '4', '--output', str(tmp_path / 'out'), '--epochs', '1', *extra]


def assert_one_line_error(stderr, words):
    assert 'Traceback' not in stderr
    errors = [line for line in stderr.splitlines() if 'error' in line.lower()]
    assert len(errors) == 1 and words in errors[0], stderr[-2000:]


@pytest.mark.parametrize('extra,status,words', BAD_INPUTS, ids=[' '.join(b[0]) for b in BAD_INPUTS])
def test_bad_input_is_one_line_error_and_leaves_no_output(image_folder, tmp_path, monkeypatch, capsys, extra, status,
                                                         words):
    """In process (fast); an exception escaping main() would fail the test, as a traceback would."""
    sys.path.insert(0, str(REPO_ROOT))
    import train as train_script
    monkeypatch.setattr(sys, 'argv', ['train.py', *bad_input_args(tmp_path, image_folder, extra)])
    monkeypatch.setattr(logging.root, 'handlers', [])  # main() adds a handler on this test's captured stderr
    try:
        code = train_script.main()
    except SystemExit as e:  # argparse errors
        code = e.code
    assert code == status
    assert_one_line_error(capsys.readouterr().err, words)
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('extra,status,words', [BAD_INPUTS[5], BAD_INPUTS[10]], ids=['yaml', 'corrupt-resume'])
def test_bad_input_exit_status_of_the_process(image_folder, tmp_path, extra, status, words):
    result = run_script('train.py', *bad_input_args(tmp_path, image_folder, extra))
    assert result.returncode == status
    assert_one_line_error(result.stderr, words)
    assert not (tmp_path / 'out').exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the message on a machine without CUDA')
def test_default_cuda_device_without_cuda_is_one_line(image_folder, tmp_path):
    result = train_in_process('--data-dir', image_folder, '--model', 'test_resnet', '--output', tmp_path / 'o')
    assert result.returncode == 1
    assert 'Traceback' not in result.stderr and 'pass --device cpu' in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / 'o').exists()


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo ranks under torchrun')
def test_the_stop_flag_costs_no_host_sync_between_log_lines_and_still_stops_all_ranks(tmp_path):
    report = tmp_path / 'stop'
    result = torchrun(REPO_ROOT / 'tests' / 'train' / 'stop_cost_worker.py', report, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f'stop.{rank}.json').read_text()) for rank in (0, 1)]
    for got in ranks:
        logged = [i for i, (all_reduces, reads) in enumerate(got['costs']) if all_reduces or reads]
        assert logged == [0, 4, 8, 9], got['costs']  # log lines every 4 updates and the epoch's last, nothing between
        # rank 1 alone was signalled, at update 1: every rank stops at the next log line
        assert got['stopped'] == 'stopped by SIGTERM after epoch 1 update 4', got
