"""The per-line table: what each source line allocates and frees, and what is live after it.

Seed 002's author printed ``torch.cuda.memory_allocated()`` after every line of ``forward``; this
is that table, automatic and symbolic. In eager mode every executed line is a row (a line run
twice in a loop gives two rows); in graph mode consecutive fx nodes from the same source line are
merged into one row. ``memory`` is what ``memory_allocated()`` would print after the line:
resident bytes (parameters, buffers, inputs) plus live activations.

>>> for row in report.by_line(dict(B=64, L=32)): print(row)      # doctest: +SKIP
seed_attention.py:35  qkv = self.qkv(x)   +12.00 MiB  -0 B  memory 20.00 MiB
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import sympy

from ..accounting import Evaluation
from ..capture import statement_of, statement_text
from ..units import format_bytes


@dataclasses.dataclass
class LineRow:
    """One source line (or training phase): bytes as formulas, or ints when dims were given."""

    location: str  # file:line, or a node/phase name for rows without source
    code: str
    allocated: Any  # bytes allocated while the line ran
    freed: Any  # bytes of activations freed by the time it ended
    live: Any  # activation bytes live after it (above resident)
    memory: Any  # resident + live: what memory_allocated() prints after the line
    nodes: list  # the fx nodes / line records merged into this row

    def __str__(self) -> str:
        return (f"{_cut(self.location, 24):<24} {_cut(self.code, 48):<48} +{_cut(_text(self.allocated), 16):>16} "
                f"-{_cut(_text(self.freed), 16):>16}  memory {_cut(_text(self.memory), 48)}")


def _text(v: Any) -> str:
    return format_bytes(v) if isinstance(v, int) else str(v)


def _cut(text: str, width: int) -> str:
    """``text`` within ``width`` characters (a long formula ends in '…'; the full one is on the row)."""
    return text if len(text) <= width else text[:width - 1] + "…"


class LineTable(list):
    """The rows of the per-line table (a list of :class:`LineRow`); ``str()`` prints it aligned, each
    column width-capped (long formulas end in '…': the rows keep them whole)."""

    def __str__(self) -> str:
        head = f"{'line':<24} {'code':<48} {'+allocated':>17} {'-freed':>17}  memory after"
        return "\n".join([head, "-" * len(head)] + [str(r) for r in self])

    def __repr__(self) -> str:
        return str(self)


def by_line(report: Any, evaluation: Evaluation | None = None) -> LineTable:
    """Rows of the per-line table of ``report`` (numbers of ``evaluation``, else formulas)."""
    groups: list[list[int]] = []
    key_of: list[Any] = []
    for k, n in enumerate(report.nodes):
        if n.op in ("placeholder", "get_attr", "output") and not n.allocations:
            continue
        key = (n.source.file, statement_of(n.source.file, n.source.line)) if (n.source and n.op != "line") else n.name
        if groups and key_of[-1] == key and report.mode == "graph":
            groups[-1].append(k)
        else:
            groups.append([k])
            key_of.append(key)
    freed_by: dict[str, list] = {}
    for s in report.storages:
        if s.step is not None and s.freed_at is not None:
            freed_by.setdefault(s.freed_at, []).append(s)
    if evaluation is not None:
        live = evaluation.liveness
        size = lambda s: live.sizes[s.index]  # noqa: E731 - rounded to allocator blocks on CUDA
        after = lambda k: live.after[k]  # noqa: E731
        resident = live.resident
    else:
        size = lambda s: s.bytes  # noqa: E731
        after = lambda k: report.nodes[k].live_after  # noqa: E731
        resident = report.resident
    rows = []
    for group in groups:
        nodes = [report.nodes[k] for k in group]
        allocated = _total(size(s) for n in nodes for s in n.allocations)
        freed = _total(size(s) for n in nodes for s in freed_by.get(n.name, []))
        first = nodes[0]
        location = _location(first)
        code = statement_text(first.source.file, first.source.line) if first.source else first.target
        live_after = after(group[-1])
        rows.append(LineRow(location, code, allocated, freed, live_after, _total([resident, live_after]),
                            [n.name for n in nodes]))
    return LineTable(rows)


def _location(node: Any) -> str:
    if not node.source:
        return node.name
    start, end = statement_of(node.source.file, node.source.line)
    name = f"{os.path.basename(node.source.file)}:{start}"
    return name + (f"-{end}" if end > start else "") + node.name[len(str(node.source)):]  # keeps "#2" of loops


def _total(values: Any) -> Any:
    values = list(values)
    if all(isinstance(v, int) for v in values):
        return sum(values)
    return sympy.expand(sympy.Add(*values)) if values else sympy.Integer(0)


def format_lines(rows: list[LineRow]) -> str:
    """The rows as an aligned text table (what ``str(report.by_line())`` prints)."""
    return str(LineTable(rows))
