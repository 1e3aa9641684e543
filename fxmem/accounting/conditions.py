"""A region as a user reads it: PyTorch's guards simplified, deduplicated, implied ones dropped.

PyTorch records every size decision as a guard over its symbols (``Ne(floor(floor(W/2)/2 - 3/2)
+ 1, 1)``: a convolution's output is not 1 wide). Many are implied by others or by the dims'
bounds, some repeat, and a guard on one dim usually says no more than a bound on it. Every step
here is a proof, never a guess, so the text says exactly what the guards say:

* a guard on one dim whose expression is monotone in it (built from ``+``, ``*`` of non-negative
  factors, ``//``) is solved exactly for that dim - a bound (``W >= 10``) - by searching the
  integer where it changes (the expression is monotone, so one crossing is all there is);
* a guard that the dims' bounds imply (value-range analysis, also of the factored expression) is
  dropped; one said twice (``B <= 15``, ``B < 16``) is said once;
* ``Mod(H, 2) == 0`` reads ``H even``, ``Mod(4096, W) == 0`` ``4096 divisible by W``; ``floor(H/2)`` reads ``H//2``.

The region's membership test (:meth:`fxmem.accounting.Region.violations`) keeps the original
guards; this module only writes them.

>>> from fxmem.parsing import dim_symbol
>>> B, W = dim_symbol("B"), dim_symbol("W")
>>> readable({B: 2, W: 6}, {}, [B < 16, sympy.Ne(sympy.floor(sympy.floor(W / 2) / 2 - sympy.Rational(3, 2)) + 1, 1)])
['B >= 2', 'B <= 15', 'W >= 10']
"""
from __future__ import annotations

from typing import Mapping, Sequence

import sympy
from sympy.printing.precedence import PRECEDENCE
from sympy.printing.str import StrPrinter

from .. import _torch_compat as tc
from ..search import first_true

_SEARCH_LIMIT = 1 << 62  # a bound beyond this is not a size anyone has
GE, NE, EQ = ">=", "!=", "=="


def readable(lower: Mapping[sympy.Symbol, int], upper: Mapping[sympy.Symbol, int],
             guards: Sequence[sympy.Basic]) -> list[str]:
    """``lower``/``upper`` bounds per dim and the guards, as the shortest exact list of conditions."""
    lo = {s: int(v) for s, v in lower.items()}
    hi: dict[sympy.Symbol, int | None] = {s: None for s in lo}
    hi.update({s: int(v) for s, v in upper.items()})
    kept: list[tuple[sympy.Expr, str] | sympy.Basic] = []
    for g in guards:
        c = _canonical(g)
        if c is not None and c in kept:
            continue
        if c is None and g in kept:
            continue
        kept.append(c if c is not None else g)
    tried: set = set()  # (guard, the bounds of its dims) already found not implied
    changed = True
    while changed:  # a tighter bound can make another guard implied: repeat until nothing moves
        changed = False
        for item in list(kept):
            if not isinstance(item, tuple):
                continue
            expr, rel = item
            key = (item, tuple((s, lo.get(s), hi.get(s)) for s in sorted(expr.free_symbols, key=str)))
            if key in tried:
                continue
            tried.add(key)
            if _implied(expr, rel, lo, hi):
                kept.remove(item)
                changed = True
                continue
            if _solve_for_bound(expr, rel, lo, hi):
                kept.remove(item)
                changed = True
    out = []
    for s in lo:
        if hi.get(s) is not None and hi[s] == lo[s]:
            out.append(f"{s} == {lo[s]}")
            continue
        if lo[s] > 1:
            out.append(f"{s} >= {lo[s]}")
        if hi.get(s) is not None:
            out.append(f"{s} <= {hi[s]}")
    for item in kept:
        text = _text(item)
        if text not in out:
            out.append(text)
    return out


