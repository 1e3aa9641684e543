"""The analysis result: formulas in the user's dims, per-node and per-storage detail, numbers.

Every byte count is a sympy expression in positive-integer symbols named after the user's dims.

>>> report = fxmem.analyze(GAT(6, 128), ("B", "N", 6), ("B", "N", "N"))   # doctest: +SKIP
>>> report.peak                                                          # doctest: +SKIP
1024*B*N**2 + ...
>>> report.evaluate(B=4, N=500)["peak"]                                   # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Callable

import sympy
import torch

from .memory_plan import MemoryPlan
from .specs import check_dims, check_input_sizes
from .tracing import SourceLine

if TYPE_CHECKING:  # pragma: no cover
    from .figure import Figure
    from .liveness import Liveness

FORMULA_KEYS = ("resident", "peak", "retained", "saved", "output")
TRAIN_KEYS = ("train_resident", "train_peak", "grads", "optimizer_state")


def format_bytes(n: int) -> str:
    """``1023`` -> ``'1023 B'``, ``1024000000`` -> ``'976.6 MiB'`` (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass
class StorageInfo:
    """One storage the forward touched: its size (bytes, formula) and why it exists."""

    index: int
    bytes: sympy.Expr
    dtype: torch.dtype
    shape: tuple
    kind: str  # parameter | buffer | input | constant | activation
    name: str
    node: str | None  # fx node that allocated it (None if resident)
    op: str | None  # aten op that allocated it
    saved_by: list  # ["mm (node linear)", ...] - autograd keeps it for backward
    freed_at: str | None  # fx node by whose end it had been freed; None = alive at return
    is_output: bool
    module: str = ""  # module path of the allocating node ("" at top level or if resident)

    def to_dict(self) -> dict:
        return {"index": self.index, "module": self.module, "bytes": str(self.bytes), "dtype": str(self.dtype).replace("torch.", ""),
                "shape": [str(d) for d in self.shape], "kind": self.kind, "name": self.name, "node": self.node,
                "op": self.op, "saved_by": list(self.saved_by), "freed_at": self.freed_at, "is_output": self.is_output}


@dataclasses.dataclass
class NodeInfo:
    """One fx node: what it computes, what it allocates, what is live when it ends (bytes)."""

    name: str
    op: str
    target: str
    module: str
    source: SourceLine | None
    shapes: list  # output shapes (tuples of sympy), one per tensor output
    dtypes: list
    allocations: list  # [StorageInfo]
    allocated: sympy.Expr
    saved: sympy.Expr  # bytes of this node's allocations that autograd keeps
    live_after: sympy.Expr  # activation bytes live when the node ends (above resident)
    value: sympy.Expr | None = None  # for nodes computing a size (x.size(1) ...)

    def to_dict(self) -> dict:
        return {"name": self.name, "op": self.op, "target": self.target, "module": self.module,
                "source": str(self.source) if self.source else None,
                "code": self.source.code if self.source else None,
                "shapes": [[str(d) for d in s] for s in self.shapes],
                "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
                "allocations": [a.index for a in self.allocations], "allocated": str(self.allocated),
                "saved": str(self.saved), "live_after": str(self.live_after),
                "value": str(self.value) if self.value is not None else None}


class Report:
    """Memory of one forward of a traced model, as formulas in the user's dims (bytes).

    Attributes ``resident``, ``peak``, ``retained``, ``saved``, ``output`` are sympy expressions:

    * ``resident`` - parameters + buffers + inputs;
    * ``peak`` - absolute peak during one forward of the traced GraphModule (which frees each
      value after its last use), autograd recording as in training when ``grad=True``;
    * ``retained`` - bytes allocated by the forward still held when it returns (output + saved);
    * ``saved`` - bytes autograd holds for backward beyond parameters and inputs;
    * ``output`` - bytes of the returned tensors that the forward allocated.

    With ``optimizer=`` (see :mod:`fxmem.training`), also ``train_resident`` (the above resident
    bytes + optimizer state), ``train_peak`` (absolute peak of a steady-state training step),
    ``grads`` and ``optimizer_state``; otherwise these are None.
    """

    def __init__(self, plan: MemoryPlan, *, model_name: str, specs: list, device: str, grad: bool,
                 dtype: torch.dtype, hints: dict, graph_module: torch.fx.GraphModule, mode: str,
                 reanalyze: Callable[[dict], "Report"]):
        self._plan = plan
        self.model_name = model_name
        self.specs = specs
        self.device = device
        self.grad = grad
        self.dtype = dtype
        self.mode = mode
        self.hints = dict(hints)
        self.graph_module = graph_module
        self._reanalyze = reanalyze
        self._regions: dict[tuple, Report] = {}
        self.symbols: dict[str, sympy.Symbol] = dict(plan.symbols)
        f = plan.formulas()
        self.resident: sympy.Expr = f["resident"]
        self.peak: sympy.Expr = f["peak"]
        self.retained: sympy.Expr = f["retained"]
        self.saved: sympy.Expr = f["saved"]
        self.output: sympy.Expr = f["output"]
        self.train_resident: sympy.Expr | None = f.get("train_resident")
        self.train_peak: sympy.Expr | None = f.get("train_peak")
        self.grads: sympy.Expr | None = f.get("grads")
        self.optimizer_state: sympy.Expr | None = f.get("optimizer_state")
        self.notes: list[str] = list(plan.notes)
        self.storages = self._storage_infos()
        self.nodes = self._node_infos()

    # --- construction ---------------------------------------------------------------------------
    def _storage_infos(self) -> list[StorageInfo]:
        rec = self._plan.rec
        freed_at: dict[int, str] = {}
        pending: list[int] = []
        for kind, i in rec.events:
            if kind == "free":
                pending.append(i)
            elif kind == "node":
                for s in pending:
                    freed_at[s] = rec.nodes[i].name
                pending.clear()
        for s in pending:
            freed_at[s] = "<return>"
        module_of = {n.name: n.module for n in rec.nodes}
        out = []
        for s in rec.storages:
            out.append(StorageInfo(
                s.index, self._plan.sizes[s.index], s.dtype, tuple(self._plan.to_user(d) for d in s.shape),
                s.kind, s.name, s.node, s.op, [f"{op} (node {node})" for node, op in s.saved_by],
                freed_at.get(s.index), s.is_output, module_of.get(s.node, "") if s.node else ""))
        return out

    def _node_infos(self) -> list[NodeInfo]:
        rec, plan = self._plan.rec, self._plan
        by_node: dict[str, list[StorageInfo]] = {}
        for s in self.storages:
            if s.node is not None:
                by_node.setdefault(s.node, []).append(s)
        infos = []
        for k, n in enumerate(rec.nodes):
            allocs = by_node.get(n.name, [])
            live = plan.replay.after_node[k] if k < len(plan.replay.after_node) else {}
            from .symbolic import to_expr
            infos.append(NodeInfo(
                n.name, n.op, n.target, n.module, n.source,
                [tuple(plan.to_user(d) for d in shape) for shape, _, _ in n.outputs],
                [dt for _, dt, _ in n.outputs], allocs,
                sympy.Add(*[a.bytes for a in allocs]) if allocs else sympy.Integer(0),
                sympy.Add(*[a.bytes for a in allocs if a.saved_by and a.freed_at is None]) if allocs else sympy.Integer(0),
                to_expr(live), plan.to_user(n.value) if n.value is not None else None))
        return infos

    # --- numbers --------------------------------------------------------------------------------
    @property
    def region(self) -> list[str]:
        """Conditions on the dims under which the formulas hold (e.g. ``N >= 2``)."""
        conds = [f"{s} >= {lo}" for s, lo in self._plan.region.lower.items() if lo > 1]
        return conds + [str(g) for g in self._plan.region.guards]

    def evaluate(self, **dims: int) -> dict[str, int]:
        """Exact byte counts at concrete dims: ``resident``, ``peak``, ``retained``, ``saved``, ...

        Outside the region where the formulas hold (say ``N=1``, which PyTorch treats specially),
        the model is re-analysed at those sizes, so the numbers are always those of a real run.
        On ``device="cuda"`` every block is rounded up to 512 bytes, as the caching allocator does.
        """
        report, values = self._for_dims(dims)
        if values is None:  # no dims given: fine only when the model has none (all sizes concrete)
            values = check_dims(dims, self.symbols)
        result = report._plan.evaluate({report.symbols[k]: v for k, v in values.items()})
        return {k: v for k, v in result.items() if not k.startswith("_")}

    def at(self, expr: sympy.Expr, **dims: int) -> int:
        """Value of any formula of this report (a storage's ``bytes``, a node's ``live_after``) at ``dims``."""
        from .symbolic import evaluate

        values = check_dims(dims, self.symbols)
        return evaluate(sympy.sympify(expr), {self.symbols[k]: v for k, v in values.items()})

    def by_line(self, dims: dict | None = None) -> list:
        """Seed 002's per-line table, automatic: per source line, bytes allocated, freed, and live
        after it (formulas, or numbers at ``dims``). Eager mode has every executed line; graph mode
        merges the fx nodes of each line. See :mod:`fxmem.lines`.

        >>> print(fxmem.lines.format_lines(report.by_line(dict(B=64, L=32))))   # doctest: +SKIP
        """
        from .lines import by_line

        return by_line(self, dims)

    def max_size(self, dim: str, budget: Any, train: bool = False, **fixed: int) -> int:
        """The largest ``dim`` whose peak (``train=True``: training-step peak) fits ``budget``.

        ``budget`` is bytes or a string such as ``"80GiB"`` or ``"32GB"``; ``fixed`` gives the other
        dims. Exact: the answer fits and the next size does not (see :mod:`fxmem.budget`).

        >>> report.max_size("B", budget="32GiB", N=500)           # doctest: +SKIP
        """
        from .budget import max_size

        return max_size(self, dim, budget, train=train, **fixed)

    def peak_node(self, **dims: int) -> str | None:
        """The fx node during which the peak happens (at ``dims``, or at the analysis' example sizes)."""
        report, values = self._for_dims(dims)
        values = values if values is not None else self.hints
        step = report._plan.evaluate({report.symbols[k]: v for k, v in values.items()})["_peak_step"]
        return None if step is None else report._plan.rec.steps[step].node

    def liveness(self, dims: dict | None = None) -> "Liveness":
        """Live activation bytes node by node, at ``dims`` (default: the example sizes ``hints``).

        ``.high[k]`` is the most bytes live at any moment while ``nodes[k]`` runs, ``.after[k]`` the
        bytes live when it ends (both above resident); ``.peak`` and ``.peak_node`` agree with
        :meth:`evaluate` and :meth:`peak_node`. Outside the formulas' region the lists belong to
        the re-analysis at ``dims``.

        >>> report.liveness({"B": 4, "N": 500}).peak_node          # doctest: +SKIP
        'cat'
        """
        from .liveness import liveness

        report, values = self._for_dims(dims)
        return liveness(report, values)

    def diagram(self, dims: dict | None = None, group: str | None = None, depth: int | None = None) -> "Figure":
        """The fx graph as a ``graphviz.Digraph``, coloured by live bytes, the peak marked.

        Without ``dims`` labels are formulas (bytes) and colours are at ``hints``; with ``dims``
        they are numbers. ``group="module"`` collapses each module (``blocks.3``) into one box.
        See :mod:`fxmem.diagram`.

        >>> report.diagram().save("gat.svg")                       # doctest: +SKIP
        """
        from .diagram import diagram

        report, values = self._for_dims(dims)
        return diagram(report, values, group=group, depth=depth)

    def timeline(self, dims: dict | None = None) -> "Figure":
        """When each activation storage lives: one bar per storage, the peak line. See :mod:`fxmem.timeline`.

        >>> report.timeline({"B": 4, "N": 500}).save("gat_timeline.png")   # doctest: +SKIP
        """
        from .timeline import timeline

        report, values = self._for_dims(dims)
        return timeline(report, values)

    def render(self, path: str, what: str = "diagram", dims: dict | None = None, group: str | None = None) -> str:
        """Write the diagram (``what="timeline"``: the timeline) to ``path``; SVG, PNG or PDF by extension.

        >>> report.render("gat.png", dims={"B": 4, "N": 500})        # doctest: +SKIP
        'gat.png'
        """
        if what == "diagram":
            return self.diagram(dims, group=group).save(path)
        if what == "timeline":
            return self.timeline(dims).save(path)
        from .errors import SpecError

        raise SpecError(f"render(what={what!r}): use what='diagram' or what='timeline'")

    def _for_dims(self, dims: dict | None) -> tuple["Report", dict | None]:
        """The report whose formulas hold at ``dims`` (self, or a re-analysis, cached) and the
        checked dims; the one place that decides when to re-analyse."""
        if not dims:
            return self, None
        values = check_dims(dims, self.symbols)
        check_input_sizes(self.specs, values, self.symbols)
        if self._plan.region.violations({self.symbols[k]: v for k, v in values.items()}):
            key = tuple(sorted(values.items()))
            if key not in self._regions:
                self._regions[key] = self._reanalyze(values)
            return self._regions[key], values
        return self, values

    # --- views ----------------------------------------------------------------------------------
    @property
    def training(self) -> bool:
        """Whether a training step was analysed (``optimizer=`` given)."""
        return self.train_peak is not None

    def formulas(self) -> dict[str, sympy.Expr]:
        """The headline formulas (bytes): five for the forward, four more for a training step."""
        keys = FORMULA_KEYS + (TRAIN_KEYS if self.training else ())
        return {k: getattr(self, k) for k in keys}

    def to_dict(self) -> dict:
        """Everything, JSON-serialisable (formulas as strings)."""
        return {
            "model": self.model_name, "mode": self.mode, "device": self.device, "grad": self.grad,
            "dtype": str(self.dtype).replace("torch.", ""),
            "inputs": [{"arg": s.arg, "shape": [str(d) for d in s.dims], "dtype": str(s.dtype).replace("torch.", "")}
                       for s in self.specs],
            "dims": sorted(self.symbols), "hints": self.hints, "region": self.region, "notes": self.notes,
            "formulas": {k: str(v) for k, v in self.formulas().items()},
            "nodes": [n.to_dict() for n in self.nodes],
            "storages": [s.to_dict() for s in self.storages],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self, dims: dict | None = None, max_width: int = 60) -> str:
        """The per-node table: what each node allocates, what autograd saves, what is live after it.

        With ``dims`` the byte columns are numbers at those sizes instead of formulas.
        """
        report, values = self._for_dims(dims)
        if report is not self:
            return report.table(values, max_width)
        nums = subs = None
        if values is not None:
            subs = {self.symbols[k]: v for k, v in values.items()}
            nums = self._plan.evaluate(subs)

        def fmt(expr: sympy.Expr, k: int | None = None, node_live: bool = False) -> str:
            if nums is None:
                text = str(expr)
                return text if len(text) <= max_width else text[: max_width - 1] + "…"
            from .symbolic import evaluate
            return format_bytes(nums["_after_node"][k] if node_live else evaluate(expr, subs))

        rows = [("#", "node", "target", "shape", "allocates", "saved", "live after", "line")]
        for k, n in enumerate(self.nodes):
            if n.op in ("output",) and not n.allocations:
                continue
            shape = "; ".join("(" + ", ".join(str(d) for d in s) + ")" for s in n.shapes) or (str(n.value) if n.value is not None else "")
            rows.append((str(k), n.name, _short_target(n), shape[:40], fmt(n.allocated) if n.allocations else "",
                         fmt(n.saved) if n.saved != 0 else "", fmt(n.live_after, k, node_live=True),
                         str(n.source) if n.source else ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def summary(self, dims: dict | None = None) -> str:
        """The headline formulas (and numbers at ``dims``) as text."""
        head = (f"fxmem · {self.model_name} · {self.mode} mode · device={self.device} · "
                f"{'training (autograd records)' if self.grad else 'inference (no grad)'}")
        inputs = ", ".join(f"{s.arg}{s.text}" for s in self.specs)
        lines = [head, f"inputs: {inputs}"]
        if self.region:
            lines.append("formulas hold for: " + ", ".join(self.region))
        nums = self.evaluate(**dims) if dims else None
        for k in FORMULA_KEYS + (TRAIN_KEYS if self.training else ()):
            line = f"  {k:<15} = {getattr(self, k)}"
            if nums is not None:
                line += f"   -> {nums[k]:,} B ({format_bytes(nums[k])})"
            lines.append(line)
        if self.device == "cuda":
            lines.append("  (bytes as requested; evaluate() rounds every block up to 512 B like the CUDA allocator)")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary() + "\n\n" + self.table()

    def __repr__(self) -> str:
        return f"<fxmem.Report {self.model_name}: peak = {self.peak}>"

    def _repr_latex_(self) -> str:
        """The headline formulas (bytes) as LaTeX, for notebooks and nbconvert."""
        names = {k: k.replace("_", r"\_") for k in self.formulas()}
        rows = [rf"\text{{{names[k]}}} &= {sympy.latex(v)}" for k, v in self.formulas().items()]
        return r"$$\begin{aligned}" + r" \\ ".join(rows) + r"\end{aligned}$$"

    def _repr_html_(self) -> str:
        """The summary and the per-node table as HTML (notebooks show this)."""
        from .report_html import report_html

        return report_html(self)


def _short_target(n: NodeInfo) -> str:
    if n.op == "call_module":
        return n.module or n.target
    if n.op == "call_method":
        return "." + n.target
    return n.target
