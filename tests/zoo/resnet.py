"""ResNet-18 as torchvision builds it (``torchvision.models.resnet18``: BasicBlock, [2, 2, 2, 2],
a 7x7 stride-2 stem and a 3x3 stride-2 max pool), written out here because torchvision needs the
CUDA build of torch; ``width`` scales every stage's channels (64 is torchvision's)."""
from __future__ import annotations

import torch
import torch.nn as nn


# 11 sizes a training analysis is checked at (tests/exactness/test_resnet18.py, benchmarks): batch 1 to
# 6, images 7x9 to 128x96; B=1 needs layer4's map to have 2 or more values per channel for batch norm
# in training (H, W >= 33)
SIZES = [dict(B=1, H=64, W=64), dict(B=2, H=40, W=56), dict(B=3, H=33, W=33), dict(B=4, H=64, W=64),
         dict(B=2, H=97, W=97), dict(B=5, H=100, W=120), dict(B=2, H=128, W=96), dict(B=3, H=17, W=23),
         dict(B=6, H=50, W=70), dict(B=1, H=80, W=64), dict(B=2, H=7, W=9)]


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], width
        for k, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if k == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
