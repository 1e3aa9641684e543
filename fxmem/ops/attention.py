"""GAT attention, fused: masked softmax over decomposed scores without any N x M float tensor kept.

    e_ij  = LeakyReLU(s_i + t_j)                      scores, decomposed (GAT: s = Wh·a1, t = Wh·a2)
    a_ij  = softmax_j(e_ij if keep_ij else fill)      keep_ij: adj_ij > threshold (or <, ==, ...), or not
    out_i = sum_j a_ij h_j

Written out, autograd keeps the scores, the mask and the softmax, N x M each (seed 000's layer:
about 21·B·N² bytes after its pair tensor is gone). Here rows are processed in blocks of R rows:
a block holds complete rows, so its softmax is exact (no online rescaling is needed when the
blocks are rows), and only two row statistics are saved, ``top_i = max_j e_ij`` and
``total_i = sum_j exp(e_ij - top_i)`` (two, not their log-sum-exp: with a fill of -9e15 the sum
would lose the scores' low digits). Backward recomputes each block's scores from ``s``, ``t``,
``adj`` and the statistics (FlashAttention's scheme; dgNN's fused GAT kernel does the same on GPUs):

    P = exp(e - top) / total,  dP = dout·hᵀ,  dh += Pᵀ·dout,  dE = P ⊙ (dP - rowsum(P ⊙ dP)),
    dE = 0 where not kept,  dE *= LeakyReLU'(s_i + t_j),  ds_i = sum_j dE_ij,  dt_j = sum_i dE_ij

Layouts (the rewrite arranges the model's tensors so): ``s`` is [Gm, Gh, N], ``t`` [Gm, Gh, M],
``h`` [Gm, Gh, M, F], ``adj`` [Am, N, M] with Am = Gm or 1 (the mask is shared by the Gh heads),
``out`` [Gm, Gh, N, F]. The block rows R come from ``block_bytes``, the scratch one block may use
(:func:`block_rows`); the kernel allocates, per block, the scores (R·M per group) and a bool mask
in the forward, and twice the scores plus two bool masks in the backward - exactly, as
:mod:`fxmem.kernels.fused` says (its tests compare with the allocator on real runs).

The kernel is plain PyTorch, registered for every device; a faster CUDA kernel (FlexAttention, or
Triton) can be registered for the ``cuda`` key of the same op, with its own memory rule.

>>> out = masked_attention(s, t, h, adj, compare="gt", threshold=0.0, fill=-9e15, slope=0.2)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_BLOCK_BYTES = 4 * 2**20  # scratch of one block; small enough to stay in cache-sized chunks
# how the mask is read from adj: adj_ij <op> threshold, or "true" for a bool adj itself
COMPARE = ("gt", "ge", "lt", "le", "eq", "ne", "true")
_COMPARE = {"gt": torch.gt, "ge": torch.ge, "lt": torch.lt, "le": torch.le, "eq": torch.eq, "ne": torch.ne}


def block_rows(n: Any, m: Any, groups: Any, mask_groups: Any, element_size: int, block_bytes: int) -> Any:
    """Rows per block: as many as keep the backward's scratch (2 float and 1 bool score blocks per
    group, 1 bool mask block per mask group) within ``block_bytes``, at least 1, at most ``n``.

    Sizes may be symbolic: the comparisons then become guards of the analysis' region.
    """
    per_row = (2 * element_size + 1) * groups * m + mask_groups * m
    rows = block_bytes // per_row
    if rows < 1:
        return 1
    return n if rows >= n else rows


def _dropped(adj: torch.Tensor, r0: int, rows: int, compare: str, threshold: float, keep: bool) -> torch.Tensor:
    """Where the scores are replaced by ``fill``, for rows r0..r0+rows: [Am, 1, rows, M] bool.

    ``keep``: the comparison says which scores stay (``where(adj > 0, e, fill)``); otherwise which
    are replaced (``e.masked_fill(adj == 0, fill)``).
    """
    part = adj[:, r0:r0 + rows].unsqueeze(1)
    if compare == "true":
        return part.logical_not() if keep else part  # a bool adj that says what to replace is a view
    found = _COMPARE[compare](part, threshold)
    # not(keep) rather than the opposite comparison: NaN entries are dropped, as where(adj > 0, ...) does
    return found.logical_not_() if keep else found


def _scores(s3: torch.Tensor, t3: torch.Tensor, adj: torch.Tensor, heads: int, r0: int, rows: int,
            compare: str, threshold: float, keep: bool, fill: float, slope: float, want_negative: bool) -> tuple:
    """The masked scores of rows r0..r0+rows as [G, rows, M], the drop mask, and (for the
    backward) where s_i + t_j <= 0 (LeakyReLU's slope applies there)."""
    z = s3[:, r0:r0 + rows, None] + t3[:, None, :]
    negative = z <= 0.0 if want_negative else None
    F.leaky_relu_(z, slope)
    drop = _dropped(adj, r0, rows, compare, threshold, keep)
    z.view(-1, heads, rows, z.shape[-1]).masked_fill_(drop, fill)
    return z, drop, negative


@torch.library.custom_op("fxmem::masked_attention", mutates_args=())
def masked_attention_op(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, adj: torch.Tensor, compare: str,
                        threshold: float, keep: bool, fill: float, slope: float, block_bytes: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, top, total)``: the attention output [Gm, Gh, N, F] and the row statistics [Gm, Gh, N]."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    g = gm * gh
    s3, t3, h3 = s.contiguous().view(g, n), t.contiguous().view(g, m), h.contiguous().view(g, m, f)
    out = s.new_empty(gm, gh, n, f)
    top, total = s.new_empty(gm, gh, n, 1), s.new_empty(gm, gh, n, 1)
    out3, top3, total3 = out.view(g, n, f), top.view(g, n, 1), total.view(g, n, 1)
    step = block_rows(n, m, g, adj.shape[0], s.element_size(), block_bytes)
    for r0 in range(0, n, step):
        _forward_block(s3, t3, h3, adj, gh, out3, top3, total3, r0, min(step, n - r0), compare, threshold, keep,
                       fill, slope)
    return out, top, total


def _forward_block(s3, t3, h3, adj, heads, out3, top3, total3, r0, rows, compare, threshold, keep, fill, slope) -> None:
    # a function per block: its temporaries die when it returns, before the next block's are made
    z, drop, _ = _scores(s3, t3, adj, heads, r0, rows, compare, threshold, keep, fill, slope, False)
    del drop
    top, total = top3[:, r0:r0 + rows], total3[:, r0:r0 + rows]
    torch.amax(z, -1, keepdim=True, out=top)
    z.sub_(top).exp_()
    torch.sum(z, -1, keepdim=True, out=total)
    z.div_(total)
    out3[:, r0:r0 + rows] = torch.bmm(z, h3)


@masked_attention_op.register_fake
def _(s, t, h, adj, compare, threshold, keep, fill, slope, block_bytes):
    gm, gh, n = s.shape
    return s.new_empty(gm, gh, n, h.shape[-1]), s.new_empty(gm, gh, n, 1), s.new_empty(gm, gh, n, 1)


@torch.library.custom_op("fxmem::masked_attention_backward", mutates_args=())
def masked_attention_backward_op(grad: torch.Tensor, s: torch.Tensor, t: torch.Tensor, h: torch.Tensor,
                                 adj: torch.Tensor, top: torch.Tensor, total: torch.Tensor, compare: str,
                                 threshold: float, keep: bool, fill: float, slope: float, block_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ds, dt, dh)`` from the gradient of ``out``, recomputing the scores block by block."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    g = gm * gh
    s3, t3, h3 = s.contiguous().view(g, n), t.contiguous().view(g, m), h.contiguous().view(g, m, f)
    grad3 = grad.contiguous().view(g, n, f)
    ds = s.new_empty(gm, gh, n)
    dt = t.new_zeros(gm, gh, m)
    dh = h.new_zeros(gm, gh, m, f)
    ds2, dt2, dh3 = ds.view(g, n), dt.view(g, m), dh.view(g, m, f)
    top3, total3 = top.view(g, n, 1), total.view(g, n, 1)
    step = block_rows(n, m, g, adj.shape[0], s.element_size(), block_bytes)
    for r0 in range(0, n, step):
        _backward_block(grad3, s3, t3, h3, adj, top3, total3, gh, ds2, dt2, dh3, r0, min(step, n - r0),
                        compare, threshold, keep, fill, slope)
    return ds, dt, dh


def _backward_block(grad3, s3, t3, h3, adj, top3, total3, heads, ds2, dt2, dh3, r0, rows, compare, threshold, keep,
                    fill, slope) -> None:
    z, drop, negative = _scores(s3, t3, adj, heads, r0, rows, compare, threshold, keep, fill, slope, True)
    # the forward's softmax, from the saved row statistics, by the same operations
    p = z.sub_(top3[:, r0:r0 + rows]).exp_().div_(total3[:, r0:r0 + rows])
    g = grad3[:, r0:r0 + rows]
    dp = torch.bmm(g, h3.transpose(1, 2))
    dh3.baddbmm_(p.transpose(1, 2), g)
    dp.mul_(p)
    row = dp.sum(-1, keepdim=True)
    dp.addcmul_(p, row, value=-1.0)  # softmax backward: P ⊙ (dP - rowsum(P ⊙ dP))
    del row
    dp.view(-1, heads, rows, dp.shape[-1]).masked_fill_(drop, 0.0)  # where() sends nothing to dropped scores
    del drop
    slope_at = p.fill_(1.0).masked_fill_(negative, slope)  # LeakyReLU', in the scores' buffer
    del negative
    dp.mul_(slope_at)
    del slope_at, p, z
    ds2[:, r0:r0 + rows] = dp.sum(-1)
    dt2.add_(dp.sum(-2))


@masked_attention_backward_op.register_fake
def _(grad, s, t, h, adj, top, total, compare, threshold, keep, fill, slope, block_bytes):
    return s.new_empty(s.shape), t.new_empty(t.shape), h.new_empty(h.shape)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    s, t, h, adj, compare, threshold, keep, fill, slope, block_bytes = inputs
    ctx.options = (compare, threshold, keep, fill, slope, block_bytes)
    ctx.save_for_backward(s, t, h, adj, output[1], output[2])


def _backward(ctx: Any, grad: torch.Tensor, grad_top: Any, grad_total: Any) -> tuple:
    s, t, h, adj, top, total = ctx.saved_tensors
    ds, dt, dh = torch.ops.fxmem.masked_attention_backward(grad, s, t, h, adj, top, total, *ctx.options)
    return ds, dt, dh, None, None, None, None, None, None, None


masked_attention_op.register_autograd(_backward, setup_context=_setup)


def masked_attention(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, adj: torch.Tensor, *, compare: str = "gt",
                     threshold: float = 0.0, keep: bool = True, fill: float = -9e15, slope: float = 0.2,
                     block_bytes: int = DEFAULT_BLOCK_BYTES) -> torch.Tensor:
    """softmax_j(LeakyReLU(s_i + t_j) where kept, else fill) @ h, fused; [Gm, Gh, N, F] (see module doc).

    The mask: ``adj <compare> threshold`` (``compare="true"``: a bool ``adj`` itself) says which scores
    stay (``keep=True``) or which are replaced by ``fill`` (``keep=False``).
    """
    if compare not in COMPARE:
        raise ValueError(f"compare={compare!r}: use one of {COMPARE}")
    return torch.ops.fxmem.masked_attention(s, t, h, adj, compare, float(threshold), bool(keep), float(fill),
                                            float(slope), int(block_bytes))[0]
