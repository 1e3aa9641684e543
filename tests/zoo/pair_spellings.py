"""GAT attention written the many ways public code writes it, and its look-alikes.

Each model's attention logits come from a linear map over pairs ``[h_i || h_j]`` (DESIGN.md's list
of spellings, and a few more), or from something that only looks like it. Sizes are small: the
tests run them for real. ``SPECS`` on each class gives its input specs.
"""
from __future__ import annotations

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F

FIN, FEAT = 4, 8  # input features, features per node (F); pairs have 2F = 16


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / shape[0] ** 0.5)


class _Logits(nn.Module):
    """h = x @ W, then ``pairs(h)`` and the model's own map to logits, then masked softmax attention."""

    SPECS: tuple = (("B", "N", FIN), ("B", "N", "N"))

    def __init__(self) -> None:
        super().__init__()
        self.W = _param(FIN, FEAT)
        self.a = _param(2 * FEAT, 1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(x, self.W)
        e = F.leaky_relu(self.logits(h), 0.2)
        attention = torch.softmax(torch.where(adj > 0, e, -9e15 * torch.ones_like(e)), dim=-1)
        return F.elu(torch.matmul(attention, h))


# --- the spellings: each must be rewritten --------------------------------------------------------

class PyGATRepeat(_Logits):
    """1. pyGAT's original, unbatched: repeat + view, cat on dim 1, view(N, -1, 2F), @ a, squeeze(2)."""

    SPECS = (("N", FIN), ("N", "N"))

    def logits(self, h):
        N = h.size()[0]
        a_input = torch.cat([h.repeat(1, N).view(N * N, -1), h.repeat(N, 1)], dim=1).view(N, -1, 2 * FEAT)
        return torch.matmul(a_input, self.a).squeeze(2)


class RepeatInterleave(_Logits):
    """2. unbatched: repeat_interleave(N, dim=0) with repeat(N, 1), cat on dim 1, view(N, N, 2F)."""

    SPECS = (("N", FIN), ("N", "N"))

    def logits(self, h):
        N = h.shape[0]
        a_input = torch.cat([h.repeat_interleave(N, dim=0), h.repeat(N, 1)], dim=1).view(N, N, 2 * FEAT)
        return (a_input @ self.a).squeeze(-1)


class BatchedRepeatLastDim(_Logits):
    """3. batched repeat, cat on dim=-1, view(B, N, -1, 2F), matmul(a).squeeze(3)."""

    def logits(self, h):
        B, N = h.size(0), h.size(1)
        a_input = torch.cat([h.repeat(1, 1, N).view(B, N * N, -1), h.repeat(1, N, 1)], dim=-1)
        return torch.matmul(a_input.view(B, N, -1, 2 * FEAT), self.a).squeeze(3)


class MergedPairsMap(_Logits):
    """3b. the map applied before the view to N x N: pairs [B, N*N, 2F] (i*N + j), @ a, view(B, N, N)."""

    def logits(self, h):
        B, N = h.size(0), h.size(1)
        a_input = torch.cat([h.repeat_interleave(N, dim=1), h.repeat(1, N, 1)], dim=-1)
        return torch.matmul(a_input, self.a).view(B, N, N)


class ConstantK(_Logits):
    """4. batched repeat_interleave(K, dim=1) + repeat(1, K, 1) with K a Python int (constant N)."""

    K = 5
    SPECS = (("B", 5, FIN), ("B", 5, 5))

    def logits(self, h):
        K = self.K
        a_input = torch.cat([h.repeat_interleave(K, dim=1), h.repeat(1, K, 1)], dim=2).view(-1, K, K, 2 * FEAT)
        return a_input.matmul(self.a).squeeze(3)


class LinearOnPairs(_Logits):
    """5. nn.Linear(2F, 1, bias=False) applied to the pair tensor instead of @ a."""

    def __init__(self) -> None:
        super().__init__()
        del self.a
        self.attn = nn.Linear(2 * FEAT, 1, bias=False)

    def logits(self, h):
        N = h.size(1)
        pairs = torch.cat([h.repeat_interleave(N, dim=1), h.repeat(1, N, 1)], dim=2).view(-1, N, N, 2 * FEAT)
        return self.attn(pairs).squeeze(-1)


class Expand(_Logits):
    """6. cat([h.unsqueeze(2).expand(-1, -1, N, -1), h.unsqueeze(1).expand(-1, N, -1, -1)], dim=-1)."""

    def logits(self, h):
        N = h.shape[1]
        pairs = torch.cat([h.unsqueeze(2).expand(-1, -1, N, -1), h.unsqueeze(1).expand(-1, N, -1, -1)], dim=-1)
        return (pairs @ self.a)[..., 0]


class MultiHeadLinearPerHead(nn.Module):
    """7. multi-head: pairs viewed (N, N, heads, 2F), then one nn.Linear per head."""

    SPECS = (("N", FIN),)
    HEADS = 3

    def __init__(self) -> None:
        super().__init__()
        self.W = _param(FIN, self.HEADS * FEAT)
        self.att = nn.ModuleList([nn.Linear(2 * FEAT, 1) for _ in range(self.HEADS)])

    def forward(self, x):
        N = x.size(0)
        h = (x @ self.W).view(N, self.HEADS, FEAT)
        pairs = torch.cat([h.repeat_interleave(N, dim=0), h.repeat(N, 1, 1)], dim=-1).view(N, N, self.HEADS, 2 * FEAT)
        e = torch.stack([self.att[k](pairs[:, :, k]).squeeze(-1) for k in range(self.HEADS)], dim=-1)
        return torch.softmax(F.leaky_relu(e, 0.2), dim=1)  # [N, N, heads]


class MultiHeadMulSum(nn.Module):
    """7'. multi-head, batched: per-head a of shape [heads, 2F], (pairs * a).sum(-1)."""

    SPECS = (("B", "N", FIN),)
    HEADS = 2

    def __init__(self) -> None:
        super().__init__()
        self.W = _param(FIN, self.HEADS * FEAT)
        self.a = _param(self.HEADS, 2 * FEAT)

    def forward(self, x):
        B, N = x.shape[0], x.shape[1]
        h = (x @ self.W).view(B, N, self.HEADS, FEAT)
        hi = h.unsqueeze(2).expand(B, N, N, self.HEADS, FEAT)
        hj = h.unsqueeze(1).expand(B, N, N, self.HEADS, FEAT)
        e = (torch.cat([hi, hj], dim=-1) * self.a).sum(-1)  # [B, N, N, heads]
        return torch.softmax(F.leaky_relu(e, 0.2), dim=2)


class Einops(_Logits):
    """einops.repeat on both sides, cat on -1, F.linear with a bias and 3 outputs."""

    def __init__(self) -> None:
        super().__init__()
        del self.a
        self.w = _param(3, 2 * FEAT)
        self.b = _param(3)

    def logits(self, h):
        N = h.shape[1]
        pairs = torch.cat([einops.repeat(h, "b i f -> b i j f", j=N), einops.repeat(h, "b j f -> b i j f", i=N)], -1)
        return F.linear(pairs, self.w, self.b).sum(-1)


class StackFlatten(_Logits):
    """stack on a new dim then flatten (the j-side first in memory), with (x * a).sum(-1, keepdim=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _param(2 * FEAT)  # replaces the [2F, 1] one

    def logits(self, h):
        N = h.shape[1]
        hj = h[:, None].expand(-1, N, -1, -1)
        hi = h[:, :, None].expand(-1, -1, N, -1)
        pairs = torch.stack([hi, hj], dim=3).flatten(3)
        return torch.sum(pairs * self.a, dim=-1, keepdim=True).squeeze(-1)


class Bipartite(nn.Module):
    """Pairs of two different node sets (sources N, targets M), nn.Linear(2F, 3) with bias."""

    SPECS = (("B", "N", FIN), ("B", "M", FIN))

    def __init__(self) -> None:
        super().__init__()
        self.Ws = nn.Linear(FIN, FEAT)
        self.Wd = nn.Linear(FIN, FEAT)
        self.attn = nn.Linear(2 * FEAT, 3)

    def forward(self, xs, xd):
        hs, hd = self.Ws(xs), self.Wd(xd)
        N, M = hs.size(1), hd.size(1)
        pairs = torch.cat([hs.unsqueeze(2).expand(-1, -1, M, -1), hd.unsqueeze(1).expand(-1, N, -1, -1)], dim=-1)
        return torch.softmax(self.attn(pairs), dim=2)  # [B, N, M, 3]


class SwappedSides(_Logits):
    """j-side first in the concatenation (x = [h_j || h_i]), transposed layout via permute."""

    def logits(self, h):
        N = h.shape[1]
        left = h.unsqueeze(1).expand(-1, N, -1, -1)
        right = h.permute(1, 0, 2).unsqueeze(1).expand(-1, N, -1, -1).permute(2, 0, 1, 3)
        return torch.cat([left, right], dim=3).matmul(self.a).squeeze(3)


class VectorA(_Logits):
    """a as a vector [2F]: pairs @ a drops the feature dim, no squeeze; pairs built with tile."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _param(2 * FEAT)

    def logits(self, h):
        N = h.shape[1]
        return torch.cat([h[:, :, None].tile(1, 1, N, 1), h[:, None].tile(1, N, 1, 1)], dim=-1) @ self.a


class FlatRowsQueries(nn.Module):
    """Rows of all graphs flattened into one axis (B*N) paired with M learned queries (a parameter)."""

    SPECS = (("B", "N", FIN),)

    def __init__(self, queries: int = 5) -> None:
        super().__init__()
        self.W = nn.Linear(FIN, FEAT)
        self.q = _param(queries, FEAT)
        self.attn = nn.Linear(2 * FEAT, 1)

    def forward(self, x):
        h = self.W(x).flatten(0, 1)  # [B*N, F]
        M = self.q.shape[0]
        pairs = torch.cat([h.unsqueeze(1).expand(-1, M, -1), self.q.unsqueeze(0).expand(h.shape[0], -1, -1)], -1)
        return torch.softmax(self.attn(pairs).squeeze(-1), dim=-1)  # [B*N, M]


SPELLINGS = [PyGATRepeat, RepeatInterleave, BatchedRepeatLastDim, MergedPairsMap, ConstantK, LinearOnPairs, Expand,
             MultiHeadLinearPerHead, MultiHeadMulSum, Einops, StackFlatten, Bipartite, SwappedSides,
             VectorA, FlatRowsQueries]


# --- look-alikes: the attention map must not be decomposed ----------------------------------------

class GATv2(nn.Module):
    """a · LeakyReLU(W [h_i || h_j]): the nonlinearity sits between the pairs and a."""

    SPECS = (("B", "N", FIN),)

    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.W = nn.Linear(2 * FIN, hidden)
        self.a = _param(hidden, 1)

    def forward(self, x):
        N = x.size(1)
        pairs = torch.cat([x.unsqueeze(2).expand(-1, -1, N, -1), x.unsqueeze(1).expand(-1, N, -1, -1)], -1)
        return torch.softmax((F.leaky_relu(self.W(pairs), 0.2) @ self.a).squeeze(-1), dim=-1)


class GATv2Broadcast(nn.Module):
    """GATv2 as PyG writes it: a · LeakyReLU(W h_i + W h_j), the sum made by broadcasting."""

    SPECS = (("B", "N", FIN),)

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Linear(FIN, FEAT)
        self.a = _param(FEAT, 1)

    def forward(self, x):
        h = self.W(x)
        s = F.leaky_relu(h.unsqueeze(2) + h.unsqueeze(1), 0.2)
        return torch.softmax(torch.matmul(s, self.a).squeeze(-1), dim=-1)


class ProductPairs(nn.Module):
    """(h_i * h_j) @ a: a bilinear form, not a concatenation."""

    SPECS = (("B", "N", FIN),)

    def __init__(self) -> None:
        super().__init__()
        self.W = _param(FIN, FEAT)
        self.a = _param(FEAT, 1)

    def forward(self, x):
        h = x @ self.W
        N = h.shape[1]
        prod = h.unsqueeze(2).expand(-1, -1, N, -1) * h.unsqueeze(1).expand(-1, N, -1, -1)
        return torch.softmax((prod @ self.a).squeeze(-1), dim=-1)


class ScrambledHeads(nn.Module):
    """Multi-head pairs built from all heads at once, then viewed per head: head k's "pair" is not
    (h_i^k || h_j^k) but two halves of [h_i || h_j] over all heads (a real mistake: view before cat)."""

    SPECS = (("N", FIN),)
    HEADS = 2

    def __init__(self) -> None:
        super().__init__()
        self.W = _param(FIN, self.HEADS * FEAT)
        self.a = _param(2 * FEAT, 1)

    def forward(self, x):
        N = x.size(0)
        h = x @ self.W
        pairs = torch.cat([h.repeat_interleave(N, dim=0), h.repeat(N, 1)], dim=1).view(N, N, self.HEADS, 2 * FEAT)
        return torch.softmax((pairs @ self.a).squeeze(-1), dim=1)


# --- edge MLPs: Linear(2F -> D) on pairs, then a nonlinearity ---------------------------------------

class EdgeMLP(nn.Module):
    """score_ij = w2 · relu(W1 [h_i || h_j] + b1): the first layer splits, the second does not."""

    SPECS = (("B", "N", FIN),)

    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.lin1 = nn.Linear(2 * FIN, hidden)
        self.lin2 = nn.Linear(hidden, 1)

    def forward(self, x):
        N = x.size(1)
        pairs = torch.cat([x.repeat_interleave(N, dim=1), x.repeat(1, N, 1)], dim=-1).view(-1, N, N, 2 * FIN)
        return self.lin2(torch.relu(self.lin1(pairs))).squeeze(-1)


class EdgeMLPPairsKept(nn.Module):
    """An edge MLP whose pair tensor is needed anyway (also returned): splitting saves nothing."""

    SPECS = (("B", "N", FIN),)

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.lin1 = nn.Linear(2 * FIN, hidden)

    def forward(self, x):
        N = x.size(1)
        pairs = torch.cat([x.unsqueeze(2).expand(-1, -1, N, -1), x.unsqueeze(1).expand(-1, N, -1, -1)], -1)
        return torch.relu(self.lin1(pairs)), pairs
