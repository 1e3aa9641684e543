"""The liveness diagram: the fx graph in execution order, coloured by the memory live at each step.

Each node says what it computes (op, output shape), what it allocates and whether autograd keeps
it for backward; each edge says how big the tensor it carries is; the fill is the most activation
bytes live while the node runs (a heat scale, legend on top), and the node holding the peak
carries a banner with the peak's formula and value. Without ``dims`` shapes and bytes are
formulas in the user's dims and colours are taken at the analysis' example sizes (``report.hints``);
with ``dims`` everything is numbers at those sizes. ``group="module"`` draws one box per module
(``blocks.3``, ``encoder.layer.0`` ...), so a 12-block transformer stays legible.

>>> fig = diagram(report, report.evaluate(B=4, N=500), concrete=True)    # doctest: +SKIP
>>> fig.save("gat.svg")                           # doctest: +SKIP
'gat.svg'
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import sympy

from ..accounting import Evaluation, Liveness
from ..accounting.symbolic import evaluate
from ..errors import SpecError
from ..records import Node
from .figure import FONT, INK_SOFT, OUTPUT, PEAK, RESIDENT, SAVED, Figure, esc, heat, heat_bins, ink, lines_html
from .text import code_text, dims_text, format_bytes, formula_text, node_kind, wrap

GROUPS = (None, "module")


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

    def allocated(self, nodes: list[Node]) -> str:
        # numbers use the plan's sizes: on CUDA those are rounded to 512-byte blocks
        if self.concrete:
            return format_bytes(sum(self.live.sizes[a.index] for n in nodes for a in n.allocations))
        return formula_text(sympy.Add(*[n.allocated for n in nodes]))

    def shape(self, shape: tuple) -> str:
        dims = [str(self.value(d)) if self.concrete else formula_text(d) for d in shape]
        return "(" + ", ".join(dims) + ")"

    def tensor(self, n: Node) -> str | None:
        """Size of what ``n`` passes on: its tensors' bytes, or the value of a size computation."""
        if n.shapes:
            total = sympy.Add(*[sympy.Mul(*s) * dt.itemsize for s, dt in zip(n.shapes, n.dtypes)])
            return self.bytes(total)
        if n.value is not None:
            return str(self.value(n.value)) if self.concrete else formula_text(n.value)
        return None


def diagram(report: Any, evaluation: Evaluation, concrete: bool, group: str | None = None,
            depth: int | None = None) -> Figure:
    """The fx graph of ``report`` as a :class:`~.figure.Figure` (a ``graphviz.Digraph``).

    ``evaluation``: the numbers colours (and, when ``concrete``, labels) are at; without
    ``concrete`` labels are formulas.
    ``group="module"``: one box per module, cut at the first numbered level (``blocks.3``) or at
    ``depth`` components of the module path; nodes at top level stay as they are.
    Byte counts are bytes; live bytes are above resident (parameters, buffers, inputs).
    """
    if report.graph_module is None:
        raise SpecError("the diagram draws the fx graph, which an eager-mode analysis has none of; analyse with "
                        "mode='graph', or use report.timeline() / report.by_line()")
    if group not in GROUPS:
        raise SpecError(f"diagram(group={group!r}): use group=None or group='module'")
    live = evaluation.liveness
    num = _Numbers(report, live, concrete=concrete)
    fig = Figure(name=report.model_name, graph_attr=dict(
        rankdir="TB", nodesep="0.3", ranksep="0.35", fontname=FONT, labelloc="t", tooltip=report.model_name,
        label=_title(report, evaluation, num)),
        node_attr=dict(shape="box", style="filled,rounded", fontname=FONT, fontsize="11", margin="0.06,0.04",
                       penwidth="1", color="#888888"),
        edge_attr=dict(fontname=FONT, fontsize="9", fontcolor=INK_SOFT, color="#666666", arrowsize="0.6"))
    fig.dims, fig.peak_node = dict(live.dims), live.peak_node
    if group:  # keep sibling blocks left to right in execution order (ungrouped, dot's own order reads better)
        fig.graph_attr["ordering"] = "out"
    position = {n.name: k for k, n in enumerate(report.nodes)}
    boxes = _boxes(report, group, depth)
    box_of = {n.name: b for b in boxes for _, n in b.nodes}
    for box in boxes:
        _draw_box(fig, box, report, num)
    fx_nodes = {n.name: n for n in report.graph_module.graph.nodes}
    seen = set()
    for box in boxes:
        for _, n in box.nodes:
            for src in fx_nodes[n.name].all_input_nodes if n.name in fx_nodes else []:
                tail = box_of.get(src.name)
                if tail is None or tail is box or (src.name, box.id) in seen:
                    continue
                seen.add((src.name, box.id))
                producer = report.nodes[position[src.name]]
                carried = num.tensor(producer)
                size_edge = not producer.shapes  # an int (x.size(1)), not a tensor
                fig.edge(tail.id, box.id, label=f" {carried}" if carried else "",
                         style="dashed" if size_edge else "solid",
                         tooltip=f"{src.name} -> {n.name}")
    return fig


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


