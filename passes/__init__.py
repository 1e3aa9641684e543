"""Rewrites that make a model take less memory, each verified: ``fxmem.optimize``.

This folder is the top-level ``passes/`` of the source tree, installed as ``fxmem.passes``:

* :mod:`.optimize` - ``fxmem.optimize``: trace, probe at small sizes, find, apply, verify, keep
  what lowers the peak, pass after pass;
* :mod:`.modes` - one graph that follows ``train()``/``eval()`` as the model does (fx freezes
  ``self.training`` while tracing);
* :mod:`.verify` - same outputs, gradients and buffers as the original, in train and eval mode,
  with and without grad;
* :mod:`.local_verify` - the regions a rewrite changed, each checked against what it replaced
  (alike regions once), next to the whole model at the smallest size;
* :mod:`.registry` - the passes, as data: the rules (``PASSES``; ``register(rule)`` adds yours) and
  the whole-graph passes (``GRAPH_PASSES``: reorder, recompute); :mod:`.base` - what a pass is and what it is given;
* the pair-linear rule: :mod:`.pair_linear` (the rule), :mod:`.data_movement` (which nodes only
  copy elements, and the id probe), :mod:`.linear_maps` (what counts as a linear map),
  :mod:`.pair_layout` (how the pair tensor is laid out), :mod:`.pair_reasons` (why a look-alike
  is declined), :mod:`.gathered_pairs` (pairs of rows picked by an edge list);
* the fused-attention rule: :mod:`.fused_attention` (the rule: match, layouts, kernel call,
  rewrite), :mod:`.attention_parts` (the attention's parts read off the graph: dropout, softmax,
  LeakyReLU, mask, the scores' axes; the SDPA rule reads them too), :mod:`.attention_layout` (the
  model's tensors laid out for the kernel, :mod:`fxmem.ops.attention`);
* the fused-message-passing rule: :mod:`.message_passing` (the kernel: :mod:`fxmem.ops.spmm`);
* the SDPA rule: :mod:`.sdpa` (the rule), :mod:`.sdpa_parts` (q, k, v and their layouts),
  :mod:`.sdpa_masks` (scale and masks, causal ones included).
* recomputation to fit a budget (``optimize(..., budget=, dims=)``): :mod:`.recompute` (the
  plan; ``fxmem.passes.max_size(report, dim, budget)``, the largest size that fits with it),
  :mod:`.segments` (the blocks, and how a graph runs one under ``torch.utils.checkpoint``).

>>> opt = fxmem.optimize(layer, ("B", "N", 6), ("B", "N", "N"))          # doctest: +SKIP
"""
if __name__ != "fxmem.passes":  # a source checkout's root on sys.path makes this folder findable as ``passes``
    raise ImportError(f"this folder is the package fxmem.passes, not a module {__name__!r}: import fxmem.passes")

from fxmem.passes.base import Finding, GraphPass, Line, Pass, Probe  # noqa: E402
from fxmem.passes.optimize import optimize  # noqa: E402
from fxmem.passes.recompute import BudgetError, max_size  # noqa: E402
from fxmem.passes.registry import GRAPH_PASSES, PASSES, register, unregister  # noqa: E402
from fxmem.passes.verify import Difference, compare  # noqa: E402

__all__ = ["optimize", "max_size", "compare", "Difference", "PASSES", "GRAPH_PASSES", "register", "unregister",
           "Pass", "GraphPass", "Line", "Finding", "Probe", "BudgetError"]
