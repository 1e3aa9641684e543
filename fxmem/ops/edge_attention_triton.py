"""Triton kernels for the edge-list GAT attention (:func:`fxmem.ops.edge_attention.edge_attention`) on CUDA.

The same exact math as the PyTorch form (see :mod:`fxmem.ops.edge_attention`'s module doc), for
``added is None`` and no dropout, as one custom op ``fxmem::edge_attention_fused`` and its
backward ``fxmem::edge_attention_fused_backward``. The edges come as CSR: ``rowptr`` [Am*N + 1]
(int64) over the adjacency's rows, ``row`` and ``col`` [K] (``edges[0]``, ``edges[1]``: views, no
copies). With one adjacency for all groups (Am = 1) every group reads the same K edges: the
kernels index them per group (column ``a*M + j`` of adjacency ``a = gm % Am``); no repeated list.

* forward: one program per (row, group): an online softmax over the row's edges in tiles of
  :data:`BLOCK_EDGES` (running maximum and sum, FlashAttention-style), then the masked entries'
  weight ``w_i`` and ``(w_i / Z_i) sum_j h_j`` (``sum_j h_j``: one [G, F] float32 column sum, a
  small kernel of its own). Writes ``out`` and each row's shift ``top`` and normaliser ``norm``
  (float32 [Gm, Gh, N] each), which the backward reads.
* backward, without atomics (deterministic):

  1. a row kernel, one program per (row, group), recomputing the row's weights: ``ds_i``, and the
     row statistics ``D_i = g_i . out_i`` and ``beta_i = w_i / Z_i``, from
     ``u = sum p dP``, ``v = sum p lambda dP``, ``q = sum p lambda``, ``r = sum dP`` over the kept
     entries (``D`` is known only after the pass, so ``ds = (v - D q) / Z``).
  2. the column sums ``sum_j h_j`` (again) and ``sum_i beta_i g_i`` (the masked entries' share of
     every ``dh_j``), one program per group.
  3. a column kernel, one program per (column, group), over the column's edges (the transposed
     structure, built here: a stable sort of ``col``): ``dt_j`` and ``dh_j``.

Scores, softmax and sums are float32 whatever the operands' dtype (float32, float16, bfloat16:
:func:`handles`); operands are read through their strides (no contiguous copies), offsets are 64-bit.

What the wrappers allocate, in bytes (:mod:`fxmem.kernels.edge_fused` states it as the CUDA rule;
the Triton kernels allocate nothing themselves):

* :func:`forward`: its outputs, then a float32 [G, F] buffer of ``sum_j h_j`` (4·G·F), freed on return.
* :func:`backward`: its outputs, one float32 scratch of 4·(2·G·F + 2·G·N) bytes (both column sums,
  D and beta), then the transposed structure (:func:`by_column`: ``torch.sort`` of ``col`` - sorted
  values and order, 8·K each -, an int64 ``arange`` of Am·M + 1, the column pointers, 8·(Am·M + 1)
  each; the arange and sorted values freed at once), everything freed on return.

CUDA calls take them only with ``FXMEM_TRITON_ATTENTION=1`` (:func:`fxmem.ops.attention_triton.enabled`,
the dense kernels' switch); the op's CPU kernel is the PyTorch math (:func:`reference`), so the
op runs anywhere. Nothing here imports Triton until a kernel is launched.

>>> rowptr = torch.searchsorted(edges[0], torch.arange(n + 1))                  # doctest: +SKIP
>>> out, top, norm = forward(s, t, h, rowptr, edges[0], edges[1], n, m, -9e15, 0.2)  # doctest: +SKIP
>>> ds, dt, dh = backward(torch.ones_like(out), s, t, h, rowptr, edges[0], edges[1], top, norm,
...                       n, m, -9e15, 0.2)                                      # doctest: +SKIP
"""
from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from . import attention_triton as _dense
from .attention_triton import DTYPES, _launch

if TYPE_CHECKING:  # the kernels' source names it; imported for real in _kernels()
    import triton.language as tl

# edges per tile of a row's (or a column's) loop: a [32, F] block of h in registers for F up to 128
# at 4 warps. Not tuned: no GPU was at hand.
BLOCK_EDGES = 32
BLOCK_ROWS = 32  # rows per tile of the column sums


