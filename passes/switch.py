"""Two verified forms of one model, and the condition in the user's dims that picks one per call.

Where a rewrite's peak formula is lower than the original's only for some sizes (a fused message
passing pays when ``E >= 2*N``), :func:`fxmem.optimize` returns both forms: the call reads the
dims from its inputs' shapes and runs the form that is never higher there. fxmem's analysis of the
result follows the branch taken at its sizes and records the condition as part of its region (a
symbolic size compared in Python is a guard), so the formulas are those of the form that runs.

>>> opt.fxmem_forms.condition                       # doctest: +SKIP
Condition(dim='E', k=2, other='N')
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Mapping, Sequence

import sympy

import torch
import torch.fx

from fxmem.accounting.symbolic import _guard_text as guard_text
from fxmem.specs import InputSpec
from fxmem.passes.decide import Condition


class Guards:
    """Where a captured graph holds, as TorchDynamo's size guards in the user's dims (``L <= 64``
    where the model asserts ``t <= block_size``): :meth:`holds` evaluates them on the call's sizes,
    ints or symbolic sizes alike (Python comparisons: under fxmem's analysis they become its guards),
    by walking the expressions - nothing is compiled or executed from text."""

    def __init__(self, exprs: Sequence[sympy.Expr]) -> None:
        self.exprs = tuple(exprs)
        self.dims = sorted({str(x) for g in self.exprs for x in g.free_symbols})

    def __str__(self) -> str:
        return " and ".join(guard_text(g) for g in self.exprs)

    def holds(self, sizes: Mapping[str, Any]) -> bool:
        return all(bool(_value(g, sizes)) for g in self.exprs)


_RELATIONS = {sympy.Le: operator.le, sympy.Lt: operator.lt, sympy.Ge: operator.ge, sympy.Gt: operator.gt,
              sympy.Eq: operator.eq, sympy.Ne: operator.ne}


def _value(expr: sympy.Expr, sizes: Mapping[str, Any]) -> Any:
    """``expr`` at ``sizes`` with Python's operators (sizes may be SymInts)."""
    if expr.is_Symbol:
        return sizes[str(expr)]
    if expr.is_Integer:
        return int(expr)
    if type(expr) in _RELATIONS:
        return _RELATIONS[type(expr)](_value(expr.lhs, sizes), _value(expr.rhs, sizes))
    args = [_value(a, sizes) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return functools.reduce(operator.add, args)
    if isinstance(expr, sympy.Mul):
        return functools.reduce(operator.mul, args)
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) >= 0:
        return functools.reduce(operator.mul, [args[0]] * int(expr.exp), 1)
    if type(expr).__name__ == "FloorDiv":  # torch's own sympy functions in ShapeEnv guards
        return args[0] // args[1]
    if isinstance(expr, sympy.Mod) or type(expr).__name__ == "PythonMod":
        return args[0] % args[1]
    raise ValueError(f"cannot evaluate {expr} on sizes")  # the caller refuses the graph, saying so


class Forms(torch.nn.Module):
    """``when`` where ``condition`` holds at the inputs' sizes, ``otherwise`` elsewhere.

    ``positions`` say where each dim of the condition is read: ``{dim: (argument index, axis)}``.
    ``force`` (True/False) takes one form whatever the sizes (verification of both forms).

    The forms' modules are the model's own, registered on the returned module too: ``parameters()``
    and ``named_modules()`` name each once, where the model does; ``state_dict`` leaves the forms out
    (their keys would repeat the model's) and loading one does not ask for them.
    """

    def __init__(self, condition: Condition, positions: Mapping[str, tuple[int, int]],
                 when: torch.fx.GraphModule, otherwise: torch.fx.GraphModule) -> None:
        super().__init__()
        self.condition, self.positions = condition, dict(positions)
        self.when, self.otherwise = when, otherwise
        self.force: bool | None = None
        self.register_load_state_dict_post_hook(_not_missing)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        # called by the returned module with its destination: add nothing (the model's keys are there)
        return destination if destination is not None else {}

    def forward(self, *args: Any) -> Any:
        if self.force is not None:
            take = self.force
        else:
            take = self.condition.holds({d: args[i].shape[a] for d, (i, a) in self.positions.items()})
        return self.when(*args) if take else self.otherwise(*args)


def _not_missing(module: Forms, incompatible: Any) -> None:
    """A state_dict has no keys for the forms (they are the model's, saved under its names)."""
    prefixes = [name + "." for name, m in _named_forms(module)]
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                    if not any(k.startswith(p) or f".{p}" in k for p in prefixes)]


def _named_forms(module: Forms) -> list:
    return [("fxmem_forms.when", module.when), ("fxmem_forms.otherwise", module.otherwise)]


def positions(condition: Any, specs: Sequence[InputSpec], symbols: Mapping[str, Any]) -> dict | None:
    """Where each dim of ``condition`` (a :class:`Condition` or :class:`Guards`) is an input's size
    (first plain occurrence); None if one is not."""
    out = {}
    dims = condition.dims if isinstance(condition, Guards) else (condition.dim, condition.other)
    for dim in dims:
        if dim is None:
            continue
        at = next(((i, a) for i, s in enumerate(specs) for a, d in enumerate(s.dims) if d == symbols[dim]), None)
        if at is None:
            return None
        out[dim] = at
    return out


def build(condition: Any, where: Mapping[str, tuple[int, int]], when: torch.fx.GraphModule,
          otherwise: torch.nn.Module, name: str) -> torch.fx.GraphModule:
    """A GraphModule with ``otherwise``'s call signature whose one node calls :class:`Forms`."""
    graph = torch.fx.Graph()
    signature = otherwise if isinstance(otherwise, torch.fx.GraphModule) else when  # the model itself: when's
    args = [graph.node_copy(n) for n in signature.graph.nodes if n.op == "placeholder"]
    out = graph.call_module("fxmem_forms", tuple(args))
    graph.output(out)
    root = torch.nn.Module()
    root.fxmem_forms = Forms(condition, where, when, otherwise)
    gm = torch.fx.GraphModule(root, graph, name)
    gm.training = otherwise.training  # its own flag only (train() would reach the model's modules)
    return gm
