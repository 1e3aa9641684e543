"""What every rewrite pass has in common: the findings it reports and how the optimizer calls it.

A pass is data: a name, a ``find`` that looks at a traced graph (and at the values its nodes take
on small real inputs) and returns :class:`Finding` s, and a ``rewrite`` that applies one finding
to a copy of the graph. ``find`` decides; ``rewrite`` never declines.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch.fx

from fxmem.capture import source_line



# a node's meta key: the name of the node (of the graph as captured) whose value a rewrite's node
# computes instead: where the regions :mod:`.local_verify` checks one by one start and end
REPLACES = "fxmem_replaces"

@dataclasses.dataclass
class Probe:
    """The graph run once for real at small sizes: ``sizes`` of the user's dims (``{"N": 4}``) and
    ``env``, the value of every node (tensor, int, tuple)."""

    sizes: Mapping[str, int]
    env: Mapping[torch.fx.Node, Any]


@dataclasses.dataclass
class Finding:
    """One place a pass looked at: ``status`` is ``"match"`` (a rewrite it can apply) or
    ``"declined"`` with the ``reason`` in words."""

    rule: str
    node: torch.fx.Node  # the node the rewrite replaces (in the original graph)
    status: str
    reason: str
    plan: Any = None  # what ``rewrite`` needs; None when declined
    # nodes that are no longer needed once every finding that shares them is applied (the pair
    # tensor and its copies): findings sharing such nodes are applied, or declined, together
    frees: frozenset = frozenset()

    @property
    def where(self) -> str:
        """``"matmul_1 (seed_gat.py:45)"``: the node and the user's source line."""
        line = source_line(self.node)
        return f"{self.node.name} ({line})" if line else self.node.name


@dataclasses.dataclass(frozen=True)
class Pass:
    """A rewrite rule: ``find(gm, probes, settings) -> [Finding]``; ``rewrite(graph, nodes, finding, gm) -> Node``.

    ``probes`` are runs of the graph at two or more small sizes (:class:`Probe`); ``settings`` the
    user's choices for this pass (``optimize(..., settings={name: {...}})``, keys from ``settings``
    below); ``nodes`` maps each node of the original graph to its counterpart in the graph being
    rewritten; ``rewrite`` inserts the replacement of ``finding.node`` and returns it (the caller
    rewires the users).
    """

    name: str
    find: Callable[[torch.fx.GraphModule, Sequence[Probe], Mapping[str, Any]], list[Finding]]
    rewrite: Callable[[torch.fx.Graph, dict, Finding, torch.fx.GraphModule], torch.fx.Node]
    settings: Mapping[str, str] = dataclasses.field(default_factory=dict)  # what can be set, in words
    # what ``find`` looks for, in words: the record of a call where nothing of the kind was found
    looks_for: str = ""
    flags: frozenset = frozenset()  # the settings that are True/False (the others are sizes in bytes)
    # where ``find`` has no Finding: the closest thing in the graph and why it is not one, in words
    # (``"softmax_1 (gat.py:42): its weights are read by sum (node sum_1), not ..."``), or None
    nearest: Callable[[torch.fx.GraphModule, Sequence[Probe]], str | None] | None = None

    def no_match(self, gm: torch.fx.GraphModule, probes: Sequence[Probe]) -> dict:
        """The ``reason`` and ``details`` of the record of a call where ``find`` found nothing: what
        was looked for and, where ``nearest`` names one, the nearest thing found and why it is not one.

        >>> Pass("r", find, rewrite, looks_for="cat([h, h]).sum()").no_match(gm, probes)  # doctest: +SKIP
        {'reason': 'looked for cat([h, h]).sum(); none in the graph', 'details': None}
        """
        looked = f"looked for {self.looks_for}; none in the graph"
        near = self.nearest(gm, probes) if self.nearest is not None else None
        if not near:
            return {"reason": looked, "details": None}
        # the reason names the site (its first clause); the details say why it is not one
        return {"reason": f"{looked}; nearest: {near.split(': ', 1)[0]}", "details": f"{looked}; nearest: {near}"}


@dataclasses.dataclass
class Line:
    """What a whole-graph pass (:class:`GraphPass`) is given of one ``optimize`` call: the model,
    its inputs, sizes and options, and the call's services - ``memory(gm)`` fxmem's analysis of a
    graph (made once per graph), ``analysed(gm)`` the one made already or None, ``share(gm)`` the
    model's modules given to ``gm`` under their names (what a pass proposes, the driver verifies).
    A switched call has two lines, one per form."""

    model: torch.nn.Module
    specs: Sequence[Any]  # the parsed input specs
    input_specs: tuple  # as the user wrote them
    hints: Mapping[str, int]  # the example sizes, {dim: int}
    verify_at: Sequence[Mapping[str, int]]  # the small sizes rewrites are verified at
    verify_inputs: list  # real inputs at those sizes
    step_options: Any  # AnalysisOptions of a training step with the step's optimizer
    budget: Any  # the call's budget= and dims= (a :class:`.budget.Budget`), or None
    runs_at_dims: bool  # whether this line's form is the one that runs at budget.dims
    memory: Callable[[torch.fx.GraphModule], Any]
    analysed: Callable[[torch.fx.GraphModule], Any]
    share: Callable[[torch.fx.GraphModule], None]


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """A rewrite of the whole graph, run after the rules on what they kept: ``run(gm, line) ->
    (module, entry)`` proposes the module (``gm`` when it proposes nothing) with its
    ``meta["fxmem"]`` entry (:func:`log_entry`'s schema; ``"no match"`` with what it looked for
    when it found nothing). The pass decides by its own criterion (reorder: lower at the example
    sizes and never higher at the small ones; recompute: fits the budget at its dims); the driver
    verifies what it proposes against the model, as it does a rule's rewrite, and records the
    outcome: a proposal that differs is declined, or, where ``failed`` is given,
    ``failed(entry, difference)`` raises (recompute: a budget that cannot be met is an error)."""

    name: str
    run: Callable[[torch.fx.GraphModule, Line], tuple[torch.fx.GraphModule, dict]]
    looks_for: str = ""
    failed: Callable[[dict, Any], None] | None = None


