"""Figure: a graphviz drawing that saves itself by file extension and shows itself in notebooks.

The diagram (:mod:`.diagram`) and the timeline (:mod:`.timeline`) are both Figures, so they
render through the same ``dot`` to SVG, PNG or PDF. This module also holds what they share in
drawing: HTML-like label pieces and the heat scale that colours live bytes (text - formulas and
byte counts - is :mod:`.text`'s).

>>> fig = report.diagram()                     # doctest: +SKIP
>>> fig.save("gat.png")                        # doctest: +SKIP
'gat.png'
"""
from __future__ import annotations

import contextlib
import html
import os
from typing import Any, Iterator

import graphviz

from ..errors import FxMemError, SpecError

# file extension -> graphviz output format ("gv"/"dot" write the source itself)
FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf", ".gv": None, ".dot": None}
FONT = "Helvetica,Arial,sans-serif"

# ColorBrewer YlOrRd: light for little live memory, red near the peak; text stays black on all
# but the darkest, so every label reads in print and on screen
HEAT = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c")
EMPTY = "#ffffff"  # nothing live
PEAK = "#67000d"  # the peak's border and banner
SAVED = "#c6dbef"  # rows and bars of tensors autograd keeps for backward
SAVED_EDGE = "#2171b5"
OUTPUT = "#c7e9c0"
RESIDENT = "#eeeeee"
INK_SOFT = "#555555"

class Figure(graphviz.Digraph):
    """A graphviz Digraph with ``save(path)`` by extension and notebook display (SVG).

    ``dims`` are the sizes its numbers and colours were computed at (bytes everywhere);
    ``peak_node`` is the fx node holding the peak there (in a drawing of the training step, the
    node in whose forward or backward the step's peak happens); ``peak_phase`` the phase of the
    training step it happens in (None for a drawing of the forward).
    """

    dims: dict = {}
    peak_node: str | None = None
    peak_phase: str | None = None

    def save(self, path: str | os.PathLike) -> str:
        """Write the figure to ``path``: ``.svg``, ``.png``, ``.pdf`` (rendered by ``dot``) or ``.gv``/``.dot``."""
        path = os.fspath(path)
        fmt = output_format(path)
        data = self.source.encode() if fmt is None else self._pipe(fmt)
        with writing(path):
            with open(path, "wb") as f:
                f.write(data)
        return path

    def svg(self) -> str:
        """The rendered SVG as text."""
        return self._pipe("svg").decode("utf-8")

    def _pipe(self, fmt: str) -> bytes:
        try:
            return self.pipe(format=fmt)
        except graphviz.ExecutableNotFound as exc:
            raise FxMemError("drawing needs graphviz's `dot` program: install it (apt-get install graphviz, "
                             "brew install graphviz, conda install graphviz) and retry") from exc

    def _repr_svg_(self) -> str:
        return self.svg()

    def _repr_html_(self) -> str:
        # inline SVG scales with the notebook cell and keeps the tooltips (exact formulas on hover)
        return f'<div style="max-width:100%;overflow:auto">{self.svg()}</div>'


