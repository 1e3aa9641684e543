"""Capture of code torch.fx cannot trace: ``fxmem.optimize`` takes the graph TorchDynamo captures
(``torch.zeros(x.size(0), F)``, common in GNN code), rewrites it, and the result computes what the
model computes (outputs and gradients, train and eval mode), keeps its parameters, and its memory
is what fxmem predicts on real runs; where neither fx nor Dynamo can capture one graph, optimize
says so, and analyze still works."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from conftest import check_against_real_run

EDGES = fxmem.TensorSpec((2, "E"), dtype=torch.int64)


class ScatterGCN(nn.Module):
    """A GCN layer as GNN code writes it: fx fails at ``torch.zeros(x.size(0), F)``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.p = 0.2

    def forward(self, x, edge_index):
        h = F.dropout(self.lin(x), self.p, self.training)
        out = torch.zeros(x.size(0), 32)
        return out.index_add_(0, edge_index[1], h[edge_index[0]]).relu()


def _inputs(n: int, e: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g, requires_grad=True), torch.randint(0, n, (2, e), generator=g)


def test_optimize_rewrites_the_graph_dynamo_captures_where_fx_cannot():
    model = ScatterGCN()
    opt = fxmem.optimize(model, ("N", 16), EDGES, hints={"N": 53, "E": 2003})
    assert "TorchDynamo" in opt.meta["fxmem_capture"] and "zeros" in opt.meta["fxmem_capture"]
    found = [(r["rule"], r["status"]) for r in opt.meta["fxmem"] if r["status"] != "no match"]
    # the fused form is applied where the formulas prove it pays (E >= k*N; a 'switch' record says where)
    assert ("fused-message-passing", "applied") in found
    assert {rule for rule, status in found if status == "applied"} <= {"fused-message-passing", "switch"}
    assert sorted(opt.state_dict()) == sorted(model.state_dict())
    assert all(a is b for a, b in zip(opt.parameters(), model.parameters()))
    for train in (True, False):
        model.train(train)
        opt.train(train)
        x, ei = _inputs(40, 300, seed=int(train))
        torch.manual_seed(3)
        want = model(x, ei)
        (gx,) = torch.autograd.grad(want.square().sum(), x)
        torch.manual_seed(3)
        got = opt(x, ei)
        (ox,) = torch.autograd.grad(got.square().sum(), x)
        assert torch.allclose(got, want, atol=1e-5) and torch.allclose(ox, gx, atol=1e-4)
    opt.eval()
    report = fxmem.analyze(opt, ("N", 16), EDGES, grad=False)
    check_against_real_run(opt, (("N", 16), EDGES), [dict(N=40, E=300), dict(N=9, E=31)], grad=False, report=report,
                           makers={"edge_index": lambda shape, dims: torch.randint(0, dims["N"], shape)})


def test_optimize_says_when_neither_fx_nor_dynamo_captures_a_graph():
    class OnValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # a decision on values: a graph break
                return self.lin(x)
            return torch.zeros(x.size(0), 4)

    with pytest.raises(fxmem.TraceError, match=r"(?s)neither torch.fx nor TorchDynamo.*TorchDynamo cannot capture OnValues as one graph: .*branching"):
        fxmem.optimize(OnValues(), ("B", 4))


def test_a_graph_that_holds_for_some_sizes_only_runs_only_there():
    """Dynamo follows ``if x.size(0) > 10`` for the size it ran at and guards on it; that graph holds
    where N <= 10 only, so the result runs it there and the model's own forward (the other branch)
    at every other size: the same numbers as the model on both sides."""
    class SizeBranch(ScatterGCN):
        def forward(self, x, edge_index):
            out = torch.zeros(x.size(0), 32)
            if x.size(0) > 10:
                out = out + 1
            return out.index_add_(0, edge_index[1], self.lin(x)[edge_index[0]])

    torch.manual_seed(0)
    model = SizeBranch()
    opt = fxmem.optimize(model, ("N", 16), EDGES)
    (entry,) = [e for e in opt.meta["fxmem"] if e["rule"] == "region"]
    assert entry["status"] == "applied" and "N <= 10" in entry["reason"] and "N <= 10" in entry["condition"], entry
    for n, e in ((6, 40), (10, 25), (11, 30), (40, 300)):  # both sides of the guard
        x, ei = _inputs(n, e, seed=n)
        torch.testing.assert_close(opt(x, ei), model(x, ei))
