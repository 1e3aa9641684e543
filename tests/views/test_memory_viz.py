"""report.memory_viz(): the predicted run as one self-contained HTML page (memory_viz's active
memory timeline, drawn offline). Checked against the report's own numbers on every machine, and
in a headless browser with the network off where one is installed."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch

import fxmem
from conftest import load_example
from fxmem.views.memory_viz import BOTTOM, LEFT, MIN_BAND, RIGHT, TOP

attention = load_example("seed_attention")
DIMS = dict(B=3, L=11)
ADAMW = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome-headless-shell",
            "chromium-headless-shell")


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    return fxmem.analyze(attention.Attention(64, 8), ("B", "L", 64), optimizer=ADAMW)


class _Page(HTMLParser):
    """What a browser would fetch or run (``src``/``href`` URLs, scripts), the embedded snapshot,
    and the drawn polygons (``data-size``, bytes, and ``points``)."""

    def __init__(self, page: str):
        super().__init__()
        self.urls, self.scripts, self.polygons, self.svg, self._json = [], [], [], {}, None
        self.snapshot = None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v and not v.startswith("data:")]
        if tag == "script":
            self.scripts.append(a)
            self._json = a.get("type") == "application/json" and a.get("id") == "fxmem-snapshot"
        elif tag == "svg":
            self.svg = a
        elif tag == "polygon":
            self.polygons.append(a)

    def handle_data(self, data):
        if self._json:
            self.snapshot = json.loads(data)
            self._json = False


def _replay(snap: dict) -> tuple[int, int]:
    """(peak, final) live bytes of the events, added up independently of fxmem's page code."""
    live = peak = 0
    for e in snap["device_traces"][0]:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, live)
    return peak, live


def _drawn(snap: dict, peak: int) -> list[int]:
    """The sizes (bytes) of the allocations thick enough to get a band of their own."""
    allocs = [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
    return sorted(a for a in allocs if a * (BOTTOM - TOP) / peak >= MIN_BAND)


def test_page_is_self_contained_and_carries_the_reports_numbers(report, tmp_path):
    ev = report.evaluate(**DIMS)
    path = tmp_path / "step.html"
    page = report.memory_viz(DIMS, path=str(path))  # analysed with an optimizer: the training step
    assert path.read_text(encoding="utf-8") == page
    assert not re.search(r"https?://", page), "nothing the page names is on the web"
    parsed = _Page(page)
    assert parsed.urls == [] and all(s.get("type") == "application/json" for s in parsed.scripts)
    snap = parsed.snapshot
    assert snap["fxmem"]["train"] is True and snap["fxmem"]["dims"] == DIMS
    assert _replay(snap)[0] == ev["train_peak"] == int(parsed.svg["data-peak"])
    assert f"{ev['train_peak']:,} B" in page  # the peak's label
    # one band per allocation, with its bytes; only those thinner than MIN_BAND (AdamW's 4-byte
    # step counters, 8-byte scalars here) are left to the outline of the total
    allocs = [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
    drawn = _drawn(snap, ev["train_peak"])
    assert sorted(int(p["data-size"]) for p in parsed.polygons) == drawn
    assert set(allocs) - set(drawn) <= {4, 8}
    # the forward alone: its peak, and the picture's top edge sits at the peak line
    forward = _Page(report.memory_viz(DIMS, train=False))
    assert _replay(forward.snapshot) == (ev["peak"], ev["resident"] + ev["retained"])
    tops = [min(float(xy.split(",")[1]) for xy in p["points"].split()) for p in forward.polygons]
    assert min(tops) == pytest.approx(TOP, abs=0.01) and int(forward.svg["data-peak"]) == ev["peak"]


def test_bad_input_says_what_to_do(report, tmp_path):
    with pytest.raises(fxmem.SpecError, match=r"memory_viz\(dims=.*dict"):
        report.memory_viz([3, 11])
    with pytest.raises(fxmem.SpecError, match=r"memory_viz\(train=.*True"):
        report.memory_viz(DIMS, train="yes")
    with pytest.raises(fxmem.SpecError, match=r"memory_viz\(path=.*file name"):
        report.memory_viz(DIMS, path=3)
    with pytest.raises(fxmem.FxMemError, match="cannot write"):
        report.memory_viz(DIMS, path=str(tmp_path / "no-such-folder" / "x.html"))
    inference = fxmem.analyze(attention.Attention(64, 8), ("B", "L", 64))
    with pytest.raises(fxmem.SpecError, match=r"optimizer="):
        inference.memory_viz(DIMS, train=True)
    assert _Page(inference.memory_viz(DIMS)).snapshot["fxmem"]["train"] is False  # the default: the forward


def _browser() -> str | None:
    return next((b for b in map(shutil.which, BROWSERS) if b), None)


def _headless(browser: str, *args: str) -> subprocess.CompletedProcess:
    """The browser, headless, with every network request sent to a closed local port."""
    return subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                           "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
                           "--window-size=1100,700", *args], capture_output=True, text=True, timeout=120)


