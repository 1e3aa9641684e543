"""GAT attention over the edges a dense adjacency keeps: time and memory in the number of edges.

The dense form of a GAT layer (pyGAT, seed 000) computes the attention of every pair (i, j) and
masks the pairs that are not edges:

    a_ij  = softmax_j(LeakyReLU(s_i + t_j) if kept_ij else fill),     out_i = sum_j a_ij h_j

On a sparse graph (Cora: N = 2708, 13,264 kept entries of 7.3 million) almost all of that work
is on masked pairs. Here the kept entries are listed once per adjacency (:func:`kept_edges`, one
``nonzero`` shared by every head and layer that reads the same mask) and the attention runs over
that list only (:func:`edge_attention`), with plain PyTorch ops (autograd gives the backward; the
aggregation's own backward gathers ``h[col]`` again rather than keep it through the step).

Exact, not approximate. A masked entry's weight is ``w_i = exp(fill - m_i) / Z_i`` (m_i: the row's
largest score, fill included when the row has a masked entry); it is exactly 0 when exp underflows
(fill = -9e15 or -inf next to any real score), but not always (a row with no edge: every entry is
fill, the dense softmax is uniform over all M columns; a finite fill close to the scores). Both
are kept:

    out_i = sum_{kept j} (p_ij - w_i) h_j / Z_i  +  (w_i / Z_i) sum_j h_j,
    p_ij = exp(e_ij - m_i),   Z_i = sum_{kept j} p_ij + (M - deg_i) w_i

which is the dense softmax's value for every adjacency, fill and slope (a row of fills only with
fill = -inf is NaN, as the dense softmax makes it).

Layouts are those of :mod:`fxmem.ops.attention`: ``s`` [Gm, Gh, N], ``t`` [Gm, Gh, M], ``h``
[Gm, Gh, M, F], the adjacency [Am, N, M] with Am = Gm or 1; the result is [Gm, Gh, N, F].

>>> edges = kept_edges(adj, compare="gt", threshold=0.0, keep=True)           # doctest: +SKIP
>>> out = edge_attention(s, t, h, edges, mask_groups=1, fill=-9e15, slope=0.2)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..data_paths import bound, within

# the edge list is used while the kept entries are at most 1/SPARSE_SHARE of the pairs; denser
# adjacencies run in dense row blocks (benchmarks/sparse_gat.py, "crossover": the two take the same
# time between 1/32 and 1/16 of the pairs, about 1/20, for an 8-head layer at N=1500)
SPARSE_SHARE = 20
_COMPARE = {"gt": torch.gt, "ge": torch.ge, "lt": torch.lt, "le": torch.le, "eq": torch.eq, "ne": torch.ne}


def kept_edges(adj: torch.Tensor, compare: str, threshold: float, keep: bool,
               share: int = SPARSE_SHARE) -> torch.Tensor | None:
    """The kept entries of ``adj`` [Am, N, M] as int64 [2, K]: row ``a*N + i`` and column ``a*M + j``
    of each, in row-major order (K: a size the data decides, a dim of fxmem's formulas) - or None
    when they are more than ``1/share`` of the entries (the attention then runs in dense row blocks).

    ``compare``/``threshold``/``keep`` say which entries stay, as for
    :func:`fxmem.ops.attention.masked_attention` (``"add"``: an additive mask, -inf where there is no edge).
    """
    if compare == "true":
        kept = adj if keep else adj.logical_not()
    elif compare == "add":  # an additive mask: -inf where there is no edge (NaN stays, as the sum keeps it)
        kept = adj != float("-inf")
    elif compare in _COMPARE:
        kept = _COMPARE[compare](adj, threshold)
        if not keep:  # the comparison says what is replaced: NaN entries stay, as masked_fill keeps them
            kept = kept.logical_not_()
    else:
        raise ValueError(f"compare={compare!r}: use one of {(*_COMPARE, 'true', 'add')}")
    limit = adj.numel() // share
    if not within(torch.count_nonzero(kept), limit):
        return None
    found = kept.nonzero()  # [K, 3]: (a, i, j)
    del kept
    bound(found.shape[0], limit, f"(more than 1/{share} of the pairs are edges) the attention runs in dense row "
          f"blocks", "the number of kept entries of the adjacency (its edges)")
    n, m = adj.shape[1], adj.shape[2]
    a, i, j = found.unbind(1)
    return torch.stack((a * n + i, a * m + j))


def edge_attention(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, edges: torch.Tensor, *, mask_groups: int,
                   fill: float, slope: float, added: torch.Tensor | None = None) -> torch.Tensor:
    """softmax_j(LeakyReLU(s_i + t_j) where kept, else fill) @ h over the kept entries ``edges``
    (from :func:`kept_edges`); [Gm, Gh, N, F], the dense form's value (see the module doc).
    ``added``: an additive mask [Am, N, M] (its kept entries are added to the scores; fill is -inf)."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    row, col = edges[0], edges[1]
    bias = None
    if added is not None:  # the mask's value at each edge: a gather (its gradient, where asked, is dense)
        bias = added[row // n, row % n, col % m]
        fill = float("-inf")
    if mask_groups != gm:  # one adjacency shared by the Gm groups: its edges in each group
        shift = torch.arange(gm, device=edges.device).unsqueeze(1)
        row, col = (row + shift * n).reshape(-1), (col + shift * m).reshape(-1)
        bias = None if bias is None else bias.repeat(gm)
    rows_all = gm * n
    s2 = s.permute(0, 2, 1).reshape(rows_all, gh)
    t2 = t.permute(0, 2, 1).reshape(gm * m, gh)
    h2 = h.permute(0, 2, 1, 3).reshape(gm * m, gh, f)
    e = F.leaky_relu(s2.index_select(0, row) + t2.index_select(0, col), slope)
    if bias is not None:
        e = e + bias.unsqueeze(1)
    with torch.no_grad():  # the softmax's shift: its value does not change the result, nor its gradient
        top = e.new_full((rows_all, gh), float("-inf"))
        top.scatter_reduce_(0, row.unsqueeze(1).expand(e.shape), e, "amax")
        deg = row.new_zeros(rows_all).index_add_(0, row, torch.ones_like(row))
        missing = (m - deg).unsqueeze(1)  # masked entries per row
        has_fill = missing > 0
        top = torch.where(has_fill, torch.clamp(top, min=fill), top)
        w = torch.where(has_fill, torch.exp(fill - top), 0.0)  # a masked entry's weight, before / Z
    p = torch.exp(e - top.index_select(0, row))
    z = torch.zeros_like(top).index_add_(0, row, p) + missing * w
    alpha = (p - w.index_select(0, row)) / z.index_select(0, row)
    out = _Aggregate.apply(alpha, h2, row, col, rows_all)
    beta = (w / z).view(gm, n, gh, 1)
    out = out.view(gm, n, gh, f) + beta * h2.view(gm, m, gh, f).sum(1, keepdim=True)
    return out.permute(0, 2, 1, 3)


class _Aggregate(torch.autograd.Function):
    """``out[r] = sum over edges (r, c) of alpha[e] * h[c]`` ([R, Gh, F]) keeping only ``alpha``,
    ``h`` and the indices for backward: the gathered rows ``h[col]`` (K x Gh x F, the largest
    per-edge tensor) are made again there instead of kept from the forward through the backward."""

    @staticmethod
    def forward(ctx: Any, alpha: torch.Tensor, h: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
                rows: int) -> torch.Tensor:
        ctx.save_for_backward(alpha, h, row, col)
        gathered = h.index_select(0, col)
        gathered.mul_(alpha.unsqueeze(-1))
        return h.new_zeros(rows, *h.shape[1:]).index_add_(0, row, gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        alpha, h, row, col = ctx.saved_tensors
        g = grad.index_select(0, row)  # [K, Gh, F]
        d_alpha = d_h = None
        if ctx.needs_input_grad[0]:
            hc = h.index_select(0, col)
            hc.mul_(g)
            d_alpha = hc.sum(-1)
            del hc
        if ctx.needs_input_grad[1]:
            g.mul_(alpha.unsqueeze(-1))
            d_h = torch.zeros_like(h).index_add_(0, col, g)
        return d_alpha, d_h, None, None, None
