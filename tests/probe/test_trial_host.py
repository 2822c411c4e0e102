"""The trial host: CPU trials for a process that cannot fork them (its peaks against a fork's: test_estimate.py)."""
import dataclasses

import pytest
import torch
import torch.nn as nn
from timm.models import register_model

from timm_ext.probe.trial import build_train_trial
from timm_ext.probe.trial_host import TrialHost, _host_spec
from timm_ext.train.args import parse_args

CPU = torch.device('cpu')


def trial_args(model: str = 'test_resnet'):
    args, _ = parse_args(['--model', model, '--num-classes', '3', '--img-size', '32', '--device', 'cpu'])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    return args


def _tiny(pretrained=False, num_classes: int = 3, **kwargs):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))
    model.default_cfg = model.pretrained_cfg = {'input_size': (3, 32, 32), 'num_classes': num_classes}
    return model


_tiny.__module__ = '__main__'  # as a notebook cell or a script defines it: no module the host could import
_tiny.__name__ = _tiny.__qualname__ = 'trial_host_test_in_main'
register_model(_tiny)


def test_the_host_builds_the_setup_from_the_same_arguments_and_phase():
    setup = build_train_trial(trial_args(), CPU)
    spec = _host_spec(dataclasses.replace(setup.eval_trials(8), eval_samples=20))
    assert spec.args is setup.args and spec.model_module == 'timm.models.resnet'
    assert (spec.phase, spec.train_batch, spec.eval_samples) == ('eval', 8, 20)


def test_a_model_defined_in_main_or_a_setup_without_arguments_gets_no_host():
    setup = build_train_trial(trial_args('trial_host_test_in_main'), CPU)
    assert _host_spec(setup) is None
    assert _host_spec(dataclasses.replace(build_train_trial(trial_args(), CPU), args=None)) is None


def test_a_host_that_cannot_build_the_trial_says_why_in_one_line():
    spec = _host_spec(build_train_trial(trial_args(), CPU))
    spec.args.model = 'no_such_model_anywhere'
    with pytest.raises(RuntimeError, match='no_such_model_anywhere') as info:
        TrialHost(spec)
    assert '\n' not in str(info.value)
