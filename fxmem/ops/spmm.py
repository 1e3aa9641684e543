"""Message passing, fused: gather -> per-edge message -> scatter-add as one sparse-dense product.

    out[i] = sum over edges e with dst_e = i of  w_e * x[src_e]      =  (A @ x)[i],  A[dst_e, src_e] += w_e

Written out, ``x[src] * w`` is an E x F message tensor, and autograd keeps it (seed 003: DGL's
fused send-and-receive, gSpMM, avoids it). Here the edges are sorted by target once
(:func:`csr_structure`: ``crow``, ``col``, ``perm``, shared by every layer that uses the same edge
list) and ``A`` is a CSR matrix whose values are the edge weights, multiplied with ``torch.sparse.mm``:
no E x F tensor is built, in the forward or the backward:

    dx = Aᵀ @ dout            (Aᵀ sorted by source in the backward, a CSR product again)
    dw_e = <dout[dst_e], x[src_e]>   (in chunks of edges whose picked rows fit :data:`CHUNK_BYTES`)

Weights: ``w`` is [E, H] (H = 1: one weight per edge), with ``x`` [M, H, F]: head h of the output
uses the weights w[:, h] (the multi-head broadcast ``x[src] * w[:, :, None]``). Without weights
(``x[src]`` alone) pass ``w=None``: the values are ones and get no gradient.

What the kernels allocate beyond their outputs - the int32 copies of the indices MKL's sparse
routines take, a dense result buffer, the sorted structure in the backward - is described in
:mod:`fxmem.kernels.fused` and checked against real runs; without MKL, fxmem says it cannot predict it.

>>> crow, col, perm = csr_structure(dst, src, n)                     # doctest: +SKIP
>>> out = spmm(dst, src, crow, col, perm, w, x, n)                   # doctest: +SKIP
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

CHUNK_BYTES = 2**20  # scratch of one chunk of edges in the weight gradient


@torch.library.custom_op("fxmem::csr_structure", mutates_args=())
def csr_structure_op(rows: torch.Tensor, cols: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The edges sorted by ``rows`` (stable): ``(crow [n+1], col [E], perm [E])``, int64."""
    crow, col, perm = rows.new_empty(n + 1), cols.new_empty(cols.shape), rows.new_empty(rows.shape)
    _sorted_rows(rows, crow, perm)
    torch.index_select(cols, 0, perm, out=col)
    return crow, col, perm


def _sorted_rows(rows: torch.Tensor, crow: torch.Tensor, perm: torch.Tensor) -> None:
    # the sorted rows are needed only to find where each row starts
    ordered = torch.empty_like(rows)
    torch.sort(rows, stable=True, out=(ordered, perm))
    torch.searchsorted(ordered, torch.arange(crow.shape[0], device=rows.device), out=crow)


@csr_structure_op.register_fake
def _(rows, cols, n):
    return rows.new_empty(n + 1), rows.new_empty(rows.shape), rows.new_empty(rows.shape)


def csr_structure(rows: torch.Tensor, cols: torch.Tensor, n: Any) -> tuple:
    """``(crow, col, perm)`` of the n x M matrix with an entry (rows[e], cols[e]) per edge e."""
    return torch.ops.fxmem.csr_structure(rows, cols, n)


