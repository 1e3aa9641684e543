"""GAT attention over decomposed scores written the ways public code writes it, and its look-alikes.

Each spelling computes softmax_j(masked LeakyReLU(s_i + t_j)) @ h: pyGAT's hand fix, a batched
multi-head layer with heads first and modules for softmax and dropout, PyG ``DenseGATConv``'s
heads-last code with ``masked_fill(adj == 0, -inf)`` (copied, since PyG's module does not trace
with fx), an unbatched layer with a bool adjacency. The look-alikes are attention too, but not
over decomposed scores, or not masked by filling in a constant. ``SPECS`` on each class.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

FIN, FEAT, HEADS = 5, 8, 3


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / shape[0] ** 0.5)


# --- spellings: each must be fused ---------------------------------------------------------------

class DecomposedHead(nn.Module):
    """pyGAT's fix: e = Wh·a1 + (Wh·a2)ᵀ, where(adj > 0, e, -9e15·ones), F.dropout(training=self.training)."""

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.W, self.a = _param(FIN, FEAT), _param(2 * FEAT, 1)
        self.leakyrelu = nn.LeakyReLU(0.2)
        self.dropout = dropout

    def forward(self, x, adj):
        h = torch.matmul(x, self.W)
        e = self.leakyrelu(torch.matmul(h, self.a[:FEAT]) + torch.matmul(h, self.a[FEAT:]).transpose(1, 2))
        attention = torch.where(adj > 0, e, -9e15 * torch.ones_like(e))
        attention = F.dropout(F.softmax(attention, dim=2), self.dropout, training=self.training)
        return F.elu(torch.matmul(attention, h))


class HeadsFirst(nn.Module):
    """Batched heads first [B, H, N, N]: mask shared by the heads, nn.Softmax and nn.Dropout modules."""

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(FIN, HEADS * FEAT)
        self.a_src, self.a_dst = _param(HEADS, FEAT), _param(HEADS, FEAT)
        self.softmax, self.drop = nn.Softmax(dim=-1), nn.Dropout(dropout)

    def forward(self, x, adj):
        B, N = x.shape[0], x.shape[1]
        h = self.lin(x).view(B, N, HEADS, FEAT).transpose(1, 2)  # [B, H, N, F]
        s = (h * self.a_src[:, None]).sum(-1).unsqueeze(-1)  # [B, H, N, 1]
        t = (h * self.a_dst[:, None]).sum(-1).unsqueeze(-2)  # [B, H, 1, N]
        e = F.leaky_relu(s + t, negative_slope=0.1)
        e = e.masked_fill(adj.unsqueeze(1) == 0, -1e9)
        out = torch.matmul(self.drop(self.softmax(e)), h)  # [B, H, N, F]
        return out.transpose(1, 2).reshape(B, N, HEADS * FEAT)


class DenseGATLike(nn.Module):
    """PyG DenseGATConv's forward (heads last, s_j + t_i, masked_fill(adj == 0, -inf), movedim)."""

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(FIN, HEADS * FEAT, bias=False)
        self.att_src, self.att_dst = _param(1, 1, HEADS, FEAT), _param(1, 1, HEADS, FEAT)
        self.dropout = dropout

    def forward(self, x, adj):
        B, N, _ = x.size()
        x = self.lin(x).view(B, N, HEADS, FEAT)
        alpha_src = torch.sum(x * self.att_src, dim=-1)
        alpha_dst = torch.sum(x * self.att_dst, dim=-1)
        alpha = alpha_src.unsqueeze(1) + alpha_dst.unsqueeze(2)  # [B, N, N, H]
        alpha = F.leaky_relu(alpha, 0.2)
        alpha = alpha.masked_fill(adj.unsqueeze(-1) == 0, float("-inf"))
        alpha = alpha.softmax(dim=2)
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        out = torch.matmul(alpha.movedim(3, 1), x.movedim(2, 1))  # [B, H, N, F]
        return out.movedim(1, 2).reshape(B, N, HEADS * FEAT)


class SharedValues(nn.Module):
    """Heads first [B, H, N, N], each head with its own scores, the values shared by every head
    (``att @ g[:, None]``: one [B, 1, N, F] tensor broadcast over the heads), heads averaged."""

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin, self.values = nn.Linear(FIN, HEADS * FEAT), nn.Linear(FIN, FEAT)
        self.a_src, self.a_dst = _param(HEADS, FEAT), _param(HEADS, FEAT)

    def forward(self, x, adj):
        B, N = x.shape[0], x.shape[1]
        h = self.lin(x).view(B, N, HEADS, FEAT).transpose(1, 2)  # [B, H, N, F]
        s = (h * self.a_src[:, None]).sum(-1).unsqueeze(-1)
        t = (h * self.a_dst[:, None]).sum(-1).unsqueeze(-2)
        e = F.leaky_relu(s + t, 0.2).masked_fill(adj.unsqueeze(1) == 0, float("-inf"))
        return (torch.softmax(e, dim=-1) @ self.values(x)[:, None]).mean(1)  # [B, N, F]


