"""When the recipe's batch trains with no trial (`timm_ext.tune.untried`): each condition that asks for a trial."""
import pytest
import torch

from timm_ext.train.args import parse_args
from timm_ext.tune.untried import untried_reason

CPU = torch.device('cpu')


def tune_args(*argv: str):
    args, _ = parse_args(['--model', 'test_resnet', '--epochs', '8', *argv])
    args.mem_budget, args.select, args.eval_probe = None, 'auto', 'auto'  # tune_batch.py's defaults
    return args


def reason(*argv: str, device: torch.device = CPU, world_size: int = 1, recipe_global: int = 128, set_by: str = '',
           train_samples: int = 1438, max_batch: int = 1438):
    args = tune_args(*argv)
    return untried_reason(args, device, world_size, recipe_global, set_by, train_samples, max_batch)


def test_a_short_run_with_stock_default_batch_needs_no_trial():
    # digits, 8 epochs: the noise-scale estimate alone (2 x 32 x 4 x 16 = 4096 samples) is over 5% of 11,504
    assert 'cannot pay' in reason() and '4096 samples' in reason()


def test_a_run_long_enough_for_judging_asks_the_trial_for_its_speed():
    assert reason(train_samples=1_281_167, max_batch=1_281_167) is None  # ImageNet, 8 epochs


def test_a_set_global_batch_needs_no_trial_under_select_auto():
    assert 'keeps the global batch -b sets' in reason(set_by='-b', train_samples=1_281_167, max_batch=1_281_167)


@pytest.mark.parametrize('change', [
    dict(device=torch.device('cuda')),  # a card's memory is small: the YAML must hold the split that fits
    dict(world_size=2),  # idle recovery costs DDP a collective a window
    dict(max_batch=64),  # the split cannot hold the recipe's batch: the plan is the split's
])
def test_cuda_ddp_or_a_small_split_ask_for_a_trial(change):
    assert reason(**{'set_by': '-b', **change}) is None


@pytest.mark.parametrize('flags', [('--batch-ramp',), ('--train-img-sizes', '32', '64')])
def test_train_flags_that_need_a_probe_ask_for_a_trial(flags):
    assert reason(*flags, set_by='-b') is None


@pytest.mark.parametrize('field, value', [('mem_budget', '1GiB'), ('select', 'max'), ('eval_probe', 'on')])
def test_tune_flags_that_ask_a_memory_question_ask_for_a_trial(field, value):
    args = tune_args()
    setattr(args, field, value)
    assert untried_reason(args, CPU, 1, 128, '-b', 1438, 1438) is None
