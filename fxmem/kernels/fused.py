"""What fxmem's own fused operators (:mod:`fxmem.ops`) allocate inside their kernels.

The fused kernels are plain PyTorch loops over blocks; on fake tensors they are opaque ops whose
fake kernels allocate only the outputs. These rules give the real kernels' programs: the
contiguous copies of their operands, then one block's temporaries in the order the kernel makes
and frees them. Every block frees what it made before the next one starts, and the first block is
the largest, so one block's program has the kernel's peak. Each entry below names the line of the
kernel it mirrors; ``tests/passes/test_fused_attention.py`` and ``tests/passes/test_message_passing.py`` compare
them with the CPU allocator on real runs (one block, several blocks, a last partial block). On
CUDA, where Triton is installed and ``FXMEM_TRITON_ATTENTION=1`` opts in, the two attention ops
without dropout run Triton kernels (:mod:`fxmem.ops.attention_triton`) instead: their rules list
what the kernels' wrappers allocate (``tests/kernels/test_triton_attention.py`` compares them with
the wrappers' allocations).

A comparison with a Python number wraps the number in a tensor on CPU and casts it (and an
operand of another dtype) to the common dtype first, as :mod:`fxmem.kernels.scalars` describes
for every op; on CUDA the number stays on the host and nothing is cast.

>>> hidden_rule(torch.ops.fxmem.masked_attention.default).why            # doctest: +SKIP
'Row blocks of masked attention: ...'
"""
from __future__ import annotations

from typing import Any

import torch

from ..ops import attention_triton as _triton
from ..ops.attention import block_rows, gemm_ready, groups_merge
from ..ops.edge_attention import noise_rows
from ..ops.spmm import chunk_rows
from ..ops import spmm as _spmm_ops  # noqa: F401 - defines the message-passing ops
from .registry import OUT, Call, Unknown, hidden, require_args
from .scalars import result_dtype
from .cpu import copy_bytes

_ATTENTION = torch.ops.fxmem.masked_attention
_ATTENTION_BACKWARD = torch.ops.fxmem.masked_attention_backward
_DROPOUT = torch.ops.fxmem.masked_attention_dropout
_DROPOUT_BACKWARD = torch.ops.fxmem.masked_attention_dropout_backward
require_args(_ATTENTION.default, "s", "t", "h", "adj", "compare", "threshold", "keep", "block_bytes")
require_args(_ATTENTION_BACKWARD.default, "grad", "s", "t", "h", "adj", "compare", "threshold", "keep", "block_bytes")
require_args(_DROPOUT.default, "s", "t", "h", "adj", "compare", "threshold", "keep", "block_bytes", "dropout")
require_args(_DROPOUT_BACKWARD.default, "grad", "s", "t", "h", "adj", "compare", "threshold", "keep", "block_bytes",
             "dropout")


def _with_a_number(device: str, operand: torch.Tensor, numel: Any, number: float) -> tuple[list, list]:
    """Allocations around an op of ``operand`` with a Python number (``adj > 0``, ``noise.div_(1 - p)``):
    before it, and their frees after (the number wrapped, cast, and ``numel`` elements of the operand
    cast where the common dtype is another)."""
    if device != "cpu":
        return [], []
    common = result_dtype([operand], [number])
    before = [8]  # the number, wrapped as a float64 0-dim tensor
    if common != torch.float64:
        before.append(common.itemsize)  # ... cast to the common dtype
    if operand.dtype != common:
        before.append(numel * common.itemsize)  # the operand's block, cast
    return before, [-b for b in reversed(before)]


def _drop_mask(call: Call, rows: Any, mask_groups: Any) -> tuple[list, list]:
    """``_dropped``: the bool mask of one block (a view of a bool adj that says what to replace)."""
    adj, compare, keep = call.arg("adj"), call.arg("compare"), call.arg("keep")
    m = call.arg("t").shape[-1]
    size = mask_groups * rows * m
    if compare == "add":  # an additive mask is added in place from a view: no mask block
        return [], []
    if compare == "true":
        return ([size], [-size]) if keep else ([], [])
    before, after = _with_a_number(call.device, adj, size, call.arg("threshold"))
    return [*before, size, *after], [-size]  # logical_not_ works in place


