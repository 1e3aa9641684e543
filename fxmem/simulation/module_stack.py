"""Eager mode's module paths: which of the model's modules is running when a storage is allocated.

Graph mode reads a node's module from fx's ``nn_module_stack``; eager mode runs the original
forward, so the simulation follows the calls themselves: forward pre- and post-hooks on fxmem's
private (fake) copy of the model - never on the user's - keep the stack of running modules, count
each module's calls and keep its first call's output shape. A storage the forward allocates belongs
to the innermost module running then (an ``nn.Linear``'s output to the Linear, as in graph mode).

>>> with ModuleStack(fake_model, env) as modules:            # doctest: +SKIP
...     fake_model(x)
>>> modules.calls["layers.0.mlp"]                              # doctest: +SKIP
ModuleCall(kind='LlamaMLP', calls=1, shape=(s0, s1, 32))
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import _torch_compat as tc


@dataclasses.dataclass
class ModuleCall:
    """A module the forward called: its class, how many times, its first call's output shape
    (the first tensor it returned, sizes over ShapeEnv symbols; None if it returned none)."""

    kind: str
    calls: int
    shape: tuple | None


class ModuleStack:
    """Hooks on the (fake, private) ``model``'s modules while the ``with`` block runs; removed after."""

    def __init__(self, model: torch.nn.Module, env: Any):
        self.env = env
        self.names = {id(m): name for name, m in model.named_modules()}
        self.modules = [m for m in model.modules()]
        self.stack: list[str] = []
        self.calls: dict[str, ModuleCall] = {}
        self._handles: list = []

    def now(self) -> str:
        """The path of the innermost module running ("" outside every submodule)."""
        return self.stack[-1] if self.stack else ""

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), ""))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        path = self.stack.pop() if self.stack else self.names.get(id(module), "")
        call = self.calls.get(path)
        if call is None:
            first = next((t for t in tc.tree_leaves(output) if isinstance(t, torch.Tensor)), None)
            shape = None if first is None else tuple(tc.size_expr(self.env, d) for d in first.shape)
            self.calls[path] = ModuleCall(type(module).__name__, 1, shape)
        else:
            call.calls += 1

    def __enter__(self) -> "ModuleStack":
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            # always_call: a forward that raises still pops its entry
            self._handles.append(m.register_forward_hook(self._post, always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stack.clear()
