"""The fused message-passing pass (``fxmem.passes.message_passing``) and its kernels
(``fxmem.ops.spmm``, rules in ``fxmem.kernels.fused``): seed 003's gather -> message -> scatter-add
chains become one CSR product.

* every spelling is fused: same outputs, gradients (w.r.t. parameters, node features and edge
  weights) and buffers in every mode (``equivalence.py``); fxmem's analysis of the result equals the
  CPU allocator on real runs, forward and training step; two layers over one edge list share one
  CSR structure;
* the kernels alone against real runs: one head or several, with weights or without;
* look-alikes are declined with the reason; at sizes where the CSR structure costs more than the
  messages, fxmem's analysis keeps the original.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zoo import edge_spellings as S
import fxmem
from conftest import check_against_real_run, check_training_against_real_run
from equivalence import assert_same_in_every_mode
from fxmem.ops.spmm import csr_structure, spmm

HINTS = {"N": 101, "E": 2003}  # a graph with about 20 edges per node
AT = ({"N": 6, "E": 17}, {"N": 9, "E": 40})


def form(opt, sizes: dict = HINTS):
    """The graph module that runs at ``sizes`` (one of two forms where the rewrite pays only for some sizes)."""
    forms = getattr(opt, "fxmem_forms", None)
    if forms is None:
        return opt
    return forms.when if forms.condition.holds(sizes) else forms.otherwise


def entries(opt, sizes: dict = HINTS) -> list[dict]:
    """The pass's entries for the form that runs at ``sizes``."""
    forms = getattr(opt, "fxmem_forms", None)
    when = None if forms is None else str(forms.condition) if forms.condition.holds(sizes) else f"not ({forms.condition})"
    return [r for r in opt.meta["fxmem"] if r["rule"] == "fused-message-passing" and r["when"] == when]


