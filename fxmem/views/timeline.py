"""The liveness timeline: one bar per activation storage, from the node that allocates it to the
node by whose end it is freed, with the live bytes above it and a line through the peak.

Time runs left to right over the fx nodes that allocate or free something (views and size
arithmetic change nothing and are skipped). Bars of tensors autograd keeps for backward, and of
the returned tensors, run past the forward's return into a shaded "kept" zone: that is the
memory a training step holds until backward. Bar colour is the storage's size on the same heat
scale as the live-bytes histogram on top (red = the size of the peak).

Drawn with graphviz (``neato`` with pinned positions), so it saves to SVG, PNG or PDF like the
diagram.

>>> timeline(report, report.evaluate(B=4, N=500), concrete=True).save("gat_timeline.svg")  # doctest: +SKIP
'gat_timeline.svg'
"""
from __future__ import annotations

import bisect
from typing import Any, Mapping

from ..accounting import Evaluation, Liveness
from ..records import Storage
from .figure import FONT, INK_SOFT, OUTPUT, PEAK, RESIDENT, SAVED, SAVED_EDGE, Figure, heat, heat_bins, ink
from .text import dims_text, format_bytes, formula_text, wrap

# geometry, inches
LABEL_W = 2.6  # storage names, right-aligned left of the chart
SIZE_W = 1.0  # each storage's bytes, right of the chart
NOTE_W = 3.6  # what ends its life
CHART_W = 7.0  # the forward, however many columns
COL_MIN, COL_MAX = 0.06, 0.4
KEPT_W = 0.5  # the zone after the forward returns
HIST_H = 1.1  # live-bytes histogram
ROW, BAR = 0.22, 0.15
GAP = 0.08
ZEBRA = "#f4f4f4"


class _Canvas:
    """Boxes and text at fixed positions (inches, y downwards) on a ``neato`` graph."""

    def __init__(self, fig: Figure):
        self.fig = fig

    def box(self, id: str, x: float, y: float, w: float, h: float, fill: str, **attrs: str) -> None:
        self.fig.node(id, pos=f"{x + w / 2:.3f},{-(y + h / 2):.3f}!", width=f"{max(w, 0.01):.3f}",
                      height=f"{max(h, 0.01):.3f}", fillcolor=fill, **attrs)

    def text(self, id: str, x: float, y: float, w: float, h: float, text: str, align: str = "l",
             size: int = 9, color: str = "black", bold: bool = False, **attrs: str) -> None:
        # a fixed-size box whose label ends in \l or \r is aligned inside it, wherever the text ends;
        # the box grows (away from its aligned edge) to hold text longer than planned, with the
        # width estimated at 0.62 em per character, so graphviz never re-centres overflowing text
        lines = text.split("\n")
        need = max(len(line) for line in lines) * size * (0.66 if bold else 0.62) / 72 + 0.05
        if need > w:
            x -= {"l": 0.0, "r": need - w}.get(align, (need - w) / 2)
            w = need
        h = max(h, len(lines) * size * 1.25 / 72)
        end = {"l": "\\l", "r": "\\r"}.get(align, "\\n")
        label = "".join(line.replace("\\", "\\\\") + end for line in lines)
        self.fig.node(id, label=label, pos=f"{x + w / 2:.3f},{-(y + h / 2):.3f}!", width=f"{w:.3f}",
                      height=f"{h:.3f}", style="", fontsize=str(size), fontcolor=color,
                      fontname="Helvetica-Bold" if bold else FONT, **attrs)


