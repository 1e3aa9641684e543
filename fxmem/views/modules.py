"""The per-module table, in the spirit of torchinfo's summary: for every module the forward calls,
its class, its output shape in the user's dims, its parameters, and the activation bytes it keeps
- what the tensors it allocated still hold when the forward returns (saved for backward, or
returned), summed over its submodules. Exact, as every fxmem number; formulas without ``dims``.

>>> print(report.modules(dict(B=64, L=32)))                      # doctest: +SKIP
module       class      output shape     parameters  parameter bytes  kept after forward
-----------  ---------  ---------------  ----------  ---------------  ------------------
Attention    Attention  (64, 32, 512)     1,049,088         4.00 MiB           22.00 MiB
  qkv        Linear     (64, 32, 1536)      786,432         3.00 MiB                 0 B
...
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy

from ..accounting import Evaluation
from ..accounting.symbolic import evaluate
from ..errors import SpecError
from ..records import Role
from .html import html_table
from ..units import format_bytes
from .text import formula_text, text_table


@dataclasses.dataclass
class ModuleRow:
    """One module: ``path`` ("" for the model itself), its class, how deep it sits, the shape of its
    (first call's) output, its parameters (count and bytes, with its submodules') and the bytes
    its tensors keep after the forward (with its submodules'). Formulas (sympy) or ints at dims."""

    path: str
    kind: str
    depth: int
    output_shape: tuple | None
    parameters: Any
    parameter_bytes: Any
    kept: Any
    calls: int


class ModuleTable(list):
    """The rows of :func:`module_rows`; prints as a text table and shows as HTML in notebooks."""

    def __init__(self, rows: list[ModuleRow], dims: dict | None):
        super().__init__(rows)
        self.dims = dims

    def _cells(self, fmt_bytes: Any, fmt_expr: Any) -> list[tuple[str, ...]]:
        out = []
        listed = {r.path for r in self}
        for r in self:
            # a path relative to the nearest module listed above it: a container the forward never
            # calls (an nn.ModuleList) has no row, so its children read "layers.0"
            parts = r.path.split(".") if r.path else []
            parent = next((k for k in range(len(parts) - 1, 0, -1) if ".".join(parts[:k]) in listed), 0)
            depth = 0 if not parts else 1 + sum(".".join(parts[:k]) in listed for k in range(1, len(parts)))
            name = ("  " * depth) + (".".join(parts[parent:]) if parts else r.kind)
            shape = "" if r.output_shape is None else "(" + ", ".join(fmt_expr(d) for d in r.output_shape) + ")"
            count = f"{r.parameters:,}" if isinstance(r.parameters, int) else fmt_expr(r.parameters)
            calls = f" ×{r.calls}" if r.calls > 1 else ""
            out.append((name + calls, r.kind, shape, count, fmt_bytes(r.parameter_bytes), fmt_bytes(r.kept)))
        return out

    def __str__(self) -> str:
        def fmt(v: Any) -> str:
            return format_bytes(v) if isinstance(v, int) else formula_text(v)

        header = ("module", "class", "output shape", "parameters", "parameter bytes", "kept after forward")
        return text_table(header, self._cells(fmt, formula_text), right=(3, 4, 5) if self.dims else (3,))

    def _repr_html_(self) -> str:
        def fmt(v: Any) -> str:
            return format_bytes(v) if isinstance(v, int) else formula_text(v)

        header = ("module", "class", "output shape", "parameters", "parameter bytes", "kept after forward")
        return html_table(header, [tuple(c.replace("  ", "\u2003") for c in row) for row in self._cells(fmt, formula_text)])


def module_rows(report: Any, evaluation: Evaluation | None = None) -> ModuleTable:
    """The per-module table of ``report`` (graph or eager mode); numbers at ``evaluation``'s dims if given."""
    calls = getattr(report, "module_calls", None)
    if report.graph_module is None and calls is None:
        raise SpecError("this report has no module paths (an analysis made before eager mode recorded them, or "
                        "of a user step=); analyse the model again")
    subs = None if evaluation is None else {report.symbols[k]: v for k, v in evaluation.liveness.dims.items()}
    if report.graph_module is None:
        return _eager_rows(report, calls, evaluation, subs)
    classes: dict[str, str] = {"": report.model_name}
    for n in report.graph_module.graph.nodes:
        for path, cls in (n.meta.get("nn_module_stack") or {}).values():
            classes.setdefault(str(path), getattr(cls, "__name__", str(cls)))
    order = [""] + [p for p in classes if p]  # first appearance in execution order
    nodes = report.nodes

    def value(expr: Any) -> Any:
        return sympy.expand(expr) if subs is None else evaluate(sympy.sympify(expr), subs)

    def inside(module: str, path: str) -> bool:
        return path == "" or module == path or module.startswith(path + ".")

    params = [s for s in report.storages if s.role == Role.PARAMETER]
    alive = [s for s in report.storages if s.kept_after_forward]
    rows = []
    for path in order:
        positions = [k for k, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output", "phase")
                     and inside(n.module, path)]
        if path == "":
            positions = list(range(len(nodes)))
        calls, shape = _calls_and_output(nodes, positions)
        mine = [s for s in params if inside(s.name, path) or path == ""]
        count = sympy.Add(*[sympy.Mul(*s.shape) for s in mine]) if mine else sympy.Integer(0)
        kept = [s for s in alive if inside(s.module, path)]
        kept_bytes = (sum(evaluation.liveness.sizes[s.index] for s in kept) if evaluation is not None
                      else sympy.expand(sympy.Add(*[s.bytes for s in kept])))
        rows.append(ModuleRow(
            path=path, kind=classes[path], depth=0 if path == "" else path.count(".") + 1,
            output_shape=None if shape is None else tuple(value(d) for d in shape),
            parameters=_int(value(count)), parameter_bytes=_int(value(sympy.Add(*[s.bytes for s in mine]))),
            kept=_int(kept_bytes), calls=calls))
    return ModuleTable(rows, None if evaluation is None else dict(evaluation.liveness.dims))


def _eager_rows(report: Any, calls: dict, evaluation: Evaluation | None, subs: dict | None) -> ModuleTable:
    """The table of an eager-mode analysis: the modules its forward called (hooks on fxmem's copy
    of the model recorded each one's class, calls and first output shape, and which module was
    running when each storage was allocated)."""
    def value(expr: Any) -> Any:
        return sympy.expand(expr) if subs is None else evaluate(sympy.sympify(expr), subs)

    def inside(module: str, path: str) -> bool:
        return path == "" or module == path or module.startswith(path + ".")

    params = [s for s in report.storages if s.role == Role.PARAMETER]
    alive = [s for s in report.storages if s.kept_after_forward]
    order = [""] + [p for p in calls if p]  # in the order the calls returned: children first
    order = [""] + sorted(order[1:], key=lambda p: _first_call_position(p, calls))
    rows = []
    for path in order:
        kind, count, shape = calls.get(path, (report.model_name, 1, None))
        mine = [s for s in params if path == "" or inside(s.name, path)]
        n_params = sympy.Add(*[sympy.Mul(*s.shape) for s in mine]) if mine else sympy.Integer(0)
        kept = [s for s in alive if inside(s.module, path)]
        kept_bytes = (sum(evaluation.liveness.sizes[s.index] for s in kept) if evaluation is not None
                      else sympy.expand(sympy.Add(*[s.bytes for s in kept])))
        rows.append(ModuleRow(
            path=path, kind=report.model_name if path == "" else kind, depth=0 if path == "" else path.count(".") + 1,
            output_shape=None if shape is None else tuple(value(d) for d in shape),
            parameters=_int(value(n_params)), parameter_bytes=_int(value(sympy.Add(*[s.bytes for s in mine]))),
            kept=_int(kept_bytes), calls=count))
    # FSDP2's collective buffers (fxmem.distributed names them): a row per kind, after the modules
    for kind in ("all-gather", "reduce-scatter"):
        mine = [s for s in report.storages if s.name.startswith(kind + " ") and s.step is not None]
        if not mine:
            continue
        kept = [s for s in mine if s.kept_after_forward]
        kept_bytes = (sum(evaluation.liveness.sizes[s.index] for s in kept) if evaluation is not None
                      else sympy.expand(sympy.Add(*[s.bytes for s in kept])))
        rows.append(ModuleRow(path=f"({kind} buffers)", kind="FSDP2", depth=1, output_shape=None,
                              parameters=0, parameter_bytes=0, kept=_int(kept_bytes), calls=len(mine)))
    return ModuleTable(rows, None if evaluation is None else dict(evaluation.liveness.dims))


def _first_call_position(path: str, calls: dict) -> tuple:
    """Sort key putting a module before its children and siblings in the order they were first
    called: post-hooks record children before their parent, so order by the parent chain's
    earliest recorded descendant."""
    keys = list(calls)
    position = {p: k for k, p in enumerate(keys)}

    def start(p: str) -> int:  # the first recorded module inside p (a child returns before its parent)
        return min(k for q, k in position.items() if q == p or q.startswith(p + "."))

    parts = path.split(".")
    return tuple(start(".".join(parts[:i + 1])) for i in range(len(parts)))


def _calls_and_output(nodes: list, positions: list[int]) -> tuple[int, tuple | None]:
    """How many separate runs of consecutive nodes the module has (its calls), and the output shape
    of the first: its last node that makes a tensor."""
    if not positions:
        return 0, None
    runs = [[positions[0]]]
    for k in positions[1:]:
        if k == runs[-1][-1] + 1 or all(not nodes[j].shapes and not nodes[j].allocations
                                        for j in range(runs[-1][-1] + 1, k)):
            runs[-1].append(k)
        else:
            runs.append([k])
    first = [nodes[k] for k in runs[0] if nodes[k].shapes]
    return len(runs), (first[-1].shapes[0] if first else None)


def _int(v: Any) -> Any:
    """A plain int where the value is a number (so tables print it with thousands separators)."""
    v = sympy.sympify(v)
    return int(v) if v.is_Integer else v

