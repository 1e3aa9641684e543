"""The predicted run as one self-contained HTML page: PyTorch's "active memory timeline", offline.

``torch.cuda._memory_viz.trace_plot(snapshot)`` draws a snapshot's allocations over time, but its
page imports the viewer (MemoryViz.js) from cdn.jsdelivr.net, and that script imports d3 from
cdn.skypack.dev: offline the page is blank. Inlining torch's script would not help (its d3 imports
still go to the web), and the torch wheels checked here (2.13.0+cpu, 2.14.1+cu130) do not ship it
at all (``torch/utils/viz/`` holds only ``_cycles.py``). So this page draws the same picture itself,
as a static SVG built here: one band per allocation, stacked in the order they were made, a band
above a freed one dropping down when it is freed - trace_plot's layout - with a tooltip (the SVG
``<title>``) giving each allocation's bytes and frames (the user's source line and the fx node).
Nothing is fetched and no script runs, so it opens in any browser, offline, and in a notebook.

The page also carries the snapshot itself: as JSON (``<script type="application/json"
id="fxmem-snapshot">``, for scripts) and as the pickle pytorch.org/memory_viz opens (a download
link, a ``data:`` URL: nothing is uploaded), for the interactive viewer when online.

Reports call it: ``report.memory_viz(dims, path=None, train=None)``.

>>> html = memory_viz_page(report.snapshot({"B": 4, "N": 500}))    # doctest: +SKIP
>>> open("gat.html", "w").write(html)                              # doctest: +SKIP
"""
from __future__ import annotations

import base64
import html as html_lib
import json
import pickle
from dataclasses import dataclass, field

from ..errors import FxMemError
from ..units import format_bytes

__all__ = ["memory_viz_page", "Band", "bands"]

# the drawing, in SVG user units (one unit is one CSS pixel at the page's natural size)
WIDTH, HEIGHT = 1000, 460
LEFT, RIGHT, TOP, BOTTOM = 110, 980, 30, 420
# tableau10, the palette MemoryViz.js colours its blocks with, so the page looks like torch's
PALETTE = ("#4e79a7", "#f28e2c", "#e15759", "#76b7b2", "#59a14f", "#edc949", "#af7aa1", "#ff9da7",
           "#9c755f", "#bab0ab")
# a band thinner than this (in units) is not drawn on its own: the outline of the total still
# shows its bytes, and a 7B model's thousands of tiny biases would otherwise bloat the page
MIN_BAND = 0.05


@dataclass
class Band:
    """One allocation's place in the stacked timeline.

    ``size`` in bytes; ``start``/``end``: the event indices (allocs and frees counted together)
    it was made and freed at (``end`` None: still live at the end); ``steps``: ``(event, offset)``
    pairs, its bottom edge in bytes from that event on (it drops when a band below it is freed).

    >>> Band(addr=0, size=512, start=0, frames=[]).steps            # doctest: +SKIP
    """

    addr: int
    size: int
    start: int
    frames: list
    end: int | None = None
    steps: list = field(default_factory=list)


def bands(snap: dict) -> tuple[list[Band], list[int], int]:
    """The snapshot's allocations laid out as trace_plot stacks them.

    Returns ``(bands, totals, events)``: ``totals[t]`` is the bytes live after event ``t`` (an
    ``alloc`` or a ``free_completed``; ``free_requested`` only announces the free), ``events`` how
    many there were.

    >>> bs, totals, n = bands(report.snapshot({"B": 4}))            # doctest: +SKIP
    >>> max(totals)                                                 # the peak, bytes  # doctest: +SKIP
    """
    traces = snap.get("device_traces") if isinstance(snap, dict) else None
    if not isinstance(traces, list) or not traces:
        raise FxMemError("memory_viz: expected a memory snapshot with 'device_traces' (report.snapshot() makes one)")
    stack: list[Band] = []  # live bands, bottom first
    done: list[Band] = []
    totals: list[int] = []
    live = 0
    t = 0
    for e in traces[0]:
        if e["action"] == "alloc":
            band = Band(addr=e["addr"], size=int(e["size"]), start=t, frames=e.get("frames") or [])
            band.steps.append((t, live))
            stack.append(band)
            live += band.size
        elif e["action"] == "free_completed":
            k = next((i for i, b in enumerate(stack) if b.addr == e["addr"]), None)
            if k is None:
                raise FxMemError(f"memory_viz: the trace frees address {e['addr']} it never allocated")
            freed = stack.pop(k)
            freed.end = t
            done.append(freed)
            live -= freed.size
            for b in stack[k:]:  # everything above the freed band drops by its size
                b.steps.append((t, b.steps[-1][1] - freed.size))
        else:
            continue
        totals.append(live)
        t += 1
    return done + stack, totals, t


def _frames_text(frames: list) -> str:
    """A band's frames, innermost last, one per line (what the tooltip shows)."""
    return "\n".join(f"{f.get('filename', '?')}:{f.get('line', 0)} {f.get('name', '')}" for f in frames)


def _band_polygon(band: Band, x, y, events: int) -> str:
    """``points`` of the band's polygon: its stepped bottom edge forwards, top edge backwards."""
    end = band.end if band.end is not None else events
    bottom = []
    for k, (t, offset) in enumerate(band.steps):
        if k:  # a drop: vertical at the free that caused it
            bottom.append((t, band.steps[k - 1][1]))
        bottom.append((t, offset))
    bottom.append((end, band.steps[-1][1]))
    top = [(t, o + band.size) for t, o in reversed(bottom)]
    return " ".join(f"{x(t):.2f},{y(o):.2f}" for t, o in bottom + top)