def timeline(report: Any, evaluation: Evaluation, concrete: bool) -> Figure:
    """The liveness timeline of ``report`` as a :class:`~.figure.Figure` (bytes).

    Bars are at ``evaluation``'s dims; without ``concrete`` sizes are shown as formulas. Bars are
    named ``bar:<storage index>`` in the output (an SVG ``<title>``), one per storage the forward
    allocated.
    """
    live = evaluation.liveness
    in_forward = {n.name for n in report.nodes if n.op != "phase"}  # fx nodes, or lines in eager mode
    position = {n.name: k for k, n in enumerate(report.nodes) if n.name in in_forward}
    storages = [s for s in report.storages if s.step is not None and s.node in position]

    # columns: the nodes where something is allocated or freed (and the peak's)
    busy = {position[s.node] for s in storages} | {position[s.freed_at] for s in storages if s.freed_at in position}
    if live.peak_node in position:
        busy.add(position[live.peak_node])
    cols = sorted(busy) or [0]
    col_w = min(COL_MAX, max(COL_MIN, CHART_W / len(cols)))
    chart_w = col_w * len(cols)

    def col(k: int) -> int:  # the column a node falls in: the last busy node at or before it
        return max(0, bisect.bisect_right(cols, k) - 1)

    fig = Figure(name=f"{report.model_name} timeline", engine="neato",
                 graph_attr=dict(splines="false", overlap="true", outputorder="nodesfirst", pad="0.25",
                                 fontname=FONT, tooltip=f"{report.model_name} liveness timeline"),
                 node_attr=dict(shape="box", style="filled", fixedsize="true", label="", margin="0",
                                penwidth="0", fontname=FONT, fontsize="9"))
    fig.dims, fig.peak_node = dict(live.dims), live.peak_node
    c = _Canvas(fig)
    rows_h = ROW * len(storages)
    top = live.peak_above_resident

    # drawn first so that everything else lies on them: zebra rows, the zone after the return
    for r in range(1, len(storages), 2):
        c.box(f"row:{r}", -LABEL_W - GAP, 0.2 + r * ROW, LABEL_W + chart_w + KEPT_W + SIZE_W + NOTE_W + 3 * GAP,
              ROW, ZEBRA)
    c.box("zone:kept", chart_w, -HIST_H - 0.05, KEPT_W, HIST_H + 0.25 + rows_h, SAVED,
          tooltip="after the forward returns: what autograd keeps for backward, and the outputs")
    c.text("label:kept", chart_w + 0.03, -HIST_H - 0.05, KEPT_W + 1.2, 0.2, "kept after return",
           size=8, color=SAVED_EDGE)
    c.box("line:return", chart_w, -HIST_H - 0.05, 0.012, HIST_H + 0.25 + rows_h, "#7f7f7f")

    # live bytes per column: the most live while its node runs (a skipped node allocates and frees
    # nothing, so it never holds more than its neighbours)
    values = [live.high[k] if k < len(live.high) else 0 for k in cols]
    for i, v in enumerate(values):
        h = HIST_H * v / top if top else 0
        c.box(f"live:{i}", i * col_w, -h, col_w, h, heat(v, top), penwidth="0.3", color="#ffffff",
              tooltip=f"{report.nodes[cols[i]].name}: up to {format_bytes(v)} live")
    c.text("label:live", -LABEL_W - GAP, -HIST_H / 2 - 0.2, LABEL_W, 0.4,
           f"live activations\nup to {format_bytes(top)}", align="r", size=9, color=INK_SOFT)
    c.box("axis:live", 0, 0, chart_w, 0.01, "#7f7f7f")

    # one bar per storage; names left, size and fate in aligned columns right, zebra rows between
    notes_x = chart_w + KEPT_W + GAP
    for r, s in enumerate(storages):
        y = 0.2 + r * ROW
        start = col(position[s.node]) * col_w
        end = (col(position[s.freed_at]) + 1) * col_w if s.freed_at in position else chart_w
        size = live.sizes[s.index]
        c.box(f"bar:{s.index}", start, y + (ROW - BAR) / 2, max(end - start, col_w), BAR, heat(size, top),
              penwidth="0.6", color="#7f7f7f", tooltip=_tooltip(s))
        kept = _kept(s, position)
        if kept:
            colour = SAVED_EDGE if s.saved_by else "#238b45" if s.is_output else "#7f7f7f"
            c.box(f"kept:{s.index}", chart_w, y + (ROW - BAR) / 2, KEPT_W, BAR,
                  SAVED if s.saved_by else OUTPUT if s.is_output else RESIDENT, penwidth="1.2", color=colour)
        ink_ = SAVED_EDGE if kept and s.saved_by else "black"
        c.text(f"name:{s.index}", -LABEL_W - GAP, y, LABEL_W, ROW, _name(s), align="r")
        c.text(f"size:{s.index}", notes_x, y, SIZE_W, ROW, format_bytes(size) if concrete else formula_text(s.bytes),
               align="r", color=ink_)
        c.text(f"fate:{s.index}", notes_x + SIZE_W + GAP, y, NOTE_W, ROW, _fate(s, kept), color=ink_)
    c.text("label:time", 0, 0.2 + rows_h, chart_w, 0.2,
           f"execution order →  ({len(cols)} nodes that allocate or free)", align="r", size=8, color=INK_SOFT)

    # the peak line
    bottom = 0.2 + rows_h
    if live.peak_node in position:
        x = (col(position[live.peak_node]) + 0.5) * col_w
        c.box("line:peak", x - 0.01, -HIST_H - 0.15, 0.02, HIST_H + 0.15 + bottom + 0.3, PEAK,
              tooltip=f"peak = {report.peak} B")
        where = "" if concrete else " (the analysis' example sizes)"
        c.text("value:peak", x - 1.0, -HIST_H - 0.32, 2.0, 0.18, format_bytes(live.peak_above_resident),
               align="c", size=8, color=PEAK)
        c.text("label:peak", max(0.0, x - 0.05), bottom + 0.3, 8.0, 0.42,
               "\n".join(wrap(f"peak in node {live.peak_node}: {formula_text(report.peak)}", 90)
                         + [f"= {live.peak:,} B ({format_bytes(live.peak)}) at {dims_text(live.dims)}{where}"]),
               align="l", size=10, color=PEAK, bold=True)
    _title(c, report, live, concrete, chart_w)
    return fig


