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

Dropout on the weights (``dropout=p``, train mode) is the model's own: the numbers ``F.dropout``
would draw for the dense weights, drawn block by block in their order and read at the edges
(:func:`edge_dropout_op`) - N x M random numbers drawn, none kept - where
:data:`fxmem.ops.attention.DRAWS_IN_PIECES` holds.

Layouts are those of :mod:`fxmem.ops.attention`: ``s`` [Gm, Gh, N], ``t`` [Gm, Gh, M], ``h``
[Gm, Gh, M, F], the adjacency [Am, N, M] with Am = Gm or 1; the result is [Gm, Gh, N, F].

>>> edges = kept_edges(adj, compare="gt", threshold=0.0, keep=True)           # doctest: +SKIP
>>> out = edge_attention(s, t, h, edges, mask_groups=1, fill=-9e15, slope=0.2)  # doctest: +SKIP
"""
from __future__ import annotations

import bisect
from typing import Any

import torch
import torch.nn.functional as F

from ..data_paths import bound, within
from .attention import DEFAULT_BLOCK_BYTES, _rng_state, block_rows

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
                   fill: float, slope: float, added: torch.Tensor | None = None, dropout: float = 0.0,
                   heads_last: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES) -> torch.Tensor:
    """softmax_j(LeakyReLU(s_i + t_j) where kept, else fill) @ h over the kept entries ``edges``
    (from :func:`kept_edges`); [Gm, Gh, N, F], the dense form's value (see the module doc).
    ``added``: an additive mask [Am, N, M] (its kept entries are added to the scores; fill is -inf).
    ``dropout``: ``F.dropout(weights, dropout)`` before the product, with the mask dropout draws over
    the dense weights [Gm, Gh, N, M] (``heads_last``: [Gm, N, M, Gh]) - see :func:`edge_dropout`."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    row, col = edges[0], edges[1]
    if added is None and not dropout and s.device.type == "cuda":  # opted in: the fused Triton kernels
        from . import edge_attention_triton as fused
        if fused.takes(s, t, h):
            rowptr = torch.searchsorted(row, torch.arange(mask_groups * n + 1, device=row.device))
            return torch.ops.fxmem.edge_attention_fused(s, t, h, rowptr, row, col, n, m, float(fill), float(slope))[0]
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
    dropped = None
    if dropout:  # the dense weights' dropout: its numbers at the edges, and each row's dropped sum of h
        with torch.no_grad():
            flagged = w != 0  # rows whose masked entries have weight (a row without an edge: uniform)
        noise, dropped, _ = torch.ops.fxmem.edge_dropout(h2, row, col, flagged, n, m, float(dropout),
                                                         bool(heads_last), int(block_bytes))
        alpha = alpha * noise.detach()
        del flagged, noise
    out = _Aggregate.apply(alpha, h2, row, col, rows_all)
    beta = (w / z).view(gm, n, gh, 1)
    if dropped is None:
        out = out.view(gm, n, gh, f) + beta * h2.view(gm, m, gh, f).sum(1, keepdim=True)
    else:  # a masked entry's weight w/Z times its own number: sum_j noise_ij h_j (0 where w is 0)
        out = out.view(gm, n, gh, f) + beta * dropped.view(gm, n, gh, f)
    return out.permute(0, 2, 1, 3)


# --- dropout over the dense weights, drawn in their order, read at the edges ------------------------------
#
# On the CPU ``F.dropout(weights, p)`` draws one number per weight in memory order, and a tensor
# drawn in pieces in that order gets the same numbers (:mod:`fxmem.ops.attention`). The edge list
# has no dense weights, but dropout's numbers are still those of the dense tensor: the kernel draws
# it in row blocks (the weights' order: groups, heads, rows, columns; heads last: groups, rows,
# columns, heads), keeps the numbers at the edges, and drops each block. Work in N x M random
# numbers still (a dense draw), memory in the edges and one block.
#
# A masked entry has weight w_i / Z_i (0 unless its row has no edge, or a fill close to the
# scores); dropout multiplies it by its own number too, so such a row also needs
# sum_j noise_ij h_j, over every column ("dropped"): a product with the block, made only for the
# blocks that have such a row (0 elsewhere, where beta is 0). Its backward draws the blocks again
# (from the generator's state before the first draw), only when some row has such weight: the
# first block always, so the kernel's memory is the same whatever the data.


