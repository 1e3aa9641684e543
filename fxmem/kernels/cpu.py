"""Hidden allocations of CPU kernels, one small rule per kernel family.

Each rule was read off a real run with the profiler and is re-checked against real runs at several
sizes by ``tests/kernels/test_kernels.py``. Arguments are read by their schema names (checked at import:
a schema change fails loudly here, not silently in a user's numbers).

>>> hidden_rule(torch.ops.aten.repeat.default).why                    # doctest: +SKIP
"The CPU kernel builds int64 index/permutation tensors of length ndim and 2*ndim."
"""
from __future__ import annotations

import math
from typing import Any

import sympy
import torch

from .. import _torch_compat as tc
from .. import data_paths
from .registry import ANY, OUT, Call, Kind, Unknown, hidden, require_args, rule
from .regimes import condition, either, sized, when

aten = torch.ops.aten


@hidden(aten.repeat, device="cpu")
def _repeat_cpu(call: Call) -> list:
    """The CPU kernel builds int64 index/permutation tensors of length ndim and 2*ndim."""
    n = call.outputs[0].dim()
    return [OUT, 8 * n, 8, 8 * n, -8, 16 * n, -8 * n, -8 * n, -16 * n]


# --- CPU flash attention ------------------------------------------------------------------------
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu
require_args(_FLASH.default, "query", "key")
require_args(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "grad_out", "query", "key")


def _flash_splits(q: torch.Tensor, k: torch.Tensor) -> tuple[Any, Any, int]:
    """ATen's CPU flash-attention block sizes for this query/key length (cpu/FlashAttentionKernel.cpp:
    q_split 256 from L = 768 on, 64 from 192, else 32, capped at L; kv_split 512 capped at S), as
    formulas over the lengths (:mod:`~fxmem.kernels.regimes`): every length is one analysis' piece."""
    L, S = q.shape[-2], k.shape[-2]
    qs = when(L >= 768, 256, when(L >= 192, 64, when(L >= 32, 32, L)))
    kvs = when(S >= 512, 512, S)
    acc = 4 if q.dtype in (torch.float32, torch.float16, torch.bfloat16) else q.element_size()
    return sized(qs), sized(kvs), acc


@hidden(_FLASH, device="cpu")
def _sdpa_flash_cpu(call: Call) -> list:
    """cpu_flash_attention: per thread a float (qSplit x kvSplit) score block, its row max and sum,
    and a (qSplit x headSize) accumulator."""
    q, k = call.arg("query"), call.arg("key")
    qs, kvs, acc = _flash_splits(q, k)
    threads = torch.get_num_threads()
    buf = threads * (qs * kvs + 2 * qs + qs * tc.raw_expr(q.shape[-1])) * acc
    reduced = threads * qs * kvs * q.element_size() if q.dtype in (torch.float16, torch.bfloat16) else 0
    return [OUT, buf, reduced, -reduced, -buf] if reduced else [OUT, buf, -buf]


@hidden(aten._scaled_dot_product_flash_attention_for_cpu_backward, device="cpu")
def _sdpa_flash_cpu_backward(call: Call) -> list:
    """grad_out.contiguous() in (B, L, H, D) layout, a per-thread (attn, grad_attn) block buffer, then
    a qSplit-long row sum per worker thread inside the parallel loop (the CPU profiler sees only the
    calling thread's; all of them are real)."""
    grad_out, q, k = call.arg("grad_out"), call.arg("query"), call.arg("key")
    qs, kvs, acc = _flash_splits(q, k)
    threads = torch.get_num_threads()
    copy = 0 if grad_out.transpose(1, 2).is_contiguous() else grad_out.numel() * grad_out.element_size()
    buf = threads * 2 * qs * kvs * acc
    reduced = threads * 2 * qs * kvs * q.element_size() if q.dtype in (torch.float16, torch.bfloat16) else 0
    work = q.shape[0] * q.shape[1]
    workers = sized(when(work < threads, work, threads))
    dsum = workers * qs * acc
    return [OUT, copy, buf, reduced, dsum, -dsum, -reduced, -buf, -copy]


# --- SDPA's math path: softmax that gives 0, not NaN, for rows with every key masked -----------------
# F.scaled_dot_product_attention falls back to its math path on CPU where flash attention does not
# apply (value head size other than q's, not 4-d); its softmax is aten._safe_softmax (torch >= 2.5).
if hasattr(aten, "_safe_softmax"):
    require_args(aten._safe_softmax.default, "self", "dim")

    @hidden(aten._safe_softmax, device="cpu")
    def _safe_softmax_cpu(call: Call) -> list:
        """softmax(self), then ``isneginf(self)`` (bool, one byte per element), ``all`` over dim
        (bool, one per row) and a 0-d zero of the output's dtype; ``where`` writes into the output."""
        x, out = call.arg("self"), call.outputs[0]
        dim = call.arg("dim") % max(x.dim(), 1)
        rows = 1
        for d, size in enumerate(x.shape):
            rows = rows * (size if d != dim else 1)
        zero = out.element_size()
        return [OUT, x.numel(), rows, zero, -zero, -rows, -x.numel()]


