"""Live bytes at concrete dims, node by node: what the diagram's heat scale and the timeline draw.

``report.evaluate`` answers "how much"; this answers "when": for every fx node, the most
activation bytes live at any moment while it runs (its high-water mark, which is where a peak
inside a node shows up - ``cat`` holds its inputs and its output at once) and the bytes live when
it ends. All numbers are bytes above resident (parameters, buffers, inputs), as the memory plan
counts them; on ``device="cuda"`` every block is rounded up to 512 bytes like the allocator does.

>>> live = liveness(report, {"B": 4, "N": 500})                  # doctest: +SKIP
>>> live.peak_node, live.peak_above_resident == max(live.high)    # doctest: +SKIP
('cat', True)
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

from .memory_plan import replay
from .specs import check_dims
from .symbolic import evaluate

if TYPE_CHECKING:  # pragma: no cover
    from .report import Report


@dataclasses.dataclass
class Liveness:
    """Bytes at concrete ``dims``; ``high``/``after`` align with ``report.nodes``, ``sizes`` with ``report.storages``."""

    dims: dict  # user dim name -> int
    resident: int  # bytes of parameters, buffers, inputs
    peak: int  # absolute peak bytes (resident + peak_above_resident)
    peak_above_resident: int
    peak_node: str | None  # fx node during which the peak happens
    high: list  # per node: most activation bytes live at any moment while it runs
    after: list  # per node: activation bytes live when it ends
    sizes: list  # per storage: bytes (rounded to allocator blocks on CUDA)


def liveness(report: "Report", dims: Mapping[str, int] | None = None) -> Liveness:
    """Per-node live bytes of ``report`` at ``dims`` (default: the analysis' example sizes).

    ``dims`` must lie where the report's formulas hold; ``Report.liveness`` re-analyses outside.
    """
    values = dict(check_dims(dict(dims), report.symbols)) if dims else dict(report.hints)
    plan = report._plan
    subs = {report.symbols[k]: v for k, v in values.items()}
    numbers = plan.evaluate(subs)
    sizes = numbers["_sizes"]
    # evaluate() keeps only the overall peak; replaying again with the same integers gives every
    # moment's live bytes, which we attribute to the fx node whose steps produced them
    walk = replay(plan.rec, lambda i: sizes[i], lambda p: evaluate(plan.to_user(p), subs), 0,
                  lambda a, b: a + b, lambda a: -a, lambda d: d > 0)
    index = {n.name: k for k, n in enumerate(report.nodes)}
    after = list(walk.after_node) + [walk.final] * (len(report.nodes) - len(walk.after_node))
    high = [max(after[k], after[k - 1] if k else 0) for k in range(len(after))]
    for step, value in walk.candidates:
        k = index.get(plan.rec.steps[step].node)
        if k is not None:
            high[k] = max(high[k], value)
    peak_step = numbers["_peak_step"]
    return Liveness(values, numbers["resident"], numbers["peak"], numbers["peak_above_resident"],
                    None if peak_step is None else plan.rec.steps[peak_step].node, high, after, list(sizes))
