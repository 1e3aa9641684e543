"""The budget solver: the largest size of one dim that fits a memory budget.

    report.max_size("B", budget="32GiB", N=500)               # forward peak
    report.max_size("B", budget="80GiB", train=True, N=500)   # a whole training step

Each candidate size is checked with the report's exact ``evaluate`` (which re-analyses where
PyTorch takes another code path), so the answer is an exact integer: the returned size fits and
the next one does not. Memory is assumed not to shrink as the dim grows.

The answer is a :class:`MaxSize`, an ``int`` that also says why when it is 0 (``.reason``:
what ``dim=1`` already needs, and how much of that is resident alone - parameters, buffers,
inputs, and in training gradients and optimizer state); a 0 also warns with that reason.

>>> parse_bytes("32GiB"), parse_bytes("32 GB"), parse_bytes(1024)
(34359738368, 32000000000, 1024)
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Sequence

from ..errors import SpecError
from ..units import format_bytes, parse_bytes

_LIMIT = 2**48  # no tensor dim is this large; a budget never exceeded here means memory does not grow


class MaxSize(int):
    """The answer of :func:`max_size`: an ``int``; ``reason`` says why when it is 0 (else None)."""

    reason: str | None = None

    @classmethod
    def of(cls, value: int, reason: str | None = None) -> "MaxSize":
        out = cls(value)
        out.reason = reason
        return out


def _format(n: int) -> str:
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n:,} B)"


def max_size(evaluate: Callable[..., Mapping[str, int]], dims: Sequence[str], dim: str, budget: Any,
             key: str = "peak", start: int = 2, **fixed: int) -> MaxSize:
    """The largest value of ``dim`` whose ``evaluate(**dims)[key]`` fits ``budget`` (bytes).

    Returns ``MaxSize(0)`` with a ``reason`` (and a warning) if even ``dim=1`` does not fit.
    ``dims`` are the analysis' dims; ``fixed`` gives every one but ``dim``.

    The search starts at ``start`` (the analysis' example size of ``dim``; at least 2) and
    doubles or bisects from there; size 1 is evaluated only when the answer may be 1. Where the
    other dims lie outside the formulas' region, ``evaluate`` re-analyses once near the answer
    instead of at size 1 (which PyTorch specialises, so it would need an analysis of its own).
    """
    limit = parse_bytes(budget)
    if dim not in dims:
        raise SpecError(f"max_size(): {dim!r} is not a dim of this analysis; its dims are {sorted(dims)}")
    if dim in fixed:
        raise SpecError(f"max_size(): {dim} is the dim to solve for; do not also fix it")

    def peak(value: int) -> int:
        return evaluate(**fixed, **{dim: value})[key]

    def nothing_fits() -> MaxSize:
        at_one = evaluate(**fixed, **{dim: 1})
        resident_key = "train_resident" if key.startswith("train") else "resident"
        what = "parameters, buffers, inputs and optimizer state" if key.startswith("train") \
            else "parameters, buffers and inputs"
        reason = (f"nothing fits: at {dim}=1 the {key.replace('_', ' ')} is already {_format(int(at_one[key]))}, "
                  f"over the budget of {_format(limit)}; resident alone ({what}) needs "
                  f"{_format(int(at_one[resident_key]))}")
        warnings.warn(f"max_size({dim!r}) = 0: {reason}", stacklevel=4)
        return MaxSize.of(0, reason)

    start = max(2, int(start))
    if peak(start) <= limit:
        fits, too_big = start, start * 2
    else:  # bisect below ``start``, size 1 presumed to fit until the answer comes down to it
        fits, too_big = 1, start
    while fits > 1 and peak(too_big) <= limit:
        fits, too_big = too_big, too_big * 2
        if too_big > _LIMIT:
            if peak(_LIMIT) > peak(1):
                raise SpecError(f"max_size(): every {dim} up to 2**48 fits the budget; it is "
                                f"larger than any memory a size fxmem searches needs")
            raise SpecError(f"max_size(): memory does not grow with {dim}; every size fits the budget")
    while too_big - fits > 1:
        mid = (fits + too_big) // 2
        if peak(mid) <= limit:
            fits = mid
        else:
            too_big = mid
    if fits == 1 and peak(1) > limit:
        return nothing_fits()
    return MaxSize.of(fits)


def min_size(evaluate: Callable[..., Mapping[str, int]], dim: str, candidates: Sequence[int], budget: Any,
             key: str = "peak", why: str = "", **fixed: int) -> MaxSize:
    """The smallest of ``candidates`` (ascending) whose ``evaluate(**fixed, dim=value)[key]`` fits
    ``budget`` (bytes): the fewest ranks, where each rank holds less the more there are. Each
    candidate is evaluated in turn (memory need not fall monotonically: padded shards). ``MaxSize(0)``
    with a ``reason`` (and a warning) where none fits; ``why`` says which values are candidates."""
    limit = parse_bytes(budget)
    if dim in fixed:
        raise SpecError(f"min_size(): {dim} is the dim to solve for; do not also fix it")
    last = None
    for value in candidates:
        last = evaluate(**fixed, **{dim: value})[key]
        if last <= limit:
            return MaxSize.of(value)
    reason = (f"none fits: {dim} = {', '.join(map(str, candidates[:6]))}{', ...' if len(candidates) > 6 else ''}"
              f" ({why}); at {dim}={candidates[-1]} the {key.replace('_', ' ')} is still {_format(int(last))}, over "
              f"the budget of {_format(limit)}" if candidates else f"no {dim} to try ({why})")
    warnings.warn(f"min_size({dim!r}) = 0: {reason}", stacklevel=4)
    return MaxSize.of(0, reason)