# --- contiguous copies inside kernels ------------------------------------------------------------
# Kernels that work on a contiguous copy of some operands (``x.expect_contiguous()`` inside), made
# before or after the op's outputs are allocated. Gradients often arrive expanded (zero strides)
# from a sum or mean; saved inputs are often transposed views.
_CONTIGUOUS_OPERANDS = {
    aten._softmax.default: (("self", "after"),),
    aten._log_softmax.default: (("self", "after"),),
    aten.embedding_dense_backward.default: (("indices", "after"), ("grad_output", "after")),
    aten._softmax_backward_data.default: (("grad_output", "after"),),
    aten._log_softmax_backward_data.default: (("grad_output", "after"),),
    aten.gelu_backward.default: (("grad_output", "after"),),
    aten.native_layer_norm.default: (("input", "before"),),
    # torch >= 2.14 makes group norm's operands contiguous inside the kernels (2.13 did it in the
    # group_norm composite, which fake tensors see as a clone, so the kernel gets them contiguous)
    aten.native_group_norm.default: (("input", "after"),),
}
for _op, _operands in _CONTIGUOUS_OPERANDS.items():
    require_args(_op, *(name for name, _ in _operands))


def copy_bytes(t: Any, fmt: torch.memory_format = torch.contiguous_format) -> Any:
    """Bytes of ``t.contiguous(memory_format=fmt)`` when that copies (0 for a tensor laid out so, or
    a non-tensor)."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous(memory_format=fmt):
        return 0
    return t.numel() * t.element_size()


def transpose_buffer(src: Any) -> Any:
    """Bytes of the block buffer ATen's CPU copy takes to copy a transposed matrix into a contiguous
    one (Copy.cpp, copy_same_type_transpose_): a 2-D source with strides (1, rows) of at least
    60 x 60 elements is copied through a 60 x 60 block of its dtype (120 x 120 for uint8), made and
    freed inside the copy; 0 otherwise."""
    if not isinstance(src, torch.Tensor) or src.dim() != 2 or src.is_complex() or src.dtype.itemsize == 0:
        return 0
    rows = src.shape[0]
    if not (src.stride()[0] == 1 and src.stride()[1] == rows):
        return 0
    block = 120 if src.dtype == torch.uint8 else 60
    return when(src.numel() >= 60 * 60, block * block * src.element_size(), 0)  # a piece on each side


def contiguous_copy(t: Any) -> list:
    """The program of ``t.contiguous()`` inside a kernel: the copy, and the copy's block buffer."""
    copy = copy_bytes(t)
    if isinstance(copy, int) and copy == 0:
        return []
    buf = transpose_buffer(t)
    return [copy, buf, -buf] if not (isinstance(buf, int) and buf == 0) else [copy]


def _nonzero(values: list) -> list:
    return [c for c in values if not (isinstance(c, int) and c == 0)]


@hidden(*_CONTIGUOUS_OPERANDS, device="cpu")
def _contiguous_copies(call: Call) -> list | None:
    """Contiguous copies of strided operands (softmax forward and backward, gelu, layer norm, group norm),
    a transposed matrix's through a block buffer (see transpose_buffer)."""
    before, after, kept = [], [], []
    for name, place in _CONTIGUOUS_OPERANDS[call.func]:
        program = contiguous_copy(call.arg(name))
        if program:
            (before if place == "before" else after).extend(program)
            kept.append(program[0])
    if not before and not after:
        return None
    return [*before, OUT, *after, *[-c for c in reversed(kept)]]


# --- pooling kernels (aten/src/ATen/native/cpu/*Pool*Kernel.cpp; read off real runs) ---------------
# Each works on operands contiguous in one memory format - the input's suggested one (contiguous or
# channels-last), the incoming gradient's, or plain contiguous - and copies, after its outputs, every
# operand that is not (a permuted input, a gradient expanded from a sum), freeing the copies on
# return. ``"out"`` is the op's own output (a backward's grad_input, allocated in the input's format).
# 3-d average pooling and the 3-d adaptive kernels have no channels-last path; the 3-d adaptive
# forwards read any strides.
_POOL_COPIES = {
    aten.max_pool2d_with_indices.default: ("self", ("self",)),
    aten.max_pool3d_with_indices.default: ("self", ("self",)),
    aten.avg_pool2d.default: ("self", ("self",)),
    aten.avg_pool3d.default: (None, ("self",)),
    aten._adaptive_avg_pool2d.default: ("self", ("self",)),
    aten.adaptive_max_pool2d.default: ("self", ("self",)),
    aten.max_pool2d_with_indices_backward.default: ("grad_output", ("grad_output", "indices", "out")),
    aten.max_pool3d_with_indices_backward.default: ("grad_output", ("grad_output", "indices", "out")),
    aten.avg_pool2d_backward.default: ("grad_output", ("grad_output", "out")),
    aten.avg_pool3d_backward.default: (None, ("grad_output",)),
    aten._adaptive_avg_pool2d_backward.default: ("grad_output", ("grad_output", "out")),
    aten._adaptive_avg_pool3d_backward.default: (None, ("grad_output",)),
    aten.adaptive_max_pool2d_backward.default: ("self", ("grad_output", "indices", "out")),
    aten.adaptive_max_pool3d_backward.default: (None, ("grad_output",)),
}
for _op, (_fmt, _operands) in _POOL_COPIES.items():
    require_args(_op, *{n for n in (_fmt, *_operands) if n not in (None, "out")})