def handles(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, grad: torch.Tensor | None = None) -> bool:
    """Whether the kernels take these operands (fake ones too: dtypes only): one dtype of :data:`DTYPES`."""
    return s.dtype in DTYPES and all(x.dtype == s.dtype for x in (t, h, *([grad] if grad is not None else [])))


def takes(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, grad: torch.Tensor | None = None) -> bool:
    """Whether a call runs the Triton kernels: CUDA operands, a CUDA build with Triton, opted in
    (``FXMEM_TRITON_ATTENTION=1``) and operands they take. Read at each call (the rule reads it too)."""
    return s.device.type == "cuda" and _dense.available() and _dense.enabled() and handles(s, t, h, grad)


# --- the ops ------------------------------------------------------------------------------------------------

@torch.library.custom_op("fxmem::edge_attention_fused", mutates_args=())
def edge_attention_fused(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, rowptr: torch.Tensor,
                         row: torch.Tensor, col: torch.Tensor, n: int, m: int, fill: float, slope: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, top, norm)``: the attention [Gm, Gh, N, F] over the CSR edges, and each row's shift
    and normaliser (float32 [Gm, Gh, N]). The CPU kernel (and CUDA without the opt-in): :func:`reference`."""
    return reference(s, t, h, rowptr, row, col, n, m, fill, slope)


@edge_attention_fused.register_kernel("cuda")
def _(s, t, h, rowptr, row, col, n, m, fill, slope):
    if not takes(s, t, h):
        return reference(s, t, h, rowptr, row, col, n, m, fill, slope)
    return forward(s, t, h, rowptr, row, col, n, m, fill, slope)


@edge_attention_fused.register_fake
def _(s, t, h, rowptr, row, col, n, m, fill, slope):
    stats = s.new_empty(s.shape, dtype=torch.float32)
    return h.new_empty(*s.shape, h.shape[-1]), stats, torch.empty_like(stats)


@torch.library.custom_op("fxmem::edge_attention_fused_backward", mutates_args=())
def edge_attention_fused_backward(grad: torch.Tensor, s: torch.Tensor, t: torch.Tensor, h: torch.Tensor,
                                  rowptr: torch.Tensor, row: torch.Tensor, col: torch.Tensor, top: torch.Tensor,
                                  norm: torch.Tensor, n: int, m: int, fill: float, slope: float
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ds, dt, dh)`` from the gradient of ``out``. The CPU kernel (and CUDA without the opt-in):
    :func:`reference_backward`."""
    return reference_backward(grad, s, t, h, rowptr, row, col, n, m, fill, slope)


@edge_attention_fused_backward.register_kernel("cuda")
def _(grad, s, t, h, rowptr, row, col, top, norm, n, m, fill, slope):
    if not takes(s, t, h, grad):
        return reference_backward(grad, s, t, h, rowptr, row, col, n, m, fill, slope)
    return backward(grad, s, t, h, rowptr, row, col, top, norm, n, m, fill, slope)


@edge_attention_fused_backward.register_fake
def _(grad, s, t, h, rowptr, row, col, top, norm, n, m, fill, slope):
    return s.new_empty(s.shape), t.new_empty(t.shape), h.new_empty(h.shape)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    s, t, h, rowptr, row, col, n, m, fill, slope = inputs
    ctx.options = (n, m, fill, slope)
    ctx.save_for_backward(s, t, h, rowptr, row, col, output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx: Any, grad: torch.Tensor, grad_top: Any, grad_norm: Any) -> tuple:
    ds, dt, dh = torch.ops.fxmem.edge_attention_fused_backward(grad, *ctx.saved_tensors, *ctx.options)
    return ds, dt, dh, None, None, None, None, None, None, None


edge_attention_fused.register_autograd(_backward, setup_context=_setup)


