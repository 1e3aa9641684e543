"""A kernel's size regimes as formulas, not guards: ``when(L >= 768, 256, 32)`` is a sympy
``Piecewise`` over the user's sizes, where ``256 if L >= 768 else 32`` would fix the analysis to
one side of 768 (a ShapeEnv guard) and every size on the other side would cost a new simulation.

Kernel rules (:mod:`fxmem.kernels.cpu`) state ATen's own size thresholds with these helpers; the
accounting (:class:`fxmem.accounting.MemoryPlan`) splits the recording into *pieces*, one per
combination of the branches, each with its conditions in the user's dims and its own formulas.
One simulation then answers every size on every side of every threshold.

>>> qs = when(L >= 768, 256, when(L >= 192, 64, 32))            # doctest: +SKIP
Piecewise((256, s0 >= 768), (64, s0 >= 192), (32, True))
>>> either(x.numel() >= 32768, [OUT, 8, -8], [OUT])               # doctest: +SKIP
[OUT, Piecewise((8, ...), (0, True)), Piecewise((-8, ...), (0, True))]
"""
from __future__ import annotations

from typing import Any, Sequence

import sympy
import torch

from .registry import OUT, OutAt

__all__ = ["when", "either", "condition", "sized"]


def condition(cond: Any) -> bool | sympy.Basic:
    """``cond`` (a bool, or a SymBool from comparing sizes) as True, False or a sympy relation over
    the ShapeEnv's symbols - read without guarding, so the analysis stays valid on both sides."""
    if isinstance(cond, (bool, int)):
        return bool(cond)
    if isinstance(cond, torch.SymBool):
        expr = cond.node.expr
    elif isinstance(cond, sympy.Basic):
        expr = cond
    else:
        return bool(cond)
    if expr is sympy.true or expr == sympy.true:
        return True
    if expr is sympy.false or expr == sympy.false:
        return False
    return expr


def sized(value: Any) -> Any:
    """A size (int, SymInt, or a formula from :func:`when`) as a sympy expression, without guards."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    if isinstance(value, (bool, int)):
        return sympy.Integer(int(value))
    return value


def when(cond: Any, then: Any, otherwise: Any) -> Any:
    """``then`` where ``cond`` holds, else ``otherwise`` (sizes: ints, SymInts or sympy
    expressions); a ``Piecewise`` when ``cond`` depends on symbolic sizes, with no guard."""
    c = condition(cond)
    if c is True:
        return then
    if c is False:
        return otherwise
    a, b = sized(then), sized(otherwise)
    if a == b:
        return then
    return sympy.Piecewise((a, c), (b, True))


def either(cond: Any, program: Sequence[Any], other: Sequence[Any]) -> list:
    """One hidden-allocation program that is ``program`` where ``cond`` holds and ``other`` where it
    does not: each allocation and free becomes ``when(cond, x, 0)`` (or the reverse), and a zero is
    no event (:func:`fxmem.accounting.replay.walk` skips it). Markers (``OUT``) must agree."""
    c = condition(cond)
    if c is True:
        return list(program)
    if c is False:
        return list(other)
    a, b = _segments(program), _segments(other)
    if [m for m, _ in a] != [m for m, _ in b]:
        raise ValueError("either(): both programs must place the outputs alike")
    out: list = []
    for (mark, items_a), (_, items_b) in zip(a, b):
        out += [when(c, p, 0) for p in items_a] + [when(c, 0, p) for p in items_b]
        if mark is not None:
            out.append(mark)
    return [p for p in out if not (isinstance(p, int) and p == 0)]


def _segments(program: Sequence[Any]) -> list[tuple[Any, list]]:
    """``program`` cut at its markers: ``[(marker, items before it), ..., (None, the rest)]``."""
    out, items = [], []
    for p in program:
        if p is OUT or isinstance(p, OutAt):
            out.append((p, items))
            items = []
        else:
            items.append(p)
    return out + [(None, items)]