def _name(s: Storage) -> str:
    return f"{s.node} · {s.op}" if s.op else s.node


def _kept(s: Storage, forward: Mapping[str, int]) -> bool:
    """Whether the storage outlives the forward: alive at its return, or freed only after it
    (by a training step's backward, which a report with ``optimizer=`` also records)."""
    if s.freed_at is None:
        return True
    if s.freed_at == "<return>":
        return s.is_output or bool(s.saved_by)
    return s.freed_at not in forward


def _fate(s: Storage, kept: bool) -> str:
    """What ends the storage's life: a node, the return, or backward."""
    if kept and s.saved_by:
        return "saved for backward of " + ", ".join(str(t) for t in s.saved_by)
    if kept and s.is_output:
        return "output"
    if s.freed_at is None:
        return "alive at return"
    if s.freed_at == "<return>":
        return "freed at return"
    return f"freed by {s.freed_at}"


def _tooltip(s: Storage) -> str:
    shape = "(" + ", ".join(str(d) for d in s.shape) + ")"
    return f"{s.name}: {s.op} {shape} {str(s.dtype).replace('torch.', '')} = {s.bytes} B"


def _title(c: _Canvas, report: Any, live: Liveness, concrete: bool, chart_w: float) -> None:
    mode = "training (autograd records)" if report.grad else "inference"
    y = -HIST_H - 1.05
    c.text("title", -LABEL_W - GAP, y, LABEL_W + chart_w + 4, 0.3,
           f"{report.model_name}  ·  liveness timeline  ·  {mode}  ·  {report.device}", size=14, bold=True)
    at = dims_text(live.dims) + ("" if concrete else " (the analysis' example sizes; sizes are formulas in bytes)")
    c.text("subtitle", -LABEL_W - GAP, y + 0.3, LABEL_W + chart_w + 4, 0.22,
           "one bar per activation storage, from the node that allocates it to the node by whose end it is freed; "
           f"colour: its size; bars at {at}", size=8, color=INK_SOFT)
    # the heat scale, shared by bars and histogram
    x = -LABEL_W - GAP
    c.text("legend:label", x, y + 0.55, 0.75, 0.2, "bytes up to", size=8)
    for i, (fill, _, hi) in enumerate(heat_bins(live.peak_above_resident)):
        c.box(f"legend:{i}", x + 0.8 + i * 0.72, y + 0.55, 0.7, 0.2, fill, penwidth="0.4", color="#7f7f7f",
              label=format_bytes(hi), fontsize="7", fontcolor=ink(fill))
