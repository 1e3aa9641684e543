"""The budget solver: the largest size of one dim that fits a memory budget.

    report.max_size("B", budget="32GiB", N=500)               # forward peak
    report.max_size("B", budget="80GiB", train=True, N=500)   # a whole training step

Each candidate size is checked with the report's exact ``evaluate`` (which re-analyses where
PyTorch takes another code path), so the answer is an exact integer: the returned size fits and
the next one does not. Memory is assumed not to shrink as the dim grows.

>>> parse_bytes("32GiB"), parse_bytes("32 GB"), parse_bytes(1024)
(34359738368, 32000000000, 1024)
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

from ..errors import SpecError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_LIMIT = 2**48  # no tensor dim is this large; a budget never exceeded here means memory does not grow


def parse_bytes(budget: Any) -> int:
    """``1024``, ``"512MiB"``, ``"32GB"`` (decimal), ``"80 GiB"`` (binary) -> bytes."""
    if isinstance(budget, bool):
        raise SpecError(f"budget must be bytes or a string like '80GiB', got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise SpecError(f"budget must be positive, got {budget}")
        return budget
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(budget))
    if not m or m.group(2).upper() not in _UNITS:
        raise SpecError(f"budget {budget!r}: write bytes as an int or a number with a unit "
                        f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '80GiB'")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise SpecError(f"budget {budget!r} is not positive")
    return value


def max_size(evaluate: Callable[..., Mapping[str, int]], dims: Sequence[str], dim: str, budget: Any,
             key: str = "peak", **fixed: int) -> int:
    """The largest value of ``dim`` whose ``evaluate(**dims)[key]`` fits ``budget`` (bytes).

    Returns 0 if even ``dim=1`` does not fit. ``dims`` are the analysis' dims; ``fixed`` gives
    every one but ``dim``.
    """
    limit = parse_bytes(budget)
    if dim not in dims:
        raise SpecError(f"max_size(): {dim!r} is not a dim of this analysis; its dims are {sorted(dims)}")
    if dim in fixed:
        raise SpecError(f"max_size(): {dim} is the dim to solve for; do not also fix it")

    def peak(value: int) -> int:
        return evaluate(**fixed, **{dim: value})[key]

    if peak(1) > limit:
        return 0
    fits, too_big = 1, 2
    while peak(too_big) <= limit:
        fits, too_big = too_big, too_big * 2
        if too_big > _LIMIT:
            raise SpecError(f"max_size(): memory does not grow with {dim}; every size fits {budget}")
    while too_big - fits > 1:
        mid = (fits + too_big) // 2
        if peak(mid) <= limit:
            fits = mid
        else:
            too_big = mid
    return fits
