"""First-call caches on the model's own modules: what a forward stores on ``self``.

A forward that builds a tensor on its first call and reads it afterwards
(``if self._table is None: self._table = ...``, a dict it fills) costs the build on the first call
only; every later call - what a training loop repeats, what the self-check measures after a warm-up -
starts with the tensor held (resident) and builds nothing. A forward that *replaces* what it stores
on every call (``self.last = h * 2``) is not a cache: each call builds it again.

The simulation tells them apart by running the forward twice on its private copy: after a quiet
first call, the attributes it filled are resident; if the recorded second call leaves them as they
are, they are a cache and the second call is the analysis (:func:`filled`, :func:`replaced`).

>>> before = attribute_tensors(model)              # doctest: +SKIP
>>> model(x); filled(before, attribute_tensors(model))   # doctest: +SKIP
{('', '_table'): (140...,)}
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["attribute_tensors", "filled", "replaced", "tensors_of", "names"]

_TABLES = ("_parameters", "_buffers", "_modules")  # the module's own tables: not what a forward stores


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors ``value`` holds: itself, or the values of a dict, list or tuple (one level)."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [v for v in items if isinstance(v, torch.Tensor)]


def attribute_tensors(model: torch.nn.Module) -> dict[tuple[str, str], tuple[int, ...]]:
    """``(module path, attribute) -> ids`` of the tensors each plain attribute of each submodule
    holds (directly, or in a dict, list or tuple); attributes holding none are left out."""
    out = {}
    for path, m in model.named_modules(remove_duplicate=True):
        for name, value in list(m.__dict__.items()):
            if name in _TABLES:
                continue
            held = _tensors(value)
            if held:
                out[(path, name)] = tuple(id(t) for t in held)
    return out


def filled(before: dict, after: dict) -> dict[tuple[str, str], tuple[int, ...]]:
    """The attributes that hold tensors in ``after`` they did not hold in ``before``."""
    return {k: ids for k, ids in after.items() if not set(ids) <= set(before.get(k, ()))}


def replaced(warm: dict, after: dict) -> list[tuple[str, str]]:
    """Of the attributes a first call ``warm`` filled, those a later call changed (not a cache)."""
    return [k for k, ids in warm.items() if after.get(k) != ids]


def tensors_of(model: torch.nn.Module, keys: dict) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, tensor)`` of the tensors the attributes ``keys`` hold now."""
    out = []
    for path, name in keys:
        value = model.get_submodule(path).__dict__.get(name)
        out += [(_qualified(path, name), t) for t in _tensors(value)]
    return out


def names(keys: Any) -> str:
    """The attributes, as the user wrote them (``self._table`` of the root, ``layers.0._cache``)."""
    return ", ".join(_qualified(path, name) if path else f"self.{name}" for path, name in keys)


def _qualified(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
