"""The memory diagram: the fx graph in execution order, each node saying what it allocates and keeps.

What a node *allocates* is the first thing one sees: one row per tensor it allocates (its output,
the contiguous copies ``matmul`` makes of its operands, dropout's mask ...), the size of each,
and, on a blue row, whether autograd keeps it for backward; with ``dims`` the fill is the node's
allocated bytes on a heat scale. The memory *live* when the node ends (everything allocated
before and not yet freed) is a second, distinct mark: a grey gauge at the bottom of the box, its
length the share of the peak; the node where the peak happens has a dark red frame and a banner
with the peak's formula and value.

Without ``dims`` every size is a formula in the user's dims and nothing is coloured by size (the
analysis' example sizes were never the user's choice); the peak's node is marked only where it is
the same for all sizes (the peak formula has no ``Max``). With ``dims`` everything is numbers.
Size arithmetic (``x.size(1)``, ``N * N``) is left out. ``group="module"`` draws one box per
module (``blocks.3``, ``encoder.layer.0`` ...), so a 12-block transformer stays legible; by default
(``group="auto"``) a graph of more than :data:`FOLD_NODES` nodes is drawn so, with the module where
the peak happens drawn node by node (``group=None`` draws every node).

With ``step`` (a :class:`~fxmem.accounting.StepLiveness`: the default for an analysis made with
``optimizer=``) the drawing is of the training step: the forward's nodes as above, then one box
per phase after it (the loss, ``backward()``, ``optimizer.step()``, ``zero_grad``) joined by dashed
edges, and the banner marks the step's peak (``train_peak``) where it happens. A peak in the
backward of node X is marked on X's box ("TRAINING-STEP PEAK in the backward of X"), the
``backward()`` box saying so too; a peak in the loss or the optimizer step on that phase's box.
The backward's own nodes are not drawn one by one: they mirror the forward's.

>>> fig = diagram(report, report.evaluate(B=4, N=500), concrete=True)    # doctest: +SKIP
>>> fig.save("gat.svg")                           # doctest: +SKIP
'gat.svg'
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy

from ..accounting import Evaluation, Liveness, StepLiveness
from ..accounting.symbolic import evaluate
from ..errors import SpecError
from ..records import Node, Storage
from .figure import (FONT, INK_SOFT, OUTPUT, PEAK, PHASE_TEXT, RESIDENT, SAVED, Figure, esc, heat, heat_bins, ink,
                     lines_html, step_peak_text)
from ..units import format_bytes
from .text import code_lines, dims_text, formula_text, node_inputs, node_kind, storage_text, wrap

GROUPS = (None, "module", "auto")
FOLD_NODES = 60  # "auto": a graph with more nodes than this folds into modules
GAUGE_W = 150  # points: the live-bytes gauge at the peak
SMALL = 1024  # bytes: constant-size tensors below this (a Python number as a tensor) share one row
STEP_PHASES = ("loss", "backward", "optimizer.step", "zero_grad")  # drawn as boxes after the forward
PHASE_FILL = "#f2f0f7"


@dataclasses.dataclass
class _Peak:
    """The peak a drawing marks: the forward's (``phase`` None) or the training step's.

    ``node``: the fx node (or line) whose box carries the banner (None: on no forward box - not
    marked, or in a phase without one); ``at``: the node it happens at, marked or not (which
    module stays open when folding); ``where``: in words; ``lines``: the banner; ``tip``: the
    exact formula for the tooltip.
    """

    node: str | None
    at: str | None
    phase: str | None
    where: str
    lines: list
    tip: str
    marked: bool


@dataclasses.dataclass
class _Box:
    """One box of the drawing: an fx node, or a module's nodes collapsed into one."""

    id: str
    nodes: list  # [(position in execution order, Node)]
    title: str  # module path or node name
    kind: str  # module class or op


