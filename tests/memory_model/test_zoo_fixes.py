"""What the zoo bench (bench/bench_zoo.py) found the trace refusing, fixed at the cause: a module two parents share,
and a view of a weight handed to a module in a forward traced under no_grad."""
import pytest
import torch
import torch.nn as nn
from timm.models import register_model
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from timm_ext.memory_model.estimate import EstimateError, estimate_memory
from timm_ext.memory_model.fake_weights import fake_weights
from timm_ext.train.args import parse_args


class _TokenBlock(nn.Module):
    """Takes the class token as an input of its own, as CaiT's class-attention blocks do."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return self.proj(token) + x.mean(1, keepdim=True)


class _Stage(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.shared = shared


class _ZooCases(nn.Module):
    """A module shared by two parents (CoaT's position encodings), a weight two modules hold, and a class token's
    view handed to a block (CaiT)."""

    def __init__(self, num_classes: int = 3, dim: int = 8, **kwargs):
        super().__init__()
        self.num_classes = num_classes
        self.embed = nn.Conv2d(3, dim, 4, 4)
        shared = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.stage1, self.stage2 = _Stage(shared), _Stage(shared)
        self.norm = nn.BatchNorm2d(dim)
        self.norm_again = nn.Module()
        self.norm_again.register_buffer('running_mean', self.norm.running_mean)  # a buffer two modules hold
        self.token = nn.Parameter(torch.zeros(1, 1, dim))
        self.block = _TokenBlock(dim)
        self.head = nn.Linear(dim, num_classes) if num_classes else nn.Identity()  # 0: an encoder, features out
        self.default_cfg = self.pretrained_cfg = {'input_size': (3, 16, 16), 'num_classes': num_classes}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.stage2.shared(self.stage1.shared(self.embed(x))))
        x = x.flatten(2).transpose(1, 2)
        return self.head(self.block(x, self.token.expand(x.shape[0], -1, -1))[:, 0])


@register_model
def zoo_fixes_test_model(pretrained=False, **kwargs):
    return _ZooCases(**kwargs)


@register_model
def zoo_fixes_test_encoder(pretrained=False, **kwargs):
    return _ZooCases(**{'num_classes': 0, **kwargs})


def test_fake_weights_converts_a_shared_module_once():
    """torch/nn/modules/module.py, `Module._apply` (via `to_empty`): a parameter that is already a fake tensor is
    swapped, not replaced, and the swap fails on a fake tensor the converter holds a weak reference to, so a module
    two parents share cannot be moved twice; `fake_weights` moves each module and weight once, keeping them shared."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match='swap'):
            _ZooCases().to_empty(device='cpu')
        model = _ZooCases()
        fake_weights(model, torch.device('cpu'))
    assert all(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])
    assert model.stage1.shared is model.stage2.shared
    assert model.norm_again.running_mean is model.norm.running_mean  # a shared buffer stays one tensor
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())


def test_the_cuda_estimate_traces_both_cases_forward_only_and_training():
    args, _ = parse_args(['--model', 'zoo_fixes_test_model', '--num-classes', '3', '--device', 'cuda', '--amp'])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    for step_kind in ('validate', 'train'):
        estimate = estimate_memory(args, 'cuda', batches=(2, 4), step_kind=step_kind)
        assert sorted(estimate.traced) == [2, 4] and estimate.replay is not None


def test_training_an_encoder_without_a_head_is_refused_in_one_line():
    """A model built with num_classes 0 (timm's encoders: deepseek_vit_412m, the *_enc models) returns features, so no
    loss can read a class from it: the training step says so and names the flag, instead of a fake-tensor error."""
    args, _ = parse_args(['--model', 'zoo_fixes_test_encoder', '--device', 'cuda', '--amp'])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    with pytest.raises(EstimateError, match=r'no classifier head \(num_classes 0\); pass --num-classes N') as error:
        estimate_memory(args, 'cuda', batches=(2, 4), step_kind='train')
    assert '\n' not in str(error.value)
    assert estimate_memory(args, 'cuda', batches=(2, 4), step_kind='validate').replay is not None  # its forward runs