@hidden(*_POOL_COPIES, device="cpu")
def _pool_copies(call: Call) -> list | None:
    """A pooling kernel's copies of the operands not laid out in the memory format it works in."""
    source, operands = _POOL_COPIES[call.func]
    fmt = tc.suggest_memory_format(call.arg(source)) if source is not None else torch.contiguous_format
    copies = _nonzero([copy_bytes(call.outputs[0] if name == "out" else call.arg(name), fmt)
                       for name in operands])
    if not copies:
        return None
    return [OUT, *copies, *[-c for c in reversed(copies)]]


require_args(aten.clone.default, "self")
require_args(aten.copy_.default, "self", "src")


@hidden(aten.clone.default, aten.copy_.default, device="cpu")
def _copy_transposed(call: Call) -> list | None:
    """A copy of a transposed matrix into a contiguous one goes through a block buffer (see transpose_buffer)."""
    src = call.arg("src") if call.func is aten.copy_.default else call.arg("self")
    out = call.outputs[0] if call.outputs else None
    if not isinstance(out, torch.Tensor) or not out.is_contiguous() or out.dtype != src.dtype \
            or tuple(out.shape) != tuple(src.shape):
        return None
    buf = transpose_buffer(src)
    return None if isinstance(buf, int) and buf == 0 else [OUT, buf, -buf]


def _blas_copy(m: torch.Tensor) -> Any:
    # ATen's gemm takes a matrix as is when one of its last two strides is 1 and the other a valid
    # leading dimension; anything else (an expanded gradient with zero strides) is copied first.
    if m.dim() < 2:
        return 0
    rows, cols = m.shape[-2], m.shape[-1]
    s_row, s_col = m.stride()[-2], m.stride()[-1]
    one = 1
    if (s_col == 1 and s_row >= (cols if cols > one else one)) or (s_row == 1 and s_col >= (rows if rows > one else one)):
        return 0
    return m.numel() * m.element_size()


require_args(aten.mm.default, "self", "mat2")
require_args(aten.bmm.default, "self", "mat2")


_HALF = (torch.float16, torch.bfloat16)


def _half_gemm(call: Call) -> Unknown | None:
    # measured on torch 2.13 CPU: a bf16/fp16 (21x64)@(64x192) mm allocates 29,696 B beyond its
    # output, (40x64)@(64x192) 9,216 B - oneDNN's packing, not a formula in the sizes
    if any(isinstance(t, torch.Tensor) and t.dtype in _HALF for t in call.tensors):
        return Unknown(call.op, "half-precision matrix products on CPU use oneDNN scratch (float32 accumulation, "
                                "packed operands) that depends on its blocking; the peak may be higher")
    return None


@hidden(aten.addmm, aten.baddbmm, device="cpu")
def _half_addmm(call: Call) -> Unknown | None:
    """addmm/baddbmm in half precision: oneDNN scratch fxmem cannot predict (float32 needs none)."""
    return _half_gemm(call)


@hidden(aten.mm, device="cpu")
def _mm_copies(call: Call) -> list | Unknown | None:
    """gemm copies an operand BLAS cannot take (neither of its last two strides is 1)."""
    half = _half_gemm(call)
    if half is not None:
        return half
    copies = _nonzero([_blas_copy(call.arg("self")), _blas_copy(call.arg("mat2"))])
    return [OUT, *copies, *[-c for c in reversed(copies)]] if copies else None


def _item_gemm_ready(t: torch.Tensor) -> bool:
    # bmm's batch_items_contiguous_or_transposed (a size-1 dim's stride does not matter)
    size, stride = t.shape, t.stride()
    return bool((stride[2] == 1 and (size[1] == 1 or stride[1] >= size[2]))
                or (stride[1] == 1 and (size[2] == 1 or stride[2] >= size[1])))


@hidden(aten.bmm, device="cpu")
def _bmm_copies(call: Call) -> list | Unknown | None:
    """bmm_out_or_baddbmm_: a strided loop for small items, batched GEMM when both operands' items are
    GEMM-ready (and the result contiguous), else one mm per item, copying one item at a time."""
    half = _half_gemm(call)
    if half is not None:
        return half
    a, b, out = call.arg("self"), call.arg("mat2"), call.outputs[0]
    if a.shape[2] * a.shape[1] * b.shape[2] < 400:
        return None
    if a.is_floating_point() and _item_gemm_ready(a) and _item_gemm_ready(b) and out.is_contiguous():
        return None
    copies = _nonzero([_blas_copy(a[0]), _blas_copy(b[0])])
    return [OUT, *copies, *[-c for c in reversed(copies)]] if copies else None


require_args(aten._euclidean_dist.default, "x1", "x2")


def _rows_bytes(t: torch.Tensor, width: Any) -> Any:
    """Bytes of a ``t.shape[:-1] + (width,)`` tensor of ``t``'s dtype (sizes may be symbolic)."""
    return math.prod(t.shape[:-1]) * width * t.element_size()


