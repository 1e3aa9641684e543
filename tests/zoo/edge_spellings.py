"""Edge-list GATs and message passing, written the ways public code writes them, and look-alikes.

Pairs are rows picked by an edge list ``edge_index`` [2, E] (row 0: sources, row 1: targets):
``cat([h[dst], h[src]], 1) @ a`` (pyGAT's sparse layer: ``a.mm(cat(...).t())``), ``Linear(2F, 1)``
on ``index_select``-ed rows, multi-head ``(cat * att).sum(-1)``. Messages are ``x[src] * w``
scattered into the targets with ``index_add_``/``scatter_add_``/``index_add``. Sizes are small: the
tests run these for real. ``SPECS`` on each class; ``EDGES`` makes a valid edge list.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem

FIN, FEAT, HEADS = 5, 8, 2
EDGE_SPEC = fxmem.TensorSpec((2, "E"), dtype=torch.int64)


def edges(shape: tuple, sizes: dict) -> torch.Tensor:
    """A random edge list over N nodes (the ``makers`` entry for ``edge_index``)."""
    gen = torch.Generator().manual_seed(sizes["E"] * 31 + sizes["N"])
    return torch.randint(0, sizes["N"], shape, generator=gen)


EDGES = {"edge_index": edges}


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / shape[0] ** 0.5)


# --- gathered pairs: each must be split ----------------------------------------------------------

class PyGATSparse(nn.Module):
    """pyGAT's SpGraphAttentionLayer: edge_h = cat(h[edge[0]], h[edge[1]]).t(), a.mm(edge_h), then
    exp(-LeakyReLU) weights summed into the rows (index_add instead of pyGAT's custom spmm)."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.W, self.a = _param(FIN, FEAT), _param(1, 2 * FEAT)
        self.leakyrelu = nn.LeakyReLU(0.2)

    def forward(self, x, edge_index):
        h = torch.mm(x, self.W)
        edge_h = torch.cat((h[edge_index[0, :], :], h[edge_index[1, :], :]), dim=1).t()  # [2F, E]
        edge_e = torch.exp(-self.leakyrelu(self.a.mm(edge_h).squeeze()))  # [E]
        rowsum = torch.zeros_like(h[:, 0]).index_add(0, edge_index[0], edge_e)
        h_prime = torch.zeros_like(h).index_add(0, edge_index[0], edge_e[:, None] * h[edge_index[1]])
        return F.elu(h_prime / (rowsum[:, None] + 1e-9))


class EdgeLinear(nn.Module):
    """Linear(2F, 1) on [x_i || x_j] picked with index_select (PyG's x_i / x_j naming)."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.att = nn.Linear(FIN, FEAT), nn.Linear(2 * FEAT, 1)

    def forward(self, x, edge_index):
        h = self.lin(x)
        src, dst = edge_index[0], edge_index[1]
        x_i, x_j = h.index_select(0, dst), h.index_select(0, src)
        return torch.sigmoid(self.att(torch.cat([x_i, x_j], dim=-1))).squeeze(-1)


class EdgeMultiHead(nn.Module):
    """Heads: h [N, H, F], pairs [E, H, 2F], (pairs * att).sum(-1) -> [E, H]."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.att = nn.Linear(FIN, HEADS * FEAT), _param(1, HEADS, 2 * FEAT)

    def forward(self, x, edge_index):
        h = self.lin(x).view(-1, HEADS, FEAT)
        pairs = torch.cat([h[edge_index[1]], h[edge_index[0]]], dim=-1)
        return F.leaky_relu((pairs * self.att).sum(-1), 0.2)


# --- gathered look-alikes --------------------------------------------------------------------------

class EdgeGATv2(nn.Module):
    """GATv2 on edges: a · LeakyReLU(W [h_dst || h_src]): W splits, a does not."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.W, self.a = nn.Linear(2 * FIN, FEAT), _param(FEAT, 1)

    def forward(self, x, edge_index):
        pairs = torch.cat([x[edge_index[1]], x[edge_index[0]]], dim=-1)
        return (F.leaky_relu(self.W(pairs), 0.2) @ self.a).squeeze(-1)


class EdgeProduct(nn.Module):
    """(h_dst * h_src) @ a: a product of the two rows, not a concatenation."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.W, self.a = _param(FIN, FEAT), _param(FEAT, 1)

    def forward(self, x, edge_index):
        h = x @ self.W
        return ((h[edge_index[1]] * h[edge_index[0]]) @ self.a).squeeze(-1)


class EdgeScrambled(nn.Module):
    """cat along the edges (dim 0) then viewed as [E, 2F]: row e holds two rows of one endpoint list."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.W, self.a = _param(FIN, FEAT), _param(2 * FEAT, 1)

    def forward(self, x, edge_index):
        h = x @ self.W
        pairs = torch.cat([h[edge_index[1]], h[edge_index[0]]], dim=0).view(-1, 2 * FEAT)
        return (pairs @ self.a).squeeze(-1)


GATHERED = [PyGATSparse, EdgeLinear, EdgeMultiHead]
GATHERED_LOOKALIKES = [EdgeGATv2, EdgeProduct, EdgeScrambled]


# --- message passing: gather -> message -> scatter-add ------------------------------------------------

class GCNIndexAdd(nn.Module):
    """GCN layer: h = lin(x); out = zeros_like(h).index_add_(0, dst, h[src] * norm[:, None]), two layers."""

    SPECS = (("N", FIN), EDGE_SPEC, ("E",))

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(FIN, hidden), nn.Linear(hidden, hidden)

    def propagate(self, h, edge_index, norm):
        out = torch.zeros_like(h)
        out.index_add_(0, edge_index[1], h[edge_index[0]] * norm[:, None])
        return out

    def forward(self, x, edge_index, norm):
        h = torch.relu(self.propagate(self.lin1(x), edge_index, norm))
        return self.propagate(self.lin2(h), edge_index, norm)


class GCNScatterAdd(nn.Module):
    """scatter_add_ with the target index broadcast over the features, messages x.index_select(0, src) * w."""

    SPECS = (("N", FIN), EDGE_SPEC, ("E", 1))

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FIN, FEAT)

    def forward(self, x, edge_index, w):
        h = self.lin(x)
        msg = h.index_select(0, edge_index[0]) * w
        index = edge_index[1].view(-1, 1).expand_as(msg)
        return h.new_zeros(h.shape).scatter_add_(0, index, msg)


class CopySource(nn.Module):
    """Unweighted sum of neighbours (DGL's copy_src + sum): index_add (out of place) of x[src]."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FIN, FEAT)

    def forward(self, x, edge_index):
        h = self.lin(x)
        return torch.zeros_like(h).index_add(0, edge_index[1], h[edge_index[0]]) + h


class HeadsMessage(nn.Module):
    """Multi-head messages x[src] [E, H, F] times attention weights [E, H, 1] (scatter_reduce "sum")."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.att = nn.Linear(FIN, HEADS * FEAT), _param(1, HEADS, FEAT)

    def forward(self, x, edge_index):
        h = self.lin(x).view(-1, HEADS, FEAT)
        alpha = torch.sigmoid((h * self.att).sum(-1))[edge_index[0]].unsqueeze(-1)  # [E, H, 1]
        msg = h[edge_index[0]] * alpha
        index = edge_index[1].view(-1, 1, 1).expand_as(msg)
        return torch.zeros_like(h).scatter_reduce(0, index, msg, reduce="sum").flatten(1)


class EdgeMLPMessage(nn.Module):
    """Messages from an MLP on [x_i || x_j]: not a sparse matrix times x."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(2 * FIN, FEAT)

    def forward(self, x, edge_index):
        msg = torch.relu(self.mlp(torch.cat([x[edge_index[1]], x[edge_index[0]]], -1)))
        return x.new_zeros(x.shape[0], FEAT).index_add_(0, edge_index[1], msg)


class MaxAggregation(nn.Module):
    """scatter_reduce with "amax": a max is no sparse-dense product."""

    SPECS = (("N", FIN), EDGE_SPEC)

    def forward(self, x, edge_index):
        msg = x[edge_index[0]]
        index = edge_index[1].view(-1, 1).expand_as(msg)
        return torch.zeros_like(x).scatter_reduce(0, index, msg, reduce="amax")


MESSAGE_PASSING = [GCNIndexAdd, GCNScatterAdd, CopySource, HeadsMessage, PyGATSparse]
MESSAGE_LOOKALIKES = [EdgeMLPMessage, MaxAggregation]
