"""Graph mode: run a traced GraphModule node by node, freeing each value where its code would.

The GraphModule's generated code drops a value right after its last use, and a result nobody uses
at once; this interpreter does the same (``torch.fx.Interpreter`` frees last uses; the unused
results are dropped here), so liveness matches a real call of the traced module. Each node's
outputs and the aten steps it ran become a :class:`~fxmem.records.Node`; errors name the node, its
source line and the inputs that reach it.

>>> runner = GraphRunner(gm, recorder, specs)          # doctest: +SKIP
>>> out = runner.run(*inputs)                          # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from .. import _torch_compat as tc
from ..capture import module_path, source_line
from ..errors import FxMemError
from ..records import Node
from ..specs import InputSpec
from .failures import failure
from .recorder import Recorder


class GraphRunner(torch.fx.Interpreter):
    """An Interpreter whose ``run_node`` also records what each node did (one record per node)."""

    def __init__(self, gm: torch.fx.GraphModule, recorder: Recorder, specs: Sequence[InputSpec],
                 name_backward: bool = False):
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False  # our errors name the node themselves
        self.recorder, self.log = recorder, recorder.log
        self.specs = list(specs)
        self.name_backward = name_backward
        self._open: tuple[torch.fx.Node, Node] | None = None  # the node that ran last, not yet closed

    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().run(*args, **kwargs)
        finally:
            self._close()  # the output node; the Interpreter has freed its inputs' last uses
            self.env.clear()

    def run_node(self, n: torch.fx.Node) -> Any:
        self._close()  # the previous node's values that died are gone by now
        self.log.enter(n.name)
        first = self.log.next_step
        try:
            value = super().run_node(n)
        except FxMemError:
            raise
        except Exception as exc:
            raise self._error(n, exc) from exc
        if self.name_backward:
            self.recorder.autograd.name_backward(n.name, value)
        self.recorder.end_node(poll=False)  # polled at close, once the node's dead values are dropped
        self._open = (n, self._describe(n, value, first))
        return value

    def _close(self) -> None:
        if self._open is None:
            return
        n, record = self._open
        self._open = None
        if not n.users and n.op not in ("output", "placeholder"):
            self.env.pop(n, None)  # fx's code drops a result nobody uses at once
        self.recorder.poll()
        record.end_step = self.log.next_step
        self.log.ended(record)

    def _describe(self, n: torch.fx.Node, value: Any, first: int) -> Node:
        table = self.recorder.table
        shapes, dtypes, outputs = [], [], []
        for t in tc.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                shapes.append(tuple(tc.size_expr(table.env, d) for d in t.shape))
                dtypes.append(t.dtype)
                outputs.append(table.lookup(t) if table.counts(t) else None)
        plain = None
        if isinstance(value, torch.SymInt) or isinstance(value, int) and not isinstance(value, bool):
            plain = tc.size_expr(table.env, value)
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        return Node(n.name, n.op, str(target), module_path(n), source_line(n), shapes, dtypes, outputs,
                    first, self.log.next_step, plain)

    def _error(self, n: torch.fx.Node, exc: BaseException) -> FxMemError:
        src = source_line(n)
        where = f"fx node '{n.name}' ({_call_text(n)})" + (f" from {src.file}:{src.line}: {src.code}" if src else "")
        feeding, stack, seen = [], [n], set()  # which inputs flow into this node: the specs to look at
        while stack:
            m = stack.pop()
            if m in seen:
                continue
            seen.add(m)
            if m.op == "placeholder":
                feeding.append(str(m.target))
            stack.extend(m.all_input_nodes)
        specs = {s.arg: s for s in self.specs}
        args_text = ", ".join(f"'{a}' {specs[a].text}" for a in reversed(feeding) if a in specs)
        rename = self.recorder.rename
        shapes = [f"{a.name}: {rename(str(tuple(tc.size_expr(self.recorder.table.env, d) for d in v.shape)))}"
                  for a in n.all_input_nodes if isinstance(v := self.env.get(a), torch.Tensor)]
        detail = ("; operand shapes " + ", ".join(shapes)) if shapes else ""
        return failure(exc, where, op=n.target, detail=detail, rename=rename,
                       advice=f"check the rank and sizes of the input specs reaching this node "
                              f"({args_text or 'none'}) against what the model expects")


def _call_text(n: torch.fx.Node) -> str:
    """``linear(input_1, weight, bias)``: what the node calls, on what."""
    target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    args = [a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args]
    args += [f"{k}={v.name if isinstance(v, torch.fx.Node) else repr(v)}" for k, v in n.kwargs.items()]
    text = f"{'.' if n.op == 'call_method' else ''}{target}({', '.join(args)})"
    return text if len(text) <= 120 else text[:119] + "…"
