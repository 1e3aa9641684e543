"""The one bisection fxmem's searches share: the first integer where a monotone test turns true.

A low module (it imports nothing of fxmem), used where a size is searched for: a guard solved
for the dim it bounds (:mod:`fxmem.accounting.conditions`) and the size from which a kernel's
regime holds (``fxmem.passes.optimize``).

>>> first_true(lambda v: v * v >= 50, 0, 100)
8
"""
from __future__ import annotations

from typing import Callable

__all__ = ["first_true"]


def first_true(pred: Callable[[int], bool], low: int, high: int) -> int:
    """The smallest ``v`` in ``(low, high]`` where ``pred(v)``, for ``pred`` false and then true
    (monotone) with ``pred(low)`` false and ``pred(high)`` true, neither evaluated here: a ``low``
    below every value worth testing (0 below the sizes) stands for a false one.

    >>> first_true(lambda v: v >= 3, 0, 8), first_true(lambda v: v >= 1, 0, 8), first_true(bool, 4, 5)
    (3, 1, 5)
    """
    while high - low > 1:
        mid = (low + high) // 2
        if pred(mid):
            high = mid
        else:
            low = mid
    return high
