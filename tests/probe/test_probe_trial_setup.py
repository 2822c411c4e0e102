"""What a probe trial changes from the run so that it stays one honest step: plain BN for SyncBN, a loss scaler that
does not skip the update, no CUDA graphs; and `--oom-recover` refused with `--sync-bn` on several processes."""
import copy
import importlib.util

import pytest
import torch
import torch.nn as nn

from conftest import REPO_ROOT
from timm_ext.train.input_checks import extension_problem
from timm_ext.probe.trial import (
    PROBE_LOSS_SCALE, build_train_trial, eval_batch_shapes, probe_compile_mode, probe_grad_scaler,
)
from timm_ext.train.args import parse_args
from timm_ext.train.setup import UsageError, build_model

CPU = torch.device('cpu')


def rank0_of_two(*argv: str):
    """train.py's namespace as `init_device` leaves it on rank 0 of 2 (no process group is needed to build)."""
    args, _ = parse_args(['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
                          *argv])
    args.distributed, args.world_size, args.rank, args.local_rank = True, 2, 0, 0
    return args


def test_sync_bn_run_is_probed_with_plain_batchnorm():
    args = rank0_of_two('--sync-bn')
    with pytest.raises(UsageError, match='--sync-bn'):  # the run's own model would be converted (CPU refuses it)
        build_model(args, CPU, None)
    setup = build_train_trial(args, CPU)
    assert 'SyncBN probed as BN' in setup.describe
    setup.step(2)  # a real update with plain BN
    assert args.sync_bn, 'the caller\'s arguments are left alone'


def test_a_trial_leaves_the_callers_arguments_as_they_were():
    # no --num-classes: the trial's targets use the model's own class count, which stock would write into args
    args, _ = parse_args(['--model', 'test_resnet', '--img-size', '32', '--device', 'cpu', '--sync-bn', '--amp',
                          '--model-kwargs', 'stem_width=8'])
    args.distributed, args.world_size, args.rank, args.local_rank = True, 2, 0, 0
    before = copy.deepcopy(vars(args))
    setup = build_train_trial(args, CPU)
    setup.step(2)
    setup.eval_trials().step(2)
    assert vars(args) == before


def adam_state_after_one_update(scaler: torch.amp.GradScaler) -> int:
    """One float16-autocast update of a small model whose scaled gradients overflow at stock's initial scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters())
    with torch.autocast('cpu', dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(torch.randn(1, 8) * 10), torch.tensor([0]))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return len(optimizer.state)


def test_probe_loss_scaler_does_not_skip_the_update_a_fresh_stock_scaler_skips():
    assert adam_state_after_one_update(torch.amp.GradScaler('cpu')) == 0  # overflow: step skipped, no state
    scaler = probe_grad_scaler(CPU)
    assert scaler.get_scale() == PROBE_LOSS_SCALE
    assert adam_state_after_one_update(scaler) == 4  # stepped: state for each of the 4 parameter tensors


@pytest.mark.parametrize('mode, probed', [
    ('reduce-overhead', None), ('max-autotune', 'max-autotune-no-cudagraphs'), ('default', 'default'),
    ('max-autotune-no-cudagraphs', 'max-autotune-no-cudagraphs'), (None, None),
])
def test_probe_compiles_without_cuda_graphs(mode, probed):
    assert probe_compile_mode(mode) == probed


def test_probe_report_says_cuda_graphs_are_off_in_trials():
    args, _ = parse_args(['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
                          '--torchcompile', 'eager', '--torchcompile-mode', 'reduce-overhead'])
    args.distributed, args.world_size, args.rank = False, 1, 0
    assert 'no CUDA graphs in trials' in build_train_trial(args, CPU).describe


# ---- --oom-recover with --sync-bn -----------------------------------------------------------------------------------

def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f'{name}_script', REPO_ROOT / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_refuses_oom_recover_with_sync_bn_under_ddp_only():
    problem = extension_problem(rank0_of_two('--sync-bn', '--oom-recover'), world_size=2)
    assert problem and '--oom-recover cannot run with --sync-bn on several processes' in problem
    single, _ = parse_args(['--sync-bn', '--oom-recover'])
    assert extension_problem(single, world_size=1) is None  # one process: SyncBN is not even converted


def test_tune_batch_refuses_oom_recover_with_sync_bn_on_several_processes(capsys):
    tune_script = load_script('tune_batch')
    assert tune_script.main(['--model', 'test_resnet', '--nproc', '2', '--sync-bn', '--oom-recover']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'cannot run with --sync-bn' in err


@pytest.mark.parametrize('eval_batch, samples, world, shapes', [
    (19, 127, 1, [19, 13]),  # the eval batch, then the split's smaller remainder
    (20, 120, 1, [20]),  # no remainder: one shape
    (200, 127, 1, [127]),  # a split smaller than the batch: one batch of all of it
    (50, 127, 2, [50, 14]),  # per rank: the distributed sampler pads 127 to 128, 64 a rank
    (19, 0, 1, []),  # no eval split: train.py does not evaluate
    (19, None, 1, [19]),  # split size unknown: the eval batch alone
])
def test_eval_batch_shapes_are_the_shapes_of_trains_eval_pass(eval_batch, samples, world, shapes):
    assert eval_batch_shapes(eval_batch, samples, world) == shapes


def test_the_warmup_is_an_update_then_the_eval_pass_in_shapes():
    args, _ = parse_args(['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
                          '-vb', '8'])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    setup = build_train_trial(args, CPU)
    calls = []
    setup.step, setup.eval_step = (lambda b: calls.append(('train', b))), (lambda b: calls.append(('eval step', b)))
    setup.eval_forward, setup.eval_samples = (lambda b: calls.append(('eval', b))), 20
    setup.warmup(6)
    assert calls == [('train', 6), ('eval', 8), ('eval', 4)]  # -vb 8 over 20 samples: 8, 8, then 4
    calls.clear()
    setup.eval_trials().warmup(6)
    assert calls == [('eval step', 6)], 'the eval-batch probe warms up with its own step only'
    calls.clear()
    setup.train_step = lambda b: calls.append(('train', b))
    setup.eval_trials(train_batch=6).warmup(8)
    assert calls == [('train', 6), ('eval step', 8), ('eval', 4), ('train', 6)], 'the next epoch trains after it'