def _axis(ymax: int, events: int, x, y) -> list[str]:
    """Axes with a few labelled ticks (bytes on the left, events below)."""
    out = [f"<line x1='{LEFT}' y1='{BOTTOM}' x2='{RIGHT}' y2='{BOTTOM}' stroke='black' shape-rendering='crispEdges'/>",
           f"<line x1='{LEFT}' y1='{TOP}' x2='{LEFT}' y2='{BOTTOM}' stroke='black' shape-rendering='crispEdges'/>"]
    for k in range(5):
        value = ymax * k // 4
        out.append(f"<text x='{LEFT - 6}' y='{y(value) + 4:.2f}' text-anchor='end' font-size='12'>"
                   f"{html_lib.escape(format_bytes(value))}</text>")
    out.append(f"<text x='{(LEFT + RIGHT) / 2}' y='{BOTTOM + 32}' text-anchor='middle' font-size='12'>"
               f"event (allocations and frees, in order; {events} in all)</text>")
    return out


def timeline_svg(snap: dict) -> str:
    """The stacked timeline of ``snap`` as an SVG element (bytes up, events across).

    The root carries ``data-peak`` (bytes) and one ``<polygon class='alloc'>`` per allocation
    that is drawn, with ``data-size`` (bytes) and a ``<title>`` tooltip.

    >>> svg = timeline_svg(report.snapshot({"B": 4}))               # doctest: +SKIP
    """
    all_bands, totals, events = bands(snap)
    peak = max(totals, default=0)
    ymax = max(peak, 1)
    x = lambda t: LEFT + (RIGHT - LEFT) * t / max(events, 1)  # noqa: E731
    y = lambda b: BOTTOM - (BOTTOM - TOP) * b / ymax  # noqa: E731
    parts = []
    for b in all_bands:
        if b.size * (BOTTOM - TOP) / ymax < MIN_BAND:
            continue
        colour = PALETTE[b.start % len(PALETTE)]  # neighbours in time differ in colour
        life = f"events {b.start}-{b.end}" if b.end is not None else f"event {b.start} to the end"
        tip = f"{b.size:,} B ({format_bytes(b.size)}), live {life}\n{_frames_text(b.frames)}"
        parts.append(f"<polygon class='alloc' data-size='{b.size}' fill='{colour}' "
                     f"points='{_band_polygon(b, x, y, events)}'><title>{html_lib.escape(tip)}</title></polygon>")
    # the total as a step outline: what every band adds up to, the tiny undrawn ones included
    outline = " ".join(f"{x(t):.2f},{y(a):.2f} {x(t + 1):.2f},{y(a):.2f}" for t, a in enumerate(totals))
    parts.append(f"<polyline class='total' fill='none' stroke='black' stroke-width='0.8' points='{outline}'/>")
    parts += _axis(ymax, events, x, y)  # after the bands, so the bottom band does not hide the axis
    parts.append(f"<line class='peak' x1='{LEFT}' x2='{RIGHT}' y1='{y(peak):.2f}' y2='{y(peak):.2f}' "
                 f"stroke='#c00' stroke-dasharray='6 4' shape-rendering='crispEdges'/>")
    parts.append(f"<text x='{RIGHT}' y='{y(peak) - 6:.2f}' text-anchor='end' font-size='12' fill='#c00'>"
                 f"peak {peak:,} B ({html_lib.escape(format_bytes(peak))})</text>")
    # no xmlns: inline SVG in HTML needs none, and the page then names no URL at all
    return (f"<svg id='fxmem-timeline' data-peak='{peak}' "
            f"width='{WIDTH}' height='{HEIGHT}' viewBox='0 0 {WIDTH} {HEIGHT}' "
            f"style='background:white;font-family:sans-serif'>" + "".join(parts) + "</svg>")


def _json_for_script(snap: dict) -> str:
    """``snap`` as JSON that cannot end its ``<script>`` element early (``</`` escaped)."""
    return json.dumps(snap, default=str).replace("</", "<\\/")


def _pickle_link(snap: dict) -> str:
    """A download link to the snapshot as the pickle pytorch.org/memory_viz opens."""
    data = base64.b64encode(pickle.dumps(snap)).decode("ascii")
    return (f"<a download='snapshot.pickle' href='data:application/octet-stream;base64,{data}'>snapshot.pickle</a>")


def memory_viz_page(snap: dict) -> str:
    """A whole HTML page of ``snap`` (a memory snapshot, e.g. ``report.snapshot(...)``): its
    stacked allocation timeline (bytes), its peak, and the snapshot itself; nothing fetched.

    >>> html = memory_viz_page(report.snapshot({"B": 4, "N": 500}, train=True))   # doctest: +SKIP
    """
    meta = snap.get("fxmem", {}) if isinstance(snap, dict) else {}
    svg = timeline_svg(snap)
    dims = ", ".join(f"{k}={v}" for k, v in (meta.get("dims") or {}).items())
    title = (f"fxmem · {meta.get('model', 'model')} · {'training step' if meta.get('train') else 'forward'}"
             + (f" · {dims}" if dims else ""))
    sizes = "512-byte blocks, as the CUDA caching allocator counts" if meta.get("device") == "cuda" else "bytes"
    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            f"<title>{html_lib.escape(title)}</title></head>"
            "<body style='font-family:sans-serif;margin:8px'>"
            f"<h3 style='margin:4px 0'>{html_lib.escape(title)}</h3>"
            f"<p style='margin:4px 0'>Predicted active memory over the run ({sizes}; device "
            f"{html_lib.escape(str(meta.get('device', '?')))}). Hover a band for its size and source line. "
            f"For PyTorch's interactive viewer, open {_pickle_link(snap)} at pytorch.org/memory_viz.</p>"
            f"{svg}"
            f"<script type='application/json' id='fxmem-snapshot'>{_json_for_script(snap)}</script>"
            "</body></html>\n")
