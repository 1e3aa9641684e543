"""Hyperparameter dims: build the model with symbolic constructor arguments.

    fxmem.analyze(Attention, ("B", "L", "H*D"), hparams={"dim": "H*D", "num_heads": "H"})

The class (or factory) is called once per analysis with PyTorch ``SymInt``s for the named
constructor arguments, under fake tensors: ``nn.Linear(dim, 3 * dim)`` gets a weight of shape
``(3*H*D, H*D)``, ``dim // num_heads`` becomes ``D``, and the formulas hold in B, L, H and D
together.

Guarantee (symbolic construction): the formulas are what a concrete construction would give, for
every hyperparameter value in ``Report.region``. Parameter *initialisation* is skipped while
building (values do not matter under fake tensors, and init code such as
``1 / math.sqrt(fan_in)`` would force a size to a concrete number). If the constructor itself
forces a hyperparameter to a number (``int(dim)``, ``range(num_heads)``), the report notes that the
dim was specialised, and ``evaluate`` at other values re-analyses - so numbers stay exact.

>>> bp = Blueprint(Attention, {"dim": H * D, "num_heads": H}, {})   # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping

import sympy
import torch

from . import _torch_compat as tc
from .errors import ModelError, SpecError
from .specs import parse_dim


@dataclasses.dataclass
class Blueprint:
    """A model to build: a class or factory, symbolic constructor arguments, concrete ones."""

    factory: Callable[..., torch.nn.Module]
    hparams: dict[str, sympy.Expr]  # constructor argument -> expression in the user's dims
    init: dict[str, Any]  # constructor arguments with concrete values

    @property
    def name(self) -> str:
        return getattr(self.factory, "__name__", type(self.factory).__name__)

    def build(self, symint: Callable[[sympy.Expr], Any]) -> torch.nn.Module:
        """Call the factory with ``symint(expr)`` for each hyperparameter (initialisation skipped)."""
        kwargs = {**self.init, **{k: symint(e) for k, e in self.hparams.items()}}
        try:
            with tc.skip_parameter_init():
                model = self.factory(**kwargs)
        except ModelError:
            raise
        except Exception as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelError(f"building {self.name}(...) failed: {type(exc).__name__}: {text}; pass its constructor "
                             f"arguments with init= (values) or hparams= (dims)") from exc
        if not isinstance(model, torch.nn.Module):
            raise ModelError(f"{self.name}(...) returned {type(model).__name__}, not an nn.Module")
        return model

    def example(self, values: Mapping[sympy.Symbol, int]) -> torch.nn.Module:
        """A concrete instance on the meta device (no memory), for names and structure."""
        with torch.device("meta"):
            return self.build(lambda e: int(e.xreplace(values)))


def blueprint(factory: Any, hparams: Mapping[str, Any] | None, init: Mapping[str, Any] | None,
              symbols: dict[str, sympy.Symbol]) -> Blueprint:
    """Check ``hparams``/``init`` against the factory's signature and parse the dim expressions."""
    if isinstance(factory, torch.nn.Module):
        raise ModelError("hparams= needs the model's class or a factory function (it builds the model), "
                         f"not an instance of {type(factory).__name__}")
    if not callable(factory):
        raise ModelError(f"model must be a torch.nn.Module, its class or a factory, got {type(factory).__name__}")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    parsed = {}
    for arg, expr in (hparams or {}).items():
        if params and not takes_any and arg not in params:
            raise SpecError(f"hparams: {getattr(factory, '__name__', factory)} has no argument {arg!r}; "
                            f"its arguments are {[p for p in params if p != 'self']}")
        parsed[arg] = parse_dim(expr, symbols, f"hparams[{arg!r}]")
        if parsed[arg].is_number:
            raise SpecError(f"hparams[{arg!r}] = {expr!r} has no dim name; pass concrete values with init=")
    for arg in init or {}:
        if params and not takes_any and arg not in params:
            raise SpecError(f"init: {getattr(factory, '__name__', factory)} has no argument {arg!r}")
    return Blueprint(factory, parsed, dict(init or {}))
