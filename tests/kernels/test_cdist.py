"""``torch.cdist`` on the CPU (fxmem/kernels/cpu.py, ``_euclidean_dist_parts``), against the allocator.

With p=2 and more than 25 rows on either side (or ``compute_mode='use_mm_for_euclid_dist'``), cdist
computes through ATen's composite ``_euclidean_dist``: norms, columns of ones and ``x1 * -2``
concatenated per side to ``(rows, K + 2)``, then one matrix product. The simulation sees one op, and
before the rule its intermediates were missing: the extended fuzzer's seed 9575 (cdist of a
``(2*B*N, 6)`` tensor) was 1,728 B low at B=12, N=3, silently, where the self-check's one real run
(the peak elsewhere) agreed. The cases take both paths (sizes on each side of the 25-row switch,
the matrix-product path forced, p=1), forward without grad and a training step, at sizes the
analysis did not see.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import check_against_real_run, check_training_against_real_run


class Dist(nn.Module):
    """A scale (so a training step has a gradient to send), then cdist in one of the ways users call it."""

    def __init__(self, how: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(5, dtype=dtype))

    def forward(self, x, y):
        x = x * self.w
        if self.how == "self":  # pairwise distances of one set (the fuzzer's case)
            return torch.cdist(x, x)
        if self.how == "transposed":  # a strided view of the first set
            return torch.cdist(x.t().contiguous().t(), y)
        if self.how == "forced":  # the matrix-product path at any size
            return torch.cdist(x, y, compute_mode="use_mm_for_euclid_dist")
        if self.how == "p1-transposed":  # the direct path at any size, a strided second set
            return torch.cdist(x, y.t().contiguous().t(), p=1.0)
        return torch.cdist(x, y)


CASES = {
    # how, specs, sizes (each side of 25 rows), hints
    "self": ("self", (("R", 5), ("Q", 5)), [dict(R=7, Q=3), dict(R=31, Q=3)], dict(R=40, Q=9)),
    "two-sets": ("two", (("R", 5), ("Q", 5)), [dict(R=3, Q=30), dict(R=28, Q=2), dict(R=12, Q=9)], dict(R=40, Q=37)),
    "batched": ("two", (("B", "R", 5), ("B", "Q", 5)), [dict(B=2, R=27, Q=4), dict(B=3, R=5, Q=6)],
                dict(B=4, R=33, Q=30)),
    "broadcast": ("two", (("B", "R", 5), (1, "Q", 5)),
                  [dict(B=3, R=26, Q=2), dict(B=2, R=3, Q=40), dict(B=3, R=4, Q=6)], dict(B=4, R=33, Q=30)),
    "broadcast-first": ("two", ((1, "R", 5), ("B", "Q", 5)), [dict(B=3, R=4, Q=6), dict(B=2, R=30, Q=3)],
                        dict(B=4, R=33, Q=30)),
    "transposed": ("transposed", (("R", 5), ("Q", 5)), [dict(R=29, Q=6), dict(R=4, Q=6)], dict(R=40, Q=37)),
    "p1-transposed": ("p1-transposed", (("R", 5), ("Q", 5)), [dict(R=29, Q=6), dict(R=4, Q=33)], dict(R=40, Q=37)),
    "forced": ("forced", (("R", 5), ("Q", 5)), [dict(R=3, Q=2), dict(R=9, Q=30)], dict(R=40, Q=37)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_forward_is_exact(name, dtype):
    how, specs, sizes, hints = CASES[name]
    torch.manual_seed(0)
    report = check_against_real_run(Dist(how, dtype), _typed(specs, dtype), sizes, grad=False, hints=hints)
    assert report.exact, report.notes


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_step_is_exact(name):
    how, specs, sizes, hints = CASES[name]
    torch.manual_seed(0)
    report = check_training_against_real_run(Dist(how), specs, sizes, lambda p: torch.optim.SGD(p, lr=0.1),
                                             hints=hints)
    assert report.exact, report.notes


def _typed(specs: tuple, dtype: torch.dtype) -> tuple:
    return tuple(fxmem.TensorSpec(s, dtype=dtype) for s in specs)
