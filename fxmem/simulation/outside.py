"""Real allocations that never pass through an aten op: library code that makes a real CPU tensor
directly, during the forward, and keeps it.

``torch.utils.checkpoint`` stashes the CPU generator's state (``torch.get_rng_state()``: a real
5 KB tensor) for every checkpointed segment until its backward runs; no dispatch mode sees that
allocation. While a model is simulated, the functions in :data:`OUTSIDE_DISPATCH` are wrapped so
that what they return is recorded like any other allocation of the node that called them, and
freed when it dies.

>>> with outside_dispatch(recorder): model(x)        # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .patching import patched

# (owner, attribute) of functions that return a freshly allocated real tensor
OUTSIDE_DISPATCH = ((torch, "get_rng_state"),)


@contextlib.contextmanager
def outside_dispatch(recorder: Any) -> Iterator[None]:
    """Record the tensors the functions of :data:`OUTSIDE_DISPATCH` allocate (scoped to the run)."""
    wrappers = []
    for owner, name in OUTSIDE_DISPATCH:
        original = getattr(owner, name)

        def wrapper(*args: Any, _original: Any = original, _name: str = f"{owner.__name__}.{name}", **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                recorder.external(out, _name)
            return out

        wrappers.append((owner, name, wrapper))
    with patched(wrappers):
        yield
