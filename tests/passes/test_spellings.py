"""Rewrite rules match by meaning, not spelling (issue 46, item 3).

* labml.ai's GAT ends in ``torch.einsum('ijh,jhf->ihf', a, g)``: the fused-attention rule reads any
  product that sums the softmax's axis against the features' rows (einsum with any letters and axis
  order) and gives the einsum's own layout back; a product over the other axis is declined;
* EdgeConv's ``Linear(cat([x_i, x_j - x_i]))`` over kNN-gathered neighbours: the pair-linear rule
  splits a map whose halves are sums of copies, ``(W1 - W2) x_i + W2 x_j``; products of pairs stay
  declined;
* where a rule finds nothing, its "no match" record names the nearest thing found (node and source
  line) and why it is not one.

Each rewrite is checked against the original model's outputs and gradients in train and eval mode
(``equivalence.py``) and by fxmem's analysis of the result (a lower peak).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from equivalence import assert_same_in_every_mode, rewritten

FIN, HIDDEN, HEADS = 5, 4, 3


def entries(opt, rule: str) -> list[dict]:
    return [e for e in opt.meta["fxmem"] if e["rule"] == rule]


def graph_inputs(n: int, seed: int = 0, batch: int | None = None) -> list:
    gen = torch.Generator().manual_seed(seed)
    if batch is not None:  # point clouds [B, N, F] (EdgeConv)
        return [torch.randn(batch, n, EDGE_F, generator=gen)]
    adj = (torch.rand(n, n, generator=gen) > 0.5).float()
    adj.fill_diagonal_(1.0)  # every row has an edge (a row with none: -inf softmax NaN in both forms)
    return [torch.randn(n, FIN, generator=gen), adj]


def inference_peak(model: nn.Module, specs: tuple, **at: int) -> int:
    """fxmem's analysed inference peak (eval mode, no grad) at ``at``, bytes."""
    was = model.training
    try:
        return fxmem.analyze(model.eval(), *specs, grad=False).evaluate(**at)["peak"]
    finally:
        model.train(was)


# --- einsum GAT (labml.ai) ------------------------------------------------------------------------------

class LabmlGAT(nn.Module):
    """labml.ai's GAT layer: per-head linear, pairs [g_i || g_j] (repeat_interleave/repeat) through
    nn.Linear(2F, 1), LeakyReLU, masked_fill with the adjacency, softmax over j, dropout, and
    ``einsum('ijh,jhf->ihf', a, g)``."""

    SPECS = (("N", FIN), ("N", "N"))

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(FIN, HIDDEN * HEADS, bias=False)
        self.attn = nn.Linear(2 * HIDDEN, 1, bias=False)
        self.activation, self.softmax, self.dropout = nn.LeakyReLU(0.2), nn.Softmax(dim=1), nn.Dropout(dropout)

    def forward(self, h, adj):
        n = h.shape[0]
        g = self.linear(h).view(n, HEADS, HIDDEN)
        pairs = torch.cat([g.repeat_interleave(n, dim=0), g.repeat(n, 1, 1)], dim=-1).view(n, n, HEADS, 2 * HIDDEN)
        e = self.activation(self.attn(pairs)).squeeze(-1)  # [N, N, H]
        e = e.masked_fill(adj.unsqueeze(-1) == 0, float("-inf"))
        a = self.dropout(self.softmax(e))
        return torch.einsum("ijh,jhf->ihf", a, g).reshape(n, HEADS * HIDDEN)


class HeadsFirstEinsum(nn.Module):
    """Scores written as s_i + t_j, heads first [H, N, N], and the product with other letters and
    the features first: ``einsum('jhd,hij->ihd', g, a)``."""

    SPECS = (("N", FIN), ("N", "N"))

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(FIN, HIDDEN * HEADS)
        self.a_l, self.a_r = nn.Parameter(torch.randn(HEADS, HIDDEN)), nn.Parameter(torch.randn(HEADS, HIDDEN))
        self.dropout = dropout

    def forward(self, h, adj):
        n = h.shape[0]
        g = self.linear(h).view(n, HEADS, HIDDEN)
        s, t = (g * self.a_l).sum(-1).t(), (g * self.a_r).sum(-1).t()  # [H, N]
        e = F.leaky_relu(s[:, :, None] + t[:, None, :], 0.2)
        e = torch.where(adj > 0, e, torch.full_like(e, -9e15))
        a = F.dropout(torch.softmax(e, dim=-1), self.dropout, training=self.training)
        return torch.einsum("jhd,hij->ihd", g, a).flatten(1)


