"""What the run's trace records for the savers priced without a trace of their own (FLOPs counted inside a traced
step, the weights' roles), and the build it traces without writing the weights' values."""
import json
import os
import subprocess
import sys
from pathlib import Path

import timm
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from conftest import REPO_ROOT
from timm_ext.memory_model.skipped_init import SkippedInit
from timm_ext.memory_model.step_facts import FlopCount, weight_storages


def _totals(model_name: str, checkpointing: bool) -> list:
    """(FlopCount's total, FlopCounterMode's) of a fake-tensor forward and backward."""
    model = timm.create_model(model_name, num_classes=10)
    model.set_grad_checkpointing(checkpointing)
    totals = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device='cpu')
        for counter in (FlopCount(), FlopCounterMode(display=False)):
            with counter:
                model(torch.randn(4, 3, *model.pretrained_cfg['input_size'][1:])).sum().backward()
            totals.append(counter.total if isinstance(counter, FlopCount) else counter.get_total_flops())
    return totals


def test_flops_counted_in_the_step_are_the_flop_counters():
    """torch/utils/flop_counter.py, FlopCounterMode._count_flops: each op's formula from `flop_registry`, called with
    the op's arguments and `out_val`; checkpointing's recomputed forward counts too. Counted in a fresh interpreter:
    a fork of a test worker that has run a backward cannot run autograd."""
    code = ('import json, sys; sys.path.insert(0, sys.argv[1]); import test_step_facts as t; '
            'print(json.dumps([t._totals(m, c) for m, c in (("test_resnet", False), ("test_vit", True), '
            '("test_convnext", False))]))')
    done = subprocess.run([sys.executable, '-c', code, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, 'PYTHONPATH': f'{REPO_ROOT}:{REPO_ROOT / "tests"}'})
    assert done.returncode == 0, done.stderr[-2000:]
    for name, (ours, reference) in zip(('test_resnet', 'test_vit', 'test_convnext'),
                                       json.loads(done.stdout.splitlines()[-1])):
        assert ours == reference > 0, name


def test_weight_storages_file_each_storage_once_with_its_role():
    model, ema = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    buffer = torch.zeros(5)
    weights = [*model.parameters(), *ema.parameters(), buffer, model.weight]  # the last one is filed already
    assert weight_storages(weights, [model.weight], ema) == [(48, 'trainable'), (12, 'fixed'), (48, 'ema'),
                                                             (12, 'ema'), (20, 'fixed')]


def test_a_build_without_its_initialisation_has_the_same_modules_shapes_and_buffers():
    """timm_ext/memory_model/skipped_init.py: the trace replaces every parameter's storage (`to_empty`), so the
    initialisers' writes to parameters are skipped; what the build reads and keeps otherwise is a normal build's."""
    torch.manual_seed(0)
    normal = timm.create_model('test_vit', num_classes=10)
    torch.manual_seed(0)
    with SkippedInit():
        skipped = timm.create_model('test_vit', num_classes=10)
        weight = torch.nn.Parameter(torch.zeros(3, 4))
        torch.nn.init.trunc_normal_(weight, std=0.02)
        timm.layers.trunc_normal_(weight, std=0.02)
    assert torch.equal(weight, torch.zeros(3, 4))  # neither initialiser wrote it
    assert [(n, p.shape) for n, p in normal.named_parameters()] == [(n, p.shape) for n, p in skipped.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(normal.buffers(), skipped.buffers()))
    assert str(normal) == str(skipped)
