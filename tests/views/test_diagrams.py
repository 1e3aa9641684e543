"""Diagrams and timelines really render with graphviz's `dot`, and say what the report says.

Every check reads the rendered SVG (or the file's bytes) and compares it with evidence taken from
the report's own data, not from the drawing code: the peak's formula and ``evaluate()`` value,
the storages autograd keeps, the storages' byte formulas, the module paths of the nodes.
"""
from __future__ import annotations

import re
import subprocess
import sys
import types
import xml.etree.ElementTree as ET

import graphviz
import torch
import pytest
import sympy

import fxmem
from conftest import ROOT, load_example
from fxmem.errors import SpecError

gat = load_example("seed_gat")
SVG = "{http://www.w3.org/2000/svg}"
XLINK = "{http://www.w3.org/1999/xlink}"
SEED = dict(B=4, N=500)


@pytest.fixture(scope="module")
def layer():
    return fxmem.analyze(gat.GraphAttentionLayer(6, 128), ("B", "N", 6), ("B", "N", "N"))


@pytest.fixture(scope="module")
def stack():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from analyze_speed import Stack
    finally:
        sys.path.pop(0)
    return fxmem.analyze(Stack(depth=3, dim=32, heads=4), ("B", "L", 32))


# --- reading the SVG ----------------------------------------------------------------------------
def items(svg: str, cls: str) -> dict[str, types.SimpleNamespace]:
    """Graphviz SVG groups of class ``node`` or ``edge``: title -> text, tooltips, polygon x-extent."""
    out = {}
    for g in ET.fromstring(svg).iter(SVG + "g"):
        if g.get("class") != cls:
            continue
        title = g.find(SVG + "title").text
        text = " ".join(re.sub(r"\s+", " ", (t.text or "").replace("\xa0", " ")).strip() for t in g.iter(SVG + "text"))
        tips = " ".join(a.get(XLINK + "title", "") for a in g.iter(SVG + "a"))
        xs = [float(p.split(",")[0]) for poly in g.iter(SVG + "polygon") for p in poly.get("points").split()]
        fills = [e.get("fill") for e in g.iter() if e.tag in (SVG + "polygon", SVG + "path")]  # box first
        out[title] = types.SimpleNamespace(text=text, tips=tips, x=(min(xs), max(xs)) if xs else None, fills=fills)
    return out


def pretty(expr) -> str:
    """How a reader writes a formula: 1024*B*N**2 -> 1024·B·N² (only the squares these models have)."""
    return str(expr).replace("**2", "²").replace("*", "·")


def kept_nodes(report) -> set[str]:
    """Nodes that allocate something autograd still holds when the forward returns."""
    return {s.node for s in report.storages if s.kind == "activation" and s.saved_by and s.freed_at is None}


# --- the diagram --------------------------------------------------------------------------------
def test_peak_node_carries_the_peak_formula_and_value(layer):
    fig = layer.diagram(SEED)
    assert isinstance(fig, graphviz.Digraph)
    nodes = items(fig.svg(), "node")
    peak = layer.peak_node(**SEED)
    value = layer.evaluate(**SEED)["peak"]
    assert "PEAK" in nodes[peak].text
    assert pretty(layer.peak) in nodes[peak].text  # the formula, in the user's dims
    assert f"{value:,} B" in nodes[peak].text and fxmem.format_bytes(value) in nodes[peak].text
    assert str(layer.peak) in nodes[peak].tips  # the exact sympy text on hover
    assert [name for name, n in nodes.items() if "PEAK" in n.text] == [peak]


def test_symbolic_labels_shapes_allocations_and_edges(layer):
    svg = layer.diagram().svg()
    nodes, edges = items(svg, "node"), items(svg, "edge")
    pair = next(s for s in layer.storages if s.op == "aten.cat")
    assert str(pair.bytes) == "1024*B*N**2"
    text = nodes[pair.node].text
    assert "(B, 2·N², 128)" in text and f"allocates {pretty(pair.bytes)}" in text
    # the edge out of cat carries the pair tensor: its label is that tensor's size
    consumers = [e for title, e in edges.items() if title.startswith(f"{pair.node}->")]
    assert consumers and all(pretty(pair.bytes) in e.text for e in consumers)
    # no numbers where formulas are asked for: the view's shape stays symbolic
    assert "(B, N, N, 256)" in " ".join(n.text for n in nodes.values())


