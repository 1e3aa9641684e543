"""Rules on each other's output, sites accepted together, and flags that are numbers.

* pyGAT's 2017 layer (pairs built by repeat_interleave/repeat, viewed to N x N x 2F) ends fused:
  pair-linear splits the pairs, then fused-attention takes its output (the mask [B, N, N] against
  the squeezed scores), in the cross product of spellings of the pairs (repeated, expanded, or
  mapped while merged as [B, N*N, 2F]) x the mask x what lies between x one head or heads laid
  out last and permuted first, and pairs of each head's own features ([B, H, N, N, 2F]);
* pyGAT's multi-head GAT: every head and the output layer fused, and the training step's peak
  measured on a real run drops by at least the N x N tensors of every head;
* ``dropout_p=self.dropout if self.training else 0`` (nanoGPT): the train and eval traces differ
  only in a number, which the graph reads from the flag: rewrites and ``budget=`` still apply.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zoo import attention_spellings as A
import fxmem
from equivalence import assert_same_in_every_mode, rewritten
from fxmem.measure import measure
from fxmem.passes.recompute import BudgetError

FIN, FEAT = A.FIN, A.FEAT


class PairSpelling(nn.Module):
    """One attention layer: ``pairs`` x ``mask`` x ``between`` x ``heads`` spellings.

    pairs: ``repeat`` (repeat_interleave/repeat, viewed to N x N x 2F), ``expand`` (both halves
    expanded to N x N), ``merged`` (the map applied to the ``[B, N*N, 2F]`` tensor before it is
    viewed as N x N: ``torch.bmm`` with the weight expanded over the batch when there are heads);
    between the map and LeakyReLU: ``squeeze`` or ``view``; heads: 1, or 2 laid out last by the map
    (``[B, N, N, H]``) and permuted first for the softmax, each head with its own values.
    """

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self, pairs: str, mask: str, between: str, heads: int = 1) -> None:
        super().__init__()
        self.W, self.a = A._param(FIN, FEAT), A._param(2 * FEAT, heads)
        self.Wv = A._param(FIN, heads * FEAT) if heads > 1 else None
        self.pairs, self.mask, self.between, self.heads = pairs, mask, between, heads

    def forward(self, x, adj):
        h = x @ self.W
        b, n, f = h.shape
        k = self.heads
        if self.pairs == "merged":
            flat = torch.cat([h.repeat_interleave(n, dim=1), h.repeat(1, n, 1)], dim=-1)  # [B, N*N, 2F]
            s = torch.bmm(flat, self.a.expand(b, -1, -1)) if k > 1 else flat @ self.a
            s = s.view(b, n, n, k)
        else:
            if self.pairs == "repeat":
                pair = torch.cat([h.repeat_interleave(n, dim=1), h.repeat(1, n, 1)], dim=-1).view(b, n, n, 2 * f)
            else:
                pair = torch.cat([h.unsqueeze(2).expand(b, n, n, f), h.unsqueeze(1).expand(b, n, n, f)], dim=-1)
            s = pair @ self.a
        if k > 1:
            s = s.permute(0, 3, 1, 2)  # [B, H, N, N]
        elif self.between == "squeeze":
            s = s.squeeze(-1)
        else:
            s = s.view(b, n, n)
        e = F.leaky_relu(s, 0.2)
        m = adj if k == 1 else adj.unsqueeze(1)
        if self.mask == "masked_fill":
            e = e.masked_fill(m == 0, float("-inf"))
        else:
            e = torch.where(m > 0, e, -9e15 * torch.ones_like(e))
        if k == 1:
            return torch.softmax(e, dim=-1) @ h
        v = (x @ self.Wv).view(b, n, k, f).transpose(1, 2)
        return (torch.softmax(e, dim=-1) @ v).transpose(1, 2).reshape(b, n, k * f)


def _inputs(b: int, n: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    adj = (torch.rand(b, n, n, generator=gen) > 0.5).float()
    adj = torch.maximum(adj, torch.eye(n).expand(b, n, n))  # every row has an edge
    return [torch.randn(b, n, FIN, generator=gen), adj]


def _statuses(opt, rule: str) -> list[str]:
    return [e["status"] for e in opt.meta["fxmem"] if e["rule"] == rule]


# the cross product of the spellings; the quick run takes one of each pairs spelling and the
# multi-head merged form, the slow run every combination
QUICK = [("repeat", "masked_fill", "squeeze", 1), ("expand", "where", "view", 1), ("merged", "where", "squeeze", 1),
         ("merged", "masked_fill", "view", 2)]
CASES = QUICK + [c for c in itertools.product(("repeat", "expand", "merged"), ("masked_fill", "where"),
                                               ("squeeze", "view"), (1, 2))
                 if c not in QUICK and not (c[3] > 1 and c[2] == "view")]  # with heads, a permute lies between


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c not in QUICK else [])
                                  for c in CASES], ids=lambda c: "-".join(map(str, c)))
def test_pairs_then_attention_end_fused(case):
    torch.manual_seed(0)
    model = PairSpelling(*case)
    opt = rewritten(fxmem.optimize(model, *PairSpelling.SPECS))  # the form where the rewrites are taken
    assert _statuses(opt, "pair-linear") == ["applied"], opt.meta["fxmem"]
    assert _statuses(opt, "fused-attention") == ["applied"], opt.meta["fxmem"]
    assert_same_in_every_mode(model, opt, _inputs(2, 7))


class PerHeadPairs(nn.Module):
    """Pairs of each head's own features: h [B, H, N, F] (heads first), pairs [B, H, N, N, 2F] by
    expanding both halves, each head's own attention vector (``pair @ a[:, None]``), then masked
    attention over that head's values."""

    SPECS = PairSpelling.SPECS

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.W, self.a, self.heads = A._param(FIN, heads * FEAT), A._param(heads, 2 * FEAT, 1), heads

    def forward(self, x, adj):
        b, n, _ = x.shape
        k, f = self.heads, FEAT
        h = (x @ self.W).view(b, n, k, f).transpose(1, 2)
        pair = torch.cat([h.unsqueeze(3).expand(b, k, n, n, f), h.unsqueeze(2).expand(b, k, n, n, f)], dim=-1)
        e = F.leaky_relu((pair @ self.a[:, None]).squeeze(-1), 0.2)
        e = torch.where(adj.unsqueeze(1) > 0, e, -9e15 * torch.ones_like(e))
        return (torch.softmax(e, dim=-1) @ h).transpose(1, 2).reshape(b, n, k * f)


def test_per_head_pair_tensors_end_fused():
    torch.manual_seed(0)
    model = PerHeadPairs()
    opt = rewritten(fxmem.optimize(model, *PerHeadPairs.SPECS))
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
