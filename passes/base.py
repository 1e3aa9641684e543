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


@dataclasses.dataclass
class Line:
    """What a whole-graph pass (:class:`GraphPass`) is given of one ``optimize`` call: the model,
    its inputs, sizes and options, and the call's services - ``memory(gm)`` fxmem's analysis of a
    graph (made once per graph), ``analysed(gm)`` the one made already or None, ``verify(gm)`` the
    comparison with the model on real runs (``.ok``), ``share(gm)`` the model's modules given to
    ``gm`` under their names. A switched call has two lines, one per form."""

    model: torch.nn.Module
    specs: Sequence[Any]  # the parsed input specs
    input_specs: tuple  # as the user wrote them
    hints: Mapping[str, int]  # the example sizes, {dim: int}
    verify_at: Sequence[Mapping[str, int]]  # the small sizes rewrites are verified at
    verify_inputs: list  # real inputs at those sizes
    step_options: Any  # AnalysisOptions of a training step with the step's optimizer
    budget: Any  # bytes or "24GiB", or None
    dims: Mapping[str, int] | None  # where the budget must hold
    runs_at_dims: bool  # whether this line's form is the one that runs at dims
    memory: Callable[[torch.fx.GraphModule], Any]
    analysed: Callable[[torch.fx.GraphModule], Any]
    verify: Callable[[torch.fx.GraphModule], Any]
    share: Callable[[torch.fx.GraphModule], None]


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """A rewrite of the whole graph, run after the rules on what they kept: ``run(gm, line) ->
    (module, entry)``, the module (``gm`` when nothing is kept) and its ``meta["fxmem"]`` entry
    (:func:`log_entry`'s schema; ``"no match"`` with what it looked for when it found nothing)."""

    name: str
    run: Callable[[torch.fx.GraphModule, Line], tuple[torch.fx.GraphModule, dict]]
    looks_for: str = ""


# The keys every ``meta["fxmem"]`` entry has, whichever pass wrote it (a rule, reorder, recompute,
# the switch between two forms); a pass may add its own after them (recompute: "plan", "budget").
LOG_KEYS = ("rule", "status", "where", "reason", "when", "decision", "peak_before", "peak_after", "saved_before",
            "saved_after", "train_peak_before", "train_peak_after", "inference_peak_before", "inference_peak_after")
# applied: in the returned module; declined: found and not kept (reason says why); no match:
# nothing of the kind in the graph (reason says what was looked for)
STATUSES = ("applied", "declined", "no match")


def log_entry(rule: str, status: str, where: str, reason: str, **extra: Any) -> dict:
    """One ``meta["fxmem"]`` entry with every key of :data:`LOG_KEYS` (None where it does not apply).

    >>> log_entry("sdpa", "no match", "Net", "no softmax(q @ k^T) @ v")["peak_after"] is None
    True
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    out = dict.fromkeys(LOG_KEYS)
    out.update(rule=rule, status=status, where=where, reason=reason)
    out.update(extra)
    return out
