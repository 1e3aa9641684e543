"""The memory timeline: bytes live over the forward, and one bar per tensor from its allocation to its free.

Time runs left to right over the fx nodes that allocate or free something (views and size
arithmetic change nothing and are skipped), named on the x-axis. The upper chart is the memory
live while each node runs: the resident bytes (parameters, buffers, inputs) at the bottom in
grey, the activations above them, so its top is what ``memory_allocated()`` would show and the
peak's bar reaches the report's ``peak``. The lower chart has one bar per activation tensor, from
the node that allocates it to the node by whose end it is freed, coloured by its fate: freed
during the forward, kept for backward, or returned. Bars of kept tensors run into the "after
return" column: what a training step holds until backward. A dashed line marks the peak.

With ``step`` (a :class:`~fxmem.accounting.StepLiveness`, the default for an analysis made with
``optimizer=``) the chart is of the whole training step: columns run over the forward's nodes,
then each node's backward (``conv (backward)``), the loss and ``optimizer.step()``, with the
phases shaded and named (SVG ids ``phase:<name>``); the bars include the backward's temporaries
and the gradients, and the dashed line and caption mark the step's peak (``train_peak``).

Bars are named by the node and what the tensor is to it; in eager mode (the original ``forward``,
Hugging Face models) by the module that made the tensor first (``model.layers.0.self_attn``), then
the source line.

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

from ..accounting import Evaluation, StepLiveness
from ..accounting.replay import forward_node_of
from ..errors import FxMemError
from ..records import Storage
from .figure import PEAK, PHASE_TEXT, output_format, step_peak_text, writing
from ..units import format_bytes
from .text import dims_text, node_inputs, storage_text

MAX_BARS = 40  # tensors drawn one by one; the rest (the smallest) are counted in the caption
MAX_TICKS = 60  # columns named on the x-axis; beyond, every k-th (and the peak's, and each phase's first)
FREED, KEPT, RETURNED, RESIDENT_GREY, LIVE = "#fdae6b", "#6baed6", "#74c476", "#bdbdbd", "#fd8d3c"
GRADIENT = "#9e9ac8"
PHASE_SHADES = ("#f7f7f7", "#e6e6f2")  # alternate backgrounds of the training step's phases


class Chart:
    """A matplotlib figure that saves itself by extension and shows itself in notebooks (SVG).

    ``dims`` are the sizes its numbers are at; ``peak_node`` the node holding the peak there.
    """

    peak_phase: str | None = None  # the training step's phase holding its peak (None: a chart of the forward)

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


def _matplotlib() -> tuple:
    """matplotlib's pieces the charts use, imported when first drawn (an optional extra: fxmem[plot])."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, MultipleLocator
    except ImportError:
        raise FxMemError("the timeline is drawn with matplotlib: pip install matplotlib (or fxmem[plot])") from None
    return Figure, Patch, FuncFormatter, MultipleLocator


def timeline(report: Any, evaluation: Evaluation, step: StepLiveness | None = None) -> Chart:
    """The memory timeline of ``report`` at ``evaluation``'s dims, as a :class:`Chart` (bytes);
    with ``step`` (the training step's live bytes at the same dims) of the whole training step."""
    if step is not None:
        return _step_timeline(report, step)
    Figure, Patch, FuncFormatter, MultipleLocator = _matplotlib()
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
    eager = report.graph_module is None
    bottom.set_xticks(range(end + 1), [_column_label(report.nodes[k].name, by_name, eager) for k in cols]
                      + ["after return"], rotation=90, fontsize=8)
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
    # "forward": the whole training step is the other chart (``step``); grad=True only records as training does
    mode = "forward (autograd records, as in training)" if report.grad else "inference"
    fig.suptitle(f"{report.model_name} · memory timeline · {mode} · "
                 f"{report.device} · at {dims_text(live.dims)}", fontsize=12, fontweight="bold")
    caption = (f"peak{where}: {live.peak:,} B ({format_bytes(live.peak)}) = resident {format_bytes(live.resident)}"
               f" + activations {format_bytes(live.peak_above_resident)}")
    if hidden:
        caption += f"; {hidden} smaller tensors not drawn as bars"
    top.set_title(caption, fontsize=9, color=PEAK, loc="left", wrap=True)
    return Chart(fig, dict(live.dims), live.peak_node)