class _Numbers:
    """Bytes as the figure shows them: formulas without ``dims``, numbers with them."""

    def __init__(self, report: Any, live: Liveness, concrete: bool):
        self.report, self.live, self.concrete = report, live, concrete
        self.subs = {report.symbols[k]: v for k, v in live.dims.items()}

    def value(self, expr: Any) -> int:
        return evaluate(sympy.sympify(expr), self.subs)

    def bytes(self, expr: Any) -> str:
        return format_bytes(self.value(expr)) if self.concrete else formula_text(expr)

    def storages(self, storages: list[Storage]) -> str:
        # numbers use the plan's sizes: on CUDA those are rounded to 512-byte blocks
        if self.concrete:
            return format_bytes(sum(self.live.sizes[s.index] for s in storages))
        return formula_text(sympy.Add(*[s.bytes for s in storages]))

    def size_of(self, storages: list[Storage]) -> int:
        return sum(self.live.sizes[s.index] for s in storages)

    def shape(self, shape: tuple) -> str:
        dims = [str(self.value(d)) if self.concrete else formula_text(d) for d in shape]
        return "(" + ", ".join(dims) + ")"

    def tensor(self, n: Node) -> str | None:
        """Size of what ``n`` passes on: its tensors' bytes (None for size arithmetic)."""
        if n.shapes:
            total = sympy.Add(*[sympy.Mul(*s) * dt.itemsize for s, dt in zip(n.shapes, n.dtypes)])
            return self.bytes(total)
        return None


def diagram(report: Any, evaluation: Evaluation, concrete: bool, group: str | None = None,
            depth: int | None = None, step: StepLiveness | None = None) -> Figure:
    """The fx graph of ``report`` as a :class:`~.figure.Figure` (a ``graphviz.Digraph``).

    ``evaluation``: the numbers at ``dims`` (``concrete``); without ``concrete`` labels are
    formulas and fills are not sized (``evaluation`` then only says where the peak is when that
    does not depend on the sizes).
    ``group="module"``: one box per module, cut at the first numbered level (``blocks.3``) or at
    ``depth`` components of the module path; nodes at top level stay as they are.
    Byte counts are bytes; live bytes are above resident (parameters, buffers, inputs).
    ``step``: the training step's live bytes at the same dims; the drawing is then of the step and
    marks its peak (``train_peak``, see the module docstring).
    """
    if report.graph_module is None and getattr(report, "module_calls", None) is None:
        raise SpecError("this report has no graph to draw (an analysis of a user step=); use "
                        "report.timeline() / report.by_line()")
    if group not in GROUPS:
        raise SpecError(f"diagram(group={group!r}): use group='auto' (folds graphs of more than {FOLD_NODES} "
                        f"nodes into modules), None (every node) or 'module'")
    live = evaluation.liveness
    num = _Numbers(report, live, concrete=concrete)
    peak = _forward_peak(report, live, concrete) if step is None else _step_peak(report, step, concrete)
    peak_node = peak.node
    expand = None
    if group == "auto":
        group = None
        drawn = [n for n in report.nodes if n.name in _forward_names(report) and not is_size_arithmetic(n)]
        if len(drawn) > FOLD_NODES and any(n.module for n in drawn):
            group = "module"  # the peak's module (at the sizes given, else the example sizes) stays open
            at = next((n for n in report.nodes if n.name == peak.at), None)
            expand = module_group(at.module, depth) if at is not None and at.module else None
    fig = Figure(name=report.model_name, graph_attr=dict(
        rankdir="TB", nodesep="0.3", ranksep="0.35", fontname=FONT, labelloc="t", tooltip=report.model_name,
        label=_title(report, evaluation, num, peak, step)),
        node_attr=dict(shape="box", style="filled,rounded", fontname=FONT, fontsize="11", margin="0.08,0.05",
                       penwidth="1", color="#888888", fillcolor="white"),
        edge_attr=dict(fontname=FONT, fontsize="9", fontcolor=INK_SOFT, color="#666666", arrowsize="0.6"))
    fig.dims, fig.peak_node = (dict(live.dims) if concrete else {}), peak_node
    fig.peak_phase = peak.phase if peak.marked else None
    if group:  # keep sibling blocks left to right in execution order (ungrouped, dot's own order reads better)
        fig.graph_attr["ordering"] = "out"
    position = {n.name: k for k, n in enumerate(report.nodes)}
    inputs_of = _inputs_of(report)
    boxes = _boxes(report, group, depth, expand)
    box_of = {n.name: b for b in boxes for _, n in b.nodes}
    for box in boxes:
        _draw_box(fig, box, report, num, peak)
    seen = set()
    for box in boxes:
        for _, n in box.nodes:
            for src in inputs_of.get(n.name, ()):
                tail = box_of.get(src)
                if tail is None or tail is box or (src, box.id) in seen:
                    continue
                seen.add((src, box.id))
                carried = num.tensor(report.nodes[position[src]])
                fig.edge(tail.id, box.id, label=f" {carried}" if carried else "", tooltip=f"{src} -> {n.name}")
    if step is not None and boxes:
        _draw_phases(fig, _last_box(boxes), report, evaluation, step, num, peak)
    return fig


