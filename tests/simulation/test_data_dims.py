"""Sizes only the data decides (boolean masks, ``nonzero``, ``masked_select``) are dims of the
formulas (K1, K2, ...): the report names them, bounds them, asks for them, and the numbers at the
values a real input has equal the allocator's counters on real runs, forward and training step,
in graph and eager mode."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.measure import measure
from fxmem.training import default_loss, train_step


class KeepPositive(nn.Module):
    """Rows whose score is positive, projected: the kept count is K1."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, h, scores):
        kept = h[scores > 0]
        return self.lin(kept).relu().sum(0)


class TwoMasks(nn.Module):
    """``nonzero`` and a boolean mask: two sizes the data decides."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, h, scores):
        idx = torch.nonzero(scores > 0.5).squeeze(1)
        picked = h.index_select(0, idx) * self.w
        neg = scores[scores < 0]
        return picked.sum() + neg.exp().sum()


def _inputs(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 8, generator=g), torch.randn(n, generator=g)]


def _check(model, report, step, counts, sizes=(7, 33, 120)):
    opt = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)
    real = copy.deepcopy(model)
    opt = torch.optim.SGD(real.parameters(), lr=0.1)
    for n in sizes:
        xs = _inputs(n, seed=n)
        dims = {"N": n, **counts(xs)}
        m = measure(lambda: model(*xs))
        ev = report.evaluate(**dims)
        assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained), dims
        train_step(real, xs, opt, default_loss)
        m = measure(lambda: train_step(real, xs, opt, default_loss))
        ev = step.evaluate(**dims)
        assert (ev["train_peak"] - ev["train_resident"], ev["train_retained"]) == (m.peak_above_start, m.retained)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_boolean_mask_count_is_a_named_dim_exact_on_real_runs(mode):
    model = KeepPositive()
    specs = (("N", 8), ("N",))
    report = fxmem.analyze(model, *specs, mode=mode)
    step = fxmem.analyze(model, *specs, mode=mode, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert set(report.symbols) == {"N", "K1"} and "K1 <= N" in report.data_dims["K1"]
    assert "K1" in str(report.peak) and "u0" not in str(report.peak)
    if mode == "eager":
        assert "test_data_dims.py:" in report.data_dims["K1"] and "scores > 0" in report.data_dims["K1"]
    if mode == "graph":
        model = report.graph_module
    _check(model, report, step, lambda xs: {"K1": int((xs[1] > 0).sum())})


def test_nonzero_and_masked_select_are_two_dims():
    model = TwoMasks()
    specs = (("N", 8), ("N",))
    report = fxmem.analyze(model, *specs, mode="eager")
    step = fxmem.analyze(model, *specs, mode="eager", optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert set(report.data_dims) == {"K1", "K2"}
    assert "nonzero" in report.data_dims["K1"] and "aten.index" in report.data_dims["K2"]
    _check(model, report, step, lambda xs: {"K1": int((xs[1] > 0.5).sum()), "K2": int((xs[1] < 0).sum())})


def test_evaluate_asks_for_the_dim_and_checks_its_bound():
    report = fxmem.analyze(KeepPositive(), ("N", 8), ("N",))
    with pytest.raises(fxmem.SpecError, match="give the value of K1"):
        report.evaluate(N=10)
    with pytest.raises(fxmem.SpecError, match=r"K1=11 is more than it can be.*K1 <= N = 10"):
        report.evaluate(N=10, K1=11)
    with pytest.raises(fxmem.SpecError, match="K1=-1 must be a whole number >= 0"):
        report.evaluate(N=10, K1=-1)
    assert report.evaluate(N=10, K1=0)["peak"] < report.evaluate(N=10, K1=10)["peak"]  # nothing kept: fine
    with pytest.raises(fxmem.SpecError, match="depends on K1"):
        report.max_size("N", budget="1MiB")


def test_a_data_dependent_op_whose_kernel_is_not_checked_is_refused():
    class Select(nn.Module):
        def forward(self, x):
            return torch.masked_select(x, x > 0)

    with pytest.raises(fxmem.UnsupportedOpError, match=r"masked_select makes a tensor whose size depends on the data"):
        fxmem.analyze(Select(), ("N", 4))
