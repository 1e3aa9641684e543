"""The pictures of a training analysis draw the training step (issue 48): the diagram, the timeline
and ``render`` mark the step's peak ``train_peak`` where it happens, by default where the analysis
has an optimizer; ``train=False`` gives the forward; ``train=True`` without one is a SpecError.

Evidence, not the drawing code: ``evaluate()["train_peak"]`` (checked against real runs elsewhere,
and here once more), the phase a *real* step reaches its peak in (the CPU allocator's events of a
real step, phases cut by marker allocations), the node the predicted memory snapshot reaches the
peak at, the DOT text, and the rendered files' bytes.
"""
from __future__ import annotations

import html
import re
import struct
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch
from torch import nn

import fxmem
from conftest import real_inputs, threads
from fxmem.measure import record_snapshot
from fxmem.records import Phase
from fxmem.training import StepHooks, default_loss, train_step

ADAM = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
CNN_DIMS = dict(B=4, H=32, W=32)
LLAMA_DIMS = dict(B=2, L=16)
MARK = 1_234_567  # bytes of the marker allocations that cut a real step into its phases (+ the phase's number)
PHASES = ["forward"] + [p.value for p in (Phase.LOSS, Phase.BACKWARD, Phase.STEP, Phase.ZERO_GRAD, Phase.RETURN)]


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        h = torch.relu(self.conv2(h))
        return self.fc(h.mean(dim=(2, 3)))


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


# one thread: SDPA's CPU backward allocates inside parallel regions, which the profiler does not hear
@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    model = CNN()
    with threads(1):
        return model, fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=ADAM, check=False), CNN_DIMS


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = _llama()
    with threads(1):
        report = fxmem.analyze(model, fxmem.TensorSpec(("B", "L"), dtype=torch.long), optimizer=ADAM, check=False)
    assert report.mode == "eager"
    return model, report, LLAMA_DIMS