@hidden(aten._euclidean_dist.default, device=ANY)
def _euclidean_dist_parts(call: Call) -> list | Unknown:
    """``torch.cdist``'s matrix-product path (p=2 with more than 25 rows on a side, or
    ``compute_mode='use_mm_for_euclid_dist'``) is ATen's composite ``_euclidean_dist``, one op to
    the simulation: per side, ``x.pow(2)`` summed to a norm column and a column of ones; ``x1 * -2``
    (an int64 wrapped -2 cast to the dtype); the two sides concatenated to ``(rows, K + 2)``, freed
    with their parts after the product, whose result is the output (in-place clamp and sqrt)."""
    x1, x2 = call.arg("x1"), call.arg("x2")
    if call.device != "cpu":  # the same parts through the caching allocator, and cuBLAS: not read on a GPU
        return Unknown(call.op, "cdist's matrix-product path (more than 25 rows) allocates intermediates whose sizes "
                                "on a GPU have not been read off a real run")
    half = _half_gemm(call)
    if half is not None:
        return half
    k = x1.shape[-1]
    prog: list = []
    for x in (x1, x2):  # pow(2) then sum(-1, keepdim) (the square freed), then ones_like
        square, column = _rows_bytes(x, k), _rows_bytes(x, 1)
        prog += [square, column, -square, column]
    column1, column2, f1 = _rows_bytes(x1, 1), _rows_bytes(x2, 1), x1.element_size()
    scaled, cat1, cat2 = _rows_bytes(x1, k), _rows_bytes(x1, k + 2), _rows_bytes(x2, k + 2)
    prog += [8, f1, scaled, -f1, -8, cat1, -column1, -column1, -scaled, cat2, -column2, -column2]
    return [*prog, OUT, -cat2, -cat1]


require_args(aten._cdist_forward.default, "x1", "x2")
# its first argument, the incoming gradient, is "grad" in torch 2.13 and "grad_output" in 2.14
_CDIST_GRAD = "grad_output" if "grad_output" in tc.argument_names(aten._cdist_backward.default) else "grad"
require_args(aten._cdist_backward.default, _CDIST_GRAD, "x1", "x2", "cdist")


def _contiguous_copy(t: torch.Tensor, shape: tuple) -> Any:
    """Bytes of ``t.expand(shape).contiguous()``'s copy: none where that view is contiguous already
    (a ``Piecewise`` where that depends on the sizes: a dim of size 1 may have any stride)."""
    strides = [0] * (len(shape) - t.dim()) + [s if n == m else 0 for s, n, m in
                                              zip(t.stride(), t.shape, shape[len(shape) - t.dim():])]
    ok, expected = [], 1
    for n, s in zip(reversed(shape), reversed(strides)):
        ok.append(sympy.Or(condition(n == 1), condition(s == expected)))
        expected = expected * n
    return when(sympy.And(*ok), 0, math.prod(shape) * t.element_size())


def _cdist_batch(x1: torch.Tensor, x2: torch.Tensor) -> tuple:
    return tuple(torch.broadcast_shapes(tuple(x1.shape[:-2]), tuple(x2.shape[:-2])))


@hidden(aten._cdist_forward.default, device="cpu")
def _cdist_forward_copies(call: Call) -> list | None:
    """cdist's direct path (p other than 2, or at most 25 rows a side): ATen's ``cdist_impl`` makes
    each operand, expanded to the common batch, contiguous before the result (a transposed or
    strided operand, a batch broadcast from 1), and frees the copies after the kernel."""
    x1, x2 = call.arg("x1"), call.arg("x2")
    batch = _cdist_batch(x1, x2)
    copies = [_contiguous_copy(x1, (*batch, *x1.shape[-2:])), _contiguous_copy(x2, (*batch, *x2.shape[-2:]))]
    return [*copies, OUT, *[-c for c in reversed(copies)]]


@hidden(aten._cdist_backward.default, device="cpu")
def _cdist_backward_copies(call: Call) -> list | None:
    """The direct path's backward: contiguous copies of both operands (expanded to the common batch),
    of the forward's result and of the incoming gradient where they are not, before its output."""
    x1, x2, res, grad = call.arg("x1"), call.arg("x2"), call.arg("cdist"), call.arg(_CDIST_GRAD)
    batch = _cdist_batch(x1, x2)
    copies = [_contiguous_copy(x1, (*batch, *x1.shape[-2:])), _contiguous_copy(x2, (*batch, *x2.shape[-2:])),
              _contiguous_copy(res, tuple(res.shape)), _contiguous_copy(grad, tuple(grad.shape))]
    return [*copies, OUT, *[-c for c in reversed(copies)]]


# --- normalisation and losses --------------------------------------------------------------------
require_args(aten.native_layer_norm_backward.default, "grad_out", "input", "output_mask")


@hidden(aten.native_layer_norm_backward, device="cpu")
def _layer_norm_backward_cpu(call: Call) -> list:
    """A contiguous copy of a strided input (before the outputs), then in the kernel a contiguous copy
    of a strided gradient and, when dgamma or dbeta is wanted, a (2, threads, N) buffer of per-thread
    partial sums (LayerNormBackwardKernelImplInternal's two-pass reduction)."""
    x, grad = call.arg("input"), call.arg("grad_out")
    mask = call.arg("output_mask") or [True, True, True]
    x_copy, dy_copy = contiguous_copy(x), contiguous_copy(grad)  # a transposed one through a block buffer
    buf = 0
    if mask[1] or mask[2]:
        n = call.outputs[-1].numel()  # dgamma/dbeta: normalized_shape's elements
        buf = 2 * torch.get_num_threads() * n * x.element_size()
    inner = _nonzero([*dy_copy[:1], buf])
    before = x_copy[:1]
    return [*x_copy, OUT, *dy_copy, *_nonzero([buf]), *[-c for c in reversed(inner)], *[-c for c in reversed(before)]]


require_args(aten.native_group_norm_backward.default, "grad_out", "input")


