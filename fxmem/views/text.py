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
from sympy.printing.str import StrPrinter

from ..accounting import FORMULA_KEYS, TRAIN_KEYS
from ..distributed.labels import is_collective_buffer
from ..specs import dim_symbol
from ..units import format_bytes

_SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


class FormulaPrinter(StrPrinter):
    """sympy's own text printer with ``·`` for products and superscripts for integer powers
    (``2052*B*N**2`` -> ``2052·B·N²``); terms keep sympy's order, as ``str(expr)`` has them."""

    def _print_Pow(self, expr: sympy.Pow, rational: bool = False) -> str:
        exp = expr.exp
        if exp.is_Integer and exp > 1:
            return self.parenthesize(expr.base, sympy.printing.precedence.PRECEDENCE["Pow"]) + \
                str(exp).translate(_SUPERSCRIPT)
        return super()._print_Pow(expr, rational)

    def _print_Mul(self, expr: sympy.Mul) -> str:
        # the base class joins factors with "*"; every factor is printed by this printer, so the
        # only "*" left in its result are products
        return super()._print_Mul(expr).replace("*", "·")


def formula_text(expr: Any) -> str:
    """A formula as compact text: ``2052*B*N**2 + 4096`` -> ``'2052·B·N² + 4096'``."""
    if isinstance(expr, str):  # names are dims, never sympy's own functions (N, S, E ...)
        # (a name followed by "(" is a function of the formula: Max, Min, floor, ceiling)
        names = {name: dim_symbol(name) for name in re.findall(r"[A-Za-z_]\w*\b(?!\s*\()", expr)}
        expr = sympy.sympify(expr, locals=names)
    return FormulaPrinter().doprint(sympy.sympify(expr))


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


def code_lines(code: str, width: int = 56) -> list[str]:
    """A source line without its comment, broken at spaces into lines of about ``width`` characters
    (never cut: the whole statement is what the reader looks for)."""
    code = code.split("  #")[0].strip()
    lines = [""]
    for word in code.split(" "):
        if lines[-1] and len(lines[-1]) + 1 + len(word) > width:
            lines.append("    " + word)
        else:
            lines[-1] = f"{lines[-1]} {word}" if lines[-1] else word
    return lines


# what the tensors a node allocates are, by the aten op that made them
_COPY_KIND = {"aten.clone": "contiguous copy", "aten._to_copy": "copy"}


def node_inputs(report: Any, node: Any) -> list[tuple[str, int | None, tuple]]:
    """The tensor inputs of fx node ``node`` as ``(fx node name, storage index, shape)`` ([] in eager mode)."""
    if report.graph_module is None:
        return []
    fx = next((n for n in report.graph_module.graph.nodes if n.name == node.name), None)
    by_name = {m.name: m for m in report.nodes}
    out = []
    for src in fx.all_input_nodes if fx is not None else []:
        m = by_name.get(src.name)
        if m is not None and m.shapes and m.outputs:
            out.append((m.name, m.outputs[0], m.shapes[0]))
    return out


def storage_text(s: Any, node: Any, inputs: list, storages: list) -> str:
    """What one tensor a node allocates is: ``output``, ``contiguous copy of getitem_3``, ``bfloat16
    copy of qkv.weight``, ``a Python number as a tensor``, or the aten op that made it.

    ``inputs``: the node's tensor inputs as ``(fx node name, storage index, shape)``; a copy is
    named after the input it copies only when exactly one input is a view of the copied storage
    with the copy's shape (otherwise after the storage itself).
    """
    if is_collective_buffer(s.name):  # FSDP2's buffers: "all-gather layers.0", "reduce-scatter layers.0"
        return s.name
    if s.index in (node.outputs or []):
        return "output"
    if s.copy_of is not None:
        kind = _COPY_KIND.get(s.op, "copy")
        if s.op == "aten._to_copy":
            kind = f"{str(s.dtype).replace('torch.', '')} copy"
        same = [name for name, index, shape in inputs if index == s.copy_of and tuple(shape) == tuple(s.shape)]
        source = same[0] if len(same) == 1 else storages[s.copy_of].name
        return f"{kind} of {source}"
    if not s.shape and not getattr(s.bytes, "free_symbols", None):
        return "a Python number as a tensor"
    return s.op or s.name


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
    return text_table(rows[0], rows[1:])


