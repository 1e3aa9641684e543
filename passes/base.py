"""What every rewrite pass has in common: the findings it reports and how the optimizer calls it.

A pass is data: a name, a ``find`` that looks at a traced graph (and at the values its nodes take
on small real inputs) and returns :class:`Finding` s, and a ``rewrite`` that applies one finding
to a copy of the graph. ``find`` decides; ``rewrite`` never declines.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch.fx

from ..capture import source_line



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