def _sizes(call: Call) -> tuple:
    """(groups per block, M, F, rows per block, element size, mask groups per block): the kernel
    with dropout visits one group at a time, or with ``heads_last`` the Gh heads of one Gm group
    (its noise is drawn in the weights' memory order)."""
    s, t, h = call.arg("s"), call.arg("t"), call.arg("h")
    gm, gh, n = s.shape
    g, m, f = gm * gh, t.shape[-1], h.shape[-1]
    if call.arg("dropout", 0.0):
        heads = gh if call.arg("heads_last", False) else 1
        rows = block_rows(n, m, f, heads, 1, s.element_size(), call.arg("block_bytes"), score_blocks=5)
        return heads, m, f, rows, s.element_size(), 1
    am = call.arg("adj").shape[0]
    rows = block_rows(n, m, f, g, am, s.element_size(), call.arg("block_bytes"))
    return g, m, f, rows, s.element_size(), am


def _noise(call: Call, scores: Any) -> list:
    """F.dropout's noise for one block (``ops.attention._noise``): the block, drawn in place, then
    divided by 1 - p in place (a Python number: wrapped in a tensor on CPU, see :mod:`.scalars`)."""
    before, after = _with_a_number(call.device, call.arg("s"), 0, 0.0)
    return [scores, *[b for b in before if b], *[a for a in after if a]]


def _unchecked_on_gpu(call: Call, program: list) -> list:
    """On CUDA the kernel is the same PyTorch code (no wrapped numbers on the device): its program,
    and a note that it was not compared with a GPU run (none was available to this work)."""
    if call.device == "cpu":
        return program
    return [*program, Unknown(call.op, "the fused kernel's blocks as on CPU; not yet compared with a real GPU run "
                                       "(fxmem.validate on a GPU checks it)")]


@hidden(_ATTENTION, device="cpu")
@hidden(_DROPOUT, device="cpu")
@hidden(_DROPOUT, device="cuda")
def _masked_attention(call: Call) -> list:
    """Row blocks of masked attention: contiguous copies of s, t, h; then per block the scores
    (G x rows x M), the bool drop mask, the softmax, with dropout its noise (one group per block),
    and - when there are several blocks - the block's output before it is copied into place (one
    block is written straight into the output)."""
    s, t, h = call.arg("s"), call.arg("t"), call.arg("h")
    g, m, f, rows, es, am = _sizes(call)
    copies = _copies(s, t, h)
    scores = g * rows * m * es
    mask, unmask = _drop_mask(call, rows, am)
    noise = [*_noise(call, scores), -scores] if call.arg("dropout", 0.0) else []
    block_out = [] if rows == s.shape[-1] else [g * rows * f * es, -g * rows * f * es]
    block = [scores, *mask, *unmask, scores, -scores, *noise, *block_out, -scores]
    return _unchecked_on_gpu(call, [*copies, OUT, *block, *[-c for c in reversed(copies)]])


@hidden(_ATTENTION_BACKWARD, device="cpu")
@hidden(_DROPOUT_BACKWARD, device="cpu")
@hidden(_DROPOUT_BACKWARD, device="cuda")
def _masked_attention_backward(call: Call) -> list:
    """Row blocks of the attention's backward: contiguous copies of s and t and h, a copy of the
    gradient where its groups do not merge into one batch dim; then per block the recomputed
    scores, the drop mask, the softmax, the block's gradient rows copied when they are not BLAS-ready
    (an expanded gradient), dP (G x rows x M), a row sum, the check whether masked entries got
    weight, LeakyReLU's backward (a new block), and the two partial sums."""
    s, t, h, grad = call.arg("s"), call.arg("t"), call.arg("h"), call.arg("grad")
    g, m, f, rows, es, am = _sizes(call)
    copies = _copies(s, t, h)
    if not groups_merge(grad):
        copies.append(grad.numel() * es)
        ready = True  # the reshape's copy is contiguous
    else:
        ready = gemm_ready(grad)  # the last two dims are those of the merged view
    scores, row = g * rows * m * es, g * rows * es
    grad_rows = [] if ready else [g * rows * f * es]
    mask, unmask = _drop_mask(call, rows, am)
    # with dropout: the noise drawn again, the kept weights for dh (freed), dP times the noise
    noise = [*_noise(call, scores), scores, -scores, -scores] if call.arg("dropout", 0.0) else []
    # torch.gt(top, below).all(): a bool per row, then one bool
    check_before, check_after = _with_a_number(call.device, s, g * rows, 0.0)
    check = [*check_before, g * rows, *check_after, 1, -g * rows, -1]
    if call.arg("compare") == "add":  # nothing is masked: no check; the mask's gradient, summed over heads
        check = []
        if call.arg("need_adj", False):
            gm = 1 if call.arg("dropout", 0.0) else s.shape[0]
            part = gm * rows * m * es
            whole = rows * m * es if call.arg("adj").shape[0] == 1 and not _is_one(gm) else 0
            check = [part, whole, -part, -whole] if whole else [part, -part]
    block = [scores, *mask, scores, *grad_rows, scores, *noise, row, -row, -scores, *check, *unmask,
             scores, -scores, -scores, row, -row, g * m * es, -g * m * es, *[-b for b in grad_rows], -scores]
    return _unchecked_on_gpu(call, [*copies, OUT, *block, *[-c for c in reversed(copies)]])


