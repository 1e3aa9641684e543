"""Byte formulas: sympy expressions in the user's dims, kept as coefficient dicts for speed.

A memory plan adds and subtracts hundreds of storage sizes; doing that with sympy ``Add`` is slow,
so sizes are kept as ``{monomial: coefficient}`` dicts (``Terms``) and turned back into sympy only
for display. A peak is a ``Max`` over candidate sums; candidates that are dominated for every
admissible size are dropped so the formula stays readable.

>>> B, N = dim_symbol("B"), dim_symbol("N")
>>> to_expr(add_terms(terms(4*B*N), terms(1024*B*N**2)))
1024*B*N**2 + 4*B*N
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping, Sequence

import sympy

from .. import _torch_compat as tc
from ..kernels.measured import MeasuredBytes
from ..specs import dim_symbol
from .compiled import compile_conditions
from .conditions import readable

Terms = dict  # dict[sympy.Expr (monomial, 1 for the constant), int]

__all__ = ["Terms", "terms", "to_expr", "add_terms", "Region", "max_of", "evaluate", "dim_symbol"]


def terms(expr: sympy.Expr) -> Terms:
    """Expand ``expr`` into ``{monomial: integer coefficient}``."""
    out: Terms = {}
    for term in sympy.Add.make_args(sympy.expand(expr)):
        coeff, mono = term.as_coeff_Mul()
        if coeff.is_Integer:
            c = int(coeff)
        else:  # a rational coefficient on a monomial: keep it exact
            c = coeff
        if c:
            out[mono] = out.get(mono, 0) + c
            if not out[mono]:
                del out[mono]
    return out


def to_expr(t: Terms) -> sympy.Expr:
    """Back to a sympy expression, highest degree first when printed."""
    if not t:
        return sympy.Integer(0)
    return sympy.Add(*[c * m for m, c in t.items()])


def add_terms(*parts: Terms, signs: Sequence[Any] | None = None) -> Terms:
    """Sum of several ``Terms``, each optionally scaled (``signs``: +1/-1 or any coefficient)."""
    out: Terms = {}
    for i, p in enumerate(parts):
        s = 1 if signs is None else signs[i]
        for m, c in p.items():
            v = out.get(m, 0) + s * c
            if v:
                out[m] = v
            else:
                out.pop(m, None)
    return out


def evaluate(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> int:
    """Exact integer value of ``expr`` at ``values``."""
    v = sympy.sympify(expr).xreplace({k: sympy.Integer(x) for k, x in values.items()}) if values else sympy.sympify(expr)
    if not v.is_number:
        v = sympy.sympify(v).doit()
    if not v.is_number:
        raise ValueError(f"cannot evaluate {expr} at {values}: {v} still has symbols")
    return int(v)


def binding(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> tuple[sympy.Expr, int]:
    """``expr`` with each ``Max``/``Min`` replaced by its candidate that decides it at ``values``
    (the first one on a tie), and how many candidates were dropped: the formula as it reads at the
    user's sizes. It equals ``expr`` at ``values`` (the caller may check that), not elsewhere.

    >>> B, L = sympy.symbols("B L", positive=True)
    >>> binding(8*B + sympy.Max(4*B*L, 1000), {B: 2, L: 512})
    (4*B*L + 8*B, 1)
    """
    dropped = 0

    def pick(e: sympy.Expr) -> sympy.Expr:
        nonlocal dropped
        if isinstance(e, (sympy.Max, sympy.Min)):
            args = [pick(a) for a in e.args]
            at = [evaluate(a, values) for a in args]
            best = (max if isinstance(e, sympy.Max) else min)(range(len(args)), key=lambda i: (at[i], -i))
            dropped += len(args) - 1
            return args[best]
        if isinstance(e, (sympy.Add, sympy.Mul)):
            return e.func(*[pick(a) for a in e.args])
        return e

    return pick(sympy.sympify(expr)), dropped


@dataclasses.dataclass
class Region:
    """Where the formulas hold: a lower bound per dim (usually 2) plus the guards PyTorch recorded.

    ``shifted(t)`` rewrites ``t`` with every dim as ``lower + u`` (u >= 0) and every floor/mod atom
    as ``its lower bound + v`` (v >= 0); if all coefficients of ``shifted(a - b)`` are >= 0 then
    ``a >= b`` everywhere in the region. That is the test used to prune a ``Max``. Shifting is
    linear, so it is done once per monomial and cached.
    """

    lower: dict[sympy.Symbol, int]
    guards: list[sympy.Expr]
    # dims PyTorch fixed while analysing: ``{dim: value or expression in other dims}``. The
    # formulas hold only there (a kernel read the size as a number, or the example size was 0/1).
    pinned: dict[sympy.Symbol, sympy.Expr] = dataclasses.field(default_factory=dict)
    upper: dict[sympy.Symbol, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._shifted: dict[sympy.Expr, Terms] = {}
        self._atoms: dict[sympy.Expr, sympy.Expr] = {}
        self._text: list[str] | None = None
        self._fast: Any = None

    def conditions(self) -> list[str]:
        """The region as text, in the user's dims (``B == 1024``, ``N >= 2``, ``N even``), each
        condition once and none implied by the others (see :mod:`.conditions`)."""
        if self._text is None:  # proofs over the guards: once
            out = [f"{s} == {v}" for s, v in self.pinned.items()]
            lower = {s: lo for s, lo in self.lower.items() if s not in self.pinned}
            upper = {s: hi for s, hi in self.upper.items() if s not in self.pinned}
            self._text = out + [text for text in readable(lower, upper, self.guards) if text not in out]
        return list(self._text)

    def _compiled(self) -> Any:
        """Every condition as one compiled test (:mod:`.compiled`), with the dims it reads; False
        where a condition cannot be compiled."""
        if self._fast is None:
            conds = [sympy.Eq(s, v) for s, v in self.pinned.items()]
            conds += [sympy.Ge(s, lo) for s, lo in self.lower.items() if s not in self.pinned]
            conds += [sympy.Le(s, hi) for s, hi in self.upper.items() if s not in self.pinned]
            conds += [g for g in self.guards if isinstance(g, sympy.Basic)]
            conds = [c for c in conds if c is not sympy.true]
            symbols = sorted({s for c in conds for s in c.free_symbols}, key=str)
            try:
                self._fast = (compile_conditions(conds, symbols), symbols)
            except (NotImplementedError, TypeError, ValueError, AttributeError):
                self._fast = False
        return self._fast

    def holds(self, values: Mapping[sympy.Symbol, int]) -> bool:
        """Whether ``values`` lies in the region (dims not given are not tested)."""
        fast = self._compiled()
        if fast and all(s in values for s in fast[1]):
            return all(fast[0](values))
        return not self.violations(values)

    def violations(self, values: Mapping[sympy.Symbol, int]) -> list[str]:
        """Reasons ``values`` lies outside the region ([] when inside)."""
        fast = self._compiled()
        if fast and all(s in values for s in fast[1]) and all(fast[0](values)):
            return []  # the common case, in microseconds; the reasons below are for the rest
        why = []
        for s, v in self.pinned.items():
            if s in values:
                want = v.xreplace(values) if isinstance(v, sympy.Basic) else v
                if not (getattr(want, "is_number", True) and want == values[s]):
                    why.append(f"{s} == {v}")
        for s, lo in self.lower.items():
            if s in values and values[s] < lo and s not in self.pinned:
                why.append(f"{s} >= {lo}")
        for s, hi in self.upper.items():
            if s in values and values[s] > hi and s not in self.pinned:
                why.append(f"{s} <= {hi}")
        for g in self.guards:
            try:
                ok = bool(g.xreplace(values))
            except (TypeError, ValueError, ZeroDivisionError):  # undefined there (x % (N-1) at N=1): outside
                ok = False
            if not ok:
                why.append(_guard_text(g))
        return why

    def _atom(self, atom: sympy.Expr) -> sympy.Expr:
        if atom not in self._atoms:
            if isinstance(atom, MeasuredBytes):  # a measured kernel's bytes: >= 0, nothing else known
                low = 0
            else:
                low = tc.lower_bound(atom, {s: (lo, None) for s, lo in self.lower.items()})
            k = len(self._atoms)
            if low is None:  # unknown sign: monomials holding it must cancel exactly
                self._atoms[atom] = sympy.Symbol(f"_w{k}", real=True)
            else:
                self._atoms[atom] = low + sympy.Symbol(f"_v{k}", nonnegative=True)
        return self._atoms[atom]

    def shifted_monomial(self, mono: sympy.Expr) -> Terms:
        if mono not in self._shifted:
            measured = mono.atoms(MeasuredBytes)  # opaque: the floors inside its arguments are its own
            atoms = sorted(measured | {a for a in mono.atoms(sympy.floor, sympy.ceiling, sympy.Mod)
                                       if not any(a in m.args or m.has(a) for m in measured)},
                           key=sympy.default_sort_key)
            expr = mono.xreplace({a: self._atom(a) for a in atoms})
            shift = {s: lo + sympy.Symbol(f"_u_{s}", nonnegative=True) for s, lo in self.lower.items()}
            self._shifted[mono] = terms(expr.xreplace(shift))
        return self._shifted[mono]

    def shifted(self, t: Terms) -> Terms:
        """``t`` over non-negative offsets from the region's lower corner (see class docstring)."""
        monomials = list(t)
        return add_terms(*[self.shifted_monomial(m) for m in monomials], signs=[t[m] for m in monomials])


