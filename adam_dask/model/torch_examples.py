"""Example PyTorch modules for the torch engine, importable by factory path on every worker
(``--model adam_dask.model.torch_examples:residual_net``).

* :class:`PaperNet`: the paper's MNIST network (``conv5x5:10,maxpool2,conv5x5:20,maxpool2,
  fc400,fc400,fc10``, relu as ``adam.model.activation`` by default) as an ``nn.Module``: the numba engine's tensors, shapes and flat
  order (its names count the activations as modules, so they differ).
* :class:`ResidualNet`: what the spec grammar cannot say: padding, a strided convolution,
  residual blocks with batch norm, global average pooling.

>>> import torch
>>> residual_net()(torch.zeros(2, 1, 28, 28)).shape
torch.Size([2, 10])
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "PaperNet",
    "ResidualBlock",
    "ResidualNet",
    "paper_net",
    "residual_net",
    "tiny_residual_net",
]


class PaperNet(nn.Sequential):
    """The paper's MNIST net, the numba spec's tensors in the same flat order; ``activation``
    "relu" or "tanh"."""

    def __init__(self, in_channels: int = 1, classes: int = 10, activation: str = "relu"):
        act = {"relu": nn.ReLU, "tanh": nn.Tanh}[activation]
        super().__init__(
            nn.Conv2d(in_channels, 10, 5),  # 28 -> 24
            act(),
            nn.MaxPool2d(2),  # -> 12
            nn.Conv2d(10, 20, 5),  # -> 8
            act(),
            nn.MaxPool2d(2),  # -> 4
            nn.Flatten(),
            nn.Linear(20 * 4 * 4, 400),
            act(),
            nn.Linear(400, 400),
            act(),
            nn.Linear(400, classes),
        )


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions (padding 1) with batch norm, added to the input."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class ResidualNet(nn.Module):
    """A small ResNet: a padded stem, a strided convolution, ``blocks`` residual blocks per
    stage, global average pooling and a dense classifier."""

    def __init__(self, in_channels: int = 1, classes: int = 10, width: int = 16, blocks: int = 1):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.stage1 = nn.Sequential(*[ResidualBlock(width) for _ in range(blocks)])
        self.down = nn.Sequential(  # stride 2: 28 -> 14
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
        )
        self.stage2 = nn.Sequential(*[ResidualBlock(2 * width) for _ in range(blocks)])
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


def paper_net() -> PaperNet:
    """The factory of :class:`PaperNet` (MNIST: 1 channel, 10 classes)."""
    return PaperNet()


def residual_net() -> ResidualNet:
    """The factory of :class:`ResidualNet` (MNIST: 1 channel, 10 classes, width 16)."""
    return ResidualNet()


def tiny_residual_net() -> ResidualNet:
    """A narrow :class:`ResidualNet` (width 8) for quick tests and notebooks."""
    return ResidualNet(width=8)