def _step_timeline(report: Any, step: StepLiveness) -> Chart:
    """The whole training step as a :class:`Chart`: live bytes per column above ``train_resident``,
    one bar per tensor the step allocates, the phases shaded, the step's peak marked (bytes)."""
    Figure, Patch, FuncFormatter, MultipleLocator = _matplotlib()
    end = len(step.columns)  # the "after the step" column
    storages = [s for s in report.storages if s.index in step.born]
    shown = sorted(storages, key=lambda s: -step.sizes[s.index])[:MAX_BARS]
    shown.sort(key=lambda s: s.index)  # allocation order, top to bottom
    width = min(18.0, max(10.0, 0.28 * (min(end, MAX_TICKS) + 1) + 4.5))
    fig = Figure(figsize=(width, 2.6 + 0.24 * len(shown) + 2.0), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2.6, 0.24 * max(len(shown), 1) + 0.2])
    values = [c.high for c in step.columns] + [step.final]
    for i, v in enumerate(values):
        r = top.bar(i, step.resident, width=0.8, color=RESIDENT_GREY, edgecolor="white", linewidth=0.3)
        r.patches[0].set_gid(f"resident:{i}")
        b = top.bar(i, v, bottom=step.resident, width=0.8, color=PEAK if i == step.peak_column else LIVE,
                    edgecolor="white", linewidth=0.3)
        b.patches[0].set_gid(f"live:{i}")
    top.yaxis.set_major_locator(MultipleLocator(_binary_step(max(values, default=0) + step.resident)))
    top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(int(v)) if v else "0"))
    top.set_ylabel("live while it runs")
    top.grid(axis="y", color="#eeeeee")
    top.set_axisbelow(True)
    for r, s in enumerate(shown):
        _step_bar(bottom, r, s, step, end)
    by_name = {n.name: n for n in report.nodes}
    names = [_name(s, by_name.get(s.node) or by_name.get(forward_node_of(s.node or '')), report) for s in shown]
    bottom.set_yticks(range(len(shown)), names, fontsize=8)
    bottom.set_ylim(len(shown) - 0.5, -0.5)
    bottom.set_xlim(-0.6, end + 1.6)
    _step_ticks(bottom, step, by_name, report.graph_module is None)
    bottom.set_xlabel("execution order (each node's allocating calls: forward, then its backward, then the optimizer)")
    bottom.legend(handles=[Patch(color=c) for c in (RESIDENT_GREY, LIVE, FREED, KEPT, GRADIENT, RETURNED)],
                  labels=[f"resident: parameters, buffers, inputs, optimizer state ({format_bytes(step.resident)})",
                          "activations live", "freed within the step", "kept by the forward for backward",
                          "gradient", "alive when the step ends"],
                  loc="lower left", fontsize=8, frameon=False, ncols=2, bbox_to_anchor=(0, 1.0),
                  handlelength=1.2, columnspacing=1.2)
    _shade_phases(top, bottom, step, end)
    column = step.columns[step.peak_column] if step.peak_column is not None else None
    own = by_name.get(column.forward_node) if column is not None else None
    module = own.module if own is not None and report.graph_module is None else ""
    where = step_peak_text(step.peak_node, step.peak_phase, column.forward_node if column else None, module)
    fig.suptitle(f"{report.model_name} · memory timeline · training step (forward, backward(), optimizer.step()) · "
                 f"{report.device} · at {dims_text(step.dims)}", fontsize=12, fontweight="bold")
    caption = (f"training-step peak (train_peak) {where}: {step.peak:,} B ({format_bytes(step.peak)}) = train_resident "
               f"{format_bytes(step.resident)} + activations {format_bytes(step.peak_above_resident)}")
    if len(storages) > len(shown):
        caption += f"; {len(storages) - len(shown)} smaller tensors not drawn as bars"
    top.set_title(caption, fontsize=9, color=PEAK, loc="left", wrap=True)
    chart = Chart(fig, dict(step.dims), step.peak_node)
    chart.peak_phase = step.peak_phase
    return chart


def _step_bar(ax: Any, row: int, s: Storage, step: StepLiveness, end: int) -> None:
    """One tensor's bar, from the column that allocates it to the one by whose end it is freed."""
    start = step.born[s.index]
    stop = step.died.get(s.index, end)
    forward = step.columns[start].phase == "forward"
    if s.role.value == "gradient":
        colour = GRADIENT
    elif s.index not in step.died:
        colour = RETURNED
    else:
        colour = KEPT if forward and s.saved_by and step.columns[stop].phase != "forward" else FREED
    bars = ax.barh(row, stop - start + 0.8, left=start - 0.4, height=0.7, color=colour, edgecolor="#7f7f7f",
                   linewidth=0.5)
    bars.patches[0].set_gid(f"bar:{s.index}")
    ax.text(stop + 0.5, row, format_bytes(step.sizes[s.index]), va="center", fontsize=7)