def _boxes(report: Any, group: str | None, depth: int | None) -> list[_Box]:
    classes = _module_classes(report)
    boxes: list[_Box] = []
    by_group: dict[str, _Box] = {}
    in_graph = {n.name for n in report.graph_module.graph.nodes}  # the forward's nodes, nothing after it
    for k, n in enumerate(report.nodes):
        if n.name not in in_graph:
            continue
        key = module_group(n.module, depth) if group == "module" and n.module else None
        if key is None:
            boxes.append(_Box(n.name, [(k, n)], n.name, node_kind(n, classes)))
        elif key in by_group:
            by_group[key].nodes.append((k, n))
        else:
            by_group[key] = _Box(f"module {key}", [(k, n)], key, classes.get(key, "module"))
            boxes.append(by_group[key])
    # a module holding a single node reads best as that node
    return [_Box(b.nodes[0][1].name, b.nodes, b.nodes[0][1].name, node_kind(b.nodes[0][1], classes))
            if len(b.nodes) == 1 else b for b in boxes]


def _module_classes(report: Any) -> dict[str, str]:
    """Module path -> class name, from the trace's module stacks (and the GraphModule's leaves)."""
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
def _draw_box(fig: Figure, box: _Box, report: Any, num: _Numbers) -> None:
    nodes = [n for _, n in box.nodes]
    names = {n.name for n in nodes}
    high = max(num.live.high[k] for k, _ in box.nodes)
    has_peak = num.live.peak_node in names
    fill = heat(high, num.live.peak_above_resident)
    tooltip = "; ".join(f"{n.name}: live after = {n.live_after} B" for n in nodes[:20])
    attrs: dict[str, str] = dict(fillcolor=fill, fontcolor=ink(fill), tooltip=tooltip)
    if has_peak:
        attrs.update(color=PEAK, penwidth="3.5")
        attrs["tooltip"] = f"peak = {report.peak} B; " + tooltip
    single = nodes[0] if len(nodes) == 1 else None
    if single is not None and single.op in ("placeholder", "get_attr"):
        attrs.update(fillcolor=RESIDENT, fontcolor="black", style="filled", shape="box")
    elif single is not None and single.op == "output":
        attrs.update(fillcolor=OUTPUT, fontcolor="black", shape="box", style="filled")
    elif single is not None and not single.shapes and not single.allocations and not has_peak:
        # size arithmetic (x.size(1), N * N): small and out of the way
        value = num.tensor(single)
        fig.node(box.id, label=f"{single.name}" + (f" = {value}" if value else ""), shape="ellipse",
                 style="dashed", fontsize="9", fontcolor=INK_SOFT, color="#aaaaaa", height="0.25",
                 tooltip=f"{single.target}: {single.value}")
        return
    rows = []
    if has_peak:
        rows.append(_peak_row(report, num))
    rows.append(_header_row(box))
    soft = "#f2f2f2" if ink(fill) == "white" else "#3c3c3c"  # secondary text that still reads on the fill
    if single is not None:
        rows.extend(_node_rows(single, report, num, soft))
    else:
        rows.extend(_group_rows(nodes, box, num, soft))
    fig.node(box.id, label=_table(rows), **attrs)


def _table(rows: list[str]) -> str:
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="2">' + "".join(rows) + "</TABLE>>"


def _row(text_html: str, size: int = 10, color: str | None = None, bg: str | None = None, bold: bool = False) -> str:
    font = f'<FONT POINT-SIZE="{size}"' + (f' COLOR="{color}"' if color else "") + ">"
    body = f"<B>{text_html}</B>" if bold else text_html
    cell = '<TD ALIGN="LEFT" BALIGN="LEFT"' + (f' BGCOLOR="{bg}"' if bg else "") + ">"
    return f"<TR>{cell}{font}{body}</FONT></TD></TR>"


def _header_row(box: _Box) -> str:
    first, last = box.nodes[0][0], box.nodes[-1][0]  # execution steps; a module called twice spans both calls
    step = f"#{first}" if first == last else f"#{first}–#{last}"
    kind = "" if box.kind == box.title else f"  {esc(box.kind)}"
    return _row(f"<B>{esc(box.title)}</B>{kind}  <FONT POINT-SIZE=\"9\">{step}</FONT>", size=12)


def _peak_row(report: Any, num: _Numbers) -> str:
    where = "" if num.concrete else " (example sizes)"
    formula = wrap(f"PEAK  {formula_text(report.peak)}", 46)
    value = f"= {num.live.peak:,} B ({format_bytes(num.live.peak)})"
    return _row(lines_html(formula + [value, f"at {dims_text(num.live.dims)}{where}"]), size=10, color="white",
                bg=PEAK, bold=True)