def inputs(specs: tuple, sizes: dict, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        if spec is S.EDGE_SPEC:
            out.append(S.edges((2, sizes["E"]), sizes))
        else:
            out.append(torch.rand(tuple(sizes[d] if isinstance(d, str) else d for d in spec), generator=gen))
    return out


@pytest.mark.parametrize("cls", [S.GCNIndexAdd, S.GCNScatterAdd, S.CopySource, S.HeadsMessage],
                         ids=lambda c: c.__name__)
def test_message_passing_is_fused(cls):
    torch.manual_seed(0)
    model = cls()
    opt = fxmem.optimize(model, *cls.SPECS, hints=HINTS)
    found = entries(opt)
    assert found and all(r["status"] == "applied" for r in found), found
    assert "one sparse-dense product" in found[0]["details"]
    for at in AT:
        assert_same_in_every_mode(model, opt, inputs(cls.SPECS, at))
    sizes = [{"N": 23, "E": 300}, {"N": 40, "E": 900}]
    after = check_against_real_run(opt, cls.SPECS, sizes, makers=S.EDGES)
    check_training_against_real_run(opt, cls.SPECS, sizes[:1], lambda p: torch.optim.Adam(p), makers=S.EDGES)
    before = fxmem.analyze(model, *cls.SPECS, hints=HINTS)
    big = {"N": 1000, "E": 100000}
    assert after.evaluate(**big)["peak"] < before.evaluate(**big)["peak"]


def test_two_layers_over_one_edge_list_share_one_structure():
    torch.manual_seed(0)
    opt = fxmem.optimize(S.GCNIndexAdd(), *S.GCNIndexAdd.SPECS, hints=HINTS)
    structures = [n for n in form(opt).graph.nodes if n.op == "call_function" and n.target is csr_structure]
    assert len(structures) == 1 and len(structures[0].users) == 2


def test_edge_weight_gradients_match():
    # the weights of GAT-style messages are computed from the features: their gradient flows back
    torch.manual_seed(0)
    model = S.HeadsMessage()
    opt = fxmem.optimize(model, *S.HeadsMessage.SPECS, hints=HINTS)
    assert entries(opt)[0]["status"] == "applied"
    assert_same_in_every_mode(model, opt, inputs(S.HeadsMessage.SPECS, {"N": 7, "E": 50}))


@pytest.mark.parametrize("cls,words", [
    (S.EdgeMLPMessage, ["the message is relu", "not x[src]"]),
    (S.MaxAggregation, ["reduces with 'amax'"]),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_message_lookalike_is_declined(cls, words):
    torch.manual_seed(0)
    opt = fxmem.optimize(cls(), *cls.SPECS, hints=HINTS)
    (entry,) = entries(opt)
    assert entry["status"] == "declined"
    for w in words:
        assert w in entry["details"]


def test_fused_only_where_it_pays():
    # one edge per node and 8 features: the CSR structure and MKL's index copies outweigh the messages;
    # the formulas (not the hints) decide: the original form runs there, the fused one for many edges
    torch.manual_seed(0)
    hints = {"N": 101, "E": 103}
    opt = fxmem.optimize(S.CopySource(), *S.CopySource.SPECS, hints=hints)
    (entry,) = entries(opt, hints)
    assert entry["status"] == "declined" and "lowers the peak only where E >=" in entry["reason"]
    assert entry["condition"].startswith("E >=")
    (fused,) = entries(opt, {"N": 10, "E": 10_000})
    assert fused["status"] == "applied"


# --- the kernels alone -----------------------------------------------------------------------------------

class Kernels(nn.Module):
    """csr_structure + spmm directly, heads and weights as given."""

    def __init__(self, heads: int, weighted: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(S.FIN, 8 * heads)
        self.att = nn.Linear(8, 1) if weighted else None
        self.heads = heads

    def forward(self, x, edge_index):
        n = x.shape[0]
        h = self.lin(x).view(n, self.heads, 8)
        src, dst = edge_index[0], edge_index[1]
        crow, col, perm = csr_structure(dst, src, n)
        w = torch.sigmoid(self.att(h).squeeze(-1))[src] if self.att is not None else None
        return spmm(dst, src, crow, col, perm, w, h, n).sum(1)


@pytest.mark.parametrize("heads,weighted", [(1, True), (1, False), (3, True), (2, False)])
def test_kernel_rules_match_real_runs(heads, weighted):
    torch.manual_seed(0)
    model = Kernels(heads, weighted)
    specs = (("N", S.FIN), S.EDGE_SPEC)
    sizes = [{"N": 23, "E": 70}, {"N": 40, "E": 600}]
    check_against_real_run(model, specs, sizes, makers=S.EDGES)
    check_training_against_real_run(model, specs, sizes[:1], lambda p: torch.optim.SGD(p, lr=0.1), makers=S.EDGES)


def test_kernel_gradients():
    torch.manual_seed(0)
    n, m, e = 7, 9, 40
    dst, src = torch.randint(0, n, (e,)), torch.randint(0, m, (e,))
    x = torch.randn(m, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(e, 2, dtype=torch.float64, requires_grad=True)
    crow, col, perm = csr_structure(dst, src, n)
    assert torch.autograd.gradcheck(lambda w, x: spmm(dst, src, crow, col, perm, w, x, n), (w, x))
    plain = torch.zeros(n, 2, 5, dtype=torch.float64).index_add(0, dst, x[src] * w[:, :, None])
    torch.testing.assert_close(spmm(dst, src, crow, col, perm, w, x, n), plain)


def test_pyg_scatter_is_fused():
    # torch_geometric.utils.scatter(..., reduce="sum") is new_zeros(...).scatter_add_(...) once traced
    pyg = pytest.importorskip("torch_geometric.utils")

    class PygScatter(nn.Module):
        SPECS = (("N", S.FIN), S.EDGE_SPEC, ("E",))

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(S.FIN, 8)

        def forward(self, x, edge_index, w):
            h = self.lin(x)
            return pyg.scatter(h[edge_index[0]] * w[:, None], edge_index[1], dim=0, dim_size=h.shape[0], reduce="sum")

    torch.manual_seed(0)
    model = PygScatter()
    opt = fxmem.optimize(model, *PygScatter.SPECS, hints=HINTS)
    (entry,) = entries(opt)
    assert entry["status"] == "applied", entry["reason"]
    assert_same_in_every_mode(model, opt, inputs(PygScatter.SPECS, {"N": 7, "E": 30}))
    check_against_real_run(opt, PygScatter.SPECS, [{"N": 23, "E": 300}], makers=S.EDGES)
