"""The rewrite passes :func:`fxmem.optimize` runs, in order, as data: each is a
:class:`~.base.Pass` (a name, a ``find`` that decides, a ``rewrite`` that applies). Each pass
looks at the graph the passes before it made.

>>> [p.name for p in PASSES]
['pair-linear', 'fused-attention', 'fused-message-passing', 'sdpa']
"""
from __future__ import annotations

from . import fused_attention, message_passing, pair_linear, sdpa
from .base import Pass

PASSES: tuple[Pass, ...] = (
    # a linear map over pairs [h_i || h_j] -> L1(h_i) + L2(h_j), a broadcast add (GAT attention)
    Pass(pair_linear.RULE, pair_linear.find, pair_linear.rewrite, pair_linear.SETTINGS,
         "a linear map over pairs of rows [h_i || h_j] (a cat or sum of repeated/expanded copies of one tensor)"),
    # softmax(where(mask, LeakyReLU(s_i + t_j), fill)) @ h -> one fused kernel in row blocks
    Pass(fused_attention.RULE, fused_attention.find, fused_attention.rewrite, fused_attention.SETTINGS,
         "softmax over masked pair scores s_i + t_j (after LeakyReLU) multiplied into the node features"),
    # zeros.index_add_(0, dst, x[src] * w) -> a CSR product A @ x (seed 003: fused message passing)
    Pass(message_passing.RULE, message_passing.find, message_passing.rewrite, message_passing.SETTINGS,
         "messages x[src] (times edge weights) summed into rows by index_add/scatter_add"),
    # softmax(q @ k^T * scale [+ mask]) [dropout] @ v -> F.scaled_dot_product_attention (seed 002)
    Pass(sdpa.RULE, sdpa.find, sdpa.rewrite, sdpa.SETTINGS,
         "softmax(q @ k^T * scale [+ mask]) [dropout] @ v"),
)
