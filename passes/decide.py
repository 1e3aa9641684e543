"""Decide a rewrite by its formulas: is the rewrite's peak never higher than the original's, for
every size where the analysis holds - or only where a condition in the user's dims holds?

A peak is a ``Max`` of candidate polynomials in the dims. ``after <= before`` for every size in a
region when each candidate of ``after`` is at most some candidate of ``before`` there; that in turn
holds when ``before - after``, written over non-negative offsets from the region's lower corner
(:meth:`fxmem.accounting.symbolic.Region.shifted`), has no negative coefficient. That is a proof,
never a sample: the example sizes (hints) only order the candidates, they decide nothing.

Where neither form is never higher, the two cross; a condition that splits the region is looked
for, ratio first (``E >= k*N``: substitute ``E = k*N + u`` with ``u >= 0`` and prove again), then a
bound on one dim (``N >= c``); the smallest ``k`` (``c``) that proves it is kept.

>>> d = decide([(before.peak, after.peak)], region, symbols, hints)    # doctest: +SKIP
>>> d.verdict, str(d.condition)                                       # doctest: +SKIP
('switch', 'E >= 2*N')
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, Sequence

import sympy

from fxmem.accounting.symbolic import Region, terms
from fxmem.accounting.symbolic import _dominates, _has_free_sign  # the one dominance test, shared with Max pruning

_LIMIT = 1 << 20
_ATOMS = (sympy.floor, sympy.ceiling, sympy.Mod)  # a ratio or bound beyond this is not one anyone's sizes reach


@dataclasses.dataclass(frozen=True)
class Condition:
    """``dim >= k*other`` (``other`` a dim name) or ``dim >= k`` (``other`` None), in the user's dims."""

    dim: str
    k: int
    other: str | None = None

    def __str__(self) -> str:
        if self.other is None:
            return f"{self.dim} >= {self.k}"
        return f"{self.dim} >= {self.other}" if self.k == 1 else f"{self.dim} >= {self.k}*{self.other}"

    def holds(self, sizes: Mapping[str, int]) -> bool:
        """Whether the condition holds at ``sizes`` ({dim: int})."""
        rhs = self.k * (sizes[self.other] if self.other is not None else 1)
        return sizes[self.dim] >= rhs

    def region(self, region: Region, symbols: Mapping[str, sympy.Symbol]) -> tuple[Region, dict]:
        """``region`` restricted by the condition, and the substitution that writes it (dim -> k*other + u)."""
        x = symbols[self.dim]
        lower = dict(region.lower)
        if self.other is None:
            lower[x] = max(lower.get(x, 0), self.k)
            return Region(lower, list(region.guards)), {}
        u = sympy.Symbol(f"_cond_{self.dim}", integer=True, nonnegative=True)
        lower.pop(x, None)
        lower[u] = 0  # x - k*other >= 0: a weaker region than x's own bound too, so the proof stays sound
        return Region(lower, []), {x: self.k * symbols[self.other] + u}


@dataclasses.dataclass
class Decision:
    """``verdict``: ``"keep"`` (never higher, lower somewhere), ``"decline"`` or ``"switch"`` (never
    higher where ``condition`` holds), or ``"undecided"`` (a condition might make it never higher,
    not looked for: ``decide(search=False)``); ``text`` the formula comparison it rests on, in words."""

    verdict: str
    text: str
    condition: Condition | None = None
    # "decline" because both forms have the same peak formulas: the rewrite touches no peak anywhere
    same: bool = False


def candidates(expr: sympy.Expr) -> list[sympy.Expr]:
    """The candidates of a peak: the arguments of its ``Max`` (an outer sum distributed in)."""
    expr = sympy.sympify(expr)
    if isinstance(expr, sympy.Max):
        return [c for a in expr.args for c in candidates(a)]
    if isinstance(expr, sympy.Add):
        maxes = [a for a in expr.args if isinstance(a, sympy.Max)]
        if len(maxes) == 1:
            rest = sympy.Add(*[a for a in expr.args if a is not maxes[0]])
            return [rest + c for c in candidates(maxes[0])]
    return [expr]


