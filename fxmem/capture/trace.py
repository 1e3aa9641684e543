"""Capture by ``torch.fx`` symbolic tracing, that also wraps helper libraries, with errors that point
at the user's source line.

Helper libraries such as einops call into their own backends with a ``Proxy`` and fail; fx's
``autowrap_modules`` turns each of their functions into one graph node instead, which then runs on
fake tensors like any other call.

>>> gm = trace(torch.nn.Linear(4, 2))
>>> [n.op for n in gm.graph.nodes]
['placeholder', 'call_module', 'output']
"""
from __future__ import annotations

import math
import traceback
from types import ModuleType
from typing import Sequence

import torch
import torch.fx

from ..errors import TraceError
from .source import is_user_file


def helper_modules() -> tuple[ModuleType, ...]:
    """Modules whose functions become single fx nodes: ``math`` and, when installed, ``einops``."""
    mods: list[ModuleType] = [math]
    try:
        import einops

        mods.append(einops)
    except ImportError:  # einops is optional
        pass
    return tuple(mods)


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf_modules: Sequence[type] = ()):
        super().__init__(autowrap_modules=helper_modules())
        self.record_stack_traces = True
        self._extra_leaves = tuple(leaf_modules)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if self._extra_leaves and isinstance(m, self._extra_leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def trace(model: torch.nn.Module, leaf_modules: Sequence[type] = ()) -> torch.fx.GraphModule:
    """Symbolically trace ``model`` into a GraphModule that shares its parameters.

    Raises :class:`TraceError` naming the user's ``file:line`` when fx cannot trace it.
    """
    if isinstance(model, torch.fx.GraphModule):
        return model
    tracer = _Tracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many types; all of them mean "cannot trace"
        raise _trace_error(model, exc) from exc
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def _trace_error(model: torch.nn.Module, exc: BaseException) -> TraceError:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()}" if frames else "(unknown line)"
    reason = f"{type(exc).__name__}: {exc}"
    text = str(exc)
    if "control flow" in text or "bool" in text.lower() and "proxy" in text.lower():
        advice = ("Python control flow depends on a tensor's value or size. Make the branch a leaf module "
                  "(analyze(..., leaf_modules=[MyBlock])), wrap the helper with torch.fx.wrap, or rewrite it "
                  "with tensor ops (torch.where).")
    elif "cannot be interpreted as an integer" in text or "iterated" in text or "int()" in text:
        advice = ("a size is used as a Python int (range(N), int(N), a loop over a tensor). fx keeps sizes "
                  "symbolic; use tensor ops, or mark the enclosing module as a leaf (leaf_modules=[...]).")
    else:
        advice = ("fx symbolic tracing cannot follow this code. Mark the module that contains it as a leaf "
                  "(analyze(..., leaf_modules=[...])) or wrap the function with torch.fx.wrap.")
    return TraceError(f"cannot trace {type(model).__name__} at {where}\n  {reason}\n  what to do: {advice}")


def forward_arguments(gm: torch.fx.GraphModule) -> tuple[list[str], int]:
    """Names of the graph's placeholders and how many of them have no default."""
    names, required = [], 0
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if str(n.target).startswith("*"):
            continue
        names.append(str(n.target))
        if not n.args:  # placeholders with a default carry it in args
            required += 1
    return names, required