@pytest.fixture(scope="module")
def mlp():
    """Big weights, small activations: Adam's temporaries over the gradients make the step's peak."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
    with threads(1):
        return model, fxmem.analyze(model, ("B", 256), optimizer=ADAM, check=False), dict(B=3)


@pytest.fixture(params=["cnn", "llama", "mlp"])
def case(request):
    return request.getfixturevalue(request.param)


# --- evidence -----------------------------------------------------------------------------------
class _Marked(StepHooks):
    """A real step that allocates a marker of ``MARK + k`` bytes as phase ``k`` starts."""

    def _mark(self, phase: str) -> None:
        marker = torch.empty(MARK + PHASES.index(phase), dtype=torch.uint8)
        del marker

    def forward(self, module: Any, inputs: tuple) -> Any:
        self._mark("forward")
        return module(*inputs)

    def phase(self, phase: Phase):
        self._mark(phase.value)
        return super().phase(phase)


def real_step_peak(model: nn.Module, report: fxmem.Report, dims: dict) -> tuple[int, str]:
    """(peak bytes above the step's start, phase it happens in) of a real steady-state step."""
    xs = real_inputs(report, dims)
    module = report.graph_module if report.mode == "graph" else model
    opt = ADAM(module.parameters())
    train_step(module, xs, opt, default_loss)  # the optimizer's state: the steady state starts here
    snap = record_snapshot(lambda: train_step(module, xs, opt, default_loss, hooks=_Marked()))
    live = peak = 0
    phase, at = "forward", None
    markers = {MARK + k: p for k, p in enumerate(PHASES)}
    for e in snap["device_traces"][0]:
        if e["size"] in markers:  # not the step's memory: where it is
            phase = markers[e["size"]] if e["action"] == "alloc" else phase
            continue
        if e["action"] == "alloc":
            live += e["size"]
            if live > peak:
                peak, at = live, phase
        elif e["action"] == "free_completed":
            live -= e["size"]
    return peak, at


def snapshot_peak_node(report: fxmem.Report, dims: dict) -> str:
    """The recorded node (``conv2 (backward)``) at whose allocation the predicted snapshot of the
    step reaches its largest total: read from the snapshot's frames, as memory_viz shows them."""
    live = peak = 0
    node = None
    for e in report.snapshot(dims, train=True)["device_traces"][0]:
        if e["action"] == "alloc":
            live += e["size"]
            if live > peak:
                peak = live
                node = _frame_node(e["frames"])
        elif e["action"] == "free_completed":
            live -= e["size"]
    assert peak == report.evaluate(**dims)["train_peak"]
    return node


def _frame_node(frames: list[dict]) -> str | None:
    """The node a snapshot frame names: ``fn (fx node X, op)`` at a source line, else ``fx node X, op``."""
    for f in frames:
        if "fx node " in f["name"]:
            rest = f["name"].split("fx node ", 1)[1]
            rest = rest if f["filename"] == "<fxmem>" else rest[:-1]
            return rest.rsplit(", ", 1)[0]
    return None


# --- DOT --------------------------------------------------------------------------------------------
_ID = r'(?:"(?:[^"\\]|\\.)*"|[A-Za-z_][\w.]*)'


def parse_dot(source: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """``({node id: its statement}, [(tail, head)])`` of a DOT source graphviz wrote, one statement a line."""
    nodes, edges = {}, []
    for line in source.splitlines():
        line = line.strip()
        edge = re.match(rf"({_ID}) -> ({_ID})(?: \[|$)", line)
        if edge:
            edges.append((edge.group(1).strip('"'), edge.group(2).strip('"')))
            continue
        node = re.match(rf"({_ID}) \[", line)
        if node and node.group(1) not in ("graph", "node", "edge"):
            nodes[node.group(1).strip('"')] = line
    return nodes, edges


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def svg_text(svg: str) -> str:
    """The SVG's text as one line: graphviz writes spaces as no-break spaces, matplotlib its text
    (drawn as glyph paths) in comments, wrapped where the chart wraps it."""
    return re.sub(r"\s+", " ", html.unescape(svg).replace("\xa0", " "))


def svg_ids(svg: str) -> dict[str, ET.Element]:
    return {e.get("id"): e for e in ET.fromstring(svg).iter() if e.get("id")}


def _path_numbers(element: ET.Element) -> list[list[float]]:
    return [[float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", p.get("d", ""))]
            for p in element.iter("{http://www.w3.org/2000/svg}path")]


def path_xs(element: ET.Element) -> list[float]:
    """The x coordinates of the paths inside a matplotlib SVG group (``M x y L x y ... z``)."""
    return [x for nums in _path_numbers(element) for x in nums[0::2]]


def path_ys(element: ET.Element) -> list[float]:
    return [y for nums in _path_numbers(element) for y in nums[1::2]]


# --- the diagram ----------------------------------------------------------------------------------
def test_diagram_marks_the_step_peak_on_the_node_whose_backward_holds_it(case):
    model, report, dims = case
    with threads(1):
        ev = report.evaluate(**dims)
        fig = report.diagram(dims)  # the default for an analysis with optimizer=: the training step
        real_peak, real_phase = real_step_peak(model, report, dims)
        node = snapshot_peak_node(report, dims)
    assert real_peak == ev["train_peak"] - ev["train_resident"]
    assert fig.peak_phase == real_phase
    nodes, edges = parse_dot(fig.source)
    banners = [i for i, text in nodes.items() if "TRAINING-STEP PEAK" in text]
    assert len(banners) == 1 and not [i for i, t in nodes.items() if "PEAK" in t and i not in banners]
    text = nodes[banners[0]]
    assert f"{ev['train_peak']:,} B" in text and fxmem.format_bytes(ev["train_peak"]) in text
    assert f"{ev['peak']:,} B" not in text  # not the forward's peak
    if real_phase == "backward":
        forward = node.removesuffix(" (backward)")
        assert node.endswith(" (backward)") and f"in the backward of {forward}" in text
        assert banners[0] == forward.replace(":", "#L")  # the forward node's own box (eager ids say #L)
        assert "peak happens here" in nodes["phase_backward"]
    else:  # the loss or the optimizer step: that phase's own box carries the banner
        assert real_phase in ("loss", "optimizer.step") and banners == ["phase_" + real_phase.replace(".", "_")]
    # the phases after the forward, chained; every edge between declared nodes, no ':' in any id
    assert {"phase_loss", "phase_backward", "phase_optimizer_step"} <= set(nodes)
    assert ("phase_loss", "phase_backward") in edges and ("phase_backward", "phase_optimizer_step") in edges
    assert all(t in nodes and h in nodes for t, h in edges), [e for e in edges if not set(e) <= set(nodes)]
    assert not [i for i in nodes if ":" in i]
    assert "training step" in fig.source and "train_peak" in fig.source


def test_train_false_is_the_forward_view(case):
    _, report, dims = case
    with threads(1):
        ev = report.evaluate(**dims)
        fig = report.diagram(dims, train=False)
        chart = report.timeline(dims, train=False)
    nodes, _ = parse_dot(fig.source)
    assert not [i for i in nodes if i.startswith("phase_")] and fig.peak_phase is None
    banner = [t for t in nodes.values() if "PEAK" in t]
    assert len(banner) == 1 and f"{ev['peak']:,} B" in banner[0] and "TRAINING-STEP" not in banner[0]
    assert chart.peak_phase is None and f"{ev['peak']:,} B" in svg_text(chart.svg())


def test_symbolic_diagram_of_a_step_says_train_peak(cnn):
    _, report, _ = cnn
    with threads(1):
        source = report.diagram().source
    assert "train_peak" in source and "phase_backward" in source


# --- the timeline ---------------------------------------------------------------------------------
def test_timeline_spans_the_step_and_marks_its_peak_in_its_phase(case):
    model, report, dims = case
    with threads(1):
        ev = report.evaluate(**dims)
        chart = report.timeline(dims)
        _, real_phase = real_step_peak(model, report, dims)
    assert chart.peak_phase == real_phase
    svg = chart.svg()
    ids = svg_ids(svg)
    assert f"{ev['train_peak']:,} B" in svg_text(svg) and "train_peak" in svg
    for phase in ("forward", "loss", "backward", "optimizer.step"):
        assert f"phase:{phase}" in ids, phase
    # the dashed peak line lies inside the shaded span of the phase the real step peaks in
    line = path_xs(ids["line:peak"])
    span = path_xs(ids[f"phase:{real_phase}"])
    assert line and min(span) <= min(line) and max(line) <= max(span)
    # and it stands on the tallest bar: resident (train_resident) + the most live bytes
    tops = {i: min(path_ys(e)) for i, e in ids.items() if i.startswith("live:")}  # SVG y grows downwards
    tallest = ids[min(tops, key=tops.get)]
    assert min(path_xs(tallest)) <= min(line) and max(line) <= max(path_xs(tallest))


def test_eager_timeline_names_bars_by_module_then_line(llama):
    _, report, dims = llama
    with threads(1):
        chart = report.timeline(dims)
    labels = [t.get_text() for t in chart.figure.axes[1].get_yticklabels()]
    modules = set(report.module_calls) | {"(the model)", ""}
    phases = {p.value for p in Phase}
    assert labels
    for label in labels:
        first, *_, last = label.split(" · ")
        if first in phases:  # what the optimizer step allocates: no module runs it
            continue
        assert first in modules, label
        assert re.match(r"\w+\.py:\d+", last), label  # the source line, second
    assert any(label.startswith("model.layers.") for label in labels)


# --- render -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["diagram", "timeline"])
def test_render_writes_sane_png_and_svg(case, what, tmp_path):
    _, report, dims = case
    with threads(1):
        png = report.render(str(tmp_path / f"{what}.png"), what=what, dims=dims)
        svg = report.render(str(tmp_path / f"{what}.svg"), what=what, dims=dims)
        train_peak = report.evaluate(**dims)["train_peak"]  # at the analysis' thread count, as drawn
    width, height = png_size(png)
    assert 300 < width < 10000 and 300 < height < 20000, (width, height)
    assert 10_000 < (tmp_path / f"{what}.png").stat().st_size < 20_000_000
    text = open(svg).read()
    ET.fromstring(text)  # well-formed
    assert f"{train_peak:,} B" in svg_text(text)


def test_train_true_without_an_optimizer_is_a_spec_error(tmp_path):
    report = fxmem.analyze(nn.Linear(6, 4), ("B", 6), check=False)
    for call in (lambda: report.diagram(train=True), lambda: report.timeline({"B": 3}, train=True),
                 lambda: report.render(str(tmp_path / "x.svg"), dims={"B": 3}, train=True)):
        with pytest.raises(fxmem.SpecError, match="optimizer="):
            call()
    with pytest.raises(fxmem.SpecError, match="train='yes'"):
        report.diagram(train="yes")
    assert report.diagram({"B": 3}).peak_phase is None  # without an optimizer the default is the forward