def test_kept_for_backward_is_marked_on_exactly_those_nodes(layer):
    nodes = items(layer.diagram().svg(), "node")
    marked = {name for name, n in nodes.items() if "kept for the backward of" in n.text}
    assert marked == kept_nodes(layer)
    assert marked >= {"cat", "softmax", "dropout"}
    assert f"kept for backward {pretty(layer.saved)}" in nodes["output"].text


def test_kept_for_backward_rows_stay_with_an_optimizer(layer):
    """A report with optimizer= records backward too (which frees what the forward kept); its
    diagram marks the same nodes as the forward's, and says the same kept-for-backward total."""
    train = fxmem.analyze(gat.GraphAttentionLayer(6, 128), ("B", "N", 6), ("B", "N", "N"),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    nodes = items(train.diagram().svg(), "node")
    marked = {name for name, n in nodes.items() if "kept for the backward of" in n.text}
    assert marked == kept_nodes(layer)
    assert [n.saved for n in train.nodes[:len(layer.nodes)]] == [n.saved for n in layer.nodes]


def test_numbers_at_dims(layer):
    nodes = items(layer.diagram(SEED).svg(), "node")
    pair = next(s for s in layer.storages if s.op == "aten.cat")
    assert "(4, 500000, 128)" in nodes["cat"].text
    assert f"allocates {fxmem.format_bytes(layer.at(pair.bytes, **SEED))}" in nodes["cat"].text
    assert fxmem.format_bytes(layer.at(pair.bytes, **SEED)) == "976.56 MiB"
    # every formula became a number (the peak banner quotes the peak's formula on purpose)
    for name, n in nodes.items():
        body = n.text.split(" at B=4, N=500")[-1] if name == "cat" else n.text
        assert "·N" not in body and "B," not in body, (name, n.text)


def test_fill_is_what_the_node_allocates_and_the_gauge_what_is_live(layer):
    live = layer.liveness(SEED)
    nodes = items(layer.diagram(SEED).svg(), "node")
    order = list(fxmem.views.figure.HEAT)
    allocated = {n.name: layer.at(n.allocated, **SEED) for n in layer.nodes if n.allocations}
    fill = {name: nodes[name].fills[0] for name in allocated}
    assert set(fill.values()) <= set(order)
    for a in fill:  # more bytes allocated: never a lighter colour
        for b in fill:
            if allocated[a] > allocated[b]:
                assert order.index(fill[a]) >= order.index(fill[b]), (a, b)
    # the pair tensor and the two repeat copies stand out; the N^2 attention tensors do not
    assert order.index(fill["cat"]) > order.index(fill["repeat"]) > order.index(fill["softmax"])
    # nodes that allocate nothing are not coloured by size
    assert nodes["view"].fills[0] == "white" and nodes["squeeze"].fills[0] == "white"
    # the second encoding: live bytes after each node, from the report's liveness
    for k, n in enumerate(layer.nodes):
        if n.name in nodes and n.op not in ("placeholder", "get_attr"):
            assert f"live after it: {fxmem.format_bytes(live.after[k])}" in nodes[n.name].text, n.name
    assert f"up to {fxmem.format_bytes(live.peak_above_resident)} while it runs" in nodes["cat"].text


def test_without_dims_nothing_is_coloured_by_size_and_size_arithmetic_is_left_out(layer):
    svg = layer.diagram().svg()
    nodes = items(svg, "node")
    assert {nodes[n.name].fills[0] for n in layer.nodes if n.allocations} == {"white"}
    assert "diagram(dims=...)" in svg and "live after it" not in " ".join(n.text for n in nodes.values())
    arithmetic = [n.name for n in layer.nodes if n.op == "call_function" and not n.shapes and not n.allocations]
    assert arithmetic and not set(arithmetic) & set(nodes)  # getitem = N, mul = N²: not drawn
    # the peak formula has no Max here, so its node is the same for every size: marked
    assert not layer.peak.has(sympy.Max)
    assert [t for t, n in nodes.items() if "PEAK" in n.text] == ["cat"]
    # where the peak's node depends on the sizes, no node is marked without dims
    attention = fxmem.analyze(load_example("seed_attention").Attention(64, 4), ("B", "L", 64))
    assert attention.peak.has(sympy.Max)
    assert not [t for t, n in items(attention.diagram().svg(), "node").items() if "PEAK" in n.text]


def test_which_tensors_a_node_allocates():
    report = fxmem.analyze(load_example("seed_attention").Attention(64, 4), ("B", "L", 64))
    nodes = items(report.diagram(dict(B=2, L=8)).svg(), "node")
    matmul = nodes["matmul"].text
    # matmul copies q (getitem_3) and k^T (transpose) into contiguous tensors, and autograd keeps
    # those copies, not qkv: the seed's key point, in the picture
    copies = [s for s in report.storages if s.node == "matmul" and s.op == "aten.clone"]
    assert len(copies) == 2 and all(str(b) == "matmul (aten.bmm)" for s in copies for b in s.saved_by)
    q = next(n for n in report.nodes if n.name == "getitem_3")
    assert all(s.copy_of == q.outputs[0] for s in copies)  # both copy views of qkv's storage
    assert "contiguous copy of getitem_3" in matmul and "contiguous copy of transpose" in matmul
    assert matmul.count("kept for the backward of matmul (aten.bmm)") == 2
    assert "a Python number" not in nodes["mul"].text  # 8 bytes: folded into one small row
    assert "+ 8 B in 1 small tensor" in nodes["mul"].text


def test_liveness_agrees_with_the_formulas(layer):
    live = layer.liveness(SEED)
    numbers = layer.evaluate(**SEED)
    assert max(live.high) == numbers["peak_above_resident"] and live.peak == numbers["peak"]
    assert live.peak_node == layer.peak_node(**SEED)
    assert live.after == [layer.at(n.live_after, **SEED) for n in layer.nodes]
    assert live.after[-1] == numbers["retained"]


def test_outside_the_region_the_diagram_is_of_the_real_code_path(layer):
    fig = layer.diagram(dict(B=1, N=3))  # B=1 is outside B >= 2: re-analysed
    nodes = items(fig.svg(), "node")
    assert f"{layer.evaluate(B=1, N=3)['peak']:,} B" in nodes[fig.peak_node].text


def test_group_by_module_collapses_blocks(stack):
    plain = items(stack.diagram(group=None).svg(), "node")
    grouped = items(stack.diagram(group="module").svg(), "node")
    tensors = [n for n in stack.nodes if n.shapes or n.allocations or n.op in ("placeholder", "get_attr", "output")]
    top = [n for n in tensors if not n.module]
    blocks = sorted({".".join(n.module.split(".")[:2]) for n in stack.nodes if n.module.startswith("blocks.")})
    others = {n.module for n in stack.nodes if n.module and not n.module.startswith("blocks.")}
    assert blocks == ["blocks.0", "blocks.1", "blocks.2"] and others == {"ln"}
    assert set(plain) == {n.name for n in tensors}  # every node but size arithmetic
    assert len(grouped) == len(top) + len(blocks) + len(others) < len(plain)
    assert {f"module {b}" for b in blocks} <= set(grouped)
    # each block says what its nodes allocate, summed from the storages it allocated
    dims = dict(B=2, L=16)
    grouped = items(stack.diagram(dims, group="module").svg(), "node")
    for b in blocks:
        total = sum(stack.at(s.bytes, **dims) for s in stack.storages if s.module == b or s.module.startswith(b + "."))
        assert f"allocates {fxmem.format_bytes(total)}" in grouped[f"module {b}"].text
        assert f"{len([n for n in tensors if n.module.startswith(b)])} nodes" in grouped[f"module {b}"].text
    assert [t for t, n in grouped.items() if "PEAK" in n.text] == [stack.peak_node(**dims)]


def test_group_holding_the_peak_says_so():
    net = fxmem.analyze(gat.GAT(6, 8, 4, 2), ("B", "N", 6), ("B", "N", "N"))
    peak = net.peak_node(**SEED)
    module = next(n.module for n in net.nodes if n.name == peak)
    assert module.startswith("out_att")
    grouped = items(net.diagram(SEED, group="module").svg(), "node")
    box = grouped["module out_att"]
    assert "PEAK" in box.text and f"peak inside, at node {peak}" in box.text
    assert f"{net.evaluate(**SEED)['peak']:,} B" in box.text
    assert {"module attentions.0", "module attentions.1"} <= set(grouped)


# --- the timeline -------------------------------------------------------------------------------
# --- the timeline -------------------------------------------------------------------------------
def patches(chart) -> dict:
    """The chart's drawn rectangles by their SVG id: id -> (x0, x1, y0, y1) in data units."""
    out = {}
    for ax in chart.figure.axes:
        for p in ax.patches:
            if p.get_gid():
                out[p.get_gid()] = (p.get_x(), p.get_x() + p.get_width(), p.get_y(), p.get_y() + p.get_height())
    return out


def test_timeline_has_one_bar_per_activation_tensor_and_they_render(layer):
    chart = layer.timeline(SEED)
    svg = chart.svg()
    activations = [s for s in layer.storages if s.kind == "activation"]
    drawn = sorted(g for g in patches(chart) if g.startswith("bar:"))
    assert drawn == sorted(f"bar:{s.index}" for s in activations)
    assert all(f'id="{g}"' in svg for g in drawn)  # the rendered SVG has them, by id
    names = [t.get_text() for t in chart.figure.axes[1].get_xticklabels()]
    assert names[:4] == ["matmul", "repeat", "repeat_1", "cat"] and names[-1] == "after return"  # node names
    labels = " ".join(t.get_text() for t in chart.figure.axes[1].get_yticklabels())
    assert "cat · output" in labels


def test_timeline_geometry_bars_and_peak(layer):
    chart = layer.timeline(SEED)
    bars = patches(chart)
    live = layer.liveness(SEED)
    numbers = layer.evaluate(**SEED)
    position = {n.name: k for k, n in enumerate(layer.nodes)}
    activations = [s for s in layer.storages if s.kind == "activation"]
    after_return = max(x1 for g, (x0, x1, *_) in bars.items() if g.startswith("bar:"))
    peak_x = chart.figure.axes[0].lines[0].get_xdata()[0]
    peak = position[layer.peak_node(**SEED)]
    for s in activations:
        left, right, *_ = bars[f"bar:{s.index}"]
        if s.freed_at is None:  # kept for backward, or returned: into the "after return" column
            assert right == pytest.approx(after_return), s.name
        else:
            assert right < after_return - 1, s.name
        # the peak line crosses exactly the tensors live while the peak's node runs
        born, dies = position[s.node], position.get(s.freed_at, len(layer.nodes))
        assert (left < peak_x < right) == (born <= peak <= dies), s.name
    lefts = [bars[f"bar:{s.index}"][0] for s in activations]
    assert lefts == sorted(lefts)  # allocation order runs left to right
    # the upper chart stacks activations on the resident bytes: the peak's column reaches the peak
    columns = [g for g in bars if g.startswith("live:")]
    tops = {g: bars[g][3] for g in columns}
    assert max(tops.values()) == numbers["peak"] == live.peak
    assert all(bars[g.replace("live", "resident")][3] == numbers["resident"] for g in columns)
    assert tops[columns[-1]] == numbers["resident"] + numbers["retained"]  # after return: what is kept
    title = chart.figure.axes[0].get_title(loc="left")
    assert f"{numbers['peak']:,} B" in title and "peak in node cat" in title


def test_timeline_needs_sizes(layer):
    with pytest.raises(SpecError, match="timeline.*'B': ..., 'N': ..."):
        layer.timeline()


# --- files, command line, notebooks ------------------------------------------------------------
MAGIC = {".svg": b"<?xml", ".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-"}


@pytest.mark.parametrize("what", ["diagram", "timeline"])
@pytest.mark.parametrize("ext", sorted(MAGIC))
def test_render_writes_real_files(layer, tmp_path, what, ext):
    path = layer.render(str(tmp_path / f"gat{ext}"), what=what, dims=SEED)
    data = open(path, "rb").read()
    assert data.startswith(MAGIC[ext]) and len(data) > 2000
    if ext == ".svg":
        assert "<svg" in data.decode() and ("PEAK" in data.decode() or "peak in node" in data.decode())


def test_render_refuses_unknown_formats(layer, tmp_path):
    with pytest.raises(SpecError, match=r"\.svg"):
        layer.render(str(tmp_path / "gat.txt"))
    with pytest.raises(SpecError, match="timeline"):
        layer.render(str(tmp_path / "gat.svg"), what="table")


def test_cli_writes_diagram_and_timeline(tmp_path):
    diagram, timeline = tmp_path / "d.svg", tmp_path / "t.png"
    out = subprocess.run([sys.executable, "-m", "fxmem", "analyze", "examples/seed_gat.py:GraphAttentionLayer",
                          "--input", "B,N,6", "--input", "B,N,N", "--dims", "B=4,N=500",
                          "--diagram", str(diagram), "--timeline", str(timeline)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert f"wrote {diagram}" in out.stderr and f"wrote {timeline}" in out.stderr
    assert "976.56 MiB" in diagram.read_text()  # numbers at --dims
    assert timeline.read_bytes().startswith(MAGIC[".png"])


def test_notebook_display(layer):
    fig = layer.diagram()
    assert fig._repr_svg_().lstrip().startswith("<?xml") and "<svg" in fig._repr_html_()
    assert "image/svg+xml" in fig._repr_mimebundle_()
    assert "<svg" in layer.timeline(SEED)._repr_svg_()
    latex = layer._repr_latex_()
    assert latex.startswith("$$") and sympy.latex(layer.peak) in latex and sympy.latex(layer.saved) in latex
    page = layer._repr_html_()
    assert page.count("<table") == 2  # formulas, per-node table
    rows = [line.split()[1] for line in layer.table().splitlines()[2:]]
    assert all(f"<b>{name}</b>" in page for name in rows)
    assert pretty(layer.peak) in page and "peak in node <b>cat</b>" in page
    # formulas typeset as MathML, which the browser renders itself: nothing loaded from a network
    from sympy.printing.mathml import mathml
    assert mathml(layer.peak, printer="presentation").replace("&InvisibleTimes;", "&#8290;") in page
    ET.fromstring(f"<p>{page[page.index('<math>'):page.index('</math>') + 7]}</p>")  # well-formed markup
    assert not re.search(r"<script|https?://|src=|@import", page)
    assert layer.peak._repr_latex_() == f"$\\displaystyle {sympy.latex(layer.peak)}$"
    # the peak's node depends on the sizes here: the page does not name one at sizes nobody chose
    attention = fxmem.analyze(load_example("seed_attention").Attention(64, 4), ("B", "L", 64))
    assert "depends on the sizes" in attention._repr_html_() and "example sizes" not in attention._repr_html_()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class _Deep(torch.nn.Module):  # 16 blocks: ~100 nodes
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(16))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_large_graphs_fold_into_modules_with_the_peaks_module_open():
    report = fxmem.analyze(_Deep(), ("B", 16))
    dims = dict(B=4)
    every = items(report.diagram(dims, group=None).svg(), "node")
    folded = items(report.diagram(dims).svg(), "node")  # rendered by dot
    assert len(every) > 60 > len(folded)
    peak = report.peak_node(**dims)
    open_module = ".".join(next(n.module for n in report.nodes if n.name == peak).split(".")[:2])
    assert peak in folded and "PEAK" in folded[peak].text  # the peak's own node, in its open module
    inside = [n.name for n in report.nodes if n.module.startswith(open_module + ".") and n.name in every]
    assert inside and set(inside) <= set(folded)
    closed = {f"module blocks.{k}" for k in range(16)} - {f"module {open_module}"}
    assert closed <= set(folded) and f"module {open_module}" not in folded
    # small graphs are drawn node by node by default
    small = fxmem.analyze(_Block(), ("B", 16))
    assert items(small.diagram(dims).svg(), "node").keys() == items(small.diagram(dims, group=None).svg(), "node").keys()