def _triton_takes(call: Call) -> bool:
    """Whether a CUDA call runs the Triton kernels: registered in this process (a CUDA build with
    Triton), opted in (``FXMEM_TRITON_ATTENTION=1``) and of operands they take (float64 runs the
    PyTorch row blocks)."""
    if not (_triton.registered() and _triton.enabled()):
        return False
    return _triton.handles(call.arg("s"), call.arg("t"), call.arg("h"), call.arg("adj"), call.arg("threshold"),
                           call.arg("grad"))


@hidden(_ATTENTION, device="cuda")
def _masked_attention_cuda(call: Call) -> list:
    """Masked attention on CUDA: Triton's fused kernel allocates its outputs only (else the row blocks).

    ``ops.attention_triton.masked_attention_forward`` allocates ``out`` and ``top`` and launches one
    kernel; it reads its operands through their strides (no contiguous copies) and the Triton kernel
    allocates nothing itself: its score tiles live in registers. Where the Triton kernels are not
    registered (no Triton, a CPU build) or not taken (float64), the PyTorch row blocks' program.
    """
    if not _triton_takes(call):
        return _masked_attention(call)
    return [OUT]


@hidden(_ATTENTION_BACKWARD, device="cuda")
def _masked_attention_backward_cuda(call: Call) -> list:
    """The attention's backward on CUDA: Triton's outputs, then its float32 row statistics (else the row blocks).

    ``ops.attention_triton.masked_attention_backward`` allocates ``ds, dt, dh, dadj`` (``dadj``
    empty unless the additive mask needs its gradient), then one float32 [2, G, N] buffer of each
    row's softmax sum and ``D_i = sum_j P_ij dP_ij`` (8·G·N bytes, G = Gm·Gh), freed when it returns
    after the kernels' launches. Operands are read through their strides (no copies, an expanded
    gradient included); the Triton kernels allocate nothing themselves. Where the Triton kernels are
    not registered or not taken (float64), the PyTorch row blocks' program.
    """
    if not _triton_takes(call):
        return _masked_attention_backward(call)
    gm, gh, n = call.arg("s").shape
    stats = 8 * gm * gh * n
    return [OUT, stats, -stats]


_EDGE_DROPOUT = torch.ops.fxmem.edge_dropout
_EDGE_DROPOUT_BACKWARD = torch.ops.fxmem.edge_dropout_backward
require_args(_EDGE_DROPOUT.default, "h", "row", "col", "flagged", "n", "m", "dropout", "heads_last", "block_bytes")
require_args(_EDGE_DROPOUT_BACKWARD.default, "grad", "flagged", "state", "n", "m", "dropout", "heads_last",
             "block_bytes")


def _int_with_a_number(device: str) -> tuple[list, list]:
    """An int64 op with a Python int (``torch.remainder(row, n)``): on CPU the number wrapped as an
    int64 0-dim tensor (no cast: it is the operand's dtype already)."""
    return ([8], [-8]) if device == "cpu" else ([], [])


def _edge_noise_sizes(call: Call, x: torch.Tensor) -> tuple:
    """(Gm, Gh, F, rows per draw, heads per draw, element size) of the edge list's dropout."""
    n, m, heads_last = call.arg("n"), call.arg("m"), call.arg("heads_last")
    gh, f, es = x.shape[1], x.shape[2], x.element_size()
    heads = gh if heads_last else 1
    return gh, f, noise_rows(n, m, f, heads, es, call.arg("block_bytes")), heads, es