class EinsumOverRows(HeadsFirstEinsum):
    """Look-alike: the einsum sums over i (the axis the softmax does not normalise)."""

    def forward(self, h, adj):
        n = h.shape[0]
        g = self.linear(h).view(n, HEADS, HIDDEN)
        s, t = (g * self.a_l).sum(-1).t(), (g * self.a_r).sum(-1).t()
        e = F.leaky_relu(s[:, :, None] + t[:, None, :], 0.2)
        e = torch.where(adj > 0, e, torch.full_like(e, -9e15))
        return torch.einsum("ihd,hij->jhd", g, torch.softmax(e, dim=-1)).flatten(1)


@pytest.mark.parametrize("cls,p", [(LabmlGAT, 0.0), (LabmlGAT, 0.5), (HeadsFirstEinsum, 0.0), (HeadsFirstEinsum, 0.3)],
                         ids=["labml", "labml-dropout", "heads-first", "heads-first-dropout"])
def test_einsum_gat_is_fused_and_computes_the_same(cls, p):
    torch.manual_seed(0)
    model = cls(dropout=p)
    opt = fxmem.optimize(model, *cls.SPECS)
    form = rewritten(opt)  # where the rewrite pays (a switch at small N keeps the original there)
    (entry,) = entries(form, "fused-attention")
    assert entry["status"] == "applied", entry["reason"]
    assert "no N x N float tensor built or kept" in entry["details"]
    for n in (5, 8):  # outputs and gradients against the model, train and eval, the einsum's own layout
        assert_same_in_every_mode(model, form, graph_inputs(n, seed=n))
    if form is not opt:
        assert_same_in_every_mode(model, opt, graph_inputs(6))
    before, after = inference_peak(model, cls.SPECS, N=400), inference_peak(form, cls.SPECS, N=400)
    assert after < before * 0.6, (before, after)


def test_einsum_over_the_other_axis_is_declined():
    torch.manual_seed(0)
    model = EinsumOverRows()
    opt = fxmem.optimize(model, *EinsumOverRows.SPECS)
    (entry,) = entries(opt, "fused-attention")
    assert entry["status"] == "declined"
    assert "does not sum over the axis the softmax normalises" in entry["details"], entry["details"]
    assert not any(e["status"] == "applied" for e in entries(opt, "fused-attention"))


# --- EdgeConv (DGCNN / PyG) -------------------------------------------------------------------------------

EDGE_F, EDGE_OUT, K = 16, 16, 8


class DenseEdgeConv(nn.Module):
    """EdgeConv: kNN by topk on distances, neighbours gathered, Linear(pairs(x_i, x_j)) - by default
    [x_i || x_j - x_i] - ReLU, max over the k neighbours."""

    SPECS = (("B", "N", EDGE_F),)

    def __init__(self, combine=lambda x_i, x_j: x_j - x_i, pairs=None, width: int = 2) -> None:
        super().__init__()
        self.lin, self.combine, self.pairs = nn.Linear(width * EDGE_F, EDGE_OUT), combine, pairs

    def forward(self, x):
        B, N, Fx = x.shape
        idx = torch.cdist(x, x).topk(K, dim=-1, largest=False).indices  # [B, N, k]
        x_j = torch.gather(x.unsqueeze(1).expand(B, N, N, Fx), 2, idx.unsqueeze(-1).expand(B, N, K, Fx))
        x_i = x.unsqueeze(2).expand(B, N, K, Fx)
        if self.pairs is not None:
            e = self.pairs(x_i, x_j)
        else:
            e = torch.cat([x_i, self.combine(x_i, x_j)], dim=-1)  # [B, N, k, 2F]
        return torch.relu(self.lin(e)).max(dim=2).values


