"""tune_batch.py --estimate (no real trial, any machine) and the probe seeded by the estimate."""
import re
import sys

import pytest
import yaml

from conftest import REPO_ROOT, run_script

SMALL = ['--model', 'test_resnet', '--img-size', '32', '--num-classes', '3', '--workers', '0']


def test_estimate_plans_a_cuda_run_on_32_gpus_without_a_gpu_or_the_data(tmp_path):
    config = tmp_path / 'plan.yaml'
    done = run_script('tune_batch.py', '--data-dir', tmp_path / 'not-here', *SMALL, '--amp', '--device', 'cuda',
                      '--gpu', 'A100-80GB', '--mem-budget', '4GiB,24GiB,77GiB', '--estimate', '--nproc', '8',
                      '--nnodes', '4', '--target-global-batch', '4096', '--tuned-config', config)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert 'Estimate (no real trial ran)' in out and 'not yet measured on a GPU' in out  # it states its assumptions
    # the named card, its figures and their sources; each budget is the caching allocator's, out of what it leaves
    assert 'card a100-80gb (NVIDIA A100 80GB): 79.25 GiB as CUDA reports it (https://' in out
    assert 'compute capability 8.0' in out and 'Budget 77GiB: what the caching allocator may use, of the' in out
    assert 'NCCL buffers per rank outside the allocator' in out  # and NCCL's, on 32 ranks
    rows = re.findall(r'^\s+(4GiB|24GiB|77GiB)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)', out, re.M)
    assert [r[0] for r in rows] == ['4GiB', '24GiB', '77GiB']
    fits = [int(r[1]) for r in rows]
    assert fits[0] < fits[1] < fits[2]  # more memory, a bigger micro-batch
    for _, _, micro, accum, global_batch in rows:
        assert int(micro) * 32 * int(accum) == int(global_batch) == 4096  # the recipe's global batch kept on 32 GPUs
    text = config.read_text()
    values = yaml.safe_load(text)
    assert values['batch_size'] * values['grad_accum_steps'] * 32 == 4096  # stock keys
    assert values['validation_batch_size'] > values['batch_size']  # train.py's eval, forward only, from its estimate
    assert '# Estimate (no real trial ran)' in text
    assert '--nnodes=4' in out and '--nproc-per-node=8' in out
    assert '--steady-cpu-heap' not in out  # a CUDA plan: glibc's heap is not what the budget counts


def test_estimate_on_cpu_prints_the_per_batch_table_by_category(tmp_path):
    done = run_script('tune_batch.py', '--data-dir', tmp_path, *SMALL, '--device', 'cpu', '--mem-budget', '256MiB',
                      '--estimate', '--select', 'max', '--tuned-config', tmp_path / 'c.yaml')
    assert done.returncode == 0, done.stderr
    head = next(line for line in done.stdout.splitlines() if line.strip().startswith('batch'))
    for category in ('weights', 'gradients', 'optimizer', 'activations', 'temporaries', 'runtime', 'peak'):
        assert category in head
    command = next(line for line in done.stdout.splitlines() if line.startswith('Train command: '))
    assert command.endswith(' --steady-cpu-heap')  # the heap the CPU estimate's runtime constant was measured on


@pytest.mark.parametrize('extra, needle', [
    (['--mem-budget', '1GiB,2GiB'], 'several budgets are for --estimate'),
    (['--mem-budget', '0.5', '--estimate', '--device', 'cuda'], 'needs the GPU'),
    (['--mem-budget', '1GiB,lots', '--estimate'], '--mem-budget'),
    (['--nnodes', '2'], '--nnodes'),
])
def test_bad_budget_lists_are_one_line_errors(tmp_path, capsys, extra, needle):
    # in this process: each is refused before any trace or probe (the script's own main, as a shell would run it)
    try:
        code = _tune_batch_main()(['--data-dir', str(tmp_path), *SMALL, '--tuned-config', str(tmp_path / 'p.yaml'),
                                   *extra])
    except SystemExit as e:  # the parser's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code != 0 and needle in err and 'Traceback' not in err, err
    assert len(err.strip().splitlines()) <= 2  # usage line and the error
    assert not (tmp_path / 'p.yaml').exists()


