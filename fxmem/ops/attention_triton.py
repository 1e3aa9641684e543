"""Triton kernels for the fused GAT attention (:mod:`fxmem.ops.attention`) on CUDA.

The same math as the PyTorch kernel (see its module doc), as real fused GPU kernels: nothing
N x M is ever in memory, not even one block of it - every score tile lives in registers.

* forward: one program per (group, block of rows); an online softmax over blocks of columns
  (FlashAttention's running maximum and sum), writing ``out`` and ``top`` (each row's largest
  masked score, which the backward reads).
* backward, without atomics (deterministic):

  1. a row kernel, one program per (group, block of rows), one pass over the columns: with
     ``top`` as the row maximum it sums ``l_i = sum_j exp(z_ij - top_i)`` and, from the same tiles,
     ``D_i = sum_j P_ij dP_ij`` and ``ds_i = sum_j dE_ij``. ``dE = P (dP - D) lambda`` (lambda:
     LeakyReLU's factor, 0 where a score was replaced) needs ``D`` before it is known, so the pass
     keeps ``u = sum p dP``, ``v = sum p dP lambda`` and ``w = sum p lambda`` of the unnormalised
     ``p`` instead: ``ds = v / l - (u / l)(w / l)``. ``l`` and ``D`` go to a float32 [2, G, N]
     buffer, the only scratch.
  2. a column kernel, one program per (group, block of columns), recomputing the scores of every
     row block with those statistics: ``dh_j = sum_i P_ij g_i`` and ``dt_j = sum_i dE_ij``.
  3. only for an additive mask's gradient (``need_adj``): one program per (mask group, block of
     rows) summing ``P (dP - D)`` over the groups that share the mask, column block by column
     block (the sum over heads is inside one program, so again no atomics).

Scores, softmax and sums are computed in float32 whatever the operands' dtype; products use
``tl.dot`` on the operands' dtype (float32: IEEE, not TF32) with float32 accumulation. float64
operands stay on the PyTorch kernel (:func:`handles`). Tensors are read through their strides
(the wrapper makes no contiguous copies) with 64-bit offsets.

What the wrappers allocate, in bytes (:mod:`fxmem.kernels.fused` states it as the CUDA rule):
the forward its two outputs only; the backward its four outputs, then the 8·G·N-byte statistics
buffer, freed on return. The Triton kernels themselves allocate nothing (no workspace, no TMA
descriptors; compiled for sm_90 and sm_80 they need no global scratch, as
``tests/kernels/test_triton_attention.py`` checks): every byte is a torch allocation made here.

CUDA calls take them only with ``FXMEM_TRITON_ATTENTION=1`` (:func:`enabled`) until a GPU has checked
them; ``tests/gpu/test_gpu_kernels.py`` compares them with the PyTorch kernel on CUDA tensors, and
``FXMEM_TRITON_ATTENTION=1 python benchmarks/gat.py --device cuda`` times them.

The jitted kernels are made on first use (:func:`_kernels`), not at import: importing fxmem does
not import Triton, and ``TRITON_INTERPRET=1`` set before the first call runs the kernels on CPU
tensors (Triton's interpreter; the tests check them that way).

>>> out, top = masked_attention_forward(s, t, h, adj, "gt", 0.0, True, -9e15, 0.2)  # doctest: +SKIP
>>> ds, dt, dh, dadj = masked_attention_backward(torch.ones_like(out), s, t, h, adj, top, "gt", 0.0, True,
...                                              -9e15, 0.2, False)  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import importlib.util
import os
import struct
import types
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the kernels' source names it; imported for real in _kernels()
    import triton.language as tl

# rows x columns of one score tile: 32 x 32 keeps a tile and the [32, F] operand blocks in registers
# for F up to 128 at 4 warps; tl.dot needs every dim >= 16. Not tuned: no GPU was at hand for timings.
BLOCK_ROWS = 32
BLOCK_COLS = 32
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # float64 stays on the PyTorch kernel
# the mask forms, as the kernels' compile-time switch
_CODES = {"gt": 0, "ge": 1, "lt": 2, "le": 3, "eq": 4, "ne": 5, "true": 6, "add": 7}
_registered = False


def available() -> bool:
    """Whether the kernels can run: a CUDA build of torch with Triton installed (not imported here)."""
    return torch.version.cuda is not None and importlib.util.find_spec("triton") is not None


def registered() -> bool:
    """Whether :func:`register` put the kernels on the ops' ``cuda`` key in this process."""
    return _registered