def _softmax(s, t, h, rowptr, row, col, n, m, fill, slope):
    """The PyTorch math of ``edge_attention`` on the CSR operands, in float32 at least: the edges
    (repeated per group where one adjacency serves all), the operands as rows, each edge's weight
    ``a = p / Z`` and LeakyReLU factor, each row's ``beta = w / Z``, shift and normaliser."""
    gm, gh, _ = s.shape
    f = h.shape[-1]
    if (rowptr.shape[0] - 1) // n != gm:  # one adjacency for every group: its edges in each group
        shift = torch.arange(gm, device=row.device).unsqueeze(1)
        row, col = (row + shift * n).reshape(-1), (col + shift * m).reshape(-1)
    rows_all = gm * n
    level = torch.promote_types(s.dtype, torch.float32)  # half operands: float32 sums, as the kernels
    s2 = s.permute(0, 2, 1).reshape(rows_all, gh).to(level)
    t2 = t.permute(0, 2, 1).reshape(gm * m, gh).to(level)
    h2 = h.permute(0, 2, 1, 3).reshape(gm * m, gh, f).to(level)
    x = s2.index_select(0, row) + t2.index_select(0, col)
    e = F.leaky_relu(x, slope)
    factor = torch.where(x > 0, x.new_ones(()), x.new_full((), slope))  # slope as a 0-dim: not rounded to float32
    top = e.new_full((rows_all, gh), float("-inf")).scatter_reduce_(0, row.unsqueeze(1).expand(e.shape), e, "amax")
    missing = (m - torch.bincount(row, minlength=rows_all)).unsqueeze(1)
    has_fill = missing > 0
    top = torch.where(has_fill, torch.clamp(top, min=fill), top)
    w = torch.where(has_fill, torch.exp(fill - top), 0.0)
    p = torch.exp(e - top.index_select(0, row))
    z = torch.zeros_like(top).index_add_(0, row, p) + missing * w
    return row, col, h2, p / z.index_select(0, row), factor, w / z, top, z


def _stat(x: torch.Tensor, gm: int, n: int, gh: int) -> torch.Tensor:
    return x.view(gm, n, gh).permute(0, 2, 1).contiguous().to(torch.float32)