@hidden(aten.native_group_norm_backward, device="cpu")
def _group_norm_backward_cpu(call: Call) -> list:
    """Contiguous copies of a strided gradient and input (torch >= 2.14 makes them in here), then
    GroupNormBackwardKernelImpl's per-(sample, channel) ds and db buffers (accumulate type)."""
    grad, x = call.arg("grad_out"), call.arg("input")
    copies = _nonzero([copy_bytes(grad), copy_bytes(x)])
    n, c = x.shape[0], x.shape[1]
    acc = 4 if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else x.element_size()
    ds = n * c * acc
    return [*copies, OUT, ds, ds, -ds, -ds, *[-k for k in reversed(copies)]]


_POINTWISE_LOSSES = (aten.mse_loss, aten.smooth_l1_loss)
for _loss in _POINTWISE_LOSSES:
    require_args(_loss.default, "self", "reduction")


@hidden(*_POINTWISE_LOSSES, device="cpu")
def _pointwise_loss_cpu(call: Call) -> list | None:
    """The elementwise loss, then a result allocated input-sized and reduced in place (the 0-dim
    output keeps that input-sized storage: see the OUTPUT_STORAGE rule below)."""
    reduction = call.arg("reduction", 1)
    if reduction == 0:  # 'none'
        return None
    x = call.arg("self")
    size = x.numel() * x.element_size()
    tail = [8, x.element_size(), -x.element_size(), -8] if reduction == 1 else []  # mean divides by numel
    return [size, OUT, *tail, -size]


require_args(aten.native_layer_norm.default, "input", "weight")


@rule(Kind.OUTPUT_STORAGE, aten.native_layer_norm, device="cpu")
def _mixed_layer_norm_stats(call: Call) -> dict:
    """A half-precision input with float32 weights (LayerNorm under torch.autocast): the CPU kernel
    keeps mean and rstd in float32, the meta kernel in the input's dtype (measured: 84 B, not 42 B,
    per 21 rows on torch 2.13)."""
    x, w = call.arg("input"), call.arg("weight")
    if x.dtype in _HALF and isinstance(w, torch.Tensor) and w.dtype == torch.float32:
        return {i: call.outputs[i].numel() * 4 for i in (1, 2)}
    return {}


@rule(Kind.OUTPUT_STORAGE, *_POINTWISE_LOSSES, device="cpu")
def _pointwise_loss_storage(call: Call) -> dict:
    """A reduced mse/smooth-L1 loss is a 0-dim view of an input-sized storage."""
    if call.arg("reduction", 1) == 0:
        return {}
    x = call.arg("self")
    return {0: x.numel() * x.element_size()}


_MASKED_BACKWARDS = tuple(op for op in (aten.native_batch_norm_backward.default,
                                        getattr(getattr(aten, "batch_norm_backward", None), "default", None)) if op)
for _op in _MASKED_BACKWARDS:
    require_args(_op, "output_mask")


@rule(Kind.OUTPUT_STORAGE, *_MASKED_BACKWARDS, device=ANY)
def _masked_outputs(call: Call) -> dict:
    """Batch norm's backward allocates only the gradients its output_mask asks for (an input that
    needs no gradient gets none); its fake kernel allocates all three."""
    mask = call.arg("output_mask") or [True, True, True]
    return {i: 0 for i, wanted in enumerate(mask) if not wanted and i < len(call.outputs)}


# --- complex to real --------------------------------------------------------------------------------
@hidden(aten.abs.default, device="cpu")
def _abs_complex_cpu(call: Call) -> list | None:
    """abs of a complex tensor (unary_op_impl_with_complex_to_float): the real result first, then the
    op runs complex to complex into a temporary of the input's size, copied out and freed."""
    x = call.arg("self")
    if not x.is_complex():
        return None
    tmp = x.numel() * x.element_size()
    return [OUT, tmp, -tmp]


@rule(Kind.OUTPUT_LAYOUT, aten.native_layer_norm_backward.default, device="cpu")
def _layer_norm_backward_layout(call: Call) -> dict:
    """grad_input is allocated like the contiguous copy of the input the kernel works on (the fake
    kernel follows the strided input)."""
    mask = call.arg("output_mask") or [True, True, True]
    return {0: torch.contiguous_format} if mask[0] else {}


# --- boolean-mask indexing (x[mask]) ------------------------------------------------------------
require_args(aten.index.Tensor, "self", "indices")


@hidden(aten.index.Tensor, device="cpu")
def _index_bool_mask_cpu(call: Call) -> list:
    """``x[mask]``: the kernel turns the mask into int64 indices (``mask.nonzero()``, K x mask.dim())
    before it allocates the output, and frees them after (K: the output's size where the mask sits)."""
    indices = list(call.arg("indices") or [])
    masks = [k for k, i in enumerate(indices) if i is not None and i.dtype in (torch.bool, torch.uint8)]
    if not masks:
        return []
    if len(masks) > 1 or any(i is not None for k, i in enumerate(indices) if k != masks[0]):
        return [OUT, Unknown("aten.index", "a boolean mask mixed with other indices: int64 index buffers not modelled")]
    mask = indices[masks[0]]
    nbytes = 8 * call.outputs[0].shape[masks[0]] * mask.dim()
    return [nbytes, OUT, -nbytes]


