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

from typing import Any, Mapping, Sequence

import torch
import torch.fx

from ..specs import InputSpec
from .decide import Condition


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


def positions(condition: Condition, specs: Sequence[InputSpec], symbols: Mapping[str, Any]) -> dict | None:
    """Where each dim of ``condition`` is an input's size (first plain occurrence); None if one is not."""
    out = {}
    for dim in (condition.dim, condition.other):
        if dim is None:
            continue
        at = next(((i, a) for i, s in enumerate(specs) for a, d in enumerate(s.dims) if d == symbols[dim]), None)
        if at is None:
            return None
        out[dim] = at
    return out


def build(condition: Condition, where: Mapping[str, tuple[int, int]], when: torch.fx.GraphModule,
          otherwise: torch.fx.GraphModule, name: str) -> torch.fx.GraphModule:
    """A GraphModule with ``otherwise``'s call signature whose one node calls :class:`Forms`."""
    graph = torch.fx.Graph()
    args = [graph.node_copy(n) for n in otherwise.graph.nodes if n.op == "placeholder"]
    out = graph.call_module("fxmem_forms", tuple(args))
    graph.output(out)
    root = torch.nn.Module()
    root.fxmem_forms = Forms(condition, where, when, otherwise)
    gm = torch.fx.GraphModule(root, graph, name)
    gm.training = otherwise.training  # its own flag only (train() would reach the model's modules)
    return gm
