"""Bytes as people write them and read them: ``parse_bytes("80GiB")``, ``format_bytes(n)``.

The one place fxmem's vocabulary of memory sizes lives, low in the package (it imports only
:mod:`fxmem.errors`), so every stage - budgets in :mod:`fxmem.accounting`, tables in
:mod:`fxmem.views`, the command line - reads and prints bytes the same way.

>>> parse_bytes("32GiB"), parse_bytes("32 GB"), parse_bytes(1024)
(34359738368, 32000000000, 1024)
>>> format_bytes(1023), format_bytes(1024000000)
('1023 B', '976.56 MiB')
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from .errors import SpecError

__all__ = ["parse_bytes", "format_bytes"]

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(budget: Any) -> int:
    """``1024``, ``"512MiB"``, ``"32GB"`` (decimal), ``"80 GiB"`` (binary) -> bytes."""
    if isinstance(budget, bool):
        raise SpecError(f"budget must be bytes or a string like '80GiB', got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise SpecError(f"budget must be positive, got {budget}")
        return budget
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(budget))
    if not m or m.group(2).upper() not in UNITS:
        raise SpecError(f"budget {budget!r}: write bytes as an int or a number with a unit "
                        f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '80GiB'")
    value = int(Fraction(m.group(1)) * UNITS[m.group(2).upper()])  # exact: no float overflow or rounding
    if value <= 0:
        raise SpecError(f"budget {budget!r} is not positive")
    return value


def format_bytes(n: int) -> str:
    """``1023`` -> ``'1023 B'``, ``1024000000`` -> ``'976.56 MiB'`` (binary units)."""
    if abs(int(n)) >= 2**100:  # beyond a float's reach; no memory is this large, but a budget may be
        return f"{int(n) // 2**40:,} TiB"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
