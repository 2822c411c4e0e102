"""A built model's weights moved onto fake tensors, each weight once, however its modules share them.

`Module.to_empty` under a `FakeTensorMode` walks every module's children and converts their parameters
(`Module._apply`, torch/nn/modules/module.py): a real parameter is replaced by a new parameter around its fake
tensor, but a parameter that is fake already has its contents swapped (`torch.utils.swap_tensors`). A module shared by
two parents (CoaT's convolutional position encodings, reused by its serial blocks) is visited twice; by the second
visit its parameters are fake, and the swap fails, since the fake-tensor converter holds a weak reference to them
("Cannot swap t1 because it has weakref associated with it"). `fake_weights` visits each module once
(`Module.modules()` yields a shared module once) and converts each weight once, so shared weights stay shared.
"""
import torch

__all__ = ['fake_weights']


def fake_weights(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)` for a model whose modules or weights may be shared; call it under an active
    `FakeTensorMode` (as with `to_empty`, each parameter is a new `Parameter` afterwards)."""
    converted = {}  # id(a real weight) -> (it, its fake): a weight two modules hold is converted once
    with torch.no_grad():  # a weight is a leaf: its conversion records no autograd history
        for module in model.modules():
            weights = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, weight in weights:
                if id(weight) not in converted:
                    fake = torch.empty_like(weight, device=device)
                    if isinstance(weight, torch.nn.Parameter):
                        fake = torch.nn.Parameter(fake, requires_grad=weight.requires_grad)
                    converted[id(weight)] = weight, fake
                setattr(module, name, converted[id(weight)][1])