def _canonical(g: sympy.Basic) -> tuple[sympy.Expr, str] | None:
    """``(e, rel)`` with ``g`` equivalent to ``e >= 0`` / ``e != 0`` / ``e == 0`` over the integers
    (the guards' operands are integer sizes); the sign of ``e`` fixed for ``!=``/``==``."""
    if not isinstance(g, sympy.core.relational.Relational):
        return None
    num, den = sympy.fraction(sympy.together(g.lhs - g.rhs))
    if not (den.is_Integer and den > 0 and num.is_integer):  # "< c" is "<= c - 1" for integers only
        return None
    a, b = sympy.expand(num), sympy.Integer(0)  # H/2 >= 3 is H - 6 >= 0: scaled by a positive number
    if isinstance(g, sympy.GreaterThan):
        return _reduced(sympy.expand(a - b), GE)
    if isinstance(g, sympy.StrictGreaterThan):
        return _reduced(sympy.expand(a - b - 1), GE)
    if isinstance(g, sympy.LessThan):
        return _reduced(sympy.expand(b - a), GE)
    if isinstance(g, sympy.StrictLessThan):
        return _reduced(sympy.expand(b - a - 1), GE)
    e = sympy.expand(a - b)
    if e.could_extract_minus_sign():
        e = -e
    return _reduced(e, EQ) if isinstance(g, sympy.Eq) else _reduced(e, NE) if isinstance(g, sympy.Ne) else None


def _reduced(e: sympy.Expr, rel: str) -> tuple[sympy.Expr, str]:
    """``16*x - 20480 >= 0`` as ``x - 1280 >= 0``: the integer terms divided by their common factor."""
    const, rest = e.as_coeff_Add()
    coeffs = [t.as_coeff_Mul()[0] for t in sympy.Add.make_args(rest)]
    if not rest.free_symbols or not all(c.is_Integer for c in coeffs) or not const.is_Integer:
        return e, rel
    g = sympy.gcd_list(coeffs) if len(coeffs) > 1 else abs(coeffs[0])
    if g <= 1 or not (rest / g).is_integer:
        return e, rel
    if rel == GE:  # g*x + c >= 0  <=>  x >= ceil(-c/g)  <=>  x + floor(c/g) >= 0 (x an integer)
        return sympy.expand(rest / g) + const // g, rel
    if const % g == 0:
        return sympy.expand(rest / g) + const // g, rel
    return e, rel


def _ranges(lo: dict, hi: dict) -> dict:
    return {s: (lo[s], hi.get(s)) for s in lo}


def _bounds(expr: sympy.Expr, lo: dict, hi: dict) -> tuple[int | None, int | None]:
    """Proven (lower, upper) bounds of ``expr`` over the dims' ranges (None: unknown)."""
    best_lo, best_hi = None, None
    const, rest = expr.as_coeff_Add()
    # value ranges lose the correlation between terms (a*b - b); the factored form keeps it
    for e, shift in ((expr, 0), (sympy.factor(expr), 0), (sympy.factor(rest), const)):
        low = tc.lower_bound(e, _ranges(lo, hi))
        up = tc.lower_bound(-e, _ranges(lo, hi))
        if low is not None and (best_lo is None or low + shift > best_lo):
            best_lo = low + shift
        if up is not None and (best_hi is None or shift - up < best_hi):
            best_hi = shift - up
    return best_lo, best_hi


def _implied(expr: sympy.Expr, rel: str, lo: dict, hi: dict) -> bool:
    if any(s not in lo for s in expr.free_symbols):
        return False
    low, up = _bounds(expr, lo, hi)
    if rel == GE:
        return low is not None and low >= 0
    if rel == NE:
        return (low is not None and low >= 1) or (up is not None and up <= -1)
    return False


def _monotone(e: sympy.Expr, x: sympy.Symbol, lo: dict, hi: dict) -> int | None:
    """+1 (non-decreasing in ``x``), -1 (non-increasing), 0 (constant) or None (not proven)."""
    if e.is_number:
        return 0
    if e == x:
        return 1
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        return _monotone(e.args[0], x, lo, hi)
    if isinstance(e, sympy.Add):
        return _combine([_monotone(a, x, lo, hi) for a in e.args])
    if isinstance(e, sympy.Mul):
        coeff, rest = e.as_coeff_Mul()
        factors = [f for f in sympy.Mul.make_args(rest) if not f.is_number]
        if len(factors) == 1:
            m = _monotone(factors[0], x, lo, hi)
            return None if m is None else m * int(sympy.sign(coeff))
        # a product of non-negative factors that all move one way moves that way
        ms = [_monotone(f, x, lo, hi) for f in factors]
        if None in ms or any((low := tc.lower_bound(f, _ranges(lo, hi))) is None or low < 0 for f in factors):
            return None
        m = _combine(ms)
        return None if m is None else m * int(sympy.sign(coeff))
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
        low = tc.lower_bound(e.base, _ranges(lo, hi))
        return _monotone(e.base, x, lo, hi) if low is not None and low >= 0 else None
    return None


