"""Text: byte counts, formulas as short text, node labels, the per-node table and the summary.

The report's text output and the pictures' labels share these, so a formula or a node reads the
same everywhere.

>>> format_bytes(1024000000), formula_text("2052*B*N**2 + 4096")
('976.56 MiB', '2052·B·N² + 4096')
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import sympy

from ..accounting import FORMULA_KEYS, TRAIN_KEYS

_SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def format_bytes(n: int) -> str:
    """``1023`` -> ``'1023 B'``, ``1024000000`` -> ``'976.56 MiB'`` (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def formula_text(expr: Any) -> str:
    """A formula as compact text: ``2052*B*N**2 + 4096`` -> ``'2052·B·N² + 4096'``."""
    text = str(sympy.sympify(expr))
    text = re.sub(r"\*\*(\d+)", lambda m: m.group(1).translate(_SUPERSCRIPT), text)
    return text.replace("**", "^").replace("*", "·")


def wrap(text: str, width: int = 48) -> list[str]:
    """Break a long formula at its spaces, keeping each ``+``/``-`` with the term that follows."""
    words: list[str] = []
    for word in text.split(" "):
        if words and words[-1] in ("+", "-"):
            words[-1] += " " + word
        else:
            words.append(word)
    lines = [""]
    for word in words:
        if lines[-1] and len(lines[-1]) + 1 + len(word) > width:
            lines.append(word)
        else:
            lines[-1] = f"{lines[-1]} {word}" if lines[-1] else word
    return lines


def code_text(code: str, width: int = 56) -> str:
    """A source line without its comment, cut to ``width`` characters."""
    code = code.split("  #")[0].strip()
    return code if len(code) <= width else code[: width - 1] + "…"


def dims_text(dims: Mapping[str, int]) -> str:
    """``{'B': 4, 'N': 500}`` -> ``'B=4, N=500'``."""
    return ", ".join(f"{k}={v}" for k, v in sorted(dims.items()))


def node_kind(node: Any, classes: Mapping[str, str] | None = None) -> str:
    """What a node does, as its row or box names it: ``linear``, ``.repeat``, ``Linear``, ``input``."""
    if node.op == "call_module":
        return (classes or {}).get(node.target) or node.module or node.target
    if node.op == "call_method":
        return "." + node.target
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return "parameter"
    if node.op == "output":
        return "return"
    return node.target


def node_table(report: Any, evaluation: Any = None, max_width: int = 60) -> str:
    """The per-node table: what each node allocates, what autograd saves, what is live after it.

    With an ``evaluation`` (numbers at some dims) the byte columns are numbers instead of formulas.
    """
    subs = None
    if evaluation is not None:
        subs = {report.symbols[k]: v for k, v in evaluation.liveness.dims.items()}

    def fmt(expr: sympy.Expr, k: int | None = None, node_live: bool = False) -> str:
        if subs is None:
            text = str(expr)
            return text if len(text) <= max_width else text[: max_width - 1] + "…"
        from ..accounting.symbolic import evaluate

        return format_bytes(evaluation.liveness.after[k] if node_live else evaluate(expr, subs))

    rows = [("#", "node", "target", "shape", "allocates", "saved", "live after", "line")]
    for k, n in enumerate(report.nodes):
        if n.op in ("output",) and not n.allocations:
            continue
        shape = "; ".join("(" + ", ".join(str(d) for d in s) + ")" for s in n.shapes) or (
            str(n.value) if n.value is not None else "")
        target = node_kind(n) if n.op in ("call_module", "call_method") else n.target
        rows.append((str(k), n.name, target, shape[:40], fmt(n.allocated) if n.allocations else "",
                     fmt(n.saved) if n.saved != 0 else "", fmt(n.live_after, k, node_live=True),
                     str(n.source) if n.source else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(report: Any, evaluation: Mapping[str, int] | None = None) -> str:
    """The headline formulas (and the numbers of ``evaluation``) as text."""
    head = (f"fxmem · {report.model_name} · {report.mode} mode · device={report.device} · "
            f"{'training (autograd records)' if report.grad else 'inference (no grad)'}")
    inputs = ", ".join(f"{s.arg}{s.text}" for s in report.specs)
    lines = [head, f"inputs: {inputs}"]
    if report.region:
        lines.append("formulas hold for: " + ", ".join(report.region))
    for k in FORMULA_KEYS + (TRAIN_KEYS if report.training else ()):
        line = f"  {k:<15} = {getattr(report, k)}"
        if evaluation is not None:
            line += f"   -> {evaluation[k]:,} B ({format_bytes(evaluation[k])})"
        lines.append(line)
    if report.device == "cuda":
        lines.append("  (bytes as requested; evaluate() rounds every block up to 512 B like the CUDA allocator)")
    facts = report.facts
    if "threads" in facts:
        lines.append(f"assumed: {facts['threads']} intra-op thread(s), oneDNN {'on' if facts.get('onednn') else 'off'}, "
                     f"CPU {facts.get('cpu_capability', '?')} (numbers at another setting are re-analysed)")
    if facts.get("kernel_rules"):
        lines.append("kernel rules used: " + ", ".join(facts["kernel_rules"]))
    if not report.exact:
        lines.append("  NOT EXACT: some numbers may differ from a real run (see the notes)")
    for note in report.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