def handles(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, adj: torch.Tensor, threshold: float,
            grad: torch.Tensor | None = None) -> bool:
    """Whether the kernels take a call with these operands (fake ones too: dtypes only): scores,
    features (and the gradient) of one dtype among :data:`DTYPES`, and a float64 ``adj`` only with a
    threshold that float32 holds exactly (the kernels get it as a float32 number)."""
    dtype = s.dtype
    if dtype not in DTYPES or t.dtype != dtype or h.dtype != dtype or (grad is not None and grad.dtype != dtype):
        return False
    return adj.dtype != torch.float64 or _round(threshold, torch.float32) == threshold


def enabled() -> bool:
    """Whether CUDA calls take the kernels now: opted in with ``FXMEM_TRITON_ATTENTION=1``. Off by
    default until they are checked on a GPU (their results and speed on the interpreter and their
    sm_90 compilation are checked here; fxmem.optimize's verification runs in float64, which they do
    not take, so it would not see a kernel that is wrong on a GPU). Read at each call: the memory
    rule and the kernel read the same switch."""
    return os.environ.get("FXMEM_TRITON_ATTENTION", "0") == "1"


def register(forward_op: Any, backward_op: Any, plain_forward: Any, plain_backward: Any) -> bool:
    """Put the kernels on the ``cuda`` key of ``fxmem::masked_attention`` and its backward, where
    :func:`available`; calls they do not take (not :func:`enabled`, or not :func:`handles`) run
    ``plain_forward`` / ``plain_backward``, the PyTorch bodies the ops were made from. Returns
    whether it registered (a CPU build, or no Triton: nothing changes)."""
    global _registered
    if _registered or not available():
        return _registered

    @forward_op.register_kernel("cuda")
    def _forward(s, t, h, adj, compare, threshold, keep, fill, slope, block_bytes):
        if not (enabled() and handles(s, t, h, adj, threshold)):
            return plain_forward(s, t, h, adj, compare, threshold, keep, fill, slope, block_bytes)
        return masked_attention_forward(s, t, h, adj, compare, threshold, keep, fill, slope)

    @backward_op.register_kernel("cuda")
    def _backward(grad, s, t, h, adj, top, compare, threshold, keep, fill, slope, block_bytes, need_adj=False):
        if not (enabled() and handles(s, t, h, adj, threshold, grad)):
            return plain_backward(grad, s, t, h, adj, top, compare, threshold, keep, fill, slope, block_bytes,
                                  need_adj)
        return masked_attention_backward(grad, s, t, h, adj, top, compare, threshold, keep, fill, slope, need_adj)

    _registered = True
    return True


def masked_attention_forward(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, adj: torch.Tensor, compare: str,
                             threshold: float, keep: bool, fill: float, slope: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, top)`` of ``fxmem::masked_attention``: [Gm, Gh, N, F] and [Gm, Gh, N, 1], allocated
    here on the operands' device (nothing else is), then one kernel launch."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    out = s.new_empty(gm, gh, n, f)
    top = s.new_empty(gm, gh, n, 1)
    k = _kernels()
    _launch(k["forward"], (gm * gh, _blocks(n, BLOCK_ROWS)),
            s, t, h, adj, out, top, n, m, f, gh, *s.stride(), *t.stride(), *h.stride(), *_adj_strides(adj),
            *_numbers(adj, threshold, fill, slope), **_meta(s, f, compare, keep))
    return out, top


