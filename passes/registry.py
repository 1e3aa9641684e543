"""The rewrite passes :func:`fxmem.optimize` runs, in order, as data.

``PASSES``: the rules, each a :class:`~.base.Pass` (a name, a ``find`` that proposes sites, a
``rewrite`` that applies one); each looks at the graph the rules before it kept, and the driver
accepts their sites (verified, decided by the formulas). ``GRAPH_PASSES``: what is then done to
the whole graph, each a :class:`~.base.GraphPass` run on what the rules kept. A new rule is one
module and one line here.

>>> [p.name for p in PASSES]
['pair-linear', 'fused-attention', 'fused-message-passing', 'sdpa']
>>> [p.name for p in GRAPH_PASSES]
['reorder', 'recompute']
"""
from __future__ import annotations

from fxmem.passes import fused_attention, message_passing, pair_linear, recompute, reorder, sdpa
from fxmem.passes.base import GraphPass, Pass

PASSES: tuple[Pass, ...] = (
    # a linear map over pairs [h_i || h_j] -> L1(h_i) + L2(h_j), a broadcast add (GAT attention)
    Pass(pair_linear.RULE, pair_linear.find, pair_linear.rewrite, pair_linear.SETTINGS,
         "a linear map over pairs of rows [h_i || h_j] (a cat or sum of repeated/expanded copies of one tensor)"),
    # softmax(where(mask, LeakyReLU(s_i + t_j), fill)) @ h -> one fused kernel in row blocks
    Pass(fused_attention.RULE, fused_attention.find, fused_attention.rewrite, fused_attention.SETTINGS,
         "softmax over masked pair scores s_i + t_j (after LeakyReLU) multiplied into the node features",
         fused_attention.FLAGS),
    # zeros.index_add_(0, dst, x[src] * w) -> a CSR product A @ x (seed 003: fused message passing)
    Pass(message_passing.RULE, message_passing.find, message_passing.rewrite, message_passing.SETTINGS,
         "messages x[src] (times edge weights) summed into rows by index_add/scatter_add"),
    # softmax(q @ k^T * scale [+ mask]) [dropout] @ v -> F.scaled_dot_product_attention (seed 002)
    Pass(sdpa.RULE, sdpa.find, sdpa.rewrite, sdpa.SETTINGS,
         "softmax(q @ k^T * scale [+ mask]) [dropout] @ v"),
)
GRAPH_PASSES: tuple[GraphPass, ...] = (
    # the nodes in another order, lower at the example sizes and never higher where checked
    GraphPass(reorder.RULE, reorder.propose, reorder.LOOKS_FOR),
    # with budget=: blocks recomputed in backward so that the training step fits at dims
    GraphPass(recompute.RULE, recompute.propose, recompute.LOOKS_FOR),
)
