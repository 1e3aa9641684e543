"""A Report as HTML: the summary (formulas in bytes) and the per-node table, for notebooks.

The same content as ``report.summary()`` and ``report.table()``, with the peak's node (where it
does not depend on the sizes) and the tensors autograd keeps highlighted as the diagram marks
them. Each formula appears once, typeset as MathML (which browsers render themselves: no script,
nothing fetched from a network); its plain text stays out of sight in the cell's ``title`` (shown
on hover, read by screen readers; ``report.summary()`` prints it to copy).

>>> from IPython.display import HTML; HTML(report_html(report, report.evaluate(**report.hints)))  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import sympy

from ..accounting import Evaluation
from .figure import PEAK, SAVED, esc
from .text import formula_text, node_kind

OPEN_ROWS = 60  # longer tables start folded, so a 12-block model does not flood the notebook


def math_html(expr: Any) -> str:
    """``expr`` as an inline MathML element (presentation markup: browsers render it natively).

    >>> math_html(sympy.Symbol("N") ** 2)
    '<math><msup><mi>N</mi><mn>2</mn></msup></math>'
    """
    from sympy.printing.mathml import mathml

    markup = mathml(sympy.sympify(expr), printer="presentation")
    # numeric references for HTML's named entities, so the markup is also well-formed XML
    for name, code in (("&InvisibleTimes;", "&#8290;"), ("&ApplyFunction;", "&#8289;")):
        markup = markup.replace(name, code)
    return f"<math>{markup}</math>"


def formula_cell(expr: Any) -> str:
    """A table cell showing ``expr`` (bytes) once, as MathML, with its plain text as the cell's
    tooltip (``title``), not shown a second time beside the typeset formula.

    >>> formula_cell(sympy.Symbol("B") * 4)                         # doctest: +SKIP
    """
    text = formula_text(expr)
    return f"<td style='text-align:left' title=\"{esc(text)} B\">{math_html(expr)} B</td>"


def report_html(report: Any, at_hints: Evaluation) -> str:
    """``report``'s summary and per-node table as one HTML fragment (``at_hints``: its numbers at
    the example sizes, which say where the peak is)."""
    mode = "training (autograd records)" if report.grad else "inference (no grad)"
    inputs = ", ".join(f"{s.arg}{s.text}" for s in report.specs)
    head = [f"<b>fxmem · {esc(report.model_name)}</b> · {esc(report.mode)} mode · device={esc(report.device)} · {mode}",
            f"inputs: <code>{esc(inputs)}</code>"]
    if report.region:
        head.append("formulas hold for: <code>" + esc(", ".join(report.region)) + "</code>")
    # each formula once, as MathML (rendered by the browser itself, offline); showing its text
    # beside it again read as every formula printed twice
    formulas = "".join(f"<tr><td style='text-align:left'>{esc(k)}</td>{formula_cell(v)}</tr>"
                       for k, v in report.formulas().items())
    # the peak's node is said only where it is the same at every size (no Max in the peak): the
    # example sizes the analysis ran at were never the user's choice
    peak = at_hints.liveness.peak_node if not report.peak.has(sympy.Max) else None
    where = next((n for n in report.nodes if n.name == peak), None)
    peak_line = ((f"peak in node <b>{esc(peak)}</b>" + (f" ({esc(where.source)})" if where and where.source else "")
                  + " at every size") if peak else
                 "where the peak happens depends on the sizes: <code>report.peak_node(B=..., ...)</code>")
    notes = "".join(f"<li>{esc(n)}</li>" for n in report.notes)

    rows = []
    for k, n in enumerate(report.nodes):
        if n.op == "output" and not n.allocations:
            continue
        shape = "; ".join("(" + ", ".join(formula_text(d) for d in s) + ")" for s in n.shapes)
        if not shape and n.value is not None:
            shape = formula_text(n.value)
        style = f" style='background:{PEAK};color:white'" if n.name == peak else ""
        saved = (f"<td style='text-align:left;background:{SAVED};color:black'>{esc(formula_text(n.saved))}</td>"
                 if n.saved != 0 else "<td></td>")
        cells = [str(k), f"<b>{esc(n.name)}</b>", esc(node_kind(n) if n.op in ("call_module", "call_method") else n.target), esc(shape),
                 esc(formula_text(n.allocated)) if n.allocations else ""]
        tail = [esc(formula_text(n.live_after)), esc(n.source) if n.source else ""]
        rows.append(f"<tr{style}>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells) + saved
                    + "".join(f"<td style='text-align:left'>{c}</td>" for c in tail) + "</tr>")
    header = "".join(f"<th style='text-align:left'>{h}</th>" for h in
                     ("#", "node", "target", "shape", "allocates (B)", "saved (B)", "live after (B)", "line"))
    fold = " open" if len(rows) <= OPEN_ROWS else ""
    return ("<div class='fxmem-report'>" + "<br>".join(head)
            + f"<table>{formulas}</table>" + (f"<p>{peak_line}</p>" if peak_line else "")
            + (f"<ul>{notes}</ul>" if notes else "")
            + f"<details{fold}><summary>per-node table ({len(rows)} nodes)</summary>"
            + f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table></details></div>")


def html_table(header: tuple, rows: list[tuple]) -> str:
    """Rows of strings as an HTML table (escaped, left-aligned)."""
    head = "".join(f"<th style='text-align:left'>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