def test_a_model_the_estimate_cannot_trace_is_probed_without_it(image_folder, tmp_path):
    import subprocess
    done = subprocess.run([sys.executable, str(REPO_ROOT / 'tests' / 'tune' / 'untraceable_tune.py'), str(REPO_ROOT),
                           '--data-dir', str(image_folder), '--model', 'untraceable_test_model', '--img-size', '32',
                           '--num-classes', '3', '--workers', '0', '--device', 'cpu', '--mem-budget', '256MiB',
                           '--select', 'max', '--max-batch', '8', '--dry-run', '--no-cache',
                           '--tuned-config', str(tmp_path / 'u.yaml'), '--output', str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith('Estimate:'))
    assert 'cannot be traced on fake tensors' in line and 'searches without it' in line
    assert (tmp_path / 'u.yaml').exists()


def _tune_batch_main():
    import importlib.util
    spec = importlib.util.spec_from_file_location('tune_batch_script', REPO_ROOT / 'tune_batch.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _checkpoint_files(folder):
    import torch
    good = folder / 'good.pth.tar'
    torch.save({'state_dict': {'w': torch.zeros(64)}, 'arch': 'test_resnet'}, good)
    data = good.read_bytes()
    (folder / 'truncated.pth.tar').write_bytes(data[:len(data) // 2])
    (folder / 'random.bin').write_bytes(bytes(range(256)) * 16)
    (folder / 'a-folder').mkdir()
    torch.save({'state_dict': {'w': torch.zeros(64)}, 'arch': 'vit_tiny_patch16_224'}, folder / 'vit.pth.tar')


@pytest.mark.parametrize('extra, status, needle', [
    (['--device', 'tpu'], 2, "--device: got 'tpu'; allowed: a torch device name"),
    (['--device', 'cuda:banana'], 2, "--device: got 'cuda:banana'"),
    (['--device', 'cuda:-1'], 2, "--device: got 'cuda:-1'"),
    (['--device', 'mps:0x'], 2, "--device: got 'mps:0x'"),
    (['--device', ''], 2, "--device: got ''"),
    (['--device', 'xpu'], 2, '--estimate models cpu and cuda memory only; pass --device cuda or cpu'),
    (['--resume', 'random.bin'], 1, 'is not a readable checkpoint (unpickling failed'),
    (['--resume', 'truncated.pth.tar'], 1, 'is not a readable checkpoint'),
    (['--resume', 'missing.pth.tar'], 1, '--resume file not found: missing.pth.tar; pass the path of a checkpoint'),
    (['--resume', 'a-folder'], 1, '--resume a-folder is a folder; pass the checkpoint file in it'),
    (['--resume', 'vit.pth.tar'], 1, "is a checkpoint of 'vit_tiny_patch16_224', not of --model 'test_resnet'"),
])
def test_bad_estimate_inputs_end_in_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, extra, status, needle):
    # checked as the probe checks them (the parser's device domain, the one --resume check), before any trace
    _checkpoint_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('TIMM_EXT_CACHE_DIR', str(tmp_path / 'cache'))
    argv = ['--data-dir', str(tmp_path / 'not-here'), *SMALL, '--estimate', '--mem-budget', '1GiB',
            '--tuned-config', str(tmp_path / 'plan.yaml'), *extra]
    try:
        code = _tune_batch_main()(argv)
    except SystemExit as e:  # the parser's own errors
        code = e.code
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert code == status and len(err) == 1 and needle in err[0], captured.err
    assert 'Traceback' not in captured.err and captured.out == ''
    assert not (tmp_path / 'plan.yaml').exists() and not (tmp_path / 'cache').exists()
