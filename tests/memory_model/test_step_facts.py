"""What the run's trace records for the savers priced without a trace of their own: FLOPs counted inside a traced
step, and the weights' roles."""
import timm
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from timm_ext.child_process import call_forked
from timm_ext.memory_model.step_facts import FlopCount, weight_storages


def _totals(model_name: str, checkpointing: bool) -> list:
    """(FlopCount's total, FlopCounterMode's) of a fake-tensor forward and backward (in a fork: a backward here
    would stop this process from forking autograd later)."""
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
    the op's arguments and `out_val`; checkpointing's recomputed forward counts too."""
    for model_name, checkpointing in (('test_resnet', False), ('test_vit', True), ('test_convnext', False)):
        ours, reference = call_forked(lambda: _totals(model_name, checkpointing))[0]
        assert ours == reference > 0, model_name


def test_weight_storages_file_each_storage_once_with_its_role():
    model, ema = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    buffer = torch.zeros(5)
    weights = [*model.parameters(), *ema.parameters(), buffer, model.weight]  # the last one is filed already
    assert weight_storages(weights, [model.weight], ema) == [(48, 'trainable'), (12, 'fixed'), (48, 'ema'),
                                                             (12, 'ema'), (20, 'fixed')]
