"""tune_batch.py with a model registered whose forward reads a tensor value (fake tensors cannot trace it)."""
import sys

from timm.models import register_model
import torch.nn as nn

sys.path.insert(0, sys.argv.pop(1))  # the repository root
import tune_batch  # noqa: E402


class ReadsValues(nn.Module):
    def __init__(self, num_classes: int = 3, **kwargs):
        super().__init__()
        self.num_classes = num_classes
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, num_classes)
        self.default_cfg = self.pretrained_cfg = {'input_size': (3, 32, 32), 'num_classes': num_classes}

    def forward(self, x):
        x = self.conv(x)
        return self.fc(x.mean((2, 3)) / max(float(x.abs().max().item()), 1.0))


@register_model
def untraceable_test_model(pretrained=False, **kwargs):
    return ReadsValues(**kwargs)


if __name__ == '__main__':
    sys.exit(tune_batch.main())
