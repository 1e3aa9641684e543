"""Views of a report: text (:mod:`.text` - bytes, formulas, the per-node table, the summary), the
per-line table (:mod:`.lines`), pictures (:mod:`.diagram`, :mod:`.timeline`, drawn as
:class:`~.figure.Figure`) and notebook HTML (:mod:`.html`).

Views receive data - a report's public records and formulas, and an
:class:`~fxmem.accounting.Evaluation` at some dims - and never reach into the report.

>>> print(node_table(report))                  # doctest: +SKIP
"""
from .diagram import diagram
from .figure import Figure, output_format
from .html import report_html
from .lines import LineRow, LineTable, by_line, format_lines
from .modules import ModuleRow, ModuleTable, module_rows
from .snapshot import snapshot
from ..units import format_bytes
from .text import formula_text, node_table, summary
from .timeline import Chart, timeline

__all__ = ["diagram", "timeline", "by_line", "format_lines", "LineRow", "LineTable", "report_html", "node_table", "summary",
           "format_bytes", "formula_text", "Figure", "Chart", "output_format",
           "module_rows", "ModuleRow", "ModuleTable", "snapshot"]
