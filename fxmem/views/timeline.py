"""The memory timeline: bytes live over the forward, and one bar per tensor from its allocation to its free.

Time runs left to right over the fx nodes that allocate or free something (views and size
arithmetic change nothing and are skipped), named on the x-axis. The upper chart is the memory
live while each node runs: the resident bytes (parameters, buffers, inputs) at the bottom in
grey, the activations above them, so its top is what ``memory_allocated()`` would show and the
peak's bar reaches the report's ``peak``. The lower chart has one bar per activation tensor, from
the node that allocates it to the node by whose end it is freed, coloured by its fate: freed
during the forward, kept for backward, or returned. Bars of kept tensors run into the "after
return" column: what a training step holds until backward. A dashed line marks the peak.

Drawn with matplotlib (a real chart: axes, ticks, text that is measured, not guessed); it saves
to SVG, PNG or PDF by extension and shows itself in notebooks. Every bar has an SVG id
(``bar:<storage index>``, ``live:<column>``, ``resident:<column>``, ``line:peak``).

>>> timeline(report, report.evaluate(B=4, N=500)).save("gat_timeline.svg")  # doctest: +SKIP
'gat_timeline.svg'
"""
from __future__ import annotations

import bisect
import io
import os
from typing import Any

from ..accounting import Evaluation
from ..errors import FxMemError
from ..records import Storage
from .figure import PEAK, output_format, writing
from .text import dims_text, format_bytes, node_inputs, storage_text

MAX_BARS = 40  # tensors drawn one by one; the rest (the smallest) are counted in the caption
FREED, KEPT, RETURNED, RESIDENT_GREY, LIVE = "#fdae6b", "#6baed6", "#74c476", "#bdbdbd", "#fd8d3c"


class Chart:
    """A matplotlib figure that saves itself by extension and shows itself in notebooks (SVG).

    ``dims`` are the sizes its numbers are at; ``peak_node`` the node holding the peak there.
    """

    def __init__(self, figure: Any, dims: dict, peak_node: str | None):
        self.figure, self.dims, self.peak_node = figure, dims, peak_node

    def save(self, path: str | os.PathLike) -> str:
        """Write the chart to ``path``: ``.svg``, ``.png`` or ``.pdf``."""
        path = os.fspath(path)
        fmt = output_format(path)
        if fmt is None:
            raise FxMemError(f"cannot write {path!r}: the timeline is a chart, not a graph; use .svg, .png or .pdf")
        with writing(path):
            self.figure.savefig(path, format=fmt, dpi=110)
        return path

    def svg(self) -> str:
        """The chart as SVG text."""
        out = io.StringIO()
        self.figure.savefig(out, format="svg")
        return out.getvalue()

    def _repr_svg_(self) -> str:
        return self.svg()