# --- sorting and selection (aten/src/ATen/native/Sorting.cpp, cpu/SortingKernel.cpp) ---------------
# Only allocations through ATen's allocator count: the kernels' std::vector buffers (x86-simd-sort's
# strided rows, fbgemm's radix sort, topk's and mode's per-row queues, median's index vector) come
# from malloc and are invisible to the allocator (and to the memory the user reads from torch).
# argsort and msort are composites of sort; quantile is a composite whose pieces are rules here.
require_args(aten.sort.default, "self", "dim")
require_args(aten.sort.stable, "self", "dim")
require_args(aten.kthvalue.default, "self", "dim")
require_args(aten.median.dim, "self", "dim")
require_args(aten.nanmedian.dim, "self", "dim")
require_args(aten.median.default, "self")
require_args(aten.nanmedian.default, "self")


@hidden(aten.sort, device="cpu")
def _sort_cpu(call: Call) -> list | None:
    """sort_kernel first fills the indices from an int64 ``arange`` of the sorted dim's length
    (_fill_indices, made after the outputs and freed on return), whatever path sorts them after;
    a 0-dim input takes no kernel (indices.zero_())."""
    x = call.arg("self")
    if x.dim() == 0:
        return None
    n = 8 * x.shape[call.arg("dim", -1) % x.dim()]
    return [OUT, n, -n]


@hidden(aten.kthvalue, device="cpu")
def _kthvalue_cpu(call: Call) -> list | None:
    """kthvalue_out_impl_cpu quick-selects in a contiguous clone of the input and an int64 index
    tensor of the input's shape, both made after the outputs and freed on return (index first)."""
    x = call.arg("self")
    if x.dim() == 0:
        return None
    clone, index = x.numel() * x.element_size(), 8 * x.numel()
    return [OUT, clone, index, -index, -clone]


@hidden(aten.median.dim, aten.nanmedian.dim, device="cpu")
def _median_dim_cpu(call: Call) -> list | None:
    """median_with_indices_impl makes the reduced dim contiguous when its stride is above 1: a
    contiguous copy with that dim last, made after the outputs, freed on return."""
    x = call.arg("self")
    if x.dim() == 0 or not x.stride()[call.arg("dim") % x.dim()] > 1:
        return None
    copy = x.numel() * x.element_size()
    return [OUT, copy, -copy]


def _evenly_distributed(call: Call) -> list:
    # evenly_distribute_backward (the backward of max(), min(), median(), nanmedian() over all
    # elements) builds its mask with other ops for tensor subclasses, which fake tensors are: the
    # simulated backward allocates what the real one does not, and the other way round
    x = call.arg("self")
    if call.grad_enabled and isinstance(x, torch.Tensor) and x.requires_grad:
        return [Unknown(call.op, "its backward (evenly_distribute_backward) takes another sequence of ops for real "
                                 "tensors than for fake ones: the training step's peak may differ by a few "
                                 "input-sized masks")]
    return []


require_args(aten.max.default, "self")
require_args(aten.min.default, "self")


@hidden(aten.median.default, aten.nanmedian.default, device="cpu")
def _median_all_cpu(call: Call) -> list:
    """median_impl partitions a clone of the whole input (made before the 0-dim output, freed on
    return); in training, the backward is flagged (see _evenly_distributed)."""
    x = call.arg("self")
    clone = x.numel() * x.element_size()
    return [clone, OUT, -clone, *_evenly_distributed(call)]


@hidden(aten.max.default, aten.min.default, device="cpu")
def _max_all_cpu(call: Call) -> list | None:
    """max()/min() over all elements: nothing hidden forward; in training their backward is
    flagged (see _evenly_distributed)."""
    flag = _evenly_distributed(call)
    return [OUT, *flag] if flag else None


# --- reductions (aten/src/ATen/native/ReduceOps.cpp, TensorIteratorReduce.cpp) ---------------------
# On CPU, make_reduction reduces in the output's dtype: an input of another dtype (a bool or int32
# sum, sum(dtype=torch.float64)) is first cast whole, after the output is allocated. A kernel that
# reduces through TensorIterator::parallel_reduce to ONE element, over at least GRAIN_SIZE inputs on
# more than one thread, takes the two-pass path: a (threads,) buffer of the output's dtype.
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE
_CASTING_REDUCTIONS = (aten.sum, aten.nansum, aten.prod, aten.cumsum, aten.cumprod, aten.mean)
_TWO_PASS_REDUCTIONS = (aten.sum, aten.nansum, aten.prod, aten.amax, aten.amin, aten.all, aten.any, aten.mean)
for _op in (aten.sum.default, aten.sum.dim_IntList, aten.prod.default, aten.cumsum.default, aten.amax.default):
    require_args(_op, "self")


def reduction_scratch(call: Call) -> tuple[Any, Any, list]:
    """(bytes of the input cast to the output's dtype, bytes of the two-pass buffer, flags) of a CPU
    reduction; a flag (:class:`Unknown`) where the size the buffer depends on is decided by the data."""
    x, out = call.arg("self"), call.outputs[0]
    packet = call.func.overloadpacket
    cast = 0
    if packet in _CASTING_REDUCTIONS and x.dtype != out.dtype and not (x.is_complex() or out.is_complex()):
        cast = x.numel() * out.element_size()
    buffer, flags = 0, []
    threads = torch.get_num_threads()
    if packet in _TWO_PASS_REDUCTIONS and threads > 1 and data_paths.one_element(out.numel()):
        numel = x.numel()
        if isinstance(numel, torch.SymInt) and tc.unbacked_symbols(tc.raw_expr(numel)):
            # a size the data decides (x[mask], nonzero): no example value to pick a side with
            flags = [Unknown(call.op, f"its ({threads},)-element two-pass buffer exists only over >= {GRAIN_SIZE} "
                                      f"elements, and how many there are here is decided by the data")]
        else:  # a piece on each side of GRAIN_SIZE (see fxmem.kernels.regimes)
            buffer = when(numel >= GRAIN_SIZE, threads * out.element_size(), 0)
    return cast, buffer, flags