@hidden(_EDGE_DROPOUT, device="cpu")
@hidden(_EDGE_DROPOUT, device="cuda")
def _edge_dropout(call: Call) -> list:
    """The edge list's dropout (``ops.edge_attention.edge_dropout_op``): a contiguous copy of h;
    the outputs; each edge's place in its block (``_local_index``: two int64 [K] and the wrapped
    numbers); heads first, a [Gh, K] buffer of each head's numbers; the block of numbers, heads last
    a buffer for one head's, a rows x F product; per block the draw's division by 1 - p and the check
    for rows whose masked entries have weight (a bool)."""
    h, row = call.arg("h"), call.arg("row")
    m = call.arg("m")
    gh, f, rows, heads, es = _edge_noise_sizes(call, h)
    k = row.shape[0]
    copies = _copies(h)
    before, after = _int_with_a_number(call.device)
    local = [*before, 8 * k, *after, *before, *after, *before, *after, *before, 8 * k, *after, -8 * k]
    by_head = [] if call.arg("heads_last") else [gh * k * es]
    one_head = [rows * m * es] if call.arg("heads_last") else []  # one head's numbers, contiguous
    block, product = rows * m * heads * es, rows * f * es
    div_before, div_after = _with_a_number(call.device, h, 0, 0.0)
    per_block = [*[b for b in div_before if b], *[a for a in div_after if a], 1, -1]
    frees = [*[-b for b in by_head], -block, *[-b for b in one_head], -product, -8 * k]
    return _unchecked_on_gpu(call, [*copies, OUT, *local, *by_head, block, *one_head, product, *per_block, *frees,
                                    *[-c for c in reversed(copies)]])


@hidden(_EDGE_DROPOUT_BACKWARD, device="cpu")
@hidden(_EDGE_DROPOUT_BACKWARD, device="cuda")
def _edge_dropout_backward(call: Call) -> list:
    """Its backward: a contiguous copy of the gradient; dh; the block, heads last one head's buffer,
    an M x F product; whether any row's masked entries have weight (a bool); then the first block's
    draw (its division by 1 - p) and check (a bool) - every later block's are the same."""
    grad, m = call.arg("grad"), call.arg("m")
    gh, f, rows, heads, es = _edge_noise_sizes(call, grad)
    copies = _copies(grad)
    one_head = [rows * m * es] if call.arg("heads_last") else []
    block, product = rows * m * heads * es, m * f * es
    div_before, div_after = _with_a_number(call.device, grad, 0, 0.0)
    per_block = [*[b for b in div_before if b], *[a for a in div_after if a], 1, -1]
    program = [*copies, OUT, block, *one_head, product, 1, -1, *per_block, -block, *[-b for b in one_head], -product,
               *[-c for c in reversed(copies)]]
    return _unchecked_on_gpu(call, program)


def _is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def _copies(*operands: torch.Tensor) -> list:
    """``.contiguous()`` of each operand that is not (the kernels start with these)."""
    return [c for c in (copy_bytes(x) for x in operands) if not (isinstance(c, int) and c == 0)]


# --- message passing: CSR structure and sparse-dense products (fxmem.ops.spmm) --------------------------
_STRUCTURE = torch.ops.fxmem.csr_structure
_SPMM = torch.ops.fxmem.spmm
_SPMM_BACKWARD = torch.ops.fxmem.spmm_backward
require_args(_STRUCTURE.default, "rows", "n")
require_args(_SPMM.default, "col", "w", "x", "n")
require_args(_SPMM_BACKWARD.default, "grad", "dst", "w", "x", "m", "need_x", "need_w")


def _structure(rows: torch.Tensor, n: Any) -> list:
    """``_sorted_rows``: the sorted rows and torch.sort's copy of them, then ``arange(n + 1)``."""
    sorted_rows = rows.shape[0] * rows.element_size()
    return [sorted_rows, sorted_rows, -sorted_rows, (n + 1) * 8, -(n + 1) * 8, -sorted_rows]