def _longest_run(flags: list[bool]) -> tuple[int, int]:
    """(first, last) index of the longest run of True in ``flags``."""
    best, start = (0, -1), None
    for i, f in enumerate(flags + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            best = max(best, (start, i - 1), key=lambda r: r[1] - r[0])
            start = None
    return best


def test_a_browser_offline_draws_the_timeline(report, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip(f"no headless browser ({', '.join(BROWSERS)}) on PATH; e.g. apt-get install chromium")
    from PIL import Image

    ev = report.evaluate(**DIMS)
    page = tmp_path / "forward.html"
    report.memory_viz(DIMS, path=str(page), train=False)
    # the DOM the browser built: the snapshot survived parsing whole, every band is there
    dom = _Page(_headless(browser, "--dump-dom", page.as_uri()).stdout)
    assert dom.snapshot is not None and _replay(dom.snapshot) == (ev["peak"], ev["resident"] + ev["retained"])
    assert sorted(int(p["data-size"]) for p in dom.polygons) == _drawn(dom.snapshot, ev["peak"])
    # what it painted: find the dashed red peak line, the x axis below it (the darkest row) and
    # the stack's height at the last event, which must be the bytes live at the end
    shot = tmp_path / "forward.png"
    out = _headless(browser, f"--screenshot={shot}", page.as_uri())
    assert shot.exists(), out.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    px, (w, h) = img.load(), img.size
    dark = lambda p: sum(p) < 150  # noqa: E731
    red = lambda p: p[0] > 150 and p[1] < 40 and p[2] < 40  # noqa: E731  (#c00; the palette's red is #e15759)
    white = lambda p: min(p) > 245  # noqa: E731
    peak_y = max(range(h), key=lambda y: sum(red(px[x, y]) for x in range(w)))
    axis_y = max(range(peak_y + 1, h), key=lambda y: sum(dark(px[x, y]) for x in range(w)))
    left, right = _longest_run([dark(px[x, axis_y]) for x in range(w)])  # not the "0 B" label beside it
    assert right - left == pytest.approx(RIGHT - LEFT, abs=2), "the page is drawn at its natural size"
    assert axis_y - peak_y == pytest.approx(BOTTOM - TOP, abs=2), "the stack's scale is the page's"
    column = right - 3
    top = axis_y - 1
    while top > peak_y and not white(px[column, top - 1]):
        top -= 1
    painted = [px[x, y] for x in range(left + 2, right) for y in range(peak_y + 2, axis_y - 1)]
    assert sum(not white(p) for p in painted) > 0.2 * len(painted), "the bands are painted"
    final = (ev["resident"] + ev["retained"]) / ev["peak"]
    assert (axis_y - top) / (axis_y - peak_y) == pytest.approx(final, abs=0.02)