def noise_rows(n: Any, m: Any, f: Any, heads: int, element_size: int, block_bytes: int) -> Any:
    """Rows of dropout's numbers drawn at once: a block of ``heads`` x rows x M numbers, one head's
    rows x M apart (heads last), and a rows x F product, within ``block_bytes``."""
    return block_rows(n, m, f, heads, 0, element_size, block_bytes, score_blocks=2)


def _local_index(row: torch.Tensor, col: torch.Tensor, n: int, m: int, rows: int) -> torch.Tensor:
    """Each edge's place in its row block of numbers: (i % rows) * M + j (int64 [K])."""
    local = torch.remainder(row, n)
    local.remainder_(rows)
    local.mul_(m)
    j = torch.remainder(col, m)
    local.add_(j)
    del j
    return local


class _Rows:
    """``row`` (sorted) as a sequence of ints for :mod:`bisect`: finds a block's edges without a tensor."""

    def __init__(self, row: torch.Tensor):
        self.row = row

    def __len__(self) -> int:
        return self.row.shape[0]

    def __getitem__(self, k: int) -> int:
        return int(self.row[k])


def _blocks(gm: int, gh: int, n: int, rows: int, heads_last: bool, row: torch.Tensor | None = None):
    """(g, head or None, first row, rows, first edge, end edge) of each draw, in the weights' order."""
    seq = _Rows(row) if row is not None else None
    for g in range(gm):
        starts = list(range(0, n, rows))
        edges = ([bisect.bisect_left(seq, g * n + r0) for r0 in starts] + [bisect.bisect_left(seq, (g + 1) * n)]
                 if seq is not None else [0] * (len(starts) + 1))
        for head in ([None] if heads_last else range(gh)):
            for b, r0 in enumerate(starts):
                yield g, head, r0, min(rows, n - r0), edges[b], edges[b + 1]


def _draw(block: torch.Tensor, count: int, dropout: float, generator: Any = None) -> torch.Tensor:
    """F.dropout's noise for ``count`` weights: Bernoulli(1 - p) / (1 - p), drawn in place."""
    noise = block[:count]
    noise.bernoulli_(1 - dropout, generator=generator)
    noise.div_(1 - dropout)
    return noise


@torch.library.custom_op("fxmem::edge_dropout", mutates_args=())
def edge_dropout_op(h: torch.Tensor, row: torch.Tensor, col: torch.Tensor, flagged: torch.Tensor, n: int, m: int,
                    dropout: float, heads_last: bool, block_bytes: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(noise, dropped, state)`` for the edges (``row``, ``col``: [K], rows of [Gm*N], columns
    of [Gm*M], sorted by row) of weights [Gm, Gh, N, M] (``heads_last``: [Gm, N, M, Gh]) with
    ``h`` [Gm*M, Gh, F]: ``noise`` [K, Gh] dropout's numbers at the edges (Bernoulli(1 - p) /
    (1 - p)); ``dropped`` [Gm*N, Gh, F] sum_j noise_ij h_j where ``flagged`` [Gm*N, Gh] (else 0);
    ``state`` the generator's state before the first draw."""
    h = h.contiguous()
    state = _rng_state(h.device)
    gh, f = h.shape[1], h.shape[2]
    gm, k = h.shape[0] // m, row.shape[0]
    noise = h.new_empty(k, gh)
    dropped = h.new_zeros(gm * n, gh, f)
    heads = gh if heads_last else 1
    rows = noise_rows(n, m, f, heads, h.element_size(), block_bytes)
    local = _local_index(row, col, n, m, rows)
    by_head = None if heads_last else h.new_empty(gh, k)  # heads first: a head's numbers, contiguous
    block = h.new_empty(rows * m * heads)
    one_head = h.new_empty(rows, m) if heads_last else None  # heads last: one head's numbers, contiguous
    product = h.new_empty(rows, f)
    for g, head, r0, size, lo, hi in _blocks(gm, gh, n, rows, heads_last, row):
        drawn = _draw(block, size * m * heads, dropout)
        at = slice(g * n + r0, g * n + r0 + size)
        if heads_last:
            if hi > lo:
                torch.index_select(drawn.view(size * m, gh), 0, local[lo:hi], out=noise[lo:hi])
            if bool(flagged[at].any()):
                for hd in range(gh):
                    one_head[:size].copy_(drawn.view(size, m, gh)[:, :, hd])
                    torch.mm(one_head[:size], h[g * m:(g + 1) * m, hd], out=product[:size])
                    dropped[at, hd].copy_(product[:size])
        else:
            if hi > lo:
                torch.index_select(drawn, 0, local[lo:hi], out=by_head[head, lo:hi])
            if bool(flagged[at, head].any()):
                torch.mm(drawn.view(size, m), h[g * m:(g + 1) * m, head], out=product[:size])
                dropped[at, head].copy_(product[:size])
    if by_head is not None:
        noise.copy_(by_head.t())
    del by_head, block, one_head, product, local
    return noise, dropped, state