# --- peaks --------------------------------------------------------------------------------------
def _forward_peak(report: Any, live: Liveness, concrete: bool) -> _Peak:
    """The forward's peak; marked at dims, or without them where it is in one node at every size
    (the peak formula has no ``Max``)."""
    marked = concrete or not report.peak.has(sympy.Max)
    lines = wrap(f"PEAK  {formula_text(report.peak)}", 46)
    if concrete:
        lines += [f"= {live.peak:,} B ({format_bytes(live.peak)})", f"at {dims_text(live.dims)}"]
    else:
        lines += ["(here for all sizes)"]
    where = f"in node {live.peak_node}" if live.peak_node else ""
    return _Peak(live.peak_node if marked else None, live.peak_node, None, where, lines,
                 f"peak = {report.peak} B; ", marked)


def _step_peak(report: Any, step: StepLiveness, concrete: bool) -> _Peak:
    """The training step's peak (``train_peak``, bytes): on the box of the forward node in whose
    forward or backward it happens; None (a phase box carries it) in the loss or optimizer step."""
    column = step.columns[step.peak_column] if step.peak_column is not None else None
    own = column.forward_node if column is not None and column.phase in ("forward", "backward") else None
    if own is not None and own not in _forward_names(report):
        own = None  # the backward of something the drawing has no box for: the backward() box says it
    module = next((n.module for n in report.nodes if n.name == own), "") if report.graph_module is None else ""
    where = step_peak_text(column and column.node, column and column.phase, own, module)
    marked = concrete or not report.train_peak.has(sympy.Max)
    lines = [f"TRAINING-STEP PEAK {where}"] + wrap(f"train_peak  {formula_text(report.train_peak)}", 46)
    if concrete:
        lines += [f"= {step.peak:,} B ({format_bytes(step.peak)})", f"at {dims_text(step.dims)}"]
    else:
        lines += ["(here for all sizes)"]
    return _Peak(own if marked else None, own, column.phase if column else None, where, lines,
                 f"train_peak = {report.train_peak} B ({where}); ", marked)


# --- the training step's phases -----------------------------------------------------------------
def _last_box(boxes: list) -> Any:
    """The box the step's phases follow: the output's, else the last in execution order."""
    return next((b for b in boxes if any(n.op == "output" for _, n in b.nodes)),
                max(boxes, key=lambda b: b.nodes[-1][0]))


def _draw_phases(fig: Figure, after: Any, report: Any, evaluation: Evaluation, step: StepLiveness,
                 num: _Numbers, peak: _Peak) -> None:
    """One box per phase after the forward, chained by dashed edges from the forward's last box."""
    tail = after.id
    for phase in STEP_PHASES:
        columns = [c for c in step.columns if c.phase == phase]
        if not columns and phase == "zero_grad":
            continue  # zero_grad(set_to_none=True) allocates nothing: no box to say so
        box_id = "phase_" + phase.replace(".", "_")
        here = peak.phase == phase and peak.marked
        rows = ([_row(lines_html(peak.lines), size=10, color="white", bg=PEAK, bold=True)]
                if here and peak.node is None else [])
        rows.append(f'<TR><TD ALIGN="LEFT"><FONT POINT-SIZE="12"><B>{esc(PHASE_TEXT[phase])}</B></FONT></TD>'
                    f'<TD ALIGN="RIGHT"><FONT POINT-SIZE="10" COLOR="{INK_SOFT}">training step</FONT></TD></TR>')
        rows.extend(_phase_rows(phase, columns, report, evaluation, step, num))
        if here and peak.node is not None:
            rows.append(_row(esc(f"the step's peak happens here, {peak.where} (marked on its box)"), bold=True))
        attrs = dict(color=PEAK, penwidth="3.5") if here else {}
        fig.node(box_id, label=_table(rows), fillcolor=PHASE_FILL, style="filled,rounded,dashed" if not here else
                 "filled,rounded", tooltip=(peak.tip if here else "") + PHASE_TEXT[phase], **attrs)
        fig.edge(tail, box_id, style="dashed", tooltip=f"then {PHASE_TEXT[phase]}")
        tail = box_id


