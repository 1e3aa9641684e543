"""What fxmem's own fused operators (:mod:`fxmem.ops`) allocate inside their kernels.

The fused kernels are plain PyTorch loops over blocks; on fake tensors they are opaque ops whose
fake kernels allocate only the outputs. These rules give the real kernels' programs: the
contiguous copies of their operands, then one block's temporaries in the order the kernel makes
and frees them. Every block frees what it made before the next one starts, and the first block is
the largest, so one block's program has the kernel's peak. Each entry below names the line of the
kernel it mirrors; ``tests/test_fused_attention.py`` and ``tests/test_message_passing.py`` compare
them with the CPU allocator on real runs (one block, several blocks, a last partial block).

A comparison with a Python number wraps the number in a tensor on CPU and casts it (and an
operand of another dtype) to the common dtype first, as :mod:`fxmem.kernels.scalars` describes
for every op; on CUDA the number stays on the host and nothing is cast.

>>> hidden_rule(torch.ops.fxmem.masked_attention.default).why            # doctest: +SKIP
'Row blocks of masked attention: ...'
"""
from __future__ import annotations

from typing import Any

import torch

from ..ops.attention import block_rows
from .registry import OUT, Call, Unknown, hidden, require_args
from .scalars import result_dtype
from .cpu import copy_bytes

_ATTENTION = torch.ops.fxmem.masked_attention
_ATTENTION_BACKWARD = torch.ops.fxmem.masked_attention_backward
require_args(_ATTENTION.default, "s", "t", "h", "adj", "compare", "threshold", "keep", "block_bytes")
require_args(_ATTENTION_BACKWARD.default, "grad", "s", "t", "h", "adj", "compare", "threshold", "keep", "block_bytes")


def _compare_with_number(device: str, operand: torch.Tensor, numel: Any, number: float) -> tuple[list, list]:
    """Allocations around ``operand <op> number`` (a bool result): before it, and their frees after."""
    if device != "cpu":
        return [], []
    common = result_dtype([operand], [number])
    before = [8]  # the number, wrapped as a float64 0-dim tensor
    if common != torch.float64:
        before.append(common.itemsize)  # ... cast to the common dtype
    if operand.dtype != common:
        before.append(numel * common.itemsize)  # the operand's block, cast
    return before, [-b for b in reversed(before)]


def _drop_mask(call: Call, rows: Any) -> tuple[list, list]:
    """``_dropped``: the bool mask of one block (a view of a bool adj that says what to replace)."""
    adj, compare, keep = call.arg("adj"), call.arg("compare"), call.arg("keep")
    m = call.arg("t").shape[-1]
    size = adj.shape[0] * rows * m
    if compare == "true":
        return ([size], [-size]) if keep else ([], [])
    before, after = _compare_with_number(call.device, adj, size, call.arg("threshold"))
    return [*before, size, *after], [-size]  # logical_not_ works in place


def _sizes(call: Call) -> tuple:
    s, t, h = call.arg("s"), call.arg("t"), call.arg("h")
    gm, gh, n = s.shape
    g, m, f = gm * gh, t.shape[-1], h.shape[-1]
    rows = block_rows(n, m, g, call.arg("adj").shape[0], s.element_size(), call.arg("block_bytes"))
    return g, m, f, rows, s.element_size()


def _unchecked_on_gpu(call: Call, program: list) -> list:
    """On CUDA the kernel is the same PyTorch code (no wrapped numbers on the device): its program,
    and a note that it was not compared with a GPU run (none was available to this work)."""
    if call.device == "cpu":
        return program
    return [*program, Unknown(call.op, "the fused kernel's blocks as on CPU; not yet compared with a real GPU run "
                                       "(fxmem.validate on a GPU checks it)")]


@hidden(_ATTENTION, device="cpu")
@hidden(_ATTENTION, device="cuda")
def _masked_attention(call: Call) -> list:
    """Row blocks of masked attention: contiguous copies of s, t, h; then per block the scores
    (G x rows x M), the bool drop mask, the softmax, and the block's output before it is copied
    into place."""
    s, t, h = call.arg("s"), call.arg("t"), call.arg("h")
    g, m, f, rows, es = _sizes(call)
    copies = _copies(s, t, h)
    scores, block_out = g * rows * m * es, g * rows * f * es
    mask, unmask = _drop_mask(call, rows)
    block = [scores, *mask, *unmask, scores, -scores, block_out, -block_out, -scores]
    return _unchecked_on_gpu(call, [*copies, OUT, *block, *[-c for c in reversed(copies)]])


@hidden(_ATTENTION_BACKWARD, device="cpu")
@hidden(_ATTENTION_BACKWARD, device="cuda")
def _masked_attention_backward(call: Call) -> list:
    """Row blocks of the attention's backward: contiguous copies of s, t, h and the gradient; then per
    block the recomputed scores, the drop mask, the softmax, dP (G x rows x M), a row sum, the check
    whether masked entries got weight, LeakyReLU's backward (a new block), and the two partial sums."""
    s, t, h, grad = call.arg("s"), call.arg("t"), call.arg("h"), call.arg("grad")
    g, m, f, rows, es = _sizes(call)
    copies = _copies(s, t, h, grad)
    scores, row = g * rows * m * es, g * rows * es
    mask, unmask = _drop_mask(call, rows)
    # torch.gt(top, below).all(): a bool per row, then one bool
    check_before, check_after = _compare_with_number(call.device, s, g * rows, 0.0)
    check = [*check_before, g * rows, *check_after, 1, -g * rows, -1]
    block = [scores, *mask, scores, scores, row, -row, -scores, *check, *unmask,
             scores, -scores, -scores, row, -row, g * m * es, -g * m * es, -scores]
    return _unchecked_on_gpu(call, [*copies, OUT, *block, *[-c for c in reversed(copies)]])


def _copies(*operands: torch.Tensor) -> list:
    """``.contiguous()`` of each operand that is not (the kernels start with these)."""
    return [c for c in (copy_bytes(x) for x in operands) if not (isinstance(c, int) and c == 0)]
