"""First-call caches of functions: ``functools.lru_cache`` / ``functools.cache`` in the model's code.

Library code memoises tensors it builds from sizes alone. transformers' BEiT keeps its relative
position index in ``@compile_compatible_method_lru_cache(maxsize=10)`` on
``BeitRelativePositionBias.generate_relative_position_index`` (``modeling_beit.py``): the first
call builds it (arange, meshgrid, stack, ... : temporaries and a ``(Wh*Ww+1)**2`` int64 index), every
later call with the same window size gets the same tensor back. Two consequences for fxmem:

* **Isolation.** Such a cache is process-wide, outside the model: a fake tensor (or an fx Proxy) an
  analysis puts there is what the user's next real call gets back - BEiT then returned FakeTensors
  after ``fxmem.analyze``, and the self-check's real run compared against a run that allocated
  almost nothing. So while fxmem runs, every such cache reachable from the model's classes is
  replaced by a private one (:func:`private_caches`), and the user's is put back untouched.
* **Steady state.** A real run after the first (what a training loop repeats, what the self-check
  compares after a warm-up) finds the tensor in the cache: nothing is built, and the cached tensor
  is held all along - resident memory, not the call's. The simulation therefore calls the forward
  once quietly when the model's code has such caches, and records the second call, with what the
  caches hold counted as resident (:func:`cached_tensors`).

Reachable means: a cache that is an attribute of one of the model's classes (a ``staticmethod``
too), one held in the closure of such a function (transformers' decorator), or a global of the
module that defines such a function. torch's and fxmem's own caches are not the model's.

>>> import functools
>>> class M(torch.nn.Module):
...     @staticmethod
...     @functools.lru_cache(maxsize=4)
...     def table(n):
...         return torch.arange(n)
>>> real = M.__dict__["table"].__func__
>>> with private_caches([M()]) as caches:
...     M.table(3) is M.table(3), M.__dict__["table"].__func__ is real, len(caches)
(True, False, 1)
>>> M.__dict__["table"].__func__ is real, real.cache_info().currsize
(True, 0)
"""
from __future__ import annotations

import collections
import contextlib
import functools
import sys
import types
from typing import Any, Iterable, Iterator

import torch

from . import _torch_compat as tc

__all__ = ["PrivateCache", "private_caches", "cached_tensors"]

_LRU = functools._lru_cache_wrapper  # the C type of functools.lru_cache / functools.cache wrappers


class PrivateCache:
    """An LRU cache of ``original``'s function, fxmem's own for one run: same ``maxsize``, empty at
    the start. Symbolic sizes (SymInt, which Python cannot hash) are keyed by their expression, so
    a cache keyed by sizes works on the simulation's symbolic sizes as it does on ints."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.function = original.__wrapped__
        params = original.cache_parameters() if hasattr(original, "cache_parameters") else {}
        self.maxsize = params.get("maxsize", 128)
        self.entries: collections.OrderedDict = collections.OrderedDict()
        functools.update_wrapper(self, self.function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = (_key(args), _key(tuple(sorted(kwargs.items()))))
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        value = self.function(*args, **kwargs)
        self.entries[key] = value
        if self.maxsize is not None and len(self.entries) > self.maxsize:
            self.entries.popitem(last=False)  # least recently used, as functools does
        return value

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        # an lru_cache'd method (not a staticmethod) binds to its instance, as functools' wrapper does
        return self if obj is None else types.MethodType(self, obj)

    def cache_info(self) -> Any:
        return functools._CacheInfo(0, 0, self.maxsize, len(self.entries))

    def cache_clear(self) -> None:
        self.entries.clear()

    def cache_parameters(self) -> dict:
        return {"maxsize": self.maxsize, "typed": False}

    @property
    def where(self) -> str:
        """``file:line qualname`` of the cached function (for notes)."""
        from .capture.source import short_path

        code = getattr(self.function, "__code__", None)
        at = f"{short_path(code.co_filename)}:{code.co_firstlineno} " if code is not None else ""
        return f"{at}{getattr(self.function, '__qualname__', repr(self.function))}"


# a simulation inside an isolated entry point replaces the entry point's private caches by its own
_CACHES = (_LRU, PrivateCache)


def _key(value: Any) -> Any:
    """``value`` as a hashable cache key: symbolic sizes by their expression, tuples element-wise."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = value.node
        return ("sym", type(value).__name__, str(node.expr)) if not node.is_constant() else node.constant_value()
    if isinstance(value, tuple):
        return tuple(_key(v) for v in value)
    return value