def reference(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, rowptr: torch.Tensor, row: torch.Tensor,
              col: torch.Tensor, n: int, m: int, fill: float, slope: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, top, norm)`` in PyTorch (``edge_attention``'s math; its temporaries are not modelled)."""
    gm, gh, _ = s.shape
    f = h.shape[-1]
    row, col, h2, a, _, beta, top, z = _softmax(s, t, h, rowptr, row, col, n, m, fill, slope)
    alpha = a - beta.index_select(0, row)
    out = h2.new_zeros(gm * n, gh, f).index_add_(0, row, h2.index_select(0, col) * alpha.unsqueeze(-1))
    out = out.view(gm, n, gh, f) + beta.view(gm, n, gh, 1) * h2.view(gm, m, gh, f).sum(1, keepdim=True)
    out = out.permute(0, 2, 1, 3).contiguous().to(h.dtype)
    return out, _stat(top, gm, n, gh), _stat(z, gm, n, gh)


def reference_backward(grad: torch.Tensor, s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, rowptr: torch.Tensor,
                       row: torch.Tensor, col: torch.Tensor, n: int, m: int, fill: float, slope: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ds, dt, dh)`` in PyTorch, the kernels' formulas (module doc): with ``A`` the dense weights,
    ``D_i = g_i . out_i``, ``dE = A (dP - D) lambda`` at the kept entries, and
    ``dh_j = sum_kept (A_ij - beta_i) g_i + sum_i beta_i g_i``. (Written out: autograd does not run
    inside an op's kernel.)"""
    gm, gh, _ = s.shape
    f = h.shape[-1]
    row, col, h2, a, factor, beta, _, _ = _softmax(s, t, h, rowptr, row, col, n, m, fill, slope)
    g2 = grad.permute(0, 2, 1, 3).reshape(gm * n, gh, f).to(h2.dtype)
    gr = g2.index_select(0, row)  # [K', Gh, F]
    dp = (gr * h2.index_select(0, col)).sum(-1)
    alpha = a - beta.index_select(0, row)
    hsum = h2.view(gm, m, gh, f).sum(1, keepdim=True)
    d = a.new_zeros(gm * n, gh).index_add_(0, row, alpha * dp) + beta * (g2.view(gm, n, gh, f) * hsum).sum(-1).view(
        gm * n, gh)
    de = a * (dp - d.index_select(0, row)) * factor
    ds = de.new_zeros(gm * n, gh).index_add_(0, row, de)
    dt = de.new_zeros(gm * m, gh).index_add_(0, col, de)
    gsum = (beta.view(gm, n, gh, 1) * g2.view(gm, n, gh, f)).sum(1, keepdim=True)
    dh = h2.new_zeros(gm * m, gh, f).index_add_(0, col, alpha.unsqueeze(-1) * gr).view(gm, m, gh, f) + gsum
    return (ds.view(gm, n, gh).permute(0, 2, 1).contiguous().to(s.dtype),
            dt.view(gm, m, gh).permute(0, 2, 1).contiguous().to(t.dtype),
            dh.permute(0, 2, 1, 3).contiguous().to(h.dtype))


# --- the wrappers -------------------------------------------------------------------------------------------

def forward(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, rowptr: torch.Tensor, row: torch.Tensor,
            col: torch.Tensor, n: int, m: int, fill: float, slope: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, top, norm)`` with the Triton kernels: allocates the three outputs, then the float32
    [G, F] column sum of h (4·G·F bytes), freed on return."""
    gm, gh, _ = s.shape
    f, g = h.shape[-1], gm * gh
    out = h.new_empty(gm, gh, n, f)
    top = torch.empty(gm, gh, n, dtype=torch.float32, device=s.device)
    norm = torch.empty(gm, gh, n, dtype=torch.float32, device=s.device)
    hsum = torch.empty(g, f, dtype=torch.float32, device=s.device)  # sum_j h_j of every (group, head)
    k = _kernels()
    am = (rowptr.shape[0] - 1) // n
    _launch(k["sum"], (g,), h, hsum, hsum, m, f, gh, *h.stride(), WEIGHTED=False, BR=BLOCK_ROWS, BF=_width(f))
    _launch(k["forward"], (n, g), s, t, h, rowptr, col, hsum, out, top, norm, n, m, f, gh, am,
            *s.stride(), *t.stride(), *h.stride(), float(fill), float(slope), BE=BLOCK_EDGES, BF=_width(f))
    del hsum
    return out, top, norm


def backward(grad: torch.Tensor, s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, rowptr: torch.Tensor,
             row: torch.Tensor, col: torch.Tensor, top: torch.Tensor, norm: torch.Tensor, n: int, m: int,
             fill: float, slope: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ds, dt, dh)`` with the Triton kernels: allocates the three outputs, a float32 scratch
    (4·(2·G·F + 2·G·N) bytes) and the transposed structure (:func:`by_column`), all freed on return."""
    gm, gh, _ = s.shape
    f, g = h.shape[-1], gm * gh
    am = (rowptr.shape[0] - 1) // n
    ds = s.new_empty(s.shape)
    dt = t.new_empty(t.shape)
    dh = h.new_empty(h.shape)
    scratch = torch.empty(2 * g * f + 2 * g * n, dtype=torch.float32, device=s.device)
    hsum, gsum = scratch[:g * f], scratch[g * f:2 * g * f]  # views: nothing allocated
    d_row, beta = scratch[2 * g * f:2 * g * f + g * n], scratch[2 * g * f + g * n:]
    order, colptr = by_column(col, am * m)
    k = _kernels()
    width = _width(f)
    common = (n, m, f, gh, am, *s.stride(), *t.stride(), *h.stride(), *grad.stride(), float(fill), float(slope))
    _launch(k["sum"], (g,), h, hsum, hsum, m, f, gh, *h.stride(), WEIGHTED=False, BR=BLOCK_ROWS, BF=width)
    _launch(k["rows"], (n, g), s, t, h, grad, rowptr, col, top, norm, hsum, d_row, beta, ds, *common,
            BE=BLOCK_EDGES, BF=width)
    _launch(k["sum"], (g,), grad, beta, gsum, n, f, gh, *grad.stride(), WEIGHTED=True, BR=BLOCK_ROWS, BF=width)
    _launch(k["columns"], (m, g), s, t, h, grad, colptr, order, row, top, norm, d_row, beta, gsum, dt, dh,
            *common, BE=BLOCK_EDGES, BF=width)
    del order, colptr, hsum, gsum, d_row, beta, scratch
    return ds, dt, dh


def by_column(col: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The edges grouped by column: ``(order, colptr)``, int64 [K] and [columns + 1] - edge
    ``order[k]`` for k in ``colptr[c]:colptr[c + 1]`` has column c, in row order (a stable sort).
    Allocates torch.sort's two outputs (8·K bytes each, plus its own workspace on CUDA), an arange and
    the pointers (8·(columns + 1) each); frees the arange, then the sorted columns."""
    ordered, order = torch.sort(col, stable=True)
    starts = torch.arange(columns + 1, device=col.device)
    colptr = torch.searchsorted(ordered, starts)
    del starts, ordered
    return order, colptr


def _width(f: int) -> int:
    """F padded to a power of two (a tile's feature dim)."""
    return max(16, 1 << max(0, int(f) - 1).bit_length())


# --- the kernels: plain functions here, jitted on first use (as in attention_triton) ---------------------

@functools.cache
def _kernels() -> dict[str, Any]:
    """The jitted kernels by name, made once (Triton imported here, TRITON_INTERPRET read here)."""
    import triton
    import triton.language as tl

    scope: dict[str, Any] = {"tl": tl}
    for fn in (_scores, _column_sum, _forward_kernel, _backward_rows, _backward_columns):
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
        copy.__annotations__, copy.__qualname__, copy.__doc__ = dict(fn.__annotations__), fn.__qualname__, fn.__doc__
        copy.__module__ = fn.__module__
        scope[fn.__name__] = triton.jit(copy)
    return {"sum": scope["_column_sum"], "forward": scope["_forward_kernel"], "rows": scope["_backward_rows"],
            "columns": scope["_backward_columns"]}


def _scores(s_i, t_j, ok, slope):
    """LeakyReLU(s_i + t_j) (-inf outside the tile's edges) and LeakyReLU's factor lambda."""
    x = s_i + t_j
    z = tl.where(x > 0, x, x * slope)
    factor = tl.where(x > 0, 1.0, slope)
    return tl.where(ok, z, float("-inf")), tl.where(ok, factor, 0.0)


def _column_sum(x_ptr, w_ptr, out_ptr, L, F, GH, sx0, sx1, sx2, sx3, WEIGHTED: tl.constexpr, BR: tl.constexpr,
                BF: tl.constexpr):
    # out[g] = sum_l (w[g, l] *) x[gm, gh, l, :] in float32: one program per group, so no atomics
    g = tl.program_id(0).to(tl.int64)
    gm, gh = g // GH, g % GH
    feats = tl.arange(0, BF)
    f_ok = feats < F
    acc = tl.zeros([BF], tl.float32)
    for l0 in range(0, L, BR):
        ls = l0 + tl.arange(0, BR).to(tl.int64)
        l_ok = ls < L
        x = tl.load(x_ptr + gm * sx0 + gh * sx1 + ls[:, None] * sx2 + feats[None, :] * sx3,
                    mask=l_ok[:, None] & f_ok[None, :], other=0.0).to(tl.float32)
        if WEIGHTED:
            x = x * tl.load(w_ptr + g * L + ls, mask=l_ok, other=0.0)[:, None]
        acc += tl.sum(x, 0)
    tl.store(out_ptr + g * F + feats, acc, mask=f_ok)


def _forward_kernel(s_ptr, t_ptr, h_ptr, rowptr_ptr, col_ptr, hsum_ptr, out_ptr, top_ptr, norm_ptr, N, M, F, GH,
                    AM, ss0, ss1, ss2, st0, st1, st2, sh0, sh1, sh2, sh3, fill, slope, BE: tl.constexpr,
                    BF: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    gm, gh = g // GH, g % GH
    a = gm % AM  # the adjacency this group reads (Am = 1: one for all)
    lo = tl.load(rowptr_ptr + a * N + i)
    hi = tl.load(rowptr_ptr + a * N + i + 1)
    feats = tl.arange(0, BF)
    f_ok = feats < F
    s_i = tl.load(s_ptr + gm * ss0 + gh * ss1 + i * ss2).to(tl.float32)
    run_max = tl.max(tl.full([BE], float("-inf"), tl.float32), 0)
    run_sum = tl.sum(tl.zeros([BE], tl.float32), 0)
    acc = tl.zeros([BF], tl.float32)  # sum p_ij h_j against the running maximum
    kept = tl.zeros([BF], tl.float32)  # sum h_j over the kept columns (w_i is known only at the end)
    for e0 in range(lo, hi, BE):
        idx = e0 + tl.arange(0, BE).to(tl.int64)
        ok = idx < hi
        j = tl.load(col_ptr + idx, mask=ok, other=0) - a * M
        t_j = tl.load(t_ptr + gm * st0 + gh * st1 + j * st2, mask=ok, other=0.0).to(tl.float32)
        z, _ = _scores(s_i, t_j, ok, slope)
        new_max = tl.maximum(run_max, tl.max(z, 0))
        base = tl.where(new_max == float("-inf"), 0.0, new_max)  # no -inf - -inf
        scale = tl.exp(run_max - base)
        p = tl.exp(z - base)
        hv = tl.load(h_ptr + gm * sh0 + gh * sh1 + j[:, None] * sh2 + feats[None, :] * sh3,
                     mask=ok[:, None] & f_ok[None, :], other=0.0).to(tl.float32)
        run_sum = run_sum * scale + tl.sum(p, 0)
        acc = acc * scale + tl.sum(p[:, None] * hv, 0)
        kept += tl.sum(hv, 0)
        run_max = new_max
    missing = M - (hi - lo)
    # the softmax's shift as the PyTorch form takes it: fill counts where the row has a masked entry
    top = tl.where(missing > 0, tl.maximum(run_max, fill), run_max)
    w = tl.where(missing > 0, tl.exp(fill - top), 0.0)  # a masked entry's weight, before / Z (NaN: all -inf)
    rescale = tl.where(hi > lo, tl.exp(run_max - top), 0.0)  # no edge: nothing summed (no 0 * inf)
    z_i = run_sum * rescale + missing.to(tl.float32) * w
    hsum = tl.load(hsum_ptr + g * F + feats, mask=f_ok, other=0.0)
    out = (acc * rescale - w * kept + w * hsum) / z_i
    place = g * N + i
    tl.store(out_ptr + place * F + feats, out.to(out_ptr.dtype.element_ty), mask=f_ok)
    tl.store(top_ptr + place, top)
    tl.store(norm_ptr + place, z_i)


def _backward_rows(s_ptr, t_ptr, h_ptr, grad_ptr, rowptr_ptr, col_ptr, top_ptr, norm_ptr, hsum_ptr, d_ptr, beta_ptr,
                   ds_ptr, N, M, F, GH, AM, ss0, ss1, ss2, st0, st1, st2, sh0, sh1, sh2, sh3, sg0, sg1, sg2, sg3,
                   fill, slope, BE: tl.constexpr, BF: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    gm, gh = g // GH, g % GH
    a = gm % AM
    lo = tl.load(rowptr_ptr + a * N + i)
    hi = tl.load(rowptr_ptr + a * N + i + 1)
    feats = tl.arange(0, BF)
    f_ok = feats < F
    place = g * N + i
    s_i = tl.load(s_ptr + gm * ss0 + gh * ss1 + i * ss2).to(tl.float32)
    top = tl.load(top_ptr + place)
    z_i = tl.load(norm_ptr + place)
    go = tl.load(grad_ptr + gm * sg0 + gh * sg1 + i * sg2 + feats * sg3, mask=f_ok, other=0.0).to(tl.float32)
    zero = tl.sum(tl.zeros([BE], tl.float32), 0)
    u, v, q, r = zero, zero, zero, zero  # sum p dP, sum p lambda dP, sum p lambda, sum dP (kept entries)
    for e0 in range(lo, hi, BE):
        idx = e0 + tl.arange(0, BE).to(tl.int64)
        ok = idx < hi
        j = tl.load(col_ptr + idx, mask=ok, other=0) - a * M
        t_j = tl.load(t_ptr + gm * st0 + gh * st1 + j * st2, mask=ok, other=0.0).to(tl.float32)
        z, factor = _scores(s_i, t_j, ok, slope)
        p = tl.exp(z - top)
        hv = tl.load(h_ptr + gm * sh0 + gh * sh1 + j[:, None] * sh2 + feats[None, :] * sh3,
                     mask=ok[:, None] & f_ok[None, :], other=0.0).to(tl.float32)
        dp = tl.sum(hv * go[None, :], 1)
        u += tl.sum(p * dp, 0)
        v += tl.sum(p * factor * dp, 0)
        q += tl.sum(p * factor, 0)
        r += tl.sum(dp, 0)
    missing = M - (hi - lo)
    w = tl.where(missing > 0, tl.exp(fill - top), 0.0)
    hsum = tl.load(hsum_ptr + g * F + feats, mask=f_ok, other=0.0)
    # D_i = sum over all M columns of A_ij dP_ij = g_i . out_i: the masked columns' dP sum to g.(sum h - kept h)
    d = (u + w * (tl.sum(go * hsum, 0) - r)) / z_i
    tl.store(d_ptr + place, d)
    tl.store(beta_ptr + place, w / z_i)
    tl.store(ds_ptr + place, ((v - d * q) / z_i).to(ds_ptr.dtype.element_ty))


def _backward_columns(s_ptr, t_ptr, h_ptr, grad_ptr, colptr_ptr, order_ptr, row_ptr, top_ptr, norm_ptr, d_ptr,
                      beta_ptr, gsum_ptr, dt_ptr, dh_ptr, N, M, F, GH, AM, ss0, ss1, ss2, st0, st1, st2,
                      sh0, sh1, sh2, sh3, sg0, sg1, sg2, sg3, fill, slope, BE: tl.constexpr, BF: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    gm, gh = g // GH, g % GH
    a = gm % AM
    lo = tl.load(colptr_ptr + a * M + j)
    hi = tl.load(colptr_ptr + a * M + j + 1)
    feats = tl.arange(0, BF)
    f_ok = feats < F
    t_j = tl.load(t_ptr + gm * st0 + gh * st1 + j * st2).to(tl.float32)
    hj = tl.load(h_ptr + gm * sh0 + gh * sh1 + j * sh2 + feats * sh3, mask=f_ok, other=0.0).to(tl.float32)
    dt = tl.sum(tl.zeros([BE], tl.float32), 0)
    # dh_j = sum over kept i of (A_ij - beta_i) g_i + sum over all i of beta_i g_i (the masked entries' share)
    dh = tl.load(gsum_ptr + g * F + feats, mask=f_ok, other=0.0)
    for k0 in range(lo, hi, BE):
        ks = k0 + tl.arange(0, BE).to(tl.int64)
        ok = ks < hi
        edge = tl.load(order_ptr + ks, mask=ok, other=0)
        i = tl.load(row_ptr + edge, mask=ok, other=0) - a * N
        place = g * N + i
        s_i = tl.load(s_ptr + gm * ss0 + gh * ss1 + i * ss2, mask=ok, other=0.0).to(tl.float32)
        top = tl.load(top_ptr + place, mask=ok, other=0.0)
        z_i = tl.load(norm_ptr + place, mask=ok, other=1.0)
        d = tl.load(d_ptr + place, mask=ok, other=0.0)
        beta = tl.load(beta_ptr + place, mask=ok, other=0.0)
        z, factor = _scores(s_i, t_j, ok, slope)
        p = tl.exp(z - top) / z_i  # A_ij (0 outside the tile's edges)
        go = tl.load(grad_ptr + gm * sg0 + gh * sg1 + i[:, None] * sg2 + feats[None, :] * sg3,
                     mask=ok[:, None] & f_ok[None, :], other=0.0).to(tl.float32)
        dp = tl.sum(go * hj[None, :], 1)
        dt += tl.sum(p * (dp - d) * factor, 0)
        dh += tl.sum(tl.where(ok, p - beta, 0.0)[:, None] * go, 0)
    place = g * M + j
    tl.store(dt_ptr + place, dt.to(dt_ptr.dtype.element_ty))
    tl.store(dh_ptr + place * F + feats, dh.to(dh_ptr.dtype.element_ty), mask=f_ok)