def text_table(header: tuple, rows: list[tuple], right: tuple = (), max_cell: int = 60) -> str:
    """Rows of strings as an aligned text table under ``header`` (columns ``right`` right-aligned);
    a cell longer than ``max_cell`` characters (a long formula) is cut with "…" (the report's
    attributes keep the whole expression)."""
    def cap(cell: str) -> str:
        return cell if len(cell) <= max_cell else cell[: max_cell - 1] + "…"

    rows = [tuple(header)] + [tuple(cap(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(report: Any, evaluation: Mapping[str, int] | None = None, dims: Mapping[str, int] | None = None,
            full: bool = False, asked_of: Any = None) -> str:
    """The headline formulas (and the numbers of ``evaluation``) as text.

    With ``dims`` (the sizes ``evaluation`` is at) and not ``full``, a formula that is a ``Max`` of
    candidates shows the candidate that decides it there, and how many others the full formula
    (``report.peak`` etc.) has. ``asked_of``: the report the user asked, when ``report`` is its
    re-analysis at ``dims`` (they lie outside the asked one's region): the summary says so.
    """
    head = (f"fxmem · {report.model_name} · {report.mode} mode · device={report.device} · "
            f"{'training (autograd records)' if report.grad else 'inference (no grad)'}")
    inputs = ", ".join(f"{s.arg}{s.text}" for s in report.specs)
    lines = [head, f"inputs: {inputs}"]
    if report.capture.reason:  # not the mode asked for: say which code the numbers are of, and why
        lines.append(f"capture: {report.capture.text}")
    if asked_of is not None and asked_of is not report and asked_of._plan.rec is report._plan.rec:
        lines.append(f"at {', '.join(f'{k}={v}' for k, v in dims.items())} a kernel works in another regime than at the "
                     f"example sizes: the formulas below are that piece's (the same simulation)")
    elif asked_of is not None and asked_of is not report:
        lines.append(f"re-analysed at {', '.join(f'{k}={v}' for k, v in dims.items())}: outside the region of the "
                     f"analysis asked ({', '.join(asked_of.region)}); the formulas below are the re-analysis'")
    if report.region:
        lines.append("formulas hold for: " + ", ".join(report.region))
    plan = report._plan
    if report._pieces_usable():  # a kernel's size regimes: the same simulation has formulas for each side
        here = plan.piece_of(plan.hint_values)
        others = ["; ".join([", ".join(plan.piece_conditions(p))]) for p in plan.piece_points()
                  if plan.piece_of(p) != here]
        if others:
            lines.append(f"other pieces ({len(others)}, kernels change regime there; report.pieces() has their "
                         f"formulas): " + " | ".join(others))
    if report.training:
        from ..training import Training, describe

        options = getattr(report, "options", None)
        lines.append("training step: " + describe(Training(options.optimizer, options.loss, options.step))
                     if options is not None else "training step: the default step")
    for k in FORMULA_KEYS + (TRAIN_KEYS if report.training else ()):
        formula, more = getattr(report, k), ""
        if evaluation is not None and dims and not full:
            formula, more = _binding(report, k, dims)
        line = f"  {k:<15} = {formula}"
        if evaluation is not None:
            line += f"   -> {evaluation[k]:,} B ({format_bytes(evaluation[k])})"
        lines.append(line + more)
    if report.device == "cuda":
        lines.append("  (bytes as requested; evaluate() rounds every block up to 512 B like the CUDA allocator)")
        for k in ("reserved", "train_reserved"):  # the caching allocator's segments (fresh process)
            if evaluation is not None and evaluation.get(k) is not None:
                lines.append(f"  {k:<15} = the caching allocator's segments   -> {evaluation[k]:,} B "
                             f"({format_bytes(evaluation[k])})")
    facts = report.facts
    if "threads" in facts:
        lines.append(f"assumed: {facts['threads']} intra-op thread(s), oneDNN {'on' if facts.get('onednn') else 'off'}, "
                     f"CPU {facts.get('cpu_capability', '?')} (numbers at another setting are re-analysed)")
    if facts.get("kernel_rules"):
        lines.append("kernel rules used: " + ", ".join(facts["kernel_rules"]))
    if not report.exact:
        lines.append("  NOT EXACT: some numbers may differ from a real run (see the notes)")
    for note in fold_notes(report.notes):
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def _binding(report: Any, key: str, dims: Mapping[str, int]) -> tuple[Any, str]:
    """Formula ``key`` of ``report`` as it reads at ``dims`` (see accounting.symbolic.binding), and
    the text saying what was left out; the whole formula where the two would not agree there."""
    from ..accounting.symbolic import binding, evaluate

    expr = getattr(report, key)
    values = {report.symbols[k]: v for k, v in dims.items() if k in report.symbols}
    try:
        short, dropped = binding(expr, values)
        if not dropped or evaluate(short, values) != evaluate(expr, values):
            return expr, ""
    except (ValueError, TypeError):
        return expr, ""
    return short, f"   [deciding at these sizes; {dropped} other candidate{'s' * (dropped > 1)}: summary(full=True)]"


def fold_notes(notes: list[str], names: int = 3) -> list[str]:
    """Notes that differ only in the node they name (``node 'x': aten.mm may ...``), said once:
    ``nodes 'a', 'b', 'c' and 222 more: aten.mm may ...`` (a 32-layer model repeats each 32 times)."""
    groups: dict[str, list[str]] = {}
    for note in notes:
        m = re.match(r"node '([^']*)': (.*)", note, re.S)
        key, name = (m.group(2), m.group(1)) if m else (note, None)
        groups.setdefault(key, []).append(name)
    out = []
    for rest, nodes in groups.items():
        if nodes == [None]:
            out.append(rest)
            continue
        shown = ", ".join(f"'{n}'" for n in nodes[:names])
        more = f" and {len(nodes) - names} more" if len(nodes) > names else ""
        out.append(f"node{'s' if len(nodes) > 1 else ''} {shown}{more}: {rest}")
    return out
