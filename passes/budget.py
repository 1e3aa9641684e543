"""What ``fxmem.optimize(budget=, dims=)`` asks, parsed once: the training step at ``dims`` within
``limit`` bytes.

:meth:`Budget.of` checks the arguments as the user wrote them (``"24GiB"`` or bytes; ``dims`` a
dict of positive whole sizes), :meth:`Budget.check` that ``dims`` names every dim of the inputs
and nothing else. Every part of ``optimize`` that needs the budget is handed this one object
(the recompute pass, the region's second graph, the refusals' messages).

>>> b = Budget.of("1GiB", {"B": 8, "L": 256}, grad=True)
>>> b.limit, b.at(), b.said()
(1073741824, 'B=8, L=256', "budget='1GiB'")
>>> b.without("L").dims
{'B': 8}
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from fxmem.errors import SpecError
from fxmem.units import parse_bytes


@dataclasses.dataclass(frozen=True)
class Budget:
    """``limit`` (bytes) the training step must fit at ``dims`` ({dim: size}); ``given``: the
    budget as the user wrote it (what messages quote)."""

    limit: int
    dims: Mapping[str, int]
    given: Any

    @classmethod
    def of(cls, budget: Any, dims: Mapping[str, int] | None, *, grad: bool,
           optimizer: Any = None) -> "Budget | None":
        """The parsed ``budget=``/``dims=`` (None without ``budget=``), or a :class:`SpecError`
        naming the argument. ``optimizer=`` belongs with them: it is the step's optimizer."""
        if budget is None:
            if dims is not None or optimizer is not None:
                raise SpecError("dims= and optimizer= say where a budget= must hold; pass budget= too")
            return None
        limit = parse_bytes(budget)
        if not grad:
            raise SpecError("budget= fits a training step; it needs grad=True")
        if not isinstance(dims, Mapping) or not dims:
            raise SpecError("budget= needs dims={dim: size, ...}: the sizes the training step must fit at")
        for name, size in dims.items():
            if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise SpecError(f"dims={dict(dims)!r}: each entry is a dim's name and its size, a positive int "
                                f"(got {name!r}: {size!r})")
        return cls(limit, dict(dims), budget)

    def check(self, dims: Mapping[str, Any]) -> None:
        """A :class:`SpecError` unless ``self.dims`` names each of the inputs' ``dims`` (their
        names), and nothing else: the step's size must be known in every dim."""
        unknown, missing = sorted(set(self.dims) - set(dims)), sorted(set(dims) - set(self.dims))
        wrong = ([f"{unknown} are not dims of the inputs"] if unknown else []) + \
            ([f"no size for {missing}"] if missing else [])
        if wrong:
            raise SpecError(f"dims={dict(self.dims)!r}: {'; '.join(wrong)}; give a size for each of {sorted(dims)}")

    def without(self, dim: str) -> "Budget":
        """The same budget where ``dim`` is fixed in the inputs (a graph captured at one size)."""
        return dataclasses.replace(self, dims={k: v for k, v in self.dims.items() if k != dim})

    def at(self) -> str:
        """``dims`` as messages write them: ``"B=8, L=256"``."""
        return ", ".join(f"{k}={v}" for k, v in self.dims.items())

    def said(self) -> str:
        """The argument as the user wrote it: ``"budget='24GiB'"``."""
        return f"budget={self.given!r}"