@hidden(*(op for op in {*_CASTING_REDUCTIONS, *_TWO_PASS_REDUCTIONS} if op is not aten.mean), device="cpu")
def _reduction_cpu(call: Call) -> list | None:
    """A reduction over an input of another dtype casts the input to the output's dtype first; one
    to a single element over >= GRAIN_SIZE inputs on several threads keeps a per-thread result buffer."""
    cast, buffer, flag = reduction_scratch(call)
    inner = _nonzero([cast, buffer])
    flag = flag + (_prod_backward(call) if call.func.overloadpacket is aten.prod else [])
    return [OUT, *inner, *[-c for c in reversed(inner)], *flag] if inner or flag else None


def _prod_backward(call: Call) -> list:
    # prod_backward takes prod_safe_zeros_backward (cumprods of the flattened input) for tensor
    # subclasses, fake tensors included, and for real ones a path decided by whether the input
    # holds zeros (a value)
    x = call.arg("self")
    if call.grad_enabled and isinstance(x, torch.Tensor) and x.requires_grad:
        return [Unknown(call.op, "its backward (prod_backward) takes another path for real tensors than for fake "
                                 "ones, chosen by whether the input holds zeros: the training step's peak may differ "
                                 "by a few input-sized tensors")]
    return []


# --- roll over several dims (aten/src/ATen/native/TensorTransformations.cpp, roll_common) ----------
require_args(aten.roll.default, "self", "shifts", "dims")


@hidden(aten.roll, device="cpu")
def _roll_dims_cpu(call: Call) -> list | None:
    """Rolling k > 1 dims rolls the first dim, then the rest recursively: k - 1 input-sized
    intermediates, each alive until the roll that made it returns."""
    dims = list(call.arg("dims") or [])
    if len(dims) < 2:
        return None
    x = call.arg("self")
    t = x.numel() * x.element_size()
    k = len(dims) - 1
    return [*[t] * k, OUT, *[-t] * k]


require_args(aten._trilinear.default, "i1", "i2", "i3", "expand1", "expand2", "expand3", "sumdim", "unroll_dim")
_BILINEAR = ((1, 3), (0,), (1, 2), (2, 3), 1)  # how F.bilinear calls _trilinear: expand1..3, sumdim, unroll_dim


@hidden(aten._trilinear.default, device="cpu")
def _trilinear_scratch(call: Call) -> list | Unknown:
    """_trilinear's CPU kernel (nn.Bilinear's forward: x1 (N, I), weight (O, I, J), x2 (N, J)) fills
    its zeroed output one output feature at a time: per feature, sumproduct_pair makes an (N, J)
    bmm result and then an (N, 1) one, both freed before the next (measured on real runs).
    Other calls (its own backward's) are not described: the report says so."""
    i1, w, i3 = call.arg("i1"), call.arg("i2"), call.arg("i3")
    pattern = (tuple(call.arg("expand1")), tuple(call.arg("expand2")), tuple(call.arg("expand3")),
               tuple(call.arg("sumdim")), call.arg("unroll_dim", 1))
    if pattern != _BILINEAR or not all(t.is_contiguous() for t in (i1, w, i3)) or w.dim() != 3 \
            or not isinstance(w.shape[0], int):
        return Unknown(call.op, "its per-slice scratch is described for nn.Bilinear's forward only")
    esize = i1.element_size()
    first, second = i1.shape[0] * w.shape[2] * esize, i1.shape[0] * esize
    return [OUT] + [first, second, -first, -second] * int(w.shape[0])




# --- upsampling (aten/src/ATen/native/cpu/UpSampleKernel.cpp; read off real runs) ----------------------
# The generic kernel precomputes, for each spatial dim in order, ``pairs`` (index, weight) tensors as
# long as the output there: int64 indices and weights of the input's dtype, all freed on return.
# 2-d nearest and bilinear (and 3-d on a channels-last-3d input of more than 3 channels) take a
# channels-last kernel instead where ATen's _use_vectorized_kernel_cond says so: it copies an input
# that is not channels-last contiguous, computes into a channels-last buffer an output that is not,
# then copies it back.
_PAIRS = {"nearest": 1, "_nearest_exact": 1, "linear": 2, "bilinear": 2, "trilinear": 2, "bicubic": 4}
_UPSAMPLE: dict = {}
for _name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
              "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
              "upsample_trilinear3d", "upsample_bicubic2d"):
    if hasattr(aten, _name):
        _op = getattr(aten, _name)
        require_args(_op.default, "self", "output_size")
        _UPSAMPLE[_op] = (_PAIRS[_name.replace("upsample_", "")[:-2]], _name.endswith("2d") and "bicubic" not in _name,
                          _name.endswith("3d"))