def _phase_rows(phase: str, columns: list, report: Any, evaluation: Evaluation, step: StepLiveness,
                num: _Numbers) -> list[str]:
    """What a phase box says: the backward's gradients, the optimizer's state, and (at dims) the
    most activation bytes live while the phase runs."""
    rows = []
    if phase == "backward":
        ops = len({c.forward_node for c in columns})
        rows.append(_row(esc(f"the backward of {ops} node{'s' if ops != 1 else ''}, in reverse order"),
                         color=INK_SOFT))
        grads = format_bytes(evaluation["grads"]) if num.concrete else formula_text(report.grads)
        rows.append(_row(lines_html(wrap(f"allocates gradients {grads}", 46))))
    if phase == "optimizer.step":
        state = format_bytes(evaluation["optimizer_state"]) if num.concrete else formula_text(report.optimizer_state)
        rows.append(_row(lines_html(wrap(f"optimizer state {state} (resident through the step)", 46))))
    if not columns:
        rows.append(_row(esc("allocates nothing"), color=INK_SOFT))
    elif num.concrete:
        high = max(c.high for c in columns)
        rows.append(_row(esc(f"live up to {format_bytes(step.resident + high)} "
                             f"(resident {format_bytes(step.resident)} + {format_bytes(high)})"), size=9))
    return rows


# --- boxes --------------------------------------------------------------------------------------
def module_group(module: str, depth: int | None = None) -> str:
    """The group a module path falls in: ``blocks.3.ln1`` -> ``blocks.3``; ``encoder.conv`` -> ``encoder``."""
    parts = module.split(".")
    if depth:
        return ".".join(parts[:depth])
    for i, part in enumerate(parts):
        if part.isdigit():  # ModuleList/Sequential index: one repeated block
            return ".".join(parts[: i + 1])
    return parts[0]


def is_size_arithmetic(n: Node) -> bool:
    """A node that computes a size (``x.size(1)``, ``N * N``), not a tensor: left out of the drawing."""
    return n.op not in ("placeholder", "get_attr", "output") and not n.shapes and not n.allocations


def _forward_names(report: Any) -> set:
    """The forward's nodes (nothing of a training step after it): the fx graph's, or in eager mode
    the source lines that ran."""
    if report.graph_module is not None:
        return {n.name for n in report.graph_module.graph.nodes}
    return {n.name for n in report.nodes if n.op == "line"}


def _inputs_of(report: Any) -> dict[str, list[str]]:
    """Node -> the nodes whose values it reads: the fx graph's edges, or in eager mode the lines that
    allocated the storages a line's ops read (the recording knows what each op read)."""
    if report.graph_module is not None:
        return {n.name: [m.name for m in n.all_input_nodes] for n in report.graph_module.graph.nodes}
    made_by = {s.index: s.node for s in report.storages if s.node is not None}
    out: dict[str, list[str]] = {}
    for step in report._plan.rec.steps:
        for index in step.reads:
            src = made_by.get(index)
            if src is not None and src != step.node and src not in out.setdefault(step.node, []):
                out[step.node].append(src)
    return out


def _boxes(report: Any, group: str | None, depth: int | None, expand: str | None = None) -> list[_Box]:
    classes = _module_classes(report)
    boxes: list[_Box] = []
    by_group: dict[str, _Box] = {}
    in_graph = _forward_names(report)  # the forward's nodes, nothing after it
    for k, n in enumerate(report.nodes):
        if n.name not in in_graph or is_size_arithmetic(n):
            continue
        key = module_group(n.module, depth) if group == "module" and n.module else None
        if key is not None and key == expand:
            key = None  # the module the peak is in: drawn node by node
        if key is None:
            boxes.append(_Box(n.name, [(k, n)], n.name, node_kind(n, classes)))
        elif key in by_group:
            by_group[key].nodes.append((k, n))
        else:
            by_group[key] = _Box(f"module {key}", [(k, n)], key, classes.get(key, "module"))
            boxes.append(by_group[key])
    # a module holding a single node reads best as that node
    boxes = [_Box(b.nodes[0][1].name, b.nodes, b.nodes[0][1].name, node_kind(b.nodes[0][1], classes))
             if len(b.nodes) == 1 else b for b in boxes]
    # DOT ids must not hold ':': eager mode's names are ``file.py:12``, which an edge statement reads
    # as node ``file.py``, port ``12`` (every edge went to a phantom node named after the file). The
    # id says ``file.py#L12``; the label keeps the name as written
    return [dataclasses.replace(b, id=b.id.replace(":", "#L")) for b in boxes]