def _guard_text(g: sympy.Expr) -> str:
    """A guard as Python-like text (``Eq(a, b)`` reads ``a == b``)."""
    if isinstance(g, sympy.Eq):
        return f"{g.lhs} == {g.rhs}"
    if isinstance(g, sympy.Ne):
        return f"{g.lhs} != {g.rhs}"
    return str(g)


def _dominates(a_shift: Terms, b_shift: Terms) -> bool:
    """True if a >= b over the whole region (sufficient test on shifted coefficients)."""
    for k, v in a_shift.items():
        d = v - b_shift.get(k, 0)
        if d < 0 or (d and _has_free_sign(k)):
            return False
    for k, v in b_shift.items():
        if k not in a_shift and (v > 0 or (v and _has_free_sign(k))):
            return False
    return True


@functools.lru_cache(maxsize=4096)
def _has_free_sign(monomial: sympy.Expr) -> bool:
    """Whether a shifted monomial holds a ``_w`` symbol (an atom of unknown sign)."""
    return any(str(s).startswith("_w") for s in monomial.free_symbols)


class Evaluator:
    """Fast exact values of many ``Terms`` at one point (each monomial evaluated once)."""

    def __init__(self, values: Mapping[sympy.Symbol, int]):
        self.values = {k: sympy.Integer(v) for k, v in values.items()}
        self._mono: dict[sympy.Expr, Any] = {}

    def __call__(self, t: Terms) -> Any:
        total = 0
        for m, c in t.items():
            v = self._mono.get(m)
            if v is None:
                v = self._mono[m] = sympy.sympify(m).xreplace(self.values)
                if v.is_Integer:
                    v = int(v)
            total += c * v
        return int(total) if not isinstance(total, int) else total


