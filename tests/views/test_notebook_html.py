"""The notebook view (Report._repr_html_): every formula shows once - typeset as MathML - with its
plain text kept out of sight (the cell's tooltip), not printed a second time beside it."""
from __future__ import annotations

from html.parser import HTMLParser

import pytest
import torch

import fxmem
from conftest import load_example
from fxmem.views.text import formula_text

attention = load_example("seed_attention")


class _FormulaCells(HTMLParser):
    """The cells of the page's first table (the formulas): for each, its ``title``, how many
    ``<math>`` elements it holds, and its visible text outside and inside MathML."""

    def __init__(self, page: str):
        super().__init__()
        self.cells: list[dict] = []
        self._tables = 0
        self._cell = None
        self._math = 0
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._tables += 1
        elif tag == "td" and self._tables == 1:
            self._cell = {"title": dict(attrs).get("title"), "math": 0, "text": "", "math_text": ""}
            self.cells.append(self._cell)
        elif tag == "math" and self._cell is not None:
            self._cell["math"] += 1
            self._math += 1

    def handle_endtag(self, tag):
        if tag == "math":
            self._math -= 1
        elif tag == "td":
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["math_text" if self._math else "text"] += data


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    return fxmem.analyze(attention.Attention(64, 8), ("B", "L", 64),
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


def test_each_formula_is_shown_once(report):
    page = report._repr_html_()
    cells = _FormulaCells(page).cells
    formulas = report.formulas()
    rows = [cells[i:i + 2] for i in range(0, len(cells), 2)]  # (name, formula) per row
    assert [name["text"] for name, _ in rows] == list(formulas)
    for (_, cell), expr in zip(rows, formulas.values()):
        text = formula_text(expr)
        assert cell["math"] == 1, "one typeset rendering"
        assert cell["text"].strip() == "B", "beside it only the unit, not the formula again"
        assert cell["title"] == f"{text} B", "the text stays at hand as the tooltip"
        # the MathML's own characters are the formula's symbols and digits
        assert all(s.name in cell["math_text"] for s in expr.free_symbols)
    # and the plain text is nowhere visible in the formulas table
    visible = "".join(c["text"] for c in cells)
    assert not any(formula_text(e) in visible for e in formulas.values() if len(formula_text(e)) > 3)
