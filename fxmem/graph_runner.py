"""Graph mode: run a traced GraphModule node by node, freeing each value where its code would.

The GraphModule's generated code sets a value to ``None`` right after its last use (and drops a
result nobody uses at once); this interpreter does exactly the same, so liveness matches a real
call of the traced module. Each node's outputs and the aten steps it ran are written down; errors
name the node, its source line and the inputs that reach it.

>>> runner = GraphRunner(gm, ledger, specs)          # doctest: +SKIP
>>> out = runner.run_graph(inputs)                   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from . import _torch_compat as tc
from .errors import FxMemError, ShapeError, UnsupportedOpError
from .ledger import Ledger, NodeRecord
from .real_paths import RealPaths
from .specs import InputSpec
from .tracing import module_path, source_line


def attribute_backward(ledger: Ledger, node_name: str, value: Any, seen: set) -> None:
    """Name the backward of each fx node after it: a pre-hook on the autograd nodes it created."""
    for t in torch.utils._pytree.tree_leaves(value):
        fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))

        def enter(*_: Any, name: str = f"{node_name} (backward)") -> None:
            ledger.node = name

        def leave(*_: Any) -> None:  # the engine releases the node's saved variables right after
            ledger.release_keeps(node_name)

        fn.register_prehook(enter)
        fn.register_hook(leave)


def _last_uses(graph: torch.fx.Graph) -> dict:
    """What the GraphModule's generated code sets to None after each node (fx codegen's rule)."""
    seen: set = set()
    after: dict = {}
    for node in reversed(graph.nodes):
        for n in node.all_input_nodes:
            if n not in seen:
                seen.add(n)
                after.setdefault(node, []).append(n)
    for node in graph.nodes:
        if not node.users and node.op not in ("output", "placeholder"):
            after.setdefault(node, []).append(node)
    return after


class GraphRunner(torch.fx.Interpreter):
    """Interpreter that frees values exactly where the GraphModule's code would."""

    def __init__(self, gm: torch.fx.GraphModule, ledger: Ledger, specs: Sequence[InputSpec],
                 name_backward: bool = False):
        super().__init__(gm, garbage_collect_values=False)
        self.ledger = ledger
        self.specs = list(specs)
        self.node_records: list[NodeRecord] = []
        self.name_backward = name_backward
        self._grad_fns: set = set()

    real_paths: RealPaths | None = None

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self.real_paths is not None:
            target = self.real_paths.replacement(target) or target
        return super().call_function(target, args, kwargs)

    def run_graph(self, inputs: list) -> Any:
        self.env = {}
        self.args_iter = iter(inputs)
        after = _last_uses(self.graph)
        result = None
        for node in self.graph.nodes:
            self.ledger.node = node.name
            first = len(self.ledger.steps)
            try:
                value = self.run_node(node)
            except FxMemError:
                raise
            except Exception as exc:
                raise node_error(node, exc, self) from exc
            self.env[node] = value
            if self.name_backward:
                attribute_backward(self.ledger, node.name, value, self._grad_fns)
            self.ledger.end_node(poll=False)  # polled below, once the node's dead values are dropped
            self.node_records.append(self._describe(node, value, first))
            if node.op == "output":
                result = value
            for n in after.get(node, []):
                self.env.pop(n, None)
            del value
            self.ledger.poll()
            self.node_records[-1].end_step = len(self.ledger.steps)
            self.ledger.events.append(("node", len(self.node_records) - 1))
        self.env.clear()
        return result

    def _describe(self, node: torch.fx.Node, value: Any, first: int) -> NodeRecord:
        outs = []
        for t in torch.utils._pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                shape = tuple(tc.size_expr(self.ledger.env, d) for d in t.shape)
                outs.append((shape, t.dtype, self.ledger.lookup(t) if self.ledger._counts(t) else None))
        plain = None
        if isinstance(value, torch.SymInt) or isinstance(value, int) and not isinstance(value, bool):
            plain = tc.size_expr(self.ledger.env, value)
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        return NodeRecord(node.name, node.op, str(target), module_path(node), source_line(node), outs,
                          first, len(self.ledger.steps), plain)


def node_error(node: torch.fx.Node, exc: BaseException, runner: GraphRunner) -> FxMemError:
    src = source_line(node)
    where = f"fx node '{node.name}' ({node.format_node()})" + (f" from {src.file}:{src.line}: {src.code}" if src else "")
    # which inputs flow into this node, so the user knows which spec to look at
    feeding, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            feeding.append(str(n.target))
        stack.extend(n.all_input_nodes)
    specs = {s.arg: s for s in runner.specs}
    args_text = ", ".join(f"'{a}' {specs[a].text}" for a in reversed(feeding) if a in specs)
    arg_shapes = []
    for a in node.all_input_nodes:
        v = runner.env.get(a)
        if isinstance(v, torch.Tensor):
            arg_shapes.append(f"{a.name}: {tuple(tc.size_expr(runner.ledger.env, d) for d in v.shape)}")
    shapes_text = ("; operand shapes " + ", ".join(arg_shapes)) if arg_shapes else ""
    text = str(exc)
    if isinstance(exc, tc.UNSUPPORTED_OP_ERRORS) or "fake impl" in text or "'Meta' backend" in text \
            or "meta kernel" in text.lower() or "register_fake" in text:
        op = getattr(exc, "func", None) or node.target
        return UnsupportedOpError(
            f"{where}: op {op} has no meta/fake kernel, so fxmem cannot run it on symbolic shapes "
            f"({type(exc).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}). "
            f"Register one with torch.library.register_fake (it only computes output shapes)."
        )
    if isinstance(exc, tc.DATA_DEPENDENT_ERRORS):
        return UnsupportedOpError(
            f"{where}: the result depends on tensor values ({type(exc).__name__}: {exc}). fxmem gives formulas "
            f"in input sizes; replace value-dependent code (.item(), nonzero, boolean masks) by size-only ops."
        )
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ShapeError(
        f"{where} fails on the given input shapes{shapes_text}: {reason}\n"
        f"  inputs reaching this node: {args_text or '(none)'}\n"
        f"  what to do: check the rank and sizes of those input specs against what the model expects."
    )