def _product(nnz: Any, values: Any, dense_copy: Any, rows: Any, result: Any) -> tuple[list, list]:
    """``_product``: the values in sorted order (or ones), a contiguous copy of the dense operand;
    in ``torch.sparse.mm`` (MKL) the result, a second result-sized buffer and int32 copies of the
    row starts and column indices. Returns (allocations before the result, the result and what
    follows it)."""
    before = [values, *([dense_copy] if dense_copy else [])]
    after = [result, result, (rows + 1) * 4, nnz * 4, -nnz * 4, -(rows + 1) * 4, -result,
             *([-dense_copy] if dense_copy else []), -values]
    return before, after


def _sparse_kernels_known(call: Call) -> Unknown | None:
    if call.device != "cpu":
        return Unknown(call.op, "sparse CSR products on CUDA (cuSPARSE) take workspace fxmem does not model")
    if not torch.backends.mkl.is_available():
        return Unknown(call.op, "torch.sparse.mm without MKL takes another path, not modelled")
    return None


def _outputs_at_their_places(program: list) -> list:
    """A kernel that allocates its outputs between its temporaries: ``program`` has ("out", bytes) at
    each output's place; each stands in as a hidden allocation there, and all are handed over to the
    outputs at the end (same peak, same final state)."""
    stand_ins = [b for p in program if isinstance(p, tuple) for b in p[1:]]
    flat = [p[1] if isinstance(p, tuple) else p for p in program]
    return [*flat, *[-b for b in stand_ins], OUT]


@hidden(_STRUCTURE, device="cpu")
@hidden(_STRUCTURE, device="cuda")
def _csr_structure(call: Call) -> list | Unknown:
    """Sorting the edges by row: outputs first, then the sorted rows, torch.sort's copy, an arange."""
    if call.device != "cpu":
        return Unknown(call.op, "torch.sort on CUDA takes workspace fxmem does not model")
    return [OUT, *_structure(call.arg("rows"), call.arg("n"))]


@hidden(_SPMM, device="cpu")
@hidden(_SPMM, device="cuda")
def _spmm(call: Call) -> list | Unknown:
    """One CSR product per head: the values, a contiguous copy of x's head, MKL's result buffers and
    int32 indices (one head: the product is the output; several: each is copied into place)."""
    unknown = _sparse_kernels_known(call)
    if unknown is not None:
        return unknown
    x, n, col = call.arg("x"), call.arg("n"), call.arg("col")
    m, heads, f = x.shape
    nnz, es = col.shape[0], x.element_size()
    result = n * f * es
    if heads == 1:
        before, after = _product(nnz, nnz * es, copy_bytes(x), n, result)
        return [*before, OUT, *after[1:]]
    program: list = [OUT]
    for _ in range(heads):
        before, after = _product(nnz, nnz * es, m * f * es, n, result)
        program += [*before, *after, -result]
    return program


@hidden(_SPMM_BACKWARD, device="cpu")
@hidden(_SPMM_BACKWARD, device="cuda")
def _spmm_backward(call: Call) -> list | Unknown:
    """dx: the edges sorted by source, then one CSR product per head (Aᵀ @ grad); dw: per head and
    chunk of edges, the picked rows of x and of the gradient and their row sums."""
    unknown = _sparse_kernels_known(call)
    if unknown is not None:
        return unknown
    grad, x, m, dst = call.arg("grad"), call.arg("x"), call.arg("m"), call.arg("dst")
    n, heads, f = grad.shape
    nnz, es = dst.shape[0], grad.element_size()
    program: list = []
    if call.arg("need_x"):
        structure = (m + 1) * 8 + 2 * nnz * dst.element_size()
        program += [structure, *_structure(dst, m)]
        result = m * f * es
        if heads == 1:
            before, after = _product(nnz, nnz * es, copy_bytes(grad), m, result)
            program += [*before, ("out", result), *after[1:]]
        else:
            program.append(("out", m * heads * f * es))
            for _ in range(heads):
                before, after = _product(nnz, nnz * es, n * f * es, m, result)
                program += [*before, *after, -result]
        program.append(-structure)
    if call.arg("need_w"):
        program.append(("out", nnz * heads * es))
        rows = chunk_rows(nnz, f, es)
        picked, sums = rows * f * es, rows * es
        for _ in range(heads):  # one chunk stands for all: each frees what it made
            program += [picked, picked, -picked, sums, -sums, -picked]
    return _outputs_at_their_places(program)