def max_of(candidates: Sequence[Terms], region: Region, at: Mapping[sympy.Symbol, int]) -> list[int]:
    """Indices of the candidates that survive pruning, largest at ``at`` first.

    A candidate is dropped when another one is at least as large for every size in ``region``.
    """
    uniq: dict[frozenset, int] = {}
    for i, c in enumerate(candidates):
        uniq.setdefault(frozenset(c.items()), i)
    value = Evaluator(at)
    order = sorted(uniq.values(), key=lambda i: -value(candidates[i]))
    kept: list[int] = []
    shifted: dict[int, Terms] = {}
    for i in order:
        shifted[i] = region.shifted(candidates[i])
        if any(_dominates(shifted[k], shifted[i]) for k in kept):
            continue
        # a later (smaller-at-hint) candidate can only dominate a kept one if they tie at the hint
        kept = [k for k in kept if not _dominates(shifted[i], shifted[k])] + [i]
    return kept


def build_max(exprs: Iterable[sympy.Expr]) -> sympy.Expr:
    """``Max`` of already-pruned candidates, without sympy's own (slow, lossy) evaluation."""
    exprs = list(exprs)
    if not exprs:
        return sympy.Integer(0)
    if len(exprs) == 1:
        return exprs[0]
    return sympy.Max(*exprs, evaluate=False)