def output_format(path: str) -> str | None:
    """The graphviz format a path's extension asks for (None: the DOT source); SpecError if none fits."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in FORMATS:
        raise SpecError(f"cannot write {os.fspath(path)!r}: name it with one of {', '.join(FORMATS)}")
    return FORMATS[ext]


def training_view(train: bool | None, training: bool, view: str) -> bool:
    """Whether a picture draws the whole training step, from a view's ``train=`` option: the
    default (None) does where the analysis has one (``optimizer=``), ``False`` draws the forward
    alone, ``True`` without a training step is a :class:`SpecError`.

    >>> training_view(None, True, "diagram"), training_view(False, True, "timeline")
    (True, False)
    """
    if train is not None and not isinstance(train, bool):
        raise SpecError(f"{view}(train={train!r}): use True (the training step), False (the forward) or leave it "
                        f"out (the training step when the analysis has one)")
    if train and not training:
        raise SpecError(f"{view}(train=True) draws the training step, and this analysis has none: analyse with "
                        f"optimizer=... (or leave train= out to draw the forward)")
    return training if train is None else train


PHASE_TEXT = {"forward": "the forward", "loss": "the loss", "backward": "backward()",
              "optimizer.step": "optimizer.step()", "zero_grad": "optimizer.zero_grad()", "return": "the step's return"}


def step_peak_text(node: str | None, phase: str | None, forward_node: str | None, module: str = "") -> str:
    """Where a training step's peak happens, in words: ``in the backward of conv``, ``in the
    forward, at node relu``, ``in optimizer.step()``; ``module``: the node's module path, said
    after it (eager mode's nodes are source lines).

    >>> step_peak_text("conv (backward)", "backward", "conv")
    'in the backward of conv'
    >>> step_peak_text("modeling_llama.py:164 (backward)", "backward", "modeling_llama.py:164", "model.layers.0.mlp")
    'in the backward of modeling_llama.py:164 (model.layers.0.mlp)'
    """
    if phase is None:
        return "nowhere (the step allocates nothing)"
    within = f" ({module})" if module else ""
    if phase == "backward" and forward_node and forward_node != node:
        return f"in the backward of {forward_node}{within}"
    if phase == "forward" and node:
        return f"in the forward, at node {node}{within}"
    return f"in {PHASE_TEXT.get(phase, phase)}"


# --- drawing vocabulary -------------------------------------------------------------------------
def esc(text: Any) -> str:
    """Text made safe inside a graphviz HTML-like label."""
    return html.escape(str(text), quote=True)


def lines_html(lines: list[str], align: str = "LEFT") -> str:
    """Escaped lines joined with graphviz line breaks."""
    return f'<BR ALIGN="{align}"/>'.join(esc(line) for line in lines) + f'<BR ALIGN="{align}"/>'


def heat(value: int, top: int) -> str:
    """Fill colour of ``value`` live bytes on a scale whose reddest bin holds ``top`` (the peak)."""
    if value <= 0 or top <= 0:
        return EMPTY
    return HEAT[min(len(HEAT) - 1, value * len(HEAT) // top)]


def ink(fill: str) -> str:
    """Text colour that reads on ``fill``."""
    return "white" if fill in (HEAT[-1], PEAK) else "black"


def heat_bins(top: int) -> list[tuple[str, int, int]]:
    """The scale's bins as ``(colour, low bytes, high bytes)`` for a legend."""
    n = len(HEAT)
    return [(c, -(-top * i // n), -(-top * (i + 1) // n) - (1 if i < n - 1 else 0)) for i, c in enumerate(HEAT)]


_SYSTEM_FOLDERS = ("/dev", "/proc", "/sys")  # pseudo-filesystems: a "file" there is a device or kernel state


def check_writable(path: str, what: str = "cannot write") -> None:
    """Raise :class:`SpecError` unless ``path`` can be an ordinary file (before anything slow runs)."""
    real = os.path.realpath(path)
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise SpecError(f"{what} {path!r}: the folder {folder!r} does not exist")
    if any(real == d or real.startswith(d + os.sep) for d in _SYSTEM_FOLDERS):
        raise SpecError(f"{what} {path!r}: {real} is in a system folder of devices and kernel state, not a place "
                        f"for a drawing; name a file in an ordinary folder")
    if os.path.exists(real) and not os.path.isfile(real):
        raise SpecError(f"{what} {path!r}: it exists and is not an ordinary file")
    if not os.access(folder, os.W_OK) or (os.path.exists(real) and not os.access(real, os.W_OK)):
        raise SpecError(f"{what} {path!r}: cannot write there")


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Check ``path`` (:func:`check_writable`) and turn a failed write (disk full, ...) into a
    :class:`SpecError` naming the file."""
    check_writable(path)
    try:
        yield
    except OSError as exc:
        raise SpecError(f"cannot write {path!r}: {exc.strerror or exc}") from None