# What each key of a ``meta["fxmem"]`` entry holds. Every entry has every key, whichever pass wrote it
# (a rule, reorder, recompute, the switch between two forms, the region), None where it does not
# apply; a pass may add its own after them (recompute: "plan", "budget"). Formulas are strings of
# sympy expressions in the user's dims (bytes); ``bytes_*`` are ints (bytes).
FIELDS = {
    "rule": "the pass that wrote the entry (a rule's name, 'reorder', 'recompute', 'switch', 'region', 'train/eval', 'use_cache')",
    "status": "'applied' (in the returned module), 'declined' (found, not kept) or 'no match' (nothing of the "
              "kind in the graph)",
    "where": "the node and the user's file:line of the site (the model's name for whole-graph entries; "
             "recompute: the blocks recomputed)",
    "reason": "one line (at most REASON_LIMIT characters): what was decided and why, in words - 'applied: "
              "inference peak 1.96 GiB -> 8.11 MiB at B=4, N=500', 'declined: exact, but no memory saved where "
              "the formulas hold'; the details are in the keys below",
    "when": "the sizes the entry holds for when the result has two forms ('N >= 160*B', 'not (N >= 160*B)'), "
            "else None (every size)",
    "decision": "the formula comparison the decision rests on, in words (which peak is never higher where, "
                "with both formulas where they cross)",
    "peak_before": "forward peak formula (bytes, in the dims) of the graph before the rewrite",
    "peak_after": "forward peak formula after it (None: not tried)",
    "saved_before": "formula of the bytes autograd keeps for backward, before",
    "saved_after": "the same, after",
    "train_peak_before": "training-step peak formula before (None: no training step analysed)",
    "train_peak_after": "the same, after",
    "inference_peak_before": "inference (eval mode, no_grad) peak formula before",
    "inference_peak_after": "the same, after",
    "details": "the full words of what was found: the rewrite a rule makes at the site (or why a look-alike "
               "is not one), what a switch or region runs where, a failed verification's message",
    "condition": "the condition in the dims where the rewrite lowers the peak ('N >= 160*B'; the switch's "
                 "condition; the region's guards), else None",
    "verification": "the comparison with the model on real runs: 'passed' (same outputs, gradients and buffers "
                    "at the verification sizes, train and eval mode) or 'failed: max diff 0.31 in <where>'; "
                    "None where nothing was run",
    "group": "how the site was tried with others: 'applied with the other 3 sdpa site(s) in one trial ...', "
             "'accepted as a group of 2 ... sites that lower the peak only together ...'; None alone",
    "no_longer_built": "the nodes of the original graph the rewrite removes (names), e.g. the pair tensor",
    "flops": "recompute: the FLOPs recomputed in backward, in words (and when they could not be counted)",
    "sizes": "{dim: int}: the sizes the reason's numbers and bytes_before/bytes_after are at (the example "
             "sizes; recompute: the budget's dims)",
    "bytes_before": "{'peak', 'train_peak', 'inference_peak'}: those peaks at ``sizes``, ints (bytes) "
                    "(None: not analysed)",
    "bytes_after": "the same, after",
}
LOG_KEYS = tuple(FIELDS)
# applied: in the returned module; declined: found and not kept (reason says why); no match:
# nothing of the kind in the graph (reason says what was looked for)
STATUSES = ("applied", "declined", "no match")
# the most characters a reason has: one line of a log (two of an 100-column terminal at most); the
# status, two or three peaks before -> after (format_bytes: "1.96 GiB", 8-10 characters each) and
# the example sizes of four or five dims fit in it; anything longer belongs in ``details``
REASON_LIMIT = 200


def brief(text: str, limit: int = REASON_LIMIT) -> str:
    """``text`` as one line of at most ``limit`` characters: its first sentence, cut at a word with
    "..." where still longer.

    >>> brief("pairs are not (h_i, h_j) (at B=3). The concatenation runs along dim 1")
    'pairs are not (h_i, h_j) (at B=3)'
    >>> len(brief("x " * 200)) <= REASON_LIMIT
    True
    """
    line = " ".join(str(text).split())
    cut = line.find(". ")
    if cut > 0:
        line = line[:cut]
    if len(line) > limit:
        line = line[:limit - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
    return line


def log_entry(rule: str, status: str, where: str, reason: str, **extra: Any) -> dict:
    """One ``meta["fxmem"]`` entry with every key of :data:`LOG_KEYS` (None where it does not apply);
    ``reason`` made one line (:func:`brief`): the rest of a long text belongs in ``details=``.

    >>> log_entry("sdpa", "no match", "Net", "no softmax(q @ k^T) @ v")["peak_after"] is None
    True
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    out = dict.fromkeys(LOG_KEYS)
    out.update(rule=rule, status=status, where=where, reason=brief(reason))
    out.update(extra)
    return out