def never_higher(after: sympy.Expr, before: sympy.Expr, region: Region, substitution: Mapping | None = None) -> bool:
    """Proven: ``after <= before`` at every size in ``region`` (after ``substitution``)."""
    sub = dict(substitution or {})
    if any(c.has(sympy.Max, sympy.Min) for c in candidates(after) + candidates(before)):
        return False  # a Max inside a sum of Maxes: not written as candidates, so nothing is proven
    lows = [sympy.expand(c.xreplace(sub)) for c in candidates(before)]
    shifted_lows = [region.shifted(terms(low)) if not low.has(*_ATOMS) else None for low in lows]
    for c in candidates(after):
        high = sympy.expand(c.xreplace(sub))
        if not high.has(*_ATOMS):
            shifted = region.shifted(terms(high))
            if any(s is not None and _dominates(s, shifted) for s in shifted_lows):
                continue
            plain = [s for s in shifted_lows if s is not None]
            if any(_under_a_mix(a, b, shifted) for a, b in itertools.combinations(plain, 2)):
                continue
        if not any(_bounded(low, high, region) for low in lows):
            return False
    return True


def _under_a_mix(a: dict, b: dict, c: dict) -> bool:
    """``c <= Max(a, b)`` proven through a mix: ``c <= lam*a + (1 - lam)*b`` for one ``lam`` in [0, 1],
    coefficient by coefficient over the region's offsets (``Max(a, b)`` is at least any such mix).

    No single candidate of the original may bound a rewrite's candidate where the original's peak
    moves from one candidate to another inside the region: ``24*E + 140*N`` is under neither
    ``384*N`` nor ``64*E + 64*N`` alone, but under their mix with ``lam = 5/8`` (the fused message
    passing of a mean aggregator, at every E and N). Terms are shifted (:meth:`Region.shifted`).
    """
    lo, hi = sympy.Integer(0), sympy.Integer(1)
    for m in set(a) | set(b) | set(c):
        slope = sympy.sympify(a.get(m, 0)) - b.get(m, 0)
        rest = sympy.sympify(b.get(m, 0)) - c.get(m, 0)  # lam*slope + rest >= 0 (== 0 for a free sign)
        if _has_free_sign(m):
            if slope == 0:
                if rest != 0:
                    return False
                continue
            lam = -rest / slope
            if not lo <= lam <= hi:
                return False
            lo = hi = lam
            continue
        if slope > 0:
            lo = max(lo, -rest / slope)
        elif slope < 0:
            hi = min(hi, -rest / slope)
        elif rest < 0:
            return False
        if lo > hi:
            return False
    return lo <= hi


def _bounded(low: sympy.Expr, high: sympy.Expr, region: Region) -> bool:
    """``high <= low`` with each ``floor(p/q)`` bounded (``p/q - 1 <= floor(p/q) <= p/q``: above in
    ``high``, below in ``low``, where its coefficient is positive), as one fraction whose numerator
    and denominator have no negative coefficient over the region's offsets."""
    bounded = []
    for expr, up in ((high, True), (low, False)):
        if expr.has(sympy.ceiling, sympy.Mod):
            return False
        out = sympy.Integer(0)
        for term in sympy.Add.make_args(expr):
            atoms = term.atoms(sympy.floor)
            if atoms:
                coeff = term.as_coeff_Mul()[0]
                if len(atoms) > 1 or coeff <= 0:
                    return False
                (f,) = atoms
                term = term.xreplace({f: f.args[0] if up else f.args[0] - 1})
            out += term
        bounded.append(out)
    numer, denom = sympy.fraction(sympy.together(bounded[1] - bounded[0]))
    numer, denom = sympy.expand(numer), sympy.expand(denom)
    if numer.has(*_ATOMS) or denom.has(*_ATOMS):
        return False
    if denom.is_number:
        if denom <= 0:
            return False
    elif not _dominates(region.shifted(terms(denom)), {}) or not region.shifted(terms(denom)):
        return False
    return _dominates(region.shifted(terms(numer)), {})


