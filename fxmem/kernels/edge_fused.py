"""What the edge-list attention's fused op (:mod:`fxmem.ops.edge_attention_triton`) allocates inside its kernels.

On CUDA, with Triton installed and ``FXMEM_TRITON_ATTENTION=1``, ``edge_attention`` without dropout
or an additive mask calls ``fxmem::edge_attention_fused``; its Triton wrappers allocate a few
float32 buffers and (in the backward) the edges grouped by column, listed here in bytes in the
order the wrappers make and free them (``tests/kernels/test_triton_edge_attention.py`` compares
them with the wrappers' allocations). The Triton kernels allocate nothing themselves. Elsewhere -
the CPU kernel, or CUDA without the opt-in - the op runs its PyTorch reference, which
``edge_attention`` never routes to: not modelled (Unknown).

>>> hidden_rule(torch.ops.fxmem.edge_attention_fused.default).why          # doctest: +SKIP
'The fused edge attention on CUDA: ...'
"""
from __future__ import annotations

import torch

from ..ops import attention_triton as _dense
from ..ops import edge_attention_triton as _edge
from .registry import OUT, Call, Unknown, hidden, require_args

_FORWARD = torch.ops.fxmem.edge_attention_fused
_BACKWARD = torch.ops.fxmem.edge_attention_fused_backward
require_args(_FORWARD.default, "s", "t", "h", "rowptr", "row", "col", "n", "m")
require_args(_BACKWARD.default, "grad", "s", "t", "h", "rowptr", "row", "col", "n", "m")


def _takes(call: Call) -> bool:
    """Whether the CUDA call runs the Triton wrappers (as ``edge_attention_triton.takes`` decides,
    the device aside: the rule is CUDA's)."""
    grad = call.arg("grad") if "grad" in call.bound else None
    return _dense.available() and _dense.enabled() and _edge.handles(call.arg("s"), call.arg("t"), call.arg("h"),
                                                                        grad)


def _reference(call: Call) -> Unknown:
    return Unknown(call.op, "the op's PyTorch reference (edge_attention routes only the Triton case here): "
                            "its temporaries are not modelled")


@hidden(_FORWARD, device="cpu")
@hidden(_FORWARD, device="cuda")
def _edge_attention_fused(call: Call) -> list | Unknown:
    """The fused edge attention on CUDA: ``forward`` allocates ``out``, ``top`` and ``norm``, then
    the float32 [G, F] column sum of h (4·G·F bytes, G = Gm·Gh), freed on return."""
    if call.device != "cuda" or not _takes(call):
        return _reference(call)
    gm, gh, _ = call.arg("s").shape
    hsum = 4 * gm * gh * call.arg("h").shape[-1]
    return [OUT, hsum, -hsum]


@hidden(_BACKWARD, device="cpu")
@hidden(_BACKWARD, device="cuda")
def _edge_attention_fused_backward(call: Call) -> list | Unknown:
    """Its backward on CUDA: ``ds, dt, dh``; a float32 scratch of both column sums and the row
    statistics D and beta (4·(2·G·F + 2·G·N) bytes); ``by_column``: torch.sort of the K int64
    columns (sorted values and order, 8·K each; cub's workspace on CUDA is not modelled), an int64
    arange and the column pointers (8·(Am·M + 1) each), the arange and sorted values freed at once;
    on return the order, the pointers and the scratch."""
    if call.device != "cuda" or not _takes(call):
        return _reference(call)
    gm, gh, n = call.arg("s").shape
    f, m = call.arg("h").shape[-1], call.arg("m")
    am = (call.arg("rowptr").shape[0] - 1) // n
    k = 8 * call.arg("col").shape[0]
    scratch = 4 * (2 * gm * gh * f + 2 * gm * gh * n)
    pointers = 8 * (am * m + 1)
    workspace = Unknown(call.op, "torch.sort's workspace on CUDA (the edges grouped by column) is not modelled")
    return [OUT, scratch, k, k, workspace, pointers, pointers, -pointers, -k, -k, -pointers, -scratch]