class BothExpanded(DecomposedHead):
    """Both halves broadcast by hand: s.expand(B, N, N) + t.expand(B, N, N) (two N x N views)."""

    def forward(self, x, adj):
        B, N = x.shape[0], x.shape[1]
        h = torch.matmul(x, self.W)
        s = torch.matmul(h, self.a[:FEAT]).expand(B, N, N)
        t = torch.matmul(h, self.a[FEAT:]).transpose(1, 2).expand(B, N, N)
        e = self.leakyrelu(s + t)
        attention = torch.where(adj > 0, e, -9e15 * torch.ones_like(e))
        attention = F.dropout(F.softmax(attention, dim=2), self.dropout, training=self.training)
        return F.elu(torch.matmul(attention, h))


class HeadsFirstExpanded(HeadsFirst):
    """HeadsFirst with both halves expanded by hand to [B, H, N, N] (sizes and -1 both written)."""

    def forward(self, x, adj):
        B, N = x.shape[0], x.shape[1]
        h = self.lin(x).view(B, N, HEADS, FEAT).transpose(1, 2)
        s = (h * self.a_src[:, None]).sum(-1).unsqueeze(-1).expand(B, HEADS, N, N)
        t = (h * self.a_dst[:, None]).sum(-1).unsqueeze(-2).expand(-1, -1, N, -1)
        e = F.leaky_relu(s + t, negative_slope=0.1)
        e = e.masked_fill(adj.unsqueeze(1) == 0, -1e9)
        out = torch.matmul(self.drop(self.softmax(e)), h)
        return out.transpose(1, 2).reshape(B, N, HEADS * FEAT)


class UnbatchedBoolMask(nn.Module):
    """Unbatched [N, N] with a bool adjacency: where(adj, e, fill), the fill from full_like."""

    SPECS = (("N", FIN), ("N", "N"))

    def __init__(self) -> None:
        super().__init__()
        self.W, self.a1, self.a2 = nn.Linear(FIN, FEAT), _param(FEAT), _param(FEAT)

    def forward(self, x, adj):
        h = self.W(x)
        e = F.leaky_relu((h @ self.a1)[:, None] + (h @ self.a2)[None, :], 0.2)
        return torch.softmax(torch.where(adj, e, torch.full_like(e, -1e4)), -1) @ h


# --- look-alikes: attention, but not this one ---------------------------------------------------------

class GATv2Attention(nn.Module):
    """GATv2: e_ij = a · LeakyReLU(Wh_i + Wh_j), the nonlinearity before a."""

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.a = nn.Linear(FIN, FEAT), _param(FEAT, 1)

    def forward(self, x, adj):
        h = self.lin(x)
        e = (F.leaky_relu(h.unsqueeze(2) + h.unsqueeze(1), 0.2) @ self.a).squeeze(-1)
        return torch.softmax(torch.where(adj > 0, e, -9e15 * torch.ones_like(e)), dim=-1) @ h


class AdditiveMask(DecomposedHead):
    """The mask added to the scores (-1e9 where there is no edge) instead of filled in: fused, the
    mask added block by block (tests/passes/test_fused_attention.py)."""

    def forward(self, x, adj):
        h = torch.matmul(x, self.W)
        e = self.leakyrelu(torch.matmul(h, self.a[:FEAT]) + torch.matmul(h, self.a[FEAT:]).transpose(1, 2))
        return torch.matmul(F.softmax(e + (adj <= 0).float() * -1e9, dim=2), h)


