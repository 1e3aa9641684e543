"""Values the simulation knows (fxmem.simulation.values): tensors made to hold one value
(torch.ones/zeros/full, fill_) answer the reads real code makes on them, as a real run would; a write
into their storage (in place, through a view, out=) makes them unknown again, so a branch on the
written values is refused, never taken from a stale value. Checked against real runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.measure import measure


class BranchOnMade(nn.Module):
    """Real code that branches on a tensor it made: a mask of ones, a done-flag that stays False."""

    def forward(self, x):
        done = torch.zeros(x.shape[0], dtype=torch.bool)
        keep = torch.ones(x.shape[0], dtype=torch.long)
        keep = keep & ~done
        if keep.max() == 0:  # never, for real: the real run goes on to the big branch
            return x.sum()
        scale = torch.full((x.shape[1],), 2.0)
        if bool((scale == 2).all()):
            return torch.cat([x * scale, x], dim=1)
        return x


class BranchAfterWrite(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x, idx):
        counts = torch.zeros(x.shape[0])
        if self.how == "index_add":
            counts.index_add_(0, idx, torch.ones(idx.shape[0]))
        elif self.how == "view":
            counts[:1] = x[:1, 0]
        else:
            torch.add(counts, x[:, 0], out=counts)
        if counts.max() > 0:  # the real run decides on written values
            return x * 2
        return x


def test_values_of_made_tensors_take_the_real_path():
    model = BranchOnMade()
    report = fxmem.analyze(model, ("B", "F"))
    assert report.exact
    x = torch.randn(7, 5)
    real = measure(lambda: model(x))
    at = report.evaluate(B=7, F=5)
    assert (at["peak_above_resident"], at["retained"]) == (real.peak_above_start, real.retained)
    assert at["output"] == 7 * 10 * 4  # the concatenation, as for real


@pytest.mark.parametrize("how", ["index_add", "view", "out"])
def test_a_write_makes_the_value_unknown(how):
    with pytest.raises(fxmem.FxMemError, match="decides on tensor values|values"):
        fxmem.analyze(BranchAfterWrite(how), ("B", 4), fxmem.TensorSpec(("E",), dtype=torch.long))