def _step_ticks(ax: Any, step: StepLiveness, by_name: dict, eager: bool) -> None:
    """Name the columns on the x-axis: all of them up to :data:`MAX_TICKS`, else every k-th plus
    the peak's and each phase's first (a 2-layer Llama's step has hundreds)."""
    end = len(step.columns)
    keep = set(range(end))
    if end > MAX_TICKS:
        every = -(-end // MAX_TICKS)
        keep = set(range(0, end, every)) | {k for k in range(end) if k == 0 or
                                            step.columns[k].phase != step.columns[k - 1].phase}
        if step.peak_column is not None:
            keep.add(step.peak_column)
    ticks = sorted(keep)
    ax.set_xticks(ticks + [end], [_column_label(step.columns[k].node, by_name, eager) for k in ticks]
                  + ["after the step"], rotation=90, fontsize=8 if len(ticks) <= MAX_TICKS else 6)


def _shade_phases(top: Any, bottom: Any, step: StepLiveness, end: int) -> None:
    """Shade each phase's columns, name it above the upper chart, and mark the peak's column."""
    spans: list[list] = []  # [phase, first column, last column]
    for k, c in enumerate(step.columns):
        if spans and spans[-1][0] == c.phase:
            spans[-1][2] = k
        else:
            spans.append([c.phase, k, k])
    for n, (phase, first, last) in enumerate(spans):
        for ax in (top, bottom):
            span = ax.axvspan(first - 0.5, last + 0.5, color=PHASE_SHADES[n % 2], zorder=0)
            if ax is top:
                span.set_gid(f"phase:{phase}")
        top.text((first + last) / 2, 0.98, PHASE_TEXT.get(phase, phase), transform=top.get_xaxis_transform(),
                 ha="center", va="top", fontsize=7, color="#444444", rotation=90 if last - first < 3 else 0)
    for ax in (top, bottom):
        ax.axvspan(end - 0.5, end + 1.6, color="#f0f0f0", zorder=0)
        if step.peak_column is not None:
            line = ax.axvline(step.peak_column, color=PEAK, linestyle="--", linewidth=1)
            line.set_gid("line:peak" if ax is top else "line:peak-bars")


def _binary_step(top: int) -> float:
    """A tick step of 2**k bytes (0.25 MiB, 512 MiB, 1 GiB ...) giving four to eight ticks up to ``top``."""
    step = 1.0
    while top / step > 8:
        step *= 2
    return step


def _name(s: Storage, node: Any, report: Any) -> str:
    """``matmul · contiguous copy of getitem_3``: the node and what the tensor is to it; in eager
    mode ``model.layers.0.mlp · aten.mm · modeling_llama.py:152``: the module first (a source line
    of transformers says little), the line second. ``node`` is None for what a backward or the
    optimizer step allocates (named by its op, or a gradient by its parameter)."""
    if node is None or node.name != s.node:
        # a gradient's storage is named after the backward that made it: its shape says which parameter's
        what = f"gradient {tuple(s.shape)}" if s.role.value == "gradient" else (s.op or s.name)
    else:
        what = storage_text(s, node, node_inputs(report, node), report.storages)
    if report.graph_module is not None or not s.node or (node is not None and node.op == "phase"):
        return f"{s.node} · {what}"  # graph mode's node names say where; a phase (optimizer.step) has no module
    module = s.module or (node.module if node is not None else "")
    return f"{module or '(the model)'} · {what} · {s.node}"


def _column_label(name: str, by_name: dict, eager: bool, width: int = 44) -> str:
    """An x-axis label: the node's name (graph mode); in eager mode ``module @ file.py:12`` (the
    module first), ``(backward)`` kept, cut to ``width`` characters from the left (the line stays).

    >>> _column_label("a.py:3 (backward)", {"a.py:3": type("N", (), {"module": "mlp"})}, eager=True)
    'mlp @ a.py:3 (backward)'
    """
    node = by_name.get(forward_node_of(name))
    if not eager or node is None or not node.module:
        return name
    name = f"{node.module} @ {name}"
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _kept(s: Storage, forward: dict) -> bool:
    """Whether the storage outlives the forward: alive at its return, or freed only after it
    (by a training step's backward, which a report with ``optimizer=`` also records)."""
    if s.freed_at is None:
        return True
    if s.freed_at == "<return>":
        return s.is_output or bool(s.saved_by)
    return s.freed_at not in forward
