"""Models: a small CNN (default, no batch norm unless --bn) and torchvision ResNets."""
from __future__ import annotations

import torch.nn as nn


class SmallCNN(nn.Module):
    """Three 3x3 conv layers, adaptive pooling to 4x4, one hidden FC layer.

    Works for any input size (8x8 digits, 32x32 CIFAR, 224x224 synthetic). No dropout
    and, by default, no batch norm, so the result does not depend on how the global
    batch is split across ranks.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32,
                 batch_norm: bool = False):
        super().__init__()

        def block(cin, cout):
            layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=not batch_norm)]
            if batch_norm:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU(inplace=True))
            return layers

        w = width
        self.features = nn.Sequential(
            *block(in_channels, w), *block(w, 2 * w), nn.MaxPool2d(2, ceil_mode=True),
            *block(2 * w, 4 * w), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * w * 16, 128),
                                  nn.ReLU(inplace=True), nn.Linear(128, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


def build_model(name: str, in_channels: int, num_classes: int, batch_norm: bool = False,
                width: int = 32) -> nn.Module:
    if name == "cnn":
        return SmallCNN(in_channels, num_classes, width=width, batch_norm=batch_norm)
    if name in ("resnet18", "resnet50"):
        try:
            import torchvision.models as tvm  # lazy: only the ResNets need torchvision
        except ImportError as e:
            raise SystemExit(f"--model {name} needs torchvision, which is not importable: {e}")
        model = getattr(tvm, name)(weights=None, num_classes=num_classes)
        if in_channels != 3:
            model.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
        return model
    raise SystemExit(f"unknown --model {name}")