def decide(pairs: Sequence[tuple[str, sympy.Expr, sympy.Expr]], region: Region,
           symbols: Mapping[str, sympy.Symbol], hints: Mapping[str, int], assume: Condition | None = None,
           search: bool = True) -> Decision:
    """Compare each ``(name, before, after)`` peak formula pair over ``region`` (restricted by
    ``assume``, a condition already taken: then only a stronger one of the same dims can be found).
    ``search=False``: no condition is looked for (the costly part); where one would be, the verdict
    is ``"undecided"``.

    ``hints`` only order the candidate conditions (one that holds at the hints is tried first);
    every verdict is a proof over the region (or the region restricted by the condition).
    """
    where = ", ".join(region.conditions()) or "every size"
    if assume is not None:
        where = f"{where}, {assume}" if where != "every size" else str(assume)
    pairs = [(n, sympy.sympify(b), sympy.sympify(a)) for n, b, a in pairs]
    test_region, sub = assume.region(region, symbols) if assume is not None else (region, {})
    lower = all(never_higher(a, b, test_region, sub) for _, b, a in pairs)
    higher = all(never_higher(b, a, test_region, sub) for _, b, a in pairs)
    shown = "; ".join(f"{n} {a} (was {b})" for n, b, a in pairs)
    if lower and not higher:
        return Decision("keep", f"never higher for every size where the analysis holds ({where}): {shown}")
    if lower and higher:
        return Decision("decline", f"the same peak for every size ({where}): {shown}", same=True)
    if higher:
        return Decision("decline", f"never lower for any size where the analysis holds ({where}): {shown}")
    if not search:
        return Decision("undecided", f"higher somewhere; conditions not looked for ({where}): {shown}")
    found = _conditions(pairs, region, symbols, hints) if assume is None else _stronger(assume, pairs, region, symbols)
    for cond in found:
        return Decision("switch", f"never higher where {cond} (within {where}), higher elsewhere: {shown}", cond)
    return Decision("decline", f"higher somewhere and no condition E >= k*N or N >= c in the dims makes it never "
                               f"higher ({where}): {shown}")


def _proves(cond: Condition, pairs, region: Region, symbols) -> bool:
    sub_region, sub = cond.region(region, symbols)
    return all(never_higher(a, b, sub_region, sub) for _, b, a in pairs)


def _smallest(make, pairs, region, symbols) -> Condition | None:
    """The smallest k for which ``make(k)`` proves the rewrite never higher (doubling, then halving)."""
    k = 1
    while k <= _LIMIT and not _proves(make(k), pairs, region, symbols):
        k *= 2
    if k > _LIMIT:
        return None
    lo, hi = k // 2, k  # hi proves; bisect down (a proof at a smaller k is checked, never assumed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _proves(make(mid), pairs, region, symbols):
            hi = mid
        else:
            lo = mid
    return make(hi)


def _stronger(assume: Condition, pairs, region: Region, symbols):
    make = (lambda k: Condition(assume.dim, max(k, assume.k), assume.other))
    c = _smallest(make, pairs, region, symbols)
    return [c] if c is not None else []


def _conditions(pairs, region: Region, symbols: Mapping[str, sympy.Symbol], hints: Mapping[str, int]):
    used = sorted({str(s) for _, b, a in pairs for s in (b.free_symbols | a.free_symbols)} & set(symbols))
    found: list[Condition] = []
    for x, y in itertools.permutations(used, 2):
        c = _smallest(lambda k, x=x, y=y: Condition(x, k, y), pairs, region, symbols)
        if c is not None:
            found.append(c)
    for x in used:  # a bound on one dim too: the hints pick which of them is taken
        c = _smallest(lambda k, x=x: Condition(x, k), pairs, region, symbols)
        if c is not None:
            found.append(c)
    # hints choose where to look first: a condition that holds at them, then the weakest
    found.sort(key=lambda c: (not c.holds(hints) if set(hints) >= {c.dim, c.other or c.dim} else True, c.k))
    yield from found