def _module_classes(report: Any) -> dict[str, str]:
    """Module path -> class name, from the trace's module stacks (and the GraphModule's leaves), or
    in eager mode from the modules the forward called."""
    if report.graph_module is None:
        return {path: kind for path, (kind, _, _) in (report.module_calls or {}).items()}
    out: dict[str, str] = {}
    for n in report.graph_module.graph.nodes:
        for path, cls in (n.meta.get("nn_module_stack") or {}).values():
            out.setdefault(str(path), getattr(cls, "__name__", str(cls)))
        if n.op == "call_module":
            try:
                out.setdefault(str(n.target), type(report.graph_module.get_submodule(str(n.target))).__name__)
            except AttributeError:
                pass
    return out


# --- labels -------------------------------------------------------------------------------------
def _draw_box(fig: Figure, box: _Box, report: Any, num: _Numbers, peak: _Peak) -> None:
    nodes = [n for _, n in box.nodes]
    allocations = [s for n in nodes for s in n.allocations]
    has_peak = peak.node is not None and peak.node in {n.name for n in nodes}
    fill = heat(num.size_of(allocations), num.live.peak_above_resident) if num.concrete and allocations else "white"
    attrs: dict[str, str] = dict(fillcolor=fill, tooltip=(peak.tip if has_peak else "") + _tooltip(nodes))
    if has_peak:
        attrs.update(color=PEAK, penwidth="3.5")
    single = nodes[0] if len(nodes) == 1 else None
    if single is not None and single.op in ("placeholder", "get_attr"):
        attrs.update(fillcolor=RESIDENT, style="filled", shape="box")
    elif single is not None and single.op == "output":
        attrs.update(fillcolor=OUTPUT, shape="box", style="filled")
    rows = []
    if has_peak:
        rows.append(_row(lines_html(peak.lines), size=10, color="white", bg=PEAK, bold=True))
    rows.append(_header_row(box))
    if single is not None:
        rows.extend(_node_rows(single, report, num))
    else:
        rows.extend(_group_rows(nodes, box, num, peak))
    if single is None or single.op not in ("placeholder", "get_attr"):
        rows.extend(_gauge_rows(box, num))
    fig.node(box.id, label=_table(rows), **attrs)


def _tooltip(nodes: list[Node]) -> str:
    return "; ".join(f"{n.name}: allocates {n.allocated} B, live after {n.live_after} B" for n in nodes[:20])


def _table(rows: list[str]) -> str:
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="2">' + "".join(rows) + "</TABLE>>"


def _row(text_html: str, size: int = 10, color: str | None = None, bg: str | None = None, bold: bool = False,
         face: str | None = None) -> str:
    font = f'<FONT POINT-SIZE="{size}"' + (f' COLOR="{color}"' if color else "") + (f' FACE="{face}"' if face else "") + ">"
    body = f"<B>{text_html}</B>" if bold else text_html
    cell = '<TD ALIGN="LEFT" BALIGN="LEFT" COLSPAN="2"' + (f' BGCOLOR="{bg}"' if bg else "") + ">"
    return f"<TR>{cell}{font}{body}</FONT></TD></TR>"


def _header_row(box: _Box) -> str:
    first, last = box.nodes[0][0], box.nodes[-1][0]  # execution steps; a module called twice spans both calls
    step = f"#{first}" if first == last else f"#{first}–#{last}"
    kind = "" if box.kind == box.title else esc(box.kind)
    # name and op in cells of their own: renderers that drop repeated spaces cannot run them together
    return (f'<TR><TD ALIGN="LEFT"><FONT POINT-SIZE="12"><B>{esc(box.title)}</B></FONT></TD>'
            f'<TD ALIGN="RIGHT"><FONT POINT-SIZE="10" COLOR="{INK_SOFT}">{kind} {step}</FONT></TD></TR>')