def _matrix(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the op's business, not the user's
        warnings.simplefilter("ignore")
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _values(w: Optional[torch.Tensor], perm: torch.Tensor, head: int, like: torch.Tensor) -> torch.Tensor:
    """Head ``head``'s weights in the matrix's (sorted) order; ones without weights."""
    if w is None:
        return like.new_ones(perm.shape[0])
    return w[:, head].index_select(0, perm)


@torch.library.custom_op("fxmem::spmm", mutates_args=())
def spmm_op(dst: torch.Tensor, src: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, perm: torch.Tensor,
            w: Optional[torch.Tensor], x: torch.Tensor, n: int) -> torch.Tensor:
    """``out[i, h] = sum_{e: dst_e = i} w[e, h] x[src_e, h]``: [n, H, F] from x [M, H, F]."""
    return _products(crow, col, perm, w, x, n)


def _products(crow: torch.Tensor, col: torch.Tensor, perm: torch.Tensor, w: Optional[torch.Tensor],
              dense: torch.Tensor, n: Any) -> torch.Tensor:
    """A @ dense per head: [n, H, F] from dense [M, H, F] (one head: the product is the result)."""
    m, heads, f = dense.shape
    if heads == 1:
        return _product(crow, col, _values(w, perm, 0, dense), dense.reshape(m, f), (n, m)).view(n, 1, f)
    out = dense.new_empty(n, heads, f)
    for head in range(heads):
        _head_product(out, head, crow, col, perm, w, dense, (n, m))
    return out


def _product(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, dense: torch.Tensor,
             shape: tuple) -> torch.Tensor:
    """A @ dense with A the CSR matrix of (crow, col, values); the matrix dies with the call. MKL's
    CPU product has no bfloat16 or half kernel (the model's gathers do, under autocast): those are
    computed in float32 and returned in their own dtype (two float32 copies the size of the
    operands, which fxmem's rule for this op does not count: a report says so when it checks itself)."""
    if dense.device.type == "cpu" and dense.dtype in (torch.bfloat16, torch.float16):
        return _product(crow, col, values.float(), dense.float(), shape).to(dense.dtype)
    with torch.autocast(dense.device.type, enabled=False):  # the op computes in its operands' dtype
        return torch.sparse.mm(_matrix(crow, col, values, shape), dense.contiguous())


def _head_product(out: torch.Tensor, head: int, crow: torch.Tensor, col: torch.Tensor, perm: torch.Tensor,
                  w: Optional[torch.Tensor], x: torch.Tensor, shape: tuple) -> None:
    # one head's product, written into its slice of out (a function: its temporaries die here)
    out[:, head] = _product(crow, col, _values(w, perm, head, x), x[:, head], shape)


@spmm_op.register_fake
def _(dst, src, crow, col, perm, w, x, n):
    return x.new_empty(n, x.shape[1], x.shape[2])


@torch.library.custom_op("fxmem::spmm_backward", mutates_args=())
def spmm_backward_op(grad: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, w: Optional[torch.Tensor],
                     x: Optional[torch.Tensor], m: int, need_x: bool, need_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)``: dx = Aᵀ @ grad [m, H, F] (empty when not needed), dw[e, h] = <grad[dst_e, h], x[src_e, h]>
    (empty when not needed; ``x`` is only needed for it)."""
    n, heads, f = grad.shape
    dx = _transposed_product(grad, dst, src, w, m) if need_x else grad.new_empty(0)
    dw = grad.new_empty(dst.shape[0], heads) if need_w else grad.new_empty(0)
    if need_w:
        step = chunk_rows(dst.shape[0], f, grad.element_size())
        for head in range(heads):
            for e0 in range(0, dst.shape[0], step):
                _weight_chunk(dw, head, grad, dst, src, x, e0, min(step, dst.shape[0] - e0))
    return dx, dw


def chunk_rows(edges: Any, features: Any, element_size: int) -> Any:
    """Edges per chunk of the weight gradient: two picked rows of ``features`` each within
    :data:`CHUNK_BYTES`, at least 1, at most ``edges`` (comparisons on symbolic sizes become guards)."""
    rows = CHUNK_BYTES // (2 * features * element_size)
    if rows < 1:
        return 1
    return edges if rows >= edges else rows


def _transposed_product(grad: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, w: Optional[torch.Tensor],
                        m: int) -> torch.Tensor:
    """Aᵀ @ grad: the edges sorted by source (a structure made here, dead on return)."""
    crow_t, col_t, perm_t = csr_structure_op(src, dst, m)
    return _products(crow_t, col_t, perm_t, w, grad, m)


def _weight_chunk(dw: torch.Tensor, head: int, grad: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
                  x: torch.Tensor, e0: int, rows: int) -> None:
    # dw[e] = <grad[dst_e], x[src_e]> for a chunk of edges: two rows per edge, never all E at once
    # (torch.sparse.sampled_addmm would do it over A's pattern, but fails on repeated edges)
    picked = x[:, head].index_select(0, src[e0:e0 + rows])
    picked.mul_(grad[:, head].index_select(0, dst[e0:e0 + rows]))
    dw[e0:e0 + rows, head] = picked.sum(-1)


@spmm_backward_op.register_fake
def _(grad, dst, src, w, x, m, need_x, need_w):
    n, heads, f = grad.shape
    dx = grad.new_empty(m, heads, f) if need_x else grad.new_empty(0)
    dw = grad.new_empty(dst.shape[0], heads) if need_w else grad.new_empty(0)
    return dx, dw


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    dst, src, crow, col, perm, w, x, n = inputs
    ctx.need_x = x.requires_grad
    ctx.need_w = w is not None and w.requires_grad
    ctx.m = x.shape[0]
    # the forward's structure is not kept: the backward sorts by source, and picks rows by dst and src
    ctx.save_for_backward(dst, src, w, x if ctx.need_w else None)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    dst, src, w, x = ctx.saved_tensors
    dx, dw = torch.ops.fxmem.spmm_backward(grad, dst, src, w, x, ctx.m, ctx.need_x, ctx.need_w)
    return None, None, None, None, None, (dw if ctx.need_w else None), (dx if ctx.need_x else None), None


spmm_op.register_autograd(_backward, setup_context=_setup)


def spmm(dst: torch.Tensor, src: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, perm: torch.Tensor,
         w: Optional[torch.Tensor], x: torch.Tensor, n: Any) -> torch.Tensor:
    """``sum_{e: dst_e = i} w_e x[src_e]`` for i < n, fused (see the module doc); x [M, H, F], w [E, H] or None."""
    return torch.ops.fxmem.spmm(dst, src, crow, col, perm, w, x, n)
