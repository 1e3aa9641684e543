"""Rules on each other's output, sites accepted together, and flags that are numbers.

* pyGAT's 2017 layer (pairs built by repeat_interleave/repeat, viewed to N x N x 2F) ends fused:
  pair-linear splits the pairs, then fused-attention takes its output (the mask [B, N, N] against
  the squeezed scores), in spellings of the pairs x the mask x what lies between;
* pyGAT's multi-head GAT: every head and the output layer fused, and the training step's peak
  measured on a real run drops by at least the N x N tensors of every head;
* ``dropout_p=self.dropout if self.training else 0`` (nanoGPT): the train and eval traces differ
  only in a number, which the graph reads from the flag: rewrites and ``budget=`` still apply.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attention_spellings as A
import fxmem
from equivalence import assert_same_in_every_mode, rewritten
from fxmem.measure import measure
from fxmem.passes.recompute import BudgetError

FIN, FEAT = A.FIN, A.FEAT


class PairSpelling(nn.Module):
    """One attention layer: ``pairs`` x ``mask`` x ``between`` spellings."""

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self, pairs: str, mask: str, between: str) -> None:
        super().__init__()
        self.W, self.a = A._param(FIN, FEAT), A._param(2 * FEAT, 1)
        self.pairs, self.mask, self.between = pairs, mask, between

    def forward(self, x, adj):
        h = x @ self.W
        b, n, f = h.shape
        if self.pairs == "repeat":
            pair = torch.cat([h.repeat_interleave(n, dim=1), h.repeat(1, n, 1)], dim=-1).view(b, n, n, 2 * f)
        else:
            pair = torch.cat([h.unsqueeze(2).expand(b, n, n, f), h.unsqueeze(1).expand(b, n, n, f)], dim=-1)
        s = pair @ self.a
        s = s.squeeze(-1) if self.between == "squeeze" else s.view(b, n, n)
        e = F.leaky_relu(s, 0.2)
        if self.mask == "masked_fill":
            e = e.masked_fill(adj == 0, float("-inf"))
        else:
            e = torch.where(adj > 0, e, -9e15 * torch.ones_like(e))
        return torch.softmax(e, dim=-1) @ h


def _inputs(b: int, n: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    adj = (torch.rand(b, n, n, generator=gen) > 0.5).float()
    adj = torch.maximum(adj, torch.eye(n).expand(b, n, n))  # every row has an edge
    return [torch.randn(b, n, FIN, generator=gen), adj]


def _statuses(opt, rule: str) -> list[str]:
    return [e["status"] for e in opt.meta["fxmem"] if e["rule"] == rule]


CASES = [("repeat", "masked_fill", "squeeze"), ("expand", "where", "view"),
         ("repeat", "where", "view"), ("expand", "masked_fill", "squeeze")]


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if k >= 2 else [])
                                  for k, c in enumerate(CASES)], ids="-".join)
def test_pairs_then_attention_end_fused(case):
    torch.manual_seed(0)
    model = PairSpelling(*case)
    opt = rewritten(fxmem.optimize(model, *PairSpelling.SPECS))  # the form where the rewrites are taken
    assert _statuses(opt, "pair-linear") == ["applied"], opt.meta["fxmem"]
    assert _statuses(opt, "fused-attention") == ["applied"], opt.meta["fxmem"]
    assert_same_in_every_mode(model, opt, _inputs(2, 7))


def _step_peak(module: nn.Module, xs: list) -> int:
    def step():
        module.zero_grad(set_to_none=True)
        module(*xs).sum().backward()
    return measure(step).peak_above_start


@pytest.mark.slow  # ~90 s on 2 cores: 6 sites, each verified and analysed (train step and inference)
def test_every_head_of_a_multi_head_gat_is_fused():
    torch.manual_seed(0)
    model = A.MultiHeadPairGAT(heads=2)
    # the form where the rewrites are taken (the fused kernel's scratch makes them pay only for large N)
    opt = rewritten(fxmem.optimize(model, *model.SPECS))
    assert _statuses(opt, "fused-attention") == ["applied"] * 3, opt.meta["fxmem"]
    assert_same_in_every_mode(model, opt, _inputs(2, 6))
    b, n = 2, 96
    xs = _inputs(b, n)
    before, after = _step_peak(model, xs), _step_peak(opt, xs)
    # each of the 3 layers kept at least its softmax output (4*B*N*N bytes) for backward; no longer
    assert after <= before - 3 * 4 * b * n * n, (before, after)


class NanoAttention(nn.Module):
    """nanoGPT's causal self-attention with sdpa: dropout_p=self.dropout if self.training else 0."""

    SPECS = (("B", "L", 16),)

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv, self.proj, self.dropout = nn.Linear(16, 48), nn.Linear(16, 16), dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(16, dim=2)
        q, k, v = (z.view(b, t, 2, 8).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_flag_that_picks_a_number_is_no_difference(dropout):
    torch.manual_seed(0)
    model = NanoAttention(dropout)
    opt = fxmem.optimize(model, *NanoAttention.SPECS)
    assert not [e for e in opt.meta["fxmem"] if e["rule"] == "train/eval"], opt.meta["fxmem"]
    assert_same_in_every_mode(model, opt, [torch.randn(2, 5, 16)])
    # a budget is met by a plan or refused, never silently ignored
    try:
        opt = fxmem.optimize(model, *NanoAttention.SPECS, budget="64KiB", dims={"B": 8, "L": 64})
    except BudgetError:
        return
    (entry,) = [e for e in opt.meta["fxmem"] if e["rule"] == "recompute"]
    assert entry["status"] == "applied", entry