@pytest.mark.parametrize("combine,terms", [
    (lambda x_i, x_j: x_j - x_i, ["L1(x (size 1 along dims [2]))", "+ L2(x_j)", "- L2(x (size 1 along dims [2]))"]),
    (lambda x_i, x_j: (x_j - x_i) * 0.5, ["0.5 * L2(x_j)", "- 0.5 * L2(x (size 1 along dims [2]))"]),
], ids=["x_j-x_i", "(x_j-x_i)*0.5"])
def test_edgeconv_is_split_and_computes_the_same(combine, terms):
    torch.manual_seed(0)
    model = DenseEdgeConv(combine)
    opt = fxmem.optimize(model, *DenseEdgeConv.SPECS)
    (entry,) = entries(opt, "pair-linear")
    assert entry["status"] == "applied", entry["reason"]
    for t in terms:
        assert t in entry["details"], entry["details"]
    assert entry["verification"] == "passed"
    for b, n in ((2, 10), (3, 12)):
        assert_same_in_every_mode(model, opt, graph_inputs(n, seed=n, batch=b))
    # the [B, N, k, 2F] pair tensor and x_j - x_i are no longer built: fxmem's analysed peak drops
    before, after = inference_peak(model, DenseEdgeConv.SPECS, B=8, N=200), inference_peak(opt, DenseEdgeConv.SPECS,
                                                                                           B=8, N=200)
    assert after < before, (before, after)
    assert "cat" in entry["no_longer_built"]


@pytest.mark.parametrize("pairs,width,words", [
    (lambda x_i, x_j: x_i * x_j, 1, "product/bilinear pair h_i * h_j"),
    (lambda x_i, x_j: torch.relu(torch.cat([x_i, x_j - x_i], -1)), 2, "a nonlinearity (relu"),
], ids=["product", "relu-before-map"])
def test_edgeconv_with_a_nonlinear_pair_function_is_not_split(pairs, width, words):
    torch.manual_seed(0)
    model = DenseEdgeConv(pairs=pairs, width=width)
    opt = fxmem.optimize(model, *DenseEdgeConv.SPECS)
    (entry,) = entries(opt, "pair-linear")
    assert entry["status"] == "declined" and words in entry["details"], entry["details"]
    assert_same_in_every_mode(model, opt, graph_inputs(10, batch=2))


# --- "no match" names the nearest thing found ----------------------------------------------------------

class MulSumAttention(nn.Module):
    """GAT attention whose last product is written as a broadcast multiply and a sum (no product op)."""

    SPECS = (("N", FIN), ("N", "N"))

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Linear(FIN, HIDDEN)
        self.a, self.b = nn.Parameter(torch.randn(HIDDEN)), nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x, adj):
        h = self.W(x)
        e = F.leaky_relu((h @ self.a)[:, None] + (h @ self.b)[None, :], 0.2)
        att = torch.softmax(e.masked_fill(adj == 0, -1e9), dim=1)
        return (att[:, :, None] * h[None]).sum(1)


class CatOfTwoTensors(nn.Module):
    """A Linear over a concatenation of two full tensors: no pairs of rows."""

    SPECS = (("N", FIN),)

    def __init__(self) -> None:
        super().__init__()
        self.A, self.B, self.out = nn.Linear(FIN, 4), nn.Linear(FIN, 4), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.cat([self.A(x), self.B(x)], -1))


@pytest.mark.parametrize("cls,rule,words", [
    (MulSumAttention, "fused-attention", ["nearest: softmax (test_spellings.py:", "read by mul", "not multiplied"]),
    (MulSumAttention, "sdpa", ["nearest: softmax (test_spellings.py:", "not followed by a product with v"]),
    (CatOfTwoTensors, "pair-linear", ["nearest: cat (test_spellings.py:", "feeding Linear", "not rows i and j"]),
], ids=["fused-attention", "sdpa", "pair-linear"])
def test_no_match_names_the_nearest_candidate_and_why(cls, rule, words):
    torch.manual_seed(0)
    opt = fxmem.optimize(cls(), *cls.SPECS)
    (entry,) = entries(opt, rule)
    assert entry["status"] == "no match"
    line = words[0].split("(")[1]
    assert line in entry["reason"] and entry["reason"].startswith("looked for ")  # the site, in the one line
    for w in words:
        assert w in entry["details"], entry["details"]
    # the line named is the softmax's / the cat's own
    number = int(entry["details"].split(line)[1].split(")")[0])
    source, first = inspect.getsourcelines(cls.forward)
    code = source[number - first]
    assert ("softmax" if rule != "pair-linear" else "torch.cat") in code, code


def test_a_rule_with_nothing_near_says_only_what_it_looked_for():
    opt = fxmem.optimize(nn.Sequential(nn.Linear(6, 6), nn.ReLU()), ("B", 6))
    for rule in ("pair-linear", "fused-attention", "sdpa"):
        (entry,) = entries(opt, rule)
        assert entry["status"] == "no match" and "nearest" not in entry["reason"] and entry["details"] is None
