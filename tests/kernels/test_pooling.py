"""Pooling on the CPU (fxmem/kernels/cpu.py, ``_POOL_COPIES``), against the allocator.

Each pooling kernel works on operands laid out in one memory format (the input's suggested one,
the incoming gradient's, or plain contiguous) and copies, after its outputs, those that are not: a
permuted view pooled directly, a channels-last input to a kernel without a channels-last path, the
gradient a sum sends back expanded. Before these rules such copies were missing from the formulas;
the fuzzer found a max_pool2d of a permuted tensor whose peak it missed by 1,792 B at a size where
the self-check's one real run agreed (seed 7247 of the extended op families). Every pool, in each
layout, forward without grad and a training step, at sizes the analysis did not see.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import check_against_real_run, check_training_against_real_run

POOLS = {
    "max": lambda x, d: {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[d](x, 3, 1, 1),
    "avg": lambda x, d: {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[d](x, 3, 1, 1),
    "adaptive-avg": lambda x, d: {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d,
                                  3: F.adaptive_avg_pool3d}[d](x, 2),
    "adaptive-max": lambda x, d: {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d,
                                  3: F.adaptive_max_pool3d}[d](x, 2),
}
LAYOUTS = ("contiguous", "channels-last", "permuted")


class Pool(nn.Module):
    """A per-channel scale (so a training step has a gradient to send back), the layout, the pool;
    the pool is the last op, so its backward gets the loss's gradient expanded from ``out.sum()``."""

    def __init__(self, kind: str, dims: int, layout: str):
        super().__init__()
        self.kind, self.dims, self.layout = kind, dims, layout
        self.w = nn.Parameter(torch.randn(3, *[1] * dims))

    def forward(self, x):
        h = x * self.w
        if self.layout == "channels-last":
            h = h.contiguous(memory_format=torch.channels_last if self.dims == 2 else torch.channels_last_3d)
        elif self.layout == "permuted":  # a view: the last two dims swapped, not copied
            h = h.transpose(-1, -2)
        return POOLS[self.kind](h, self.dims)


def _cases() -> list:
    return [pytest.param(kind, dims, layout, id=f"{kind}-{dims}d-{layout}") for kind in POOLS for dims in (1, 2, 3)
            for layout in LAYOUTS if not (layout == "channels-last" and dims == 1)]


def _spec(dims: int) -> tuple:
    return (("B", 3, *["S", "T", "U"][:dims]),)


def _sizes(dims: int) -> list[dict]:
    names = ["S", "T", "U"][:dims]
    return [dict(B=1, **{n: 3 + i for i, n in enumerate(names)}), dict(B=2, **{n: 6 - i for i, n in enumerate(names)})]


def _hints(dims: int) -> dict:
    # small example sizes: a 3-d pool at the default ones (about 100 per dim) simulates for long
    return dict(B=5, **dict(zip(["S", "T", "U"][:dims], (9, 10, 11) if dims == 3 else (19, 17))))


@pytest.mark.parametrize("kind,dims,layout", _cases())
def test_forward_is_exact(kind, dims, layout):
    torch.manual_seed(0)
    report = check_against_real_run(Pool(kind, dims, layout), _spec(dims), _sizes(dims), grad=False,
                                    hints=_hints(dims))
    assert report.exact, report.notes


@pytest.mark.parametrize("kind,dims,layout", _cases())
def test_training_step_is_exact(kind, dims, layout):
    torch.manual_seed(0)
    report = check_training_against_real_run(Pool(kind, dims, layout), _spec(dims), _sizes(dims),
                                             lambda p: torch.optim.SGD(p, lr=0.1), hints=_hints(dims))
    assert report.exact, report.notes
