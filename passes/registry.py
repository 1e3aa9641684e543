"""The rewrite passes :func:`fxmem.optimize` runs, in order, as data: each is a
:class:`~.base.Pass` (a name, a ``find`` that decides, a ``rewrite`` that applies).

>>> [p.name for p in PASSES]
['pair-linear']
"""
from __future__ import annotations

from . import pair_linear
from .base import Pass

PASSES: tuple[Pass, ...] = (
    # a linear map over pairs [h_i || h_j] -> L1(h_i) + L2(h_j), a broadcast add (GAT attention)
    Pass(pair_linear.RULE, pair_linear.find, pair_linear.rewrite),
)