def _node_rows(n: Node, report: Any, num: _Numbers, soft: str) -> list[str]:
    rows = []
    for shape, dtype in zip(n.shapes, n.dtypes):
        dt = "" if dtype == report.dtype else f"  {str(dtype).replace('torch.', '')}"
        rows.append(_row(esc(num.shape(shape) + dt)))
    if n.op in ("placeholder", "get_attr"):
        rows.append(_row(esc(f"resident {num.tensor(n)}"), color=INK_SOFT))
    elif n.op == "output":
        rows.append(_row(lines_html(wrap(f"retained {num.bytes(report.retained)}", 46))))
        rows.append(_row(lines_html(wrap(f"saved for backward {num.bytes(report.saved)}", 46)), bg=SAVED))
    elif n.allocations:
        rows.append(_row(lines_html(wrap(f"allocates {num.allocated([n])}", 46))))
    if n.op != "output" and n.saved != 0:
        by = sorted({str(s) for a in n.allocations if a.saved_by and a.freed_at is None for s in a.saved_by})
        rows.append(_row(lines_html(wrap(f"saved for backward {num.bytes(n.saved)}", 46)), bg=SAVED, color="black"))
        rows.append(_row(lines_html(wrap("for the backward of " + ", ".join(by), 52)), size=8, bg=SAVED, color="black"))
    if n.source is not None:
        rows.append(_row(esc(f"{n.source}  {code_text(n.source.code)}"), size=8, color=soft))
    return rows


def _group_rows(nodes: list[Node], box: _Box, num: _Numbers, soft: str) -> list[str]:
    saved = sympy.Add(*[n.saved for n in nodes])
    high = max(num.live.high[k] for k, _ in box.nodes)
    where = "" if num.concrete else f" at {dims_text(num.live.dims)}"
    rows = [_row(esc(f"{len(nodes)} nodes"), size=9, color=soft),
            _row(lines_html(wrap(f"allocates {num.allocated(nodes)}", 46)))]
    if saved != 0:
        rows.append(_row(lines_html(wrap(f"saved for backward {num.bytes(saved)}", 46)), bg=SAVED, color="black"))
    rows.append(_row(esc(f"most live {format_bytes(high)}{where}")))
    peak = next((n for n in nodes if n.name == num.live.peak_node), None)
    if peak is not None:
        rows.append(_row(esc(f"peak inside, at node {peak.name}" + (f" ({peak.source})" if peak.source else "")),
                         bold=True))
    return rows


def _title(report: Any, evaluation: Evaluation, num: _Numbers) -> str:
    live = evaluation.liveness
    mode = "training (autograd records)" if report.grad else "inference"
    at = dims_text(live.dims)
    colours = (f"fill: the most activation bytes live while the node runs (above the resident "
               f"{format_bytes(live.resident)}), at {at}"
               + ("" if num.concrete else " (the analysis' example sizes; labels are formulas in bytes)"))
    head = f"<B>{esc(report.model_name)}</B>  ·  {esc(mode)}  ·  {esc(report.device)}"
    values = evaluation if num.concrete else {}
    formulas = [f"{k} = {formula_text(getattr(report, k))}" + (f"  = {format_bytes(values[k])}" if values else "")
                for k in ("peak", "resident", "retained", "saved")]
    legend = "".join(f'<TD BGCOLOR="{c}" WIDTH="58"><FONT POINT-SIZE="8" COLOR="{ink(c)}">'
                     f"{esc(format_bytes(hi))}</FONT></TD>" for c, _, hi in heat_bins(live.peak_above_resident))
    keys = (f'<TD BGCOLOR="{PEAK}"><FONT POINT-SIZE="8" COLOR="white"> peak </FONT></TD>'
            f'<TD BGCOLOR="{SAVED}"><FONT POINT-SIZE="8"> saved for backward </FONT></TD>'
            f'<TD BGCOLOR="{RESIDENT}"><FONT POINT-SIZE="8"> resident </FONT></TD>')
    return ('<<TABLE BORDER="0" CELLSPACING="2" CELLPADDING="2">'
            f'<TR><TD ALIGN="LEFT" BALIGN="LEFT"><FONT POINT-SIZE="14">{head}</FONT></TD></TR>'
            f'<TR><TD ALIGN="LEFT" BALIGN="LEFT"><FONT POINT-SIZE="10">{lines_html([l for f in formulas for l in wrap(f, 90)])}</FONT></TD></TR>'
            f'<TR><TD ALIGN="LEFT" BALIGN="LEFT"><FONT POINT-SIZE="9" COLOR="{INK_SOFT}">{esc(colours)}</FONT></TD></TR>'
            f'<TR><TD ALIGN="LEFT"><TABLE BORDER="0" CELLSPACING="1" CELLPADDING="2"><TR>'
            f'<TD><FONT POINT-SIZE="8">activations live, up to</FONT></TD>{legend}<TD WIDTH="12"></TD>{keys}</TR></TABLE></TD></TR>'
            "</TABLE>>")