def _foreign(obj: Any) -> bool:
    """Is ``obj`` torch's or fxmem's own (their caches are not the model's)?"""
    return _foreign_module(getattr(obj, "__module__", None) or "")


def _foreign_module(name: str) -> bool:
    return name in ("torch", "fxmem") or name.startswith(("torch.", "fxmem."))  # not torchvision


def _slots(modules: Iterable[torch.nn.Module]) -> list[tuple[Any, Any, Any]]:
    """``(kind, place, name)`` of every lru cache reachable from the classes of ``modules`` and their
    submodules (see the module docstring): ``("class", cls, attr)``, ``("cell", cell, None)`` or
    ``("global", dict, name)``. A library's other caches (transformers' ``is_torch_available``) are
    not reachable so: only functions a model class defines, and those of the module defining it."""
    found: dict[tuple, tuple] = {}
    scanned: set[int] = set()

    def cells(f: Any, depth: int) -> None:
        """The caches in ``f``'s closure (and in its wrapped functions', as a decorator keeps them)."""
        if not isinstance(f, types.FunctionType) or id(f) in scanned or depth > 3 or _foreign(f):
            return
        scanned.add(id(f))
        for cell in f.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, _CACHES):
                found[("cell", id(cell))] = ("cell", cell, None)
            else:
                cells(value, depth + 1)
        cells(getattr(f, "__wrapped__", None), depth + 1)

    classes = {c for root in modules for m in root.modules() for c in type(m).__mro__
               if c is not object and not _foreign(c)}
    for cls in classes:
        for name, value in list(vars(cls).items()):
            inner = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(inner, _CACHES):
                found[("class", id(cls), name)] = ("class", cls, name)
            else:
                cells(inner.fget if isinstance(inner, property) else inner, 0)
    for name in {c.__module__ for c in classes}:
        space = getattr(sys.modules.get(name), "__dict__", {})
        for key, value in list(space.items()):
            if getattr(value, "__module__", None) != name:
                continue  # imported from elsewhere: not this module's code
            if isinstance(value, _CACHES):
                found[("global", id(space), key)] = ("global", space, key)
            else:
                cells(value, 0)  # a module-level function under a caching decorator
    return list(found.values())


def _get(kind: str, place: Any, name: Any) -> Any:
    if kind == "cell":
        return place.cell_contents
    value = vars(place)[name] if kind == "class" else place[name]
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _set(kind: str, place: Any, name: Any, cache: Any) -> None:
    if kind == "cell":
        place.cell_contents = cache
    elif kind == "global":
        place[name] = cache
    else:
        old = vars(place)[name]
        setattr(place, name, type(old)(cache) if isinstance(old, (staticmethod, classmethod)) else cache)


@contextlib.contextmanager
def private_caches(modules: Iterable[torch.nn.Module]) -> Iterator[list[PrivateCache]]:
    """While inside, every lru cache reachable from ``modules``' classes is a fresh
    :class:`PrivateCache`; on exit the originals are back, as they were (nothing fxmem computed
    is in them). Yields the private caches (one per original)."""
    slots = _slots(modules)
    originals = [(slot, _get(*slot)) for slot in slots]
    private: dict[int, PrivateCache] = {}
    for _, original in originals:
        if id(original) not in private:
            private[id(original)] = PrivateCache(original)
    try:
        for slot, original in originals:
            _set(*slot, private[id(original)])
        yield list(private.values())
    finally:
        for slot, original in reversed(originals):
            _set(*slot, original)


def cached_tensors(caches: Iterable[PrivateCache]) -> list[tuple[str, torch.Tensor]]:
    """``(where, tensor)`` of each tensor the caches hold (inside tuples, lists and dicts too)."""
    out = []
    for cache in caches:
        for value in cache.entries.values():
            for t in tc.tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    out.append((cache.where, t))
    return out
