"""Paths the data decides: code that chooses how to compute by a size only the data knows.

fxmem's edge-list attention (:mod:`fxmem.ops.edge_attention`) runs over the kept entries of an
adjacency when they are few, and in dense row blocks otherwise. Such code asks :func:`within`
(``count <= upper``?): a real run answers from the value; fxmem's analysis (fake tensors) takes
the path within the bound, and :func:`bound` names the bound with the data dim (``K1 <= N**2/20``,
see :mod:`fxmem.simulation.data_dims`); inside :func:`beyond` it takes the other path - what
``Report.evaluate`` re-analyses when given a larger value. :func:`forced` makes real runs take one
path whatever the data (``optimize`` verifies each), :func:`asked` lists the paths real runs took.

>>> if within(torch.count_nonzero(kept), kept.numel() // 20): ...     # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch

from . import _torch_compat as tc
from .errors import InternalError

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fxmem_data_dims", default=None)
_BEYOND: contextvars.ContextVar = contextvars.ContextVar("fxmem_beyond_paths", default=False)
_FORCED: contextvars.ContextVar = contextvars.ContextVar("fxmem_forced_paths", default=None)
_ASKED: contextvars.ContextVar = contextvars.ContextVar("fxmem_paths_asked", default=None)


def within(count: Any, upper: Any) -> bool:
    """Whether ``count`` (an int, or a 0-dim integer tensor) is at most ``upper``: on a real run, from
    its value (inside :func:`forced`, the path forced: verification runs each); in fxmem's analysis (a
    fake tensor), the path within the bound (see :func:`bound`), except inside :func:`beyond`. Other
    tracers get the value asked of them (a data-dependent guard)."""
    if isinstance(count, torch.Tensor) and tc.is_fake(count):
        if _ACTIVE.get() is not None:
            return not _BEYOND.get()
    side = _FORCED.get()
    taken = bool(count <= upper) if side is None else side
    asked = _ASKED.get()
    if asked is not None:
        asked.append(taken)
    return taken


def bound(size: Any, upper: Any, beyond_text: str, counts: str) -> None:
    """Record that the path taken holds for ``size <= upper`` (``size``: the data dim's SymInt, made
    after :func:`within` answered True); ``beyond_text`` says what the code does above it, ``counts``
    what the size counts. Outside fxmem's analysis it does nothing."""
    dims = _ACTIVE.get()
    if dims is None:
        return
    found = [dims.dims.get(s) for s in tc.unbacked_symbols(tc.raw_expr(size))] if isinstance(size, torch.SymInt) else []
    if not found or None in found or dims.env is None:  # the formulas would not say where they stop holding
        raise InternalError(f"fxmem's analysis took a path that holds up to a bound on a size the data decides, "
                            f"but {size} is not one of the sizes it named; please report this")
    for d in found:
        d.path_upper, d.beyond, d.counts = tc.size_expr(dims.env, upper), beyond_text, counts
        d.example = max(1, min(d.example, dims.example_of(upper) // 2))  # upper may count earlier data dims


def one_element(size: Any) -> bool:
    """``size == 1``, for a kernel rule whose kernel takes another path on one-element tensors. Where
    the size is one the data decides and could be 1, fxmem's analysis takes the general path (False)
    and records that its formulas are not those of that value (``evaluate()`` refuses it)."""
    if isinstance(size, torch.SymInt) and tc.unbacked_symbols(tc.raw_expr(size)):
        if tc.known_true(size != 1):  # 8*K1 is never 1: nothing to record
            return False
        dims = _ACTIVE.get()
        found = [dims.dims.get(s) if dims is not None else None for s in tc.unbacked_symbols(tc.raw_expr(size))]
        if None in found:
            return bool(size == 1)  # not a dim fxmem named: the guard says so
        for d in found:
            d.not_one = True
        return False
    return bool(size == 1)


@contextlib.contextmanager
def _holding(var: contextvars.ContextVar, value: Any) -> Iterator[Any]:
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def active(dims: Any) -> Any:
    """While a run is simulated: the answers of this module go to ``dims`` (a DataDims)."""
    return _holding(_ACTIVE, dims)


def forced(side: bool) -> Any:
    """Real runs inside take the path within every bound (True) or beyond it (False), whatever the data."""
    return _holding(_FORCED, side)


def asked() -> Any:
    """A list of the paths real runs inside took (True: within the bound), one per choice."""
    return _holding(_ASKED, [])


def beyond() -> Any:
    """Analyses made inside take the other path wherever code asks :func:`within`."""
    return _holding(_BEYOND, True)