def _combine(ms: list) -> int | None:
    if None in ms:
        return None
    signs = {m for m in ms if m}
    return 0 if not signs else signs.pop() if len(signs) == 1 else None


def _solve_for_bound(expr: sympy.Expr, rel: str, lo: dict, hi: dict) -> bool:
    """A guard on one dim, monotone in it, turned into a tighter bound on that dim (True: done)."""
    if rel == EQ or len(expr.free_symbols) != 1:
        return False
    (x,) = expr.free_symbols
    if x not in lo:
        return False
    m = _monotone(expr, x, lo, hi)
    if not m:
        return False
    value = lambda v: expr.xreplace({x: sympy.Integer(v)})  # noqa: E731
    holds = (lambda v: value(v) >= 0) if rel == GE else (lambda v: value(v) != 0)
    start, end = lo[x], hi.get(x)
    if rel == GE:
        if m > 0:  # false, then true from some size on: that size is the new lower bound
            first = _first(holds, start, end)
            if first is None:
                return False
            lo[x] = first
        else:  # true, then false: the last true size is the new upper bound
            if not holds(start):
                return False
            first_false = _first(lambda v: not holds(v), start, end)
            if first_false is None:
                return end is not None  # true everywhere up to the upper bound: implied
            hi[x] = first_false - 1
        return True
    # e != 0 with e monotone: the sizes where e == 0 form one interval; it is no constraint when e
    # starts past 0, and a lower bound when it starts at 0
    at_start = value(start)
    if at_start * m > 0:
        return True
    if at_start == 0:
        first = _first(holds, start, end)
        if first is None:
            return False
        lo[x] = first
        return True
    return False


def _first(pred, start: int, end: int | None) -> int | None:
    """The smallest ``v >= start`` (``<= end``) where ``pred`` holds, ``pred`` being false and then
    true (monotone); None if it never holds there."""
    if pred(start):
        return start
    step, prev = 1, start
    while True:  # gallop, then bisect between the last false and the first true
        cand = start + step
        if end is not None and cand > end:
            cand = end
        if cand > _SEARCH_LIMIT:
            return None
        if pred(cand):
            break
        if end is not None and cand == end:
            return None
        prev, step = cand, step * 2
    return first_true(pred, prev, cand)  # pred(prev) false, pred(cand) true


class _Printer(StrPrinter):
    """Python-like text in the user's dims: ``floor(H/2)`` as ``H//2``."""

    def _print_floor(self, e: sympy.floor) -> str:
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den.is_Integer and den > 1:
            inner = self._print(num)
            if not (num.is_Symbol or num.is_Integer or isinstance(num, sympy.floor)):
                inner = f"({inner})"
            return f"{inner}//{den}"
        return f"floor({self._print(e.args[0])})"


    def parenthesize(self, item: sympy.Basic, level: int, strict: bool = False) -> str:
        if isinstance(item, sympy.floor) and level >= PRECEDENCE["Mul"]:  # (H//2)*(W//2), not H//2*W//2
            return f"({self._print(item)})"
        return super().parenthesize(item, level, strict)


def _show(e: sympy.Basic) -> str:
    return _Printer().doprint(e)


def _text(item: tuple[sympy.Expr, str] | sympy.Basic) -> str:
    if not isinstance(item, tuple):
        return _show(item)
    expr, rel = item
    if isinstance(expr, sympy.Mod) and rel in (EQ, NE):
        x, k = expr.args
        if not k.is_Integer:  # a symbolic divisor (a world size: 4096 divisible by W)
            return f"{_show(x)} {'' if rel == EQ else 'not '}divisible by {_show(k)}"
        if rel == EQ:
            return f"{_show(x)} even" if k == 2 else f"{_show(x)} divisible by {k}"
        return f"{_show(x)} odd" if k == 2 else f"{_show(x)} not divisible by {k}"
    # "a >= b" with the positive terms on the left reads better than "a - b >= 0"
    pos = sympy.Add(*[t for t in sympy.Add.make_args(expr) if not t.could_extract_minus_sign()])
    neg = -sympy.Add(*[t for t in sympy.Add.make_args(expr) if t.could_extract_minus_sign()])
    if not pos.free_symbols and rel == GE:  # the dims on the left: "3*H*W <= 20480"
        return f"{_show(neg)} <= {_show(pos)}"
    return f"{_show(pos)} {rel} {_show(neg)}"
