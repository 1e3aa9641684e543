"""Batch 1 is a layout case: a view with a size-1 dim gets, from ATen, a stride at that dim that
PyTorch's fake tensors choose otherwise, and kernels read every stride to pick a memory format (at
batch 1, ``x.transpose(1, 2).reshape(B, C, H, W)`` is channels-last for a fake tensor, contiguous
for the real one, whose convolution then copies and reorders its input). Checked two ways: the
simulation's view strides against real views, and models of the family (timm CoaT/PVT/CvT
positional convs) against real runs at B=1 and other sizes."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from conftest import check_against_real_run, check_training_against_real_run
from fxmem import _torch_compat as tc

VIEWS = [  # (base shape, permutation, view shape)
    ((1, 64, 16), (0, 2, 1), (1, 16, 8, 8)),
    ((1, 12, 6), (0, 2, 1), (1, 6, 3, 4)),
    ((2, 1, 12, 6), (1, 0, 3, 2), (1, 2, 6, 3, 4)),
    ((1, 5, 1, 7), (3, 2, 0, 1), (7, 1, 5)),
    ((3, 1, 4), (1, 0, 2), (1, 1, 12)),
    ((1, 8, 1), (2, 1, 0), (1, 2, 4, 1)),
    ((4, 6), (1, 0), (6, 1, 4, 1)),
]


@pytest.mark.parametrize("base,perm,shape", VIEWS)
def test_simulated_views_have_atens_strides(base, perm, shape):
    real = torch.randn(base).permute(perm)
    mode, _ = tc.new_fake_mode()
    with mode:
        fake = torch.empty_strided(real.shape, real.stride())
        view = fake.view(shape)
    assert tuple(view.stride()) == real.view(shape).stride()


class PositionalConv(nn.Module):
    """CoaT / PVT / CvT: a patch embedding, then a depthwise conv over the tokens made an image."""

    def __init__(self, c: int = 16, k: int = 3, groups: int | None = None):
        super().__init__()
        self.embed = nn.Conv2d(3, c, 2, stride=2)
        self.pos = nn.Conv2d(c, c, k, padding=k // 2, groups=c if groups is None else groups)
        self.norm = nn.LayerNorm(c)

    def forward(self, img):
        x = self.embed(img)
        B, C, H, W = x.shape
        tokens = self.norm(x.flatten(2).transpose(1, 2))
        feat = tokens.transpose(1, 2).reshape(B, C, H, W)
        return self.pos(feat).flatten(2).transpose(1, 2) + tokens


class TokensConv1d(nn.Module):
    """A conv over a token sequence: (B, L, C) -> (B, C, L) -> Conv1d, B=1 makes the view ambiguous."""

    def __init__(self, c: int = 12):
        super().__init__()
        self.proj = nn.Linear(c, c)
        self.conv = nn.Conv1d(c, c, 3, padding=1, groups=c)

    def forward(self, x):
        h = self.proj(x)
        return self.conv(h.transpose(1, 2).reshape(x.shape[0], x.shape[2], x.shape[1])).transpose(1, 2)


# image sizes constant: oneDNN takes a batch-1 conv only above 20480 input elements, so 64 channels
# at 24 x 24 tokens is on its path, 16 at 14 x 14 on ATen's own
MODELS = {
    "coat-depthwise": (lambda: PositionalConv(), ("B", 3, 28, 28), [dict(B=1), dict(B=2)]),
    "coat-depthwise-onednn": (lambda: PositionalConv(64), ("B", 3, 48, 48), [dict(B=1), dict(B=3)]),
    "pvt-dense-conv": (lambda: PositionalConv(8, groups=1), ("B", 3, 36, 36), [dict(B=1), dict(B=3)]),
    "pvt-dense-conv-onednn": (lambda: PositionalConv(40, groups=1), ("B", 3, 48, 48), [dict(B=1)]),
    "cvt-5x5": (lambda: PositionalConv(8, k=5), ("B", 3, 44, 44), [dict(B=1)]),
    "tokens-conv1d": (TokensConv1d, ("B", "L", 12), [dict(B=1, L=40), dict(B=1, L=3000), dict(B=2, L=9)]),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_batch_one_matches_real_run(name, grad):
    factory, spec, sizes = MODELS[name]
    torch.manual_seed(0)
    check_against_real_run(factory().eval(), (spec,), sizes, grad=grad)


@pytest.mark.parametrize("name", ["coat-depthwise", "coat-depthwise-onednn", "tokens-conv1d"])
def test_batch_one_training_step_matches_real_run(name):
    factory, spec, sizes = MODELS[name]
    torch.manual_seed(0)
    check_training_against_real_run(factory().train(), (spec,), sizes[:2], lambda p: torch.optim.Adam(p, lr=1e-3))
