"""An in-place ``mul_``/``div_`` by a Python number on a view of a tensor that needs grad.

Autograd saves the wrapped number (an 8-byte 0-dim tensor) in the op's backward node. On a view,
that node lives in the base's ``CopySlices``, as long as the base's graph - not in the view's own
``grad_fn``, which dies with the view. fxmem released the number with the view; the real run keeps
it with the base (the fuzzer's seed 7507 of the extended op families: 8 B, silent at the size
asked because its self-check's small size agreed). Forward with grad and a training step, against
the allocator at sizes the analysis did not see.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import check_against_real_run, check_training_against_real_run


class InPlace(nn.Module):
    """A scaled input (needs grad), then in-place products on views of it, or on itself."""

    def __init__(self, how: str):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 1))
        self.how = how

    def forward(self, x):
        h = x * self.w
        if self.how == "slice":
            h[..., :1].mul_(2.0)
        elif self.how == "two-views":
            h[..., :1].mul_(2.0)
            h[:1].div_(4.0)
        elif self.how == "view-kept":
            v = h[..., 1:]
            v.mul_(0.5)
            return h, v
        elif self.how == "whole":  # no view: the node is the tensor's own grad_fn
            h.mul_(2.0)
        return h


HOW = ["slice", "two-views", "view-kept", "whole"]
SIZES = [dict(B=1, N=3), dict(B=3, N=2)]


@pytest.mark.parametrize("how", HOW)
def test_forward_keeps_the_number_with_the_base(how):
    torch.manual_seed(0)
    report = check_against_real_run(InPlace(how), (("B", 3, "N"),), SIZES, grad=True, hints=dict(B=6, N=7))
    assert report.exact, report.notes


@pytest.mark.parametrize("how", HOW)
def test_training_step_releases_it_in_backward(how):
    torch.manual_seed(0)
    report = check_training_against_real_run(InPlace(how), (("B", 3, "N"),), SIZES,
                                             lambda p: torch.optim.SGD(p, lr=0.1), hints=dict(B=6, N=7))
    assert report.exact, report.notes
