"""oneDNN picks its paths and scratch by CPU (vendor, ISA), thread count and sizes: an AMD EPYC and
an Intel Xeon differ where a table fitted on one would be wrong on the other. fxmem measures such
kernels on the machine it runs on (fxmem.kernels.calibrate, keyed by the call's geometry, dtype,
layout and thread count; the report names the CPU), so these tests compare with a real run on
whatever machine runs them - never with numbers taken on another one."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import check_against_real_run, check_training_against_real_run


class OneChannelConv1d(nn.Module):
    """``Conv1d(1, 6, 3)`` over a (B, L, 1) sequence made channels-first by a transpose (size-1 dims)."""

    def __init__(self, before: str = "none"):
        super().__init__()
        self.before = before
        self.norm = nn.BatchNorm1d(1)
        self.conv = nn.Conv1d(1, 6, 3)

    def forward(self, x):
        if self.before == "unsqueeze":  # (B, L) -> (B, L, 1)
            x = x.unsqueeze(2)
        h = x.transpose(1, 2)
        if self.before == "batchnorm":
            h = self.norm(h)
        if self.before == "strided":
            h = h[:, :, ::2]
        return self.conv(h)


class TwoConvs(nn.Module):
    def __init__(self, c: int = 32):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


CONV1D = {
    "transposed": (("B", "L", 1), [dict(B=3, L=40), dict(B=1, L=300), dict(B=8, L=7)]),
    "unsqueeze": (("B", "L"), [dict(B=3, L=40), dict(B=1, L=300)]),
    "batchnorm": (("B", "L", 1), [dict(B=3, L=40), dict(B=5, L=301)]),
    "strided": (("B", "L", 1), [dict(B=3, L=40), dict(B=2, L=301)]),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("before", sorted(CONV1D))
def test_one_channel_conv1d_on_a_transposed_sequence(before, grad):
    spec, sizes = CONV1D[before]
    torch.manual_seed(0)
    model = OneChannelConv1d(before).train(before == "batchnorm")
    check_against_real_run(model, (spec,), sizes, grad=grad)


def test_one_channel_conv1d_training_step():
    torch.manual_seed(0)
    check_training_against_real_run(OneChannelConv1d("batchnorm").train(), (("B", "L", 1),),
                                    [dict(B=3, L=40), dict(B=2, L=301)], lambda p: torch.optim.Adam(p, lr=1e-3))


@pytest.mark.parametrize("spec,sizes", [(("B", 32, "H", "W"), [dict(B=2, H=9, W=11), dict(B=3, H=14, W=12)]),
                                        (("B", 32, 30, 28), [dict(B=1), dict(B=2)])])
def test_stacked_convs_with_adam(spec, sizes):
    torch.manual_seed(0)
    check_training_against_real_run(TwoConvs().train(), (spec,), sizes, lambda p: torch.optim.Adam(p, lr=1e-3))