def timeline(report: Any, evaluation: Evaluation) -> Chart:
    """The memory timeline of ``report`` at ``evaluation``'s dims, as a :class:`Chart` (bytes)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, MultipleLocator
    except ImportError:
        raise FxMemError("the timeline is drawn with matplotlib: pip install matplotlib (or fxmem[plot])") from None
    live = evaluation.liveness
    in_forward = {n.name for n in report.nodes if n.op != "phase"}  # fx nodes, or lines in eager mode
    position = {n.name: k for k, n in enumerate(report.nodes) if n.name in in_forward}
    storages = [s for s in report.storages if s.step is not None and s.node in position]

    # columns: the nodes where something is allocated or freed (and the peak's), then "after return"
    busy = {position[s.node] for s in storages} | {position[s.freed_at] for s in storages if s.freed_at in position}
    if live.peak_node in position:
        busy.add(position[live.peak_node])
    cols = sorted(busy) or [0]
    end = len(cols)  # the "after return" column

    def col(k: int) -> int:  # the column a node falls in: the last busy node at or before it
        return max(0, bisect.bisect_right(cols, k) - 1)

    shown = sorted(storages, key=lambda s: -live.sizes[s.index])[:MAX_BARS]
    shown.sort(key=lambda s: s.index)  # allocation order, top to bottom
    hidden = len(storages) - len(shown)
    width = min(18.0, max(10.0, 0.28 * (end + 1) + 4.5))
    height = 2.6 + 0.24 * len(shown) + 1.4
    fig = Figure(figsize=(width, height), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2.6, 0.24 * max(len(shown), 1) + 0.2])
    binary = FuncFormatter(lambda v, _: format_bytes(int(v)) if v else "0")

    # live bytes while each node runs, on top of the resident bytes
    values = [live.high[k] if k < len(live.high) else 0 for k in cols] + [live.after[-1] if live.after else 0]
    peak_col = col(position[live.peak_node]) if live.peak_node in position else None
    for i, v in enumerate(values):
        r = top.bar(i, live.resident, width=0.8, color=RESIDENT_GREY, edgecolor="white", linewidth=0.3)
        r.patches[0].set_gid(f"resident:{i}")
        colour = PEAK if i == peak_col else KEPT if i == end else LIVE
        b = top.bar(i, v, bottom=live.resident, width=0.8, color=colour, edgecolor="white", linewidth=0.3)
        b.patches[0].set_gid(f"live:{i}")
    top.yaxis.set_major_locator(MultipleLocator(_binary_step(max(values, default=0) + live.resident)))
    top.yaxis.set_major_formatter(binary)
    top.set_ylabel("live while the node runs")
    top.grid(axis="y", color="#eeeeee")
    top.set_axisbelow(True)

    # one bar per tensor
    for r, s in enumerate(shown):
        start = col(position[s.node])
        kept = _kept(s, position)
        stop = end if kept else col(position[s.freed_at]) if s.freed_at in position else end - 1
        colour = (KEPT if s.saved_by else RETURNED) if kept else FREED
        bars = bottom.barh(r, stop - start + 0.8, left=start - 0.4, height=0.7, color=colour, edgecolor="#7f7f7f",
                           linewidth=0.5)
        bars.patches[0].set_gid(f"bar:{s.index}")
        bottom.text(stop + 0.5, r, format_bytes(live.sizes[s.index]), va="center", fontsize=7)
    by_name = {n.name: n for n in report.nodes}
    bottom.set_yticks(range(len(shown)), [_name(s, by_name[s.node], report) for s in shown], fontsize=8)
    bottom.set_ylim(len(shown) - 0.5, -0.5)
    bottom.set_xlim(-0.6, end + 1.6)
    bottom.set_xticks(range(end + 1), [report.nodes[k].name for k in cols] + ["after return"], rotation=90,
                      fontsize=8)
    bottom.set_xlabel("execution order (nodes that allocate or free)")
    bottom.legend(handles=[Patch(color=RESIDENT_GREY), Patch(color=LIVE), Patch(color=FREED), Patch(color=KEPT),
                           Patch(color=RETURNED)],
                  labels=[f"resident: parameters, buffers, inputs ({format_bytes(live.resident)})",
                          "activations live", "tensor freed during the forward", "kept for backward", "returned"],
                  loc="lower left", fontsize=8, frameon=False, ncols=5 if width > 12 else 3, bbox_to_anchor=(0, 1.0),
                  handlelength=1.2, columnspacing=1.2)
    for ax in (top, bottom):
        ax.axvspan(end - 0.5, end + 1.6, color="#f0f0f0", zorder=0)
        if peak_col is not None:
            line = ax.axvline(peak_col, color=PEAK, linestyle="--", linewidth=1)
            line.set_gid("line:peak" if ax is top else "line:peak-bars")

    where = f" in node {live.peak_node}" if live.peak_node else ""
    fig.suptitle(f"{report.model_name} · memory timeline · {'training' if report.grad else 'inference'} · "
                 f"{report.device} · at {dims_text(live.dims)}", fontsize=12, fontweight="bold")
    caption = (f"peak{where}: {live.peak:,} B ({format_bytes(live.peak)}) = resident {format_bytes(live.resident)}"
               f" + activations {format_bytes(live.peak_above_resident)}")
    if hidden:
        caption += f"; {hidden} smaller tensors not drawn as bars"
    top.set_title(caption, fontsize=9, color=PEAK, loc="left", wrap=True)
    return Chart(fig, dict(live.dims), live.peak_node)


def _binary_step(top: int) -> float:
    """A tick step of 2**k bytes (0.25 MiB, 512 MiB, 1 GiB ...) giving four to eight ticks up to ``top``."""
    step = 1.0
    while top / step > 8:
        step *= 2
    return step


def _name(s: Storage, node: Any, report: Any) -> str:
    """``matmul · contiguous copy of getitem_3``: the node and what the tensor is to it."""
    return f"{s.node} · {storage_text(s, node, node_inputs(report, node), report.storages)}"


def _kept(s: Storage, forward: dict) -> bool:
    """Whether the storage outlives the forward: alive at its return, or freed only after it
    (by a training step's backward, which a report with ``optimizer=`` also records)."""
    if s.freed_at is None:
        return True
    if s.freed_at == "<return>":
        return s.is_output or bool(s.saved_by)
    return s.freed_at not in forward
