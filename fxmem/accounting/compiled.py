"""Formulas compiled to Python: the headline numbers at a size in microseconds, exactly.

``evaluate`` is what users call in loops (a batch search, a sweep of 1,000 sizes); substituting
into sympy costs milliseconds per formula. Here each formula (a ``Terms`` dict: monomials, which
may hold ``floor``/``ceiling``/``Mod`` of the dims, and rational coefficients) becomes one Python
expression over ints and ``fractions.Fraction`` - exact integer arithmetic, never floats - and all
of a plan's formulas become one function returning their values in order.

The generated source names the dims ``d0, d1, ...``: no name the user chose is ever part of code
that runs.

>>> from fxmem.specs import dim_symbol
>>> B, N = dim_symbol("B"), dim_symbol("N")
>>> f = compile_terms([{B * N: 4, sympy.floor(N / 2): 8}], [B, N])
>>> f({B: 3, N: 5})
[76]
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Mapping, Sequence

import sympy

from ..kernels.measured import MeasuredBytes, value_of

Terms = dict  # {monomial: coefficient}, as fxmem.accounting.symbolic keeps formulas

__all__ = ["compile_terms", "compile_conditions"]


def _py(e: sympy.Basic, names: Mapping[sympy.Symbol, str]) -> str:
    """``e`` as Python over ints and ``_F`` (Fraction): every division is a Fraction, never ``/``."""
    if isinstance(e, sympy.Symbol):
        return names[e]
    if isinstance(e, sympy.Integer):
        return str(int(e))
    if isinstance(e, sympy.Rational):
        return f"_F({e.p}, {e.q})"
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(_py(a, names) for a in e.args) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + "*".join(_py(a, names) for a in e.args) + ")"
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) >= 0:
        return f"({_py(e.base, names)})**{int(e.exp)}"
    if isinstance(e, sympy.Pow) and e.exp.is_Integer:
        return f"_F(1, ({_py(e.base, names)})**{-int(e.exp)})"
    if isinstance(e, sympy.floor):
        return f"_floor({_py(e.args[0], names)})"
    if isinstance(e, sympy.ceiling):
        return f"_ceil({_py(e.args[0], names)})"
    if isinstance(e, sympy.Mod):
        return f"(({_py(e.args[0], names)}) % ({_py(e.args[1], names)}))"
    if isinstance(e, sympy.core.relational.Relational) and e.rel_op in _RELATIONS:
        return f"(({_py(e.lhs, names)}) {_RELATIONS[e.rel_op]} ({_py(e.rhs, names)}))"
    if isinstance(e, (sympy.And, sympy.Or)):
        return "(" + (" and " if isinstance(e, sympy.And) else " or ").join(_py(a, names) for a in e.args) + ")"
    if isinstance(e, sympy.Not):
        return f"(not {_py(e.args[0], names)})"
    if e is sympy.true or e is sympy.false:
        return str(bool(e))
    if isinstance(e, MeasuredBytes):  # one real run of a kernel per size (fxmem.kernels.measured)
        key, stretch, which, *dims = e.args
        return f"_measured({int(key)}, {int(stretch)}, {int(which)}, ({''.join(_py(d, names) + ', ' for d in dims)}))"
    if isinstance(e, (sympy.Max, sympy.Min)):
        return f"{'max' if isinstance(e, sympy.Max) else 'min'}({', '.join(_py(a, names) for a in e.args)})"
    raise NotImplementedError(type(e).__name__)


_RELATIONS = {">=": ">=", ">": ">", "<=": "<=", "<": "<", "==": "==", "!=": "!="}


def _source(t: Terms, names: Mapping[sympy.Symbol, str]) -> str:
    if not t:
        return "0"
    return " + ".join(f"{_py(sympy.Rational(c), names)}*{_py(sympy.sympify(m), names)}" for m, c in t.items())


def compile_terms(formulas: Sequence[Terms], symbols: Sequence[sympy.Symbol]) -> Callable[[Mapping], list[int]]:
    """One function ``f(values) -> [int, ...]``: each formula's exact value at ``values``
    (``{symbol: int}``); a value that is not a whole number raises ``ValueError``. A formula
    with a function this compiler does not know raises ``NotImplementedError`` here, at once."""
    symbols = list(symbols)
    names = {s: f"d{k}" for k, s in enumerate(symbols)}
    args = ", ".join(names[s] for s in symbols)
    body = ", ".join(_source(t, names) for t in formulas)
    code = compile(f"def _f({args}):\n    return [{body}{',' if len(formulas) == 1 else ''}]\n", "<fxmem formulas>",
                   "exec")
    scope: dict = {"_F": Fraction, "_floor": math.floor, "_ceil": math.ceil, "_measured": value_of}
    exec(code, scope)  # noqa: S102 - source generated above from sympy formulas, names d0, d1, ...
    fn = scope["_f"]

    def at(values: Mapping[sympy.Symbol, int]) -> list[int]:
        out = []
        for v in fn(*[values[s] for s in symbols]):
            if isinstance(v, Fraction):
                if v.denominator != 1:
                    raise ValueError(f"a byte formula is not a whole number here ({v})")
                v = v.numerator
            out.append(int(v))
        return out

    return at


def compile_conditions(conditions: Sequence[sympy.Basic], symbols: Sequence[sympy.Symbol]
                       ) -> Callable[[Mapping], list[bool]]:
    """One function ``f(values) -> [bool, ...]``: whether each condition (relations of the dims,
    ``And``/``Or``/``Not`` of them) holds at ``values``; a condition undefined there (a ``Mod`` by
    zero) is False. Raises ``NotImplementedError`` here for a condition it cannot compile."""
    symbols = list(symbols)
    names = {s: f"d{k}" for k, s in enumerate(symbols)}
    lines = [f"def _c{k}({', '.join(names.values())}):\n    return {_py(c, names)}\n"
             for k, c in enumerate(conditions)]
    scope: dict = {"_F": Fraction, "_floor": math.floor, "_ceil": math.ceil}
    exec(compile("".join(lines) or "pass\n", "<fxmem conditions>", "exec"), scope)  # noqa: S102 - see compile_terms
    fns = [scope[f"_c{k}"] for k in range(len(conditions))]

    def at(values: Mapping[sympy.Symbol, int]) -> list[bool]:
        args = [values[s] for s in symbols]
        out = []
        for fn in fns:
            try:
                out.append(bool(fn(*args)))
            except ZeroDivisionError:
                out.append(False)
        return out

    return at
