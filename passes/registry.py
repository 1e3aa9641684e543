"""The rewrite passes :func:`fxmem.optimize` runs, in order, as data.

``PASSES``: the rules, each a :class:`~.base.Pass` (a name, a ``find`` that proposes sites, a
``rewrite`` that applies one); each looks at the graph the rules before it kept, and the driver
accepts their sites (verified, decided by the formulas). ``GRAPH_PASSES``: what is then done to
the whole graph, each a :class:`~.base.GraphPass` run on what the rules kept. A new rule is one
module and one line here, or, from your own code, :func:`register` (and :func:`unregister`): the
driver accepts, verifies and records its sites as it does the built-in rules'.

>>> [p.name for p in PASSES]
['sdpa-flags', 'pair-linear', 'fused-attention', 'fused-message-passing', 'sdpa']
>>> [p.name for p in GRAPH_PASSES]
['reorder', 'recompute']
"""
from __future__ import annotations

from fxmem.passes import (attention_parts, fused_attention, message_passing, pair_linear, pair_reasons, recompute,
                          reorder, sdpa, sdpa_flags)
from fxmem.errors import SpecError
from fxmem.passes.base import GraphPass, Pass

__all__ = ["PASSES", "GRAPH_PASSES", "register", "unregister"]

# the rules in the order they run (a list: register() adds to this very object, which optimize reads)
PASSES: list[Pass] = [
    # first: what the capture (or the code) made of an SDPA call's mask and heads
    # sdpa(q, repeat(k), repeat(v), attn_mask=causal triangle) -> sdpa(q, k, v, is_causal=True, enable_gqa=True)
    Pass(sdpa_flags.RULE, sdpa_flags.find, sdpa_flags.rewrite, sdpa_flags.SETTINGS, sdpa_flags.LOOKS_FOR,
         nearest=sdpa_flags.nearest),
    # a linear map over pairs [h_i || h_j] -> L1(h_i) + L2(h_j), a broadcast add (GAT attention)
    Pass(pair_linear.RULE, pair_linear.find, pair_linear.rewrite, pair_linear.SETTINGS,
         "a linear map over pairs of rows [h_i || h_j] (a cat or sum of repeated/expanded copies of one tensor)",
         nearest=pair_reasons.nearest),
    # softmax(where(mask, LeakyReLU(s_i + t_j), fill)) @ h -> one fused kernel in row blocks
    Pass(fused_attention.RULE, fused_attention.find, fused_attention.rewrite, fused_attention.SETTINGS,
         "softmax over masked pair scores s_i + t_j (after LeakyReLU) multiplied into the node features",
         fused_attention.FLAGS, nearest=attention_parts.nearest_attention),
    # zeros.index_add_(0, dst, x[src] * w) -> a CSR product A @ x (seed 003: fused message passing)
    Pass(message_passing.RULE, message_passing.find, message_passing.rewrite, message_passing.SETTINGS,
         "messages x[src] (times edge weights) summed into rows by index_add/scatter_add"),
    # softmax(q @ k^T * scale [+ mask]) [dropout] @ v -> F.scaled_dot_product_attention (seed 002)
    Pass(sdpa.RULE, sdpa.find, sdpa.rewrite, sdpa.SETTINGS,
         "softmax(q @ k^T * scale [+ mask]) [dropout] @ v", sdpa.FLAGS, nearest=attention_parts.nearest_dot_product),
]
# a list as PASSES is (PASSES + GRAPH_PASSES: every pass, in the order a call runs them)
GRAPH_PASSES: list[GraphPass] = [
    # the nodes in another order, lower at the example sizes and never higher where checked
    GraphPass(reorder.RULE, reorder.propose, reorder.LOOKS_FOR),
    # with budget=: blocks recomputed in backward so that the training step fits at dims
    GraphPass(recompute.RULE, recompute.propose, recompute.LOOKS_FOR, failed=recompute.unverified),
]


def register(rule: Pass, *, before: str | None = None) -> Pass:
    """Add ``rule`` to the rules :func:`fxmem.optimize` runs: last, or just before the rule named
    ``before``. Its sites are then accepted (the formulas prove the peak lower), verified (outputs
    and gradients against the model, train and eval mode) and recorded in ``meta["fxmem"]`` as the
    built-in rules' are; its ``settings`` are checked as theirs. Returns ``rule``.

    >>> fxmem.passes.register(Pass("my-rule", find, rewrite, looks_for="cat([x, x]).sum()"))  # doctest: +SKIP
    >>> fxmem.passes.unregister("my-rule")                                                    # doctest: +SKIP
    """
    if not isinstance(rule, Pass):
        raise SpecError(f"register(): expected a fxmem.passes.Pass (name, find, rewrite, ...), got "
                        f"{type(rule).__name__}; a whole-graph pass (GraphPass) is not registered this way")
    if not isinstance(rule.name, str) or not rule.name or not callable(rule.find) or not callable(rule.rewrite):
        raise SpecError(f"register(): a Pass needs a name (a non-empty string) and callable find and rewrite; got "
                        f"name={rule.name!r}")
    names = [p.name for p in PASSES]
    if rule.name in names or rule.name in [g.name for g in GRAPH_PASSES]:
        raise SpecError(f"register(): a pass named {rule.name!r} is registered already; unregister({rule.name!r}) "
                        f"first, or give yours another name")
    if before is not None and before not in names:
        raise SpecError(f"register(before={before!r}): no rule of that name; the rules, in order: {names}")
    PASSES.insert(names.index(before) if before is not None else len(PASSES), rule)
    return rule


def unregister(name: str) -> Pass:
    """Remove the rule named ``name`` (one :func:`register` added, or a built-in one) from the rules
    :func:`fxmem.optimize` runs; returns it."""
    for k, rule in enumerate(PASSES):
        if rule.name == name:
            return PASSES.pop(k)
    raise SpecError(f"unregister({name!r}): no rule of that name; the rules, in order: {[p.name for p in PASSES]}")
