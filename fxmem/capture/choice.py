"""Which capture an analysis used, and why: the fx-traced graph where ``torch.fx`` can trace the
model, else the original ``forward`` (eager mode), with the reason fx gave.

The default ``mode="auto"`` tries fx first because a traced graph frees each value after its last
use and gives the per-node diagram and module table; where fx cannot follow the code (wrapped
``forward`` methods, control flow on sizes, Proxy item assignment, ``torch.zeros(x.size(0), F)``),
the original ``forward`` runs instead. Its numbers are those of the model as the user calls it, so
they are never a stand-in: the report says which ran (``report.capture``, and ``summary()``).

>>> Capture("graph", "torch.fx symbolic trace").text
'graph mode: torch.fx symbolic trace'
"""
from __future__ import annotations

import dataclasses

from ..errors import TraceError


@dataclasses.dataclass(frozen=True)
class Capture:
    """``mode``: "auto" (graph, falling back to eager), "graph" or "eager"; ``how``: what runs;
    ``reason``: why the original forward runs although a graph was asked for (None: it was not)."""

    mode: str
    how: str
    reason: str | None = None

    @property
    def run_mode(self) -> str:
        """The mode the simulation runs in: "graph" or "eager"."""
        return "eager" if self.mode == "eager" else "graph"

    @property
    def text(self) -> str:
        head = f"{self.run_mode} mode: {self.how}"
        return head if self.reason is None else f"{head}, because {self.reason}"


def fallback(exc: TraceError) -> Capture:
    """The eager capture that replaces a failed fx trace, saying why (fx's failure, in one line)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.strip().startswith("what to do")]
    reason = "torch.fx " + ": ".join(lines) if lines else "torch.fx cannot trace the model"
    return Capture("eager", "the original forward (locals live until it returns)", reason)
