"""Convolutions' formulas are not cut where ATen's backend question changes nothing (issue 44): torch's
fake convolution asks ATen which backend it would take (``use_mkldnn``: ``batch >= 16`` first, then
``batch > 1``, ``numel > 20480``) only to pick the output's memory format, and each comparison it
evaluated became a guard - a CNN analysed at batch 97 held for ``B >= 16`` only. Where every CPU
backend gives the same format (a contiguous input and weight), the question is asked unguarded;
what the kernels allocate is still measured in the regime of the sizes (and guarded there).
Checked against the allocator on real runs at sizes the analysis did not see, below 16 included."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem._torch_compat import conv_backend
from conftest import check_against_real_run


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16)
        self.c3 = nn.Conv2d(16, 16, 1)  # a 1x1 convolution: ATen's backend choice reads the batch here
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.head(self.c3(x).mean((2, 3)))


SPEC = ("B", 3, "H", "W")
BELOW_16 = [dict(B=2, H=20, W=31), dict(B=5, H=40, W=17), dict(B=15, H=33, W=34)]


def test_the_region_is_not_cut_at_batch_16():
    report = fxmem.analyze(SmallCNN(), SPEC, check=False)
    assert not any("16" in c for c in report.region), report.region
    for dims in BELOW_16:
        assert report._holds_at(dims), (dims, report.region)  # one analysis answers there, no re-analysis


def test_exact_below_16_forward_and_training_step():
    check_against_real_run(SmallCNN(), (SPEC,), BELOW_16, grad=False)
    check_against_real_run(SmallCNN(), (SPEC,), BELOW_16[:2], grad=True,
                           optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


def test_a_single_threaded_1x1_convolution_keeps_its_batch_regime():
    """On one thread ATen sends a 1x1 convolution to oneDNN from batch 16 on only: that regime is the
    calibrated kernel's to guard, and it does - so sizes on both sides are exact (the one below is
    re-analysed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = check_against_real_run(SmallCNN(), (SPEC,), [dict(B=20, H=12, W=13), dict(B=6, H=12, W=13)],
                                        grad=False)
        # the batch's lower bound is 16 or more (a fit may start a size or two higher on another CPU)
        bounds = [int(c.split(">=")[1]) for c in report.region if c.replace(" ", "").startswith("B>=")]
        assert bounds and max(bounds) >= 16, report.region
    finally:
        torch.set_num_threads(threads)


def test_a_layout_the_backends_disagree_on_keeps_torchs_guards():
    """A channels-last input: oneDNN and the native kernels keep it channels-last, others would not,
    so the backend decides the output's layout and the question keeps its guards."""
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 1, 1)
    assert not conv_backend._one_format(x, w)
    assert conv_backend._one_format(torch.randn(2, 3, 8, 8), w)


def test_atens_function_is_restored():
    before = torch._C._select_conv_backend
    fxmem.analyze(SmallCNN(), SPEC, check=False, grad=False)
    assert torch._C._select_conv_backend is before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_backend_keeps_a_contiguous_convolution_contiguous(dtype):
    """What the rule rests on, asked of the installed torch: for a contiguous input and weight, every
    backend a CPU input can take gives a contiguous output."""
    for shape, weight in [((2, 3, 9, 9), (4, 3, 3, 3)), ((1, 1, 9, 9), (4, 1, 1, 1)), ((2, 3, 9), (4, 3, 3)),
                          ((2, 3, 5, 9, 9), (4, 3, 3, 3, 3))]:
        assert conv_backend._one_format(torch.randn(shape, dtype=dtype), torch.randn(weight, dtype=dtype))