@hidden(*_UPSAMPLE, device="cpu")
def _upsample_cpu(call: Call) -> list:
    """The channels-last kernel's copies, or the generic kernel's index and weight tensors: per
    spatial dim ``pairs`` of int64 indices and input-dtype weights as long as the output there,
    allocated after the output, in dim order, and freed in the same order."""
    x, out = call.arg("self"), call.outputs[0]
    pairs, two_d, three_d = _UPSAMPLE[tc.op_packet(call.func)]
    fmt = torch.channels_last if two_d else torch.channels_last_3d
    copy, buf = copy_bytes(x, fmt), copy_bytes(out, fmt)
    vectorized = [OUT, *[b for b in (copy, buf) if b], *[-b for b in (buf, copy) if b]]
    if (two_d or three_d) and x.is_contiguous(memory_format=fmt) and x.shape[1] > 3:
        return vectorized
    made = []
    for length in out.shape[2:]:
        made += [8 * length, x.element_size() * length] * pairs
    generic = [OUT, *made, *[-m for m in made]]
    if two_d and pairs == 2 and x.dtype != torch.uint8 and torch.get_num_threads() == 1:
        # upsample_bilinear2d_kernel_impl_float: with one thread, three channels (an image) take the
        # channels-last kernel too (the report is remade under another thread count)
        generic = either(x.shape[1] == 3, vectorized, generic)
    # small 2-d outputs take the channels-last kernel too: a piece on each side (fxmem.kernels.regimes)
    return either(out.shape[-2] + out.shape[-1] <= 128, vectorized, generic) if two_d else generic


# Antialiased resampling (F.interpolate(antialias=True); UpSampleKernel.cpp, the separable AA kernel):
# one pass per spatial dim whose size changes, width first; two passes go through an intermediate
# (N, C, H_in, W_out) buffer. Each pass computes, for its output length n, three int64 index tensors,
# the weights (n x window, the input's dtype) and a fourth int64 tensor, all freed after the pass.
# window = 2 * ceil(support) + 1, support = interp_size / 2, times the scale when it is >= 1.
_AA = {op: size for name, size in (("_upsample_bilinear2d_aa", 2), ("_upsample_bicubic2d_aa", 4))
       if hasattr(aten, name) for op in (getattr(aten, name),)}
for _op in _AA:
    require_args(_op.default, "self", "output_size", "align_corners", "scales_h", "scales_w")


def _aa_window(n_in: Any, n_out: Any, align_corners: bool, scale: float | None, interp: int) -> Any:
    """Weights per output position of one antialiased pass (area_pixel_compute_scale, then the
    support), as a formula of the sizes where the scale is ``n_in / n_out`` (or, aligning corners,
    ``(n_in - 1) / (n_out - 1)``): a piece on each side of ``n_in == n_out``."""
    if scale is not None and scale > 0 and not align_corners:
        ratio = 1.0 / scale  # the caller's scale factor, as ATen takes it
        return 2 * math.ceil(interp / 2 * ratio if ratio >= 1.0 else interp / 2) + 1
    a, b = sized(n_in), sized(n_out)
    if align_corners:
        down = sympy.And(sympy.Gt(b, 1), sympy.Ge(a, b))
        ratio = (a - 1) / sympy.Max(b - 1, 1)
    else:
        down, ratio = sympy.Ge(a, b), a / b
    return 2 * sympy.ceiling(when(down, sympy.Rational(interp, 2) * ratio, sympy.Rational(interp, 2))) + 1


@hidden(*_AA, device="cpu")
def _upsample_aa_cpu(call: Call) -> list:
    """The separable antialiased kernel's per-pass index and weight tensors and, with two passes,
    its intermediate buffer (see the table above; read off real runs)."""
    x, out = call.arg("self"), call.outputs[0]
    esize, interp = x.element_size(), _AA[tc.op_packet(call.func)]
    scales = {3: call.arg("scales_w"), 2: call.arg("scales_h")}
    passes = []
    for dim in (3, 2):  # width first, then height
        n_in, n_out = x.shape[dim], out.shape[dim]
        if not bool(n_in != n_out):
            continue
        index = 8 * sized(n_out)
        weights = sized(n_out) * _aa_window(n_in, n_out, call.arg("align_corners"), scales[dim], interp) * esize
        passes.append([index, index, index, weights, index, -index, -index, -index, -weights, -index])
    if len(passes) < 2:
        return [OUT, *(passes[0] if passes else [])]
    temp = sized(x.shape[0]) * sized(x.shape[1]) * sized(x.shape[2]) * sized(out.shape[3]) * esize
    return [OUT, temp, *passes[0], *passes[1], -temp]


_UPSAMPLE_BACKWARD = tuple(getattr(aten, f"{op.__name__.split('.')[-1]}_backward") for op in _UPSAMPLE
                           if hasattr(aten, f"{op.__name__.split('.')[-1]}_backward"))
for _op in _UPSAMPLE_BACKWARD:
    require_args(_op.default, "grad_output", "output_size", "input_size")


@hidden(*_UPSAMPLE_BACKWARD, device="cpu")
def _upsample_backward_cpu(call: Call) -> list:
    """The backward kernels read a contiguous (or channels-last contiguous) grad_output as it is and
    copy any other (an expanded gradient, as ``out.sum()`` gives) to a contiguous one, after
    allocating grad_input; no index tensors."""
    g = call.arg("grad_output")
    dense = g.is_contiguous() or (g.dim() == 4 and g.is_contiguous(memory_format=torch.channels_last)) \
        or (g.dim() == 5 and g.is_contiguous(memory_format=torch.channels_last_3d))
    copy = 0 if dense else g.numel() * g.element_size()
    return [OUT, copy, -copy] if copy else [OUT]