@edge_dropout_op.register_fake
def _(h, row, col, flagged, n, m, dropout, heads_last, block_bytes):
    size = 16 if h.device.type == "cuda" else 5056  # the generator's state: Philox seed and offset / MT19937
    gm = h.shape[0] // m
    return (h.new_empty(row.shape[0], h.shape[1]), h.new_empty(gm * n, h.shape[1], h.shape[2]),
            torch.empty(size, dtype=torch.uint8, device="cpu"))


@torch.library.custom_op("fxmem::edge_dropout_backward", mutates_args=())
def edge_dropout_backward_op(grad: torch.Tensor, flagged: torch.Tensor, state: torch.Tensor, n: int, m: int,
                             dropout: float, heads_last: bool, block_bytes: int) -> torch.Tensor:
    """The gradient of ``h`` [Gm*M, Gh, F] from that of ``dropped`` (:func:`edge_dropout_op`): the
    blocks drawn again from ``state``, sum_i noise_ij grad_i over the flagged rows - all blocks where
    a row is flagged, else the first block alone (the same memory either way)."""
    grad = grad.contiguous()
    gh, f = grad.shape[1], grad.shape[2]
    gm = grad.shape[0] // n
    dh = grad.new_zeros(gm * m, gh, f)
    heads = gh if heads_last else 1
    rows = noise_rows(n, m, f, heads, grad.element_size(), block_bytes)
    block = grad.new_empty(rows * m * heads)
    one_head = grad.new_empty(rows, m) if heads_last else None
    product = grad.new_empty(m, f)
    needed = bool(flagged.any())
    generator = torch.Generator(device=grad.device)
    generator.set_state(state)
    for g, head, r0, size, _, _ in _blocks(gm, gh, n, rows, heads_last):
        drawn = _draw(block, size * m * heads, dropout, generator)
        at = slice(g * n + r0, g * n + r0 + size)
        if heads_last:
            if bool(flagged[at].any()):
                for hd in range(gh):
                    one_head[:size].copy_(drawn.view(size, m, gh)[:, :, hd])
                    torch.mm(one_head[:size].t(), grad[at, hd], out=product)
                    dh[g * m:(g + 1) * m, hd].add_(product)
        elif bool(flagged[at, head].any()):
            torch.mm(drawn.view(size, m).t(), grad[at, head], out=product)
            dh[g * m:(g + 1) * m, head].add_(product)
        if not needed:
            break
    del block, one_head, product
    return dh


@edge_dropout_backward_op.register_fake
def _(grad, flagged, state, n, m, dropout, heads_last, block_bytes):
    return grad.new_empty(grad.shape[0] // n * m, grad.shape[1], grad.shape[2])


def _setup_edge_dropout(ctx: Any, inputs: tuple, output: tuple) -> None:
    h, row, col, flagged, n, m, dropout, heads_last, block_bytes = inputs
    ctx.options = (n, m, dropout, heads_last, block_bytes)
    ctx.save_for_backward(flagged, output[2])


def _backward_edge_dropout(ctx: Any, grad_noise: Any, grad_dropped: torch.Tensor, grad_state: Any) -> tuple:
    flagged, state = ctx.saved_tensors
    dh = torch.ops.fxmem.edge_dropout_backward(grad_dropped, flagged, state, *ctx.options)
    return dh, None, None, None, None, None, None, None, None


edge_dropout_op.register_autograd(_backward_edge_dropout, setup_context=_setup_edge_dropout)


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