def masked_attention_backward(grad: torch.Tensor, s: torch.Tensor, t: torch.Tensor, h: torch.Tensor,
                              adj: torch.Tensor, top: torch.Tensor, compare: str, threshold: float, keep: bool,
                              fill: float, slope: float, need_adj: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ds, dt, dh, dadj)`` of ``fxmem::masked_attention_backward`` (``dadj`` empty unless
    ``need_adj``). Allocates the four outputs, then the row statistics (float32 [2, G, N]: 8·G·N
    bytes), freed on return; the kernels allocate nothing."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    g = gm * gh
    ds = s.new_empty(gm, gh, n)
    dt = t.new_empty(gm, gh, m)
    dh = h.new_empty(gm, gh, m, f)
    dadj = adj.new_empty(adj.shape) if need_adj else adj.new_empty(0)
    stats = torch.empty(2, g, n, dtype=torch.float32, device=s.device)  # l_i and D_i of every row
    k = _kernels()
    common = (n, m, f, gh, *s.stride(), *t.stride(), *h.stride(), *_adj_strides(adj), *grad.stride(),
              *top.stride()[:3])
    options = _numbers(adj, threshold, fill, slope)
    meta = _meta(s, f, compare, keep)
    operands = (s, t, h, adj, grad, top, stats[0], stats[1])  # the planes are views: nothing allocated
    _launch(k["rows"], (g, _blocks(n, BLOCK_ROWS)), *operands, ds, *common, *options, **meta)
    _launch(k["columns"], (g, _blocks(m, BLOCK_COLS)), *operands, dt, dh, *common, *options, **meta)
    if need_adj:  # one program per mask and block of rows, summing the g // Am groups that share the mask
        am = adj.shape[0]
        _launch(k["adj"], (am, _blocks(n, BLOCK_ROWS)), *operands, dadj, *common, g // am, *options, **meta)
    del stats
    return ds, dt, dh, dadj


# --- launching -----------------------------------------------------------------------------------------

def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def _launch(kernel: Any, grid: tuple, *args: Any, **meta: Any) -> None:
    """One launch (none for an empty grid: Triton refuses a zero-sized one, and there is nothing to do)."""
    if all(grid):
        kernel[grid](*args, **meta)


def _adj_strides(adj: torch.Tensor) -> tuple:
    """adj's strides, its first one 0 where one mask [1, N, M] serves every group (Am = 1)."""
    return (0 if adj.shape[0] == 1 else adj.stride(0), adj.stride(1), adj.stride(2))


def _numbers(adj: torch.Tensor, threshold: float, fill: float, slope: float) -> tuple:
    """The runtime numbers: the threshold as ``adj <compare> threshold`` compares it in PyTorch (cast to a
    floating adj's dtype), fill, slope."""
    level = adj.dtype if adj.dtype.is_floating_point and adj.dtype != torch.float64 else torch.float32
    return _round(float(threshold), level), float(fill), float(slope)


def _meta(s: torch.Tensor, f: int, compare: str, keep: bool) -> dict:
    """The compile-time switches: the mask's form, tile sizes (F padded to a power of two >= 16 for
    tl.dot) and the products' precision (IEEE float32: TF32 would miss the PyTorch kernel's results
    by ~1e-3)."""
    if compare not in _CODES:
        raise ValueError(f"compare={compare!r}: use one of {tuple(_CODES)}")
    width = max(16, 1 << max(0, int(f) - 1).bit_length())
    return {"COMPARE": _CODES[compare], "KEEP": bool(keep), "BN": BLOCK_ROWS, "BM": BLOCK_COLS, "BF": width,
            "PRECISION": "ieee" if s.dtype == torch.float32 else "tf32"}


def _round(x: float, dtype: torch.dtype) -> float:
    """``x`` as ``dtype`` holds it (round to nearest even; beyond the range: infinity), with no tensor made."""
    if dtype == torch.float16:
        try:
            return struct.unpack("e", struct.pack("e", x))[0]
        except OverflowError:
            return x * float("inf")
    try:
        single = struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return x * float("inf")
    if dtype != torch.bfloat16 or single != single or abs(single) == float("inf"):
        return single
    bits = struct.unpack("I", struct.pack("f", single))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # keep the top 16 bits, ties to even
    return struct.unpack("f", struct.pack("I", bits))[0]


# --- the kernels: plain functions here, jitted on first use ---------------------------------------------
# Each is jitted as a copy whose globals are a namespace of their own holding triton.language and the
# other jitted kernels (the names they call): importing this module imports no Triton, and Triton's
# interpreter (which runs a kernel's source again in its function's globals) finds what it needs.

@functools.cache
def _kernels() -> dict[str, Any]:
    """The jitted kernels by name, made once (Triton imported here, TRITON_INTERPRET read here)."""
    import triton
    import triton.language as tl

    scope: dict[str, Any] = {"tl": tl}
    for fn in (_masked, _weights, _h_block, _row_block, _forward_kernel, _backward_rows, _backward_columns,
               _backward_adj):
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
        copy.__annotations__, copy.__qualname__, copy.__doc__ = dict(fn.__annotations__), fn.__qualname__, fn.__doc__
        copy.__module__ = fn.__module__
        scope[fn.__name__] = triton.jit(copy)
    return {"forward": scope["_forward_kernel"], "rows": scope["_backward_rows"],
            "columns": scope["_backward_columns"], "adj": scope["_backward_adj"]}


def _masked(raw, a, valid, threshold, fill, slope, COMPARE: tl.constexpr, KEEP: tl.constexpr):
    """A tile's masked scores (-inf outside the matrix) and lambda: LeakyReLU's factor where the
    score is kept, 0 where it was replaced by fill."""
    z = tl.where(raw > 0, raw, raw * slope)
    factor = tl.where(raw > 0, 1.0, slope)
    if COMPARE == 7:  # an additive mask
        z = z + a.to(tl.float32)
    else:
        if COMPARE == 0:
            hit = a > threshold
        elif COMPARE == 1:
            hit = a >= threshold
        elif COMPARE == 2:
            hit = a < threshold
        elif COMPARE == 3:
            hit = a <= threshold
        elif COMPARE == 4:
            hit = a == threshold
        elif COMPARE == 5:
            hit = a != threshold
        else:  # a bool adj itself
            hit = a != 0
        # kept as PyTorch's not(comparison) keeps them: a NaN adj entry is replaced where the
        # comparison says what stays, kept where it says what goes
        kept = hit if KEEP else hit == 0
        z = tl.where(kept, z, fill)
        factor = tl.where(kept, factor, 0.0)
    factor = tl.where(valid, factor, 0.0)
    return tl.where(valid, z, float("-inf")), factor


def _forward_kernel(s_ptr, t_ptr, h_ptr, adj_ptr, out_ptr, top_ptr, N, M, F, GH,
            ss0, ss1, ss2, st0, st1, st2, sh0, sh1, sh2, sh3, sa0, sa1, sa2,
            threshold, fill, slope, COMPARE: tl.constexpr, KEEP: tl.constexpr, PRECISION: tl.constexpr,
            BN: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    gm, gh = g // GH, g % GH
    rows = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    row_ok = rows < N
    feats = tl.arange(0, BF)
    f_ok = feats < F
    s_i = tl.load(s_ptr + gm * ss0 + gh * ss1 + rows * ss2, mask=row_ok, other=0.0).to(tl.float32)
    run_max = tl.full([BN], float("-inf"), tl.float32)
    run_sum = tl.zeros([BN], tl.float32)
    acc = tl.zeros([BN, BF], tl.float32)
    for c0 in range(0, M, BM):
        cols = c0 + tl.arange(0, BM).to(tl.int64)
        col_ok = cols < M
        t_j = tl.load(t_ptr + gm * st0 + gh * st1 + cols * st2, mask=col_ok, other=0.0).to(tl.float32)
        valid = row_ok[:, None] & col_ok[None, :]
        a = tl.load(adj_ptr + gm * sa0 + rows[:, None] * sa1 + cols[None, :] * sa2, mask=valid, other=0)
        z, _ = _masked(s_i[:, None] + t_j[None, :], a, valid, threshold, fill, slope, COMPARE, KEEP)
        new_max = tl.maximum(run_max, tl.max(z, 1))
        # a row that is -inf so far (an additive mask): exponents against 0, not -inf - -inf = NaN
        base = tl.where(new_max == float("-inf"), 0.0, new_max)
        scale = tl.exp(run_max - base)
        p = tl.exp(z - base[:, None])
        run_sum = run_sum * scale + tl.sum(p, 1)
        hv = tl.load(h_ptr + gm * sh0 + gh * sh1 + cols[:, None] * sh2 + feats[None, :] * sh3,
                     mask=col_ok[:, None] & f_ok[None, :], other=0.0)
        acc = tl.dot(p.to(hv.dtype), hv, acc * scale[:, None], input_precision=PRECISION)
        run_max = new_max
    # a row that is -inf throughout: 0 / 0, NaN, as torch.softmax gives (rows past N: no 0 / 0)
    out = acc / tl.where(row_ok, run_sum, 1.0)[:, None]
    place = g * N + rows
    tl.store(out_ptr + place[:, None] * F + feats[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & f_ok[None, :])
    tl.store(top_ptr + place, run_max.to(top_ptr.dtype.element_ty), mask=row_ok)


def _weights(s_i, top_i, t_ptr, adj_ptr, gm, gh, rows, row_ok, cols, col_ok, st0, st1, st2, sa0, sa1, sa2,
            threshold, fill, slope, COMPARE: tl.constexpr, KEEP: tl.constexpr):
    """The backward's scores again: unnormalised weights exp(z - top) of a tile, and lambda."""
    t_j = tl.load(t_ptr + gm * st0 + gh * st1 + cols * st2, mask=col_ok, other=0.0).to(tl.float32)
    valid = row_ok[:, None] & col_ok[None, :]
    a = tl.load(adj_ptr + gm * sa0 + rows[:, None] * sa1 + cols[None, :] * sa2, mask=valid, other=0)
    z, factor = _masked(s_i[:, None] + t_j[None, :], a, valid, threshold, fill, slope, COMPARE, KEEP)
    return tl.exp(z - top_i[:, None]), factor


def _h_block(h_ptr, gm, gh, cols, col_ok, F, sh0, sh1, sh2, sh3, BF: tl.constexpr):
    feats = tl.arange(0, BF)
    return tl.load(h_ptr + gm * sh0 + gh * sh1 + cols[:, None] * sh2 + feats[None, :] * sh3,
                   mask=col_ok[:, None] & (feats < F)[None, :], other=0.0)


def _row_block(s_ptr, grad_ptr, top_ptr, gm, gh, rows, row_ok, F, ss0, ss1, ss2, sg0, sg1, sg2, sg3,
              sm0, sm1, sm2, BF: tl.constexpr):
    """A block of rows' s_i, top_i (0 for a row that is -inf throughout: no -inf - -inf) and gradient."""
    feats = tl.arange(0, BF)
    s_i = tl.load(s_ptr + gm * ss0 + gh * ss1 + rows * ss2, mask=row_ok, other=0.0).to(tl.float32)
    top_i = tl.load(top_ptr + gm * sm0 + gh * sm1 + rows * sm2, mask=row_ok, other=0.0).to(tl.float32)
    top_i = tl.where(top_i == float("-inf"), 0.0, top_i)
    go = tl.load(grad_ptr + gm * sg0 + gh * sg1 + rows[:, None] * sg2 + feats[None, :] * sg3,
                 mask=row_ok[:, None] & (feats < F)[None, :], other=0.0)
    return s_i, top_i, go


def _backward_rows(s_ptr, t_ptr, h_ptr, adj_ptr, grad_ptr, top_ptr, sum_ptr, d_ptr, ds_ptr, N, M, F, GH,
                  ss0, ss1, ss2, st0, st1, st2, sh0, sh1, sh2, sh3, sa0, sa1, sa2, sg0, sg1, sg2, sg3,
                  sm0, sm1, sm2, threshold, fill, slope, COMPARE: tl.constexpr, KEEP: tl.constexpr,
                  PRECISION: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    gm, gh = g // GH, g % GH
    rows = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    row_ok = rows < N
    s_i, top_i, go = _row_block(s_ptr, grad_ptr, top_ptr, gm, gh, rows, row_ok, F, ss0, ss1, ss2,
                               sg0, sg1, sg2, sg3, sm0, sm1, sm2, BF)
    total = tl.zeros([BN], tl.float32)  # l = sum p
    u = tl.zeros([BN], tl.float32)  # sum p dP
    v = tl.zeros([BN], tl.float32)  # sum p dP lambda
    w = tl.zeros([BN], tl.float32)  # sum p lambda
    for c0 in range(0, M, BM):
        cols = c0 + tl.arange(0, BM).to(tl.int64)
        col_ok = cols < M
        p, factor = _weights(s_i, top_i, t_ptr, adj_ptr, gm, gh, rows, row_ok, cols, col_ok, st0, st1, st2,
                            sa0, sa1, sa2, threshold, fill, slope, COMPARE, KEEP)
        hv = _h_block(h_ptr, gm, gh, cols, col_ok, F, sh0, sh1, sh2, sh3, BF)
        dp = tl.dot(go, tl.trans(hv), input_precision=PRECISION)
        total += tl.sum(p, 1)
        u += tl.sum(p * dp, 1)
        v += tl.sum(p * dp * factor, 1)
        w += tl.sum(p * factor, 1)
    total_ok = tl.where(row_ok, total, 1.0)  # rows past N: no 0 / 0 (a real row's 0 / 0 is NaN, as in torch)
    d = u / total_ok
    place = g * N + rows
    tl.store(sum_ptr + place, total, mask=row_ok)
    tl.store(d_ptr + place, d, mask=row_ok)
    # ds = sum_j P (dP - D) lambda, from the sums of the unnormalised weights
    tl.store(ds_ptr + place, (v / total_ok - d * (w / total_ok)).to(ds_ptr.dtype.element_ty), mask=row_ok)


def _backward_columns(s_ptr, t_ptr, h_ptr, adj_ptr, grad_ptr, top_ptr, sum_ptr, d_ptr, dt_ptr, dh_ptr,
                     N, M, F, GH, ss0, ss1, ss2, st0, st1, st2, sh0, sh1, sh2, sh3, sa0, sa1, sa2,
                     sg0, sg1, sg2, sg3, sm0, sm1, sm2, threshold, fill, slope, COMPARE: tl.constexpr,
                     KEEP: tl.constexpr, PRECISION: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                     BF: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    gm, gh = g // GH, g % GH
    cols = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    col_ok = cols < M
    hv = _h_block(h_ptr, gm, gh, cols, col_ok, F, sh0, sh1, sh2, sh3, BF)
    dh = tl.zeros([BM, BF], tl.float32)
    dt = tl.zeros([BM], tl.float32)
    for r0 in range(0, N, BN):
        rows = r0 + tl.arange(0, BN).to(tl.int64)
        row_ok = rows < N
        s_i, top_i, go = _row_block(s_ptr, grad_ptr, top_ptr, gm, gh, rows, row_ok, F, ss0, ss1, ss2,
                                   sg0, sg1, sg2, sg3, sm0, sm1, sm2, BF)
        total = tl.load(sum_ptr + g * N + rows, mask=row_ok, other=1.0)
        d = tl.load(d_ptr + g * N + rows, mask=row_ok, other=0.0)
        p, factor = _weights(s_i, top_i, t_ptr, adj_ptr, gm, gh, rows, row_ok, cols, col_ok, st0, st1, st2,
                            sa0, sa1, sa2, threshold, fill, slope, COMPARE, KEEP)
        p = p / total[:, None]
        dp = tl.dot(go, tl.trans(hv), input_precision=PRECISION)
        dh = tl.dot(tl.trans(p.to(go.dtype)), go, dh, input_precision=PRECISION)
        dt += tl.sum(p * (dp - d[:, None]) * factor, 0)
    feats = tl.arange(0, BF)
    place = g * M + cols
    tl.store(dt_ptr + place, dt.to(dt_ptr.dtype.element_ty), mask=col_ok)
    tl.store(dh_ptr + place[:, None] * F + feats[None, :], dh.to(dh_ptr.dtype.element_ty),
             mask=col_ok[:, None] & (feats < F)[None, :])


def _backward_adj(s_ptr, t_ptr, h_ptr, adj_ptr, grad_ptr, top_ptr, sum_ptr, d_ptr, dadj_ptr, N, M, F, GH,
                 ss0, ss1, ss2, st0, st1, st2, sh0, sh1, sh2, sh3, sa0, sa1, sa2, sg0, sg1, sg2, sg3,
                 sm0, sm1, sm2, PER, threshold, fill, slope, COMPARE: tl.constexpr, KEEP: tl.constexpr,
                 PRECISION: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
    # one program per (mask, block of rows): the PER groups sharing the mask are summed here, in
    # registers, so no two programs write the same dadj entry
    mask_group = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    row_ok = rows < N
    for c0 in range(0, M, BM):
        cols = c0 + tl.arange(0, BM).to(tl.int64)
        col_ok = cols < M
        acc = tl.zeros([BN, BM], tl.float32)
        for k in range(0, PER):
            g = mask_group * PER + k
            gm, gh = g // GH, g % GH
            s_i, top_i, go = _row_block(s_ptr, grad_ptr, top_ptr, gm, gh, rows, row_ok, F, ss0, ss1, ss2,
                                       sg0, sg1, sg2, sg3, sm0, sm1, sm2, BF)
            total = tl.load(sum_ptr + g * N + rows, mask=row_ok, other=1.0)
            d = tl.load(d_ptr + g * N + rows, mask=row_ok, other=0.0)
            p, _ = _weights(s_i, top_i, t_ptr, adj_ptr, gm, gh, rows, row_ok, cols, col_ok, st0, st1, st2,
                           sa0, sa1, sa2, threshold, fill, slope, COMPARE, KEEP)
            hv = _h_block(h_ptr, gm, gh, cols, col_ok, F, sh0, sh1, sh2, sh3, BF)
            dp = tl.dot(go, tl.trans(hv), input_precision=PRECISION)
            acc += p / total[:, None] * (dp - d[:, None])  # dE before LeakyReLU's factor
        place = (mask_group * N + rows)[:, None] * M + cols[None, :]
        tl.store(dadj_ptr + place, acc.to(dadj_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