def _node_rows(n: Node, report: Any, num: _Numbers) -> list[str]:
    rows = []
    for shape, dtype in zip(n.shapes, n.dtypes):
        dt = "" if dtype == report.dtype else f"  {str(dtype).replace('torch.', '')}"
        rows.append(_row(esc(num.shape(shape) + dt)))
    if n.op in ("placeholder", "get_attr"):
        rows.append(_row(esc(f"resident {num.tensor(n)}"), color=INK_SOFT))
    elif n.op == "output":
        rows.append(_row(lines_html(wrap(f"retained {num.bytes(report.retained)}", 46))))
        rows.append(_row(lines_html(wrap(f"kept for backward {num.bytes(report.saved)}", 46)), bg=SAVED))
    elif n.allocations:
        rows.extend(_allocation_rows(n, report, num))
    if n.source is not None and n.op not in ("output",):
        code = code_lines(n.source.code, 56)
        # on a white cell: grey on the heat fill of a large allocation (red at the peak) is unreadable
        rows.append(_row(lines_html([f"{n.source}"] + code), size=8, color=INK_SOFT, bg="white"))
    return rows


def _allocation_rows(n: Node, report: Any, num: _Numbers) -> list[str]:
    """What the node allocates, tensor by tensor: size, what it is, whether autograd keeps it."""
    inputs = node_inputs(report, n)
    big = [s for s in n.allocations if not _small(s)]
    small = [s for s in n.allocations if _small(s)]
    rows = [_row(esc(f"allocates {num.storages(n.allocations)}"), size=11, bold=True)] if len(n.allocations) > 1 else []
    for s in big:
        what = storage_text(s, n, inputs, report.storages)
        line = f"{num.storages([s])}  {what}" if len(n.allocations) > 1 else f"allocates {num.storages([s])} ({what})"
        kept = s.saved_by and s.kept_after_forward
        rows.append(_row(lines_html(wrap(line, 52)), size=11 if len(n.allocations) == 1 else 10,
                         bold=len(n.allocations) == 1, bg=SAVED if kept else None))
        if kept:
            by = ", ".join(sorted({str(b) for b in s.saved_by}))
            rows.append(_row(lines_html(wrap(f"kept for the backward of {by}", 60)), size=8, bg=SAVED))
    if small:
        kept = [s for s in small if s.saved_by and s.kept_after_forward]
        text = f"+ {num.storages(small)} in {len(small)} small tensor{'s' if len(small) > 1 else ''}"
        text += " (Python numbers as tensors)" if all(not s.shape for s in small) else ""
        text += f", {len(kept)} kept for backward" if kept else ""
        rows.append(_row(esc(text), size=8, color=INK_SOFT))
    return rows


def _small(s: Storage) -> bool:
    """A constant-size tensor of a few bytes: shown as one summary row, not one row each."""
    return not getattr(s.bytes, "free_symbols", None) and int(s.bytes) < SMALL


def _group_rows(nodes: list[Node], box: _Box, num: _Numbers, peak: _Peak) -> list[str]:
    allocations = [s for n in nodes for s in n.allocations]
    kept = [s for s in allocations if s.saved_by and s.kept_after_forward]
    rows = [_row(esc(f"{len(nodes)} nodes"), size=9, color=INK_SOFT),
            _row(lines_html(wrap(f"allocates {num.storages(allocations)}", 46)), size=11, bold=True)]
    if kept:
        rows.append(_row(lines_html(wrap(f"kept for backward {num.storages(kept)}", 46)), bg=SAVED))
    inside = next((n for n in nodes if n.name == peak.node), None) if num.concrete else None
    if inside is not None:
        text = (f"peak inside, at node {inside.name}" if peak.phase is None
                else f"the step's peak inside, {peak.where}")
        rows.append(_row(esc(text + (f" ({inside.source})" if inside.source else "")), bold=True))
    return rows