class LearnedBias(DecomposedHead):
    """A bias added to the scores that is learnt (the adjacency times a parameter): it needs a
    gradient, which the fused kernel does not compute for what it adds."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.beta = nn.Parameter(torch.ones(1))

    def forward(self, x, adj):
        h = torch.matmul(x, self.W)
        e = self.leakyrelu(torch.matmul(h, self.a[:FEAT]) + torch.matmul(h, self.a[FEAT:]).transpose(1, 2))
        return torch.matmul(F.softmax(e + adj * self.beta, dim=2), h)


class ExpandedOverNewAxis(DecomposedHead):
    """Both halves expanded over an axis neither has (2 copies, summed after): not s_i + t_j as written."""

    def forward(self, x, adj):
        B, N = x.shape[0], x.shape[1]
        h = torch.matmul(x, self.W)
        s = torch.matmul(h, self.a[:FEAT]).unsqueeze(1).expand(B, 2, N, N)
        t = torch.matmul(h, self.a[FEAT:]).transpose(1, 2).unsqueeze(1).expand(B, 2, N, N)
        e = self.leakyrelu(s + t).masked_fill(adj.unsqueeze(1) == 0, -9e15)
        return torch.matmul(F.softmax(e, dim=-1), h.unsqueeze(1)).sum(1)


class DotProductScores(nn.Module):
    """Transformer-style scores q·k (masked), not a sum s_i + t_j."""

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(FIN, FEAT), nn.Linear(FIN, FEAT), nn.Linear(FIN, FEAT)

    def forward(self, x, adj):
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        return torch.softmax(scores.masked_fill(adj == 0, float("-inf")), dim=-1) @ self.v(x)


class ProductScores(DecomposedHead):
    """LeakyReLU(s_i * t_j): the scores are a product, not a sum."""

    def forward(self, x, adj):
        h = torch.matmul(x, self.W)
        e = self.leakyrelu(torch.matmul(h, self.a[:FEAT]) * torch.matmul(h, self.a[FEAT:]).transpose(1, 2))
        return torch.matmul(torch.softmax(torch.where(adj > 0, e, -9e15 * torch.ones_like(e)), dim=2), h)


class DropoutAlwaysOn(DecomposedHead):
    """F.dropout(att, 0.5): training=True is the default, so dropout is on in eval mode too."""

    def forward(self, x, adj):
        h = torch.matmul(x, self.W)
        e = self.leakyrelu(torch.matmul(h, self.a[:FEAT]) + torch.matmul(h, self.a[FEAT:]).transpose(1, 2))
        attention = F.softmax(torch.where(adj > 0, e, -9e15 * torch.ones_like(e)), dim=2)
        return torch.matmul(F.dropout(attention, 0.5), h)


class SoftmaxOverRows(DecomposedHead):
    """softmax over dim 1 (the rows i) while the matmul sums over the columns j."""

    def forward(self, x, adj):
        h = torch.matmul(x, self.W)
        e = self.leakyrelu(torch.matmul(h, self.a[:FEAT]) + torch.matmul(h, self.a[FEAT:]).transpose(1, 2))
        return torch.matmul(F.softmax(torch.where(adj > 0, e, -9e15 * torch.ones_like(e)), dim=1), h)


SPELLINGS = [DecomposedHead, HeadsFirst, DenseGATLike, UnbatchedBoolMask, BothExpanded, HeadsFirstExpanded,
             SharedValues]
LOOKALIKES = [GATv2Attention, LearnedBias, DotProductScores, ProductScores, DropoutAlwaysOn, SoftmaxOverRows]


# --- composed and multi-head: pair-linear first, then fused attention --------------------------------

class PairHead(nn.Module):
    """pyGAT's 2017 layer: [h_i || h_j] built with repeat_interleave and repeat, viewed to N x N x 2F,
    (pair @ a).squeeze(-1), masked_fill(adj == 0, -inf), softmax, @ h."""

    def __init__(self, fin: int = FIN, fout: int = FEAT, concat: bool = True) -> None:
        super().__init__()
        self.W, self.a = _param(fin, fout), _param(2 * fout, 1)
        self.concat = concat

    def forward(self, x, adj):
        h = x @ self.W
        n = h.shape[1]
        pair = torch.cat([h.repeat_interleave(n, dim=1), h.repeat(1, n, 1)], dim=-1).view(h.shape[0], n, n, -1)
        e = F.leaky_relu((pair @ self.a).squeeze(-1), 0.2)
        att = torch.softmax(e.masked_fill(adj == 0, float("-inf")), dim=-1)
        out = att @ h
        return F.elu(out) if self.concat else out


class MultiHeadPairGAT(nn.Module):
    """pyGAT's GAT: HEADS heads concatenated, then an output attention layer (dropout 0)."""

    SPECS = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = nn.ModuleList([PairHead() for _ in range(heads)])
        self.out = PairHead(heads * FEAT, 4, concat=False)

    def forward(self, x, adj):
        x = torch.cat([head(x, adj) for head in self.heads], dim=-1)
        return F.log_softmax(F.elu(self.out(x, adj)), dim=-1)
