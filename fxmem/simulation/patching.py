"""Attributes of modules and classes replaced while a simulation runs, and put back afterwards.

The simulation wraps a few library functions for its duration (``torch.get_rng_state``, the
libraries' "is this tensor traced?" checks, ``torch.compile`` under a user's step); each is set
back to the original when the run ends, however it ends.

>>> import math
>>> with patched([(math, "pi", 3)]):
...     math.pi
3
>>> round(math.pi, 5)
3.14159
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator


@contextlib.contextmanager
def patched(replacements: Iterable[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set ``owner.name = value`` for each ``(owner, name, value)`` while the block runs; on exit
    (an error included) the original values are set back, the last replaced first."""
    originals = []
    try:
        for owner, name, value in replacements:
            originals.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


__all__ = ["patched"]