def _gauge_rows(box: _Box, num: _Numbers) -> list[str]:
    """Live activation bytes when the box's last node ends (most while it runs, if more): a grey bar
    whose length is the share of the peak - a second encoding, apart from the fill."""
    if not num.concrete or not num.live.peak_above_resident:
        return []
    last = box.nodes[-1][0]
    after = num.live.after[last]
    high = max(num.live.high[k] for k, _ in box.nodes)
    top = num.live.peak_above_resident
    filled = max(1, round(GAUGE_W * after / top)) if after else 0
    extra = max(0, round(GAUGE_W * high / top) - filled)
    rest = max(1, GAUGE_W - filled - extra)
    cells = "".join(f'<TD FIXEDSIZE="TRUE" WIDTH="{w}" HEIGHT="7" BGCOLOR="{c}"></TD>'
                    for w, c in ((filled, "#4d4d4d"), (extra, "#a6a6a6"), (rest, "#ffffff")) if w)
    more = format_bytes(high) != format_bytes(after)
    text = f"live after it: {format_bytes(after)}" + (f" (up to {format_bytes(high)} while it runs)" if more else "")
    # a fixed-size cell around the gauge: a stretched table would spread its cells apart
    return [f'<TR><TD ALIGN="LEFT" COLSPAN="2" FIXEDSIZE="TRUE" WIDTH="{GAUGE_W + 8}" HEIGHT="13">'
            f'<TABLE BORDER="1" COLOR="#7f7f7f" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0"><TR>{cells}</TR>'
            f'</TABLE></TD></TR>',
            _row(esc(text), size=8, color=INK_SOFT)]


def _title(report: Any, evaluation: Evaluation, num: _Numbers, peak: _Peak, step: StepLiveness | None) -> str:
    live = evaluation.liveness
    if step is not None:
        mode = "training step: forward, backward(), optimizer.step()"
        keys = ("train_peak", "train_resident", "grads", "optimizer_state", "peak")
    else:
        mode = "forward (autograd records, as in training)" if report.grad else "inference"
        keys = ("peak", "resident", "retained", "saved")
    head = f"<B>{esc(report.model_name)}</B>  ·  {esc(mode)}  ·  {esc(report.device)}"
    values = evaluation if num.concrete else {}
    names = {"peak": "peak (the forward alone)"} if step is not None else {}
    formulas = [f"{names.get(k, k)} = {formula_text(getattr(report, k))}"
                + (f"  = {format_bytes(values[k])}" if values else "") for k in keys]
    if num.concrete:
        share = "the forward's peak's" if step else "the peak's"
        explain = (f"at {dims_text(live.dims)}: fill = bytes the node allocates; blue rows = tensors kept for "
                   f"backward; grey bar = activations live after the node (share of {share} "
                   f"{format_bytes(live.peak_above_resident)} above the resident {format_bytes(live.resident)})")
        if step is not None:
            explain = (f"the training step's peak train_peak = {step.peak:,} B ({format_bytes(step.peak)}) happens "
                       f"{peak.where}. " + explain + "; dashed boxes: the step's phases after the forward")
        legend = "".join(f'<TD BGCOLOR="{c}" WIDTH="58"><FONT POINT-SIZE="8" COLOR="{ink(c)}">'
                         f"{esc(format_bytes(hi))}</FONT></TD>" for c, _, hi in heat_bins(live.peak_above_resident))
        scale = (f'<TR><TD ALIGN="LEFT"><TABLE BORDER="0" CELLSPACING="1" CELLPADDING="2"><TR>'
                 f'<TD><FONT POINT-SIZE="8">allocates up to</FONT></TD>{legend}<TD WIDTH="12"></TD>'
                 f'<TD BGCOLOR="{SAVED}"><FONT POINT-SIZE="8"> kept for backward </FONT></TD>'
                 f'<TD BGCOLOR="{RESIDENT}"><FONT POINT-SIZE="8"> resident </FONT></TD></TR></TABLE></TD></TR>')
    else:
        what = "the training step's peak (train_peak)" if step is not None else "the peak"
        where = (f"{what} happens {peak.where} at every size" if peak.node or (peak.marked and step is not None)
                 else f"where {what} happens depends on the sizes (it is a Max)")
        explain = (f"sizes are formulas in bytes; blue rows = tensors kept for backward; {where}. "
                   f"For numbers, a colour scale and the live bytes: diagram(dims=...)")
        scale = ""
    return ('<<TABLE BORDER="0" CELLSPACING="2" CELLPADDING="2">'
            f'<TR><TD ALIGN="LEFT" BALIGN="LEFT"><FONT POINT-SIZE="14">{head}</FONT></TD></TR>'
            f'<TR><TD ALIGN="LEFT" BALIGN="LEFT"><FONT POINT-SIZE="10">{lines_html([l for f in formulas for l in wrap(f, 90)])}</FONT></TD></TR>'
            f'<TR><TD ALIGN="LEFT" BALIGN="LEFT"><FONT POINT-SIZE="9" COLOR="{INK_SOFT}">{lines_html(wrap(explain, 110))}</FONT></TD></TR>'
            f"{scale}</TABLE>>")
