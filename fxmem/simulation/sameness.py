"""Do two values a module holds make its forward compute the same, and allocate the same bytes?

Repeated blocks are simulated once (:mod:`.repeats`) only where their modules are alike. Modules
hold more than tensors and numbers: libraries attach objects that only carry behaviour - a bound
kernel per attention module (Hugging Face's hub kernels: ``_kernel_funcs = {'rotary_pos_emb':
Func()}``, a fresh ``nn.Module`` per layer), a registry of functions, a closure or a
``functools.partial`` made per layer, a method bound to a helper. Python's ``==`` on those is
identity, so two layers built alike compare unequal. :func:`same` compares them by what they run:

* tensors by shape, stride, dtype and trainability (their bytes and their gradients);
* numbers, strings, dtypes, devices and other values that define ``==``: by ``==``;
* containers item by item; functions by code, defaults and captured values; bound methods by
  function and the object bound; ``functools.partial`` by function and arguments;
* modules and plain objects by class and by every attribute (hooks by the functions they call).

Anything it cannot look into (a C object without ``==``) is *not* the same: a pair wrongly taken
as alike would simulate one block for another, a pair wrongly taken as different only costs the
time of simulating every block.

>>> import functools, torch
>>> same(functools.partial(torch.add, alpha=2), functools.partial(torch.add, alpha=2))
True
>>> same(lambda x: x + 1, lambda x: x + 2)
False
"""
from __future__ import annotations

import enum
import functools
import types
from typing import Any

import torch

# values whose == says what they compute
_PLAIN = (type(None), bool, int, float, complex, str, bytes, range, torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size, enum.Enum, type, types.BuiltinFunctionType, types.ModuleType)


def same(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are interchangeable for what a forward computes and allocates."""
    return _same(a, b, set())


def tensor_key(t: torch.Tensor) -> tuple:
    """What of a tensor decides memory: its shape, strides, dtype and trainability."""
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad, isinstance(t, torch.nn.Parameter)


def hook_functions(module: torch.nn.Module) -> dict:
    """A module's own hooks, by kind, as the functions they call (their handles' ids left out)."""
    return {k: tuple(v.values()) for k, v in module.__dict__.items()
            if isinstance(v, dict) and (k.endswith("hooks") or "hooks_" in k)}


def _same(a: Any, b: Any, seen: set) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return tensor_key(a) == tensor_key(b)
    if isinstance(a, _PLAIN):
        return a == b or (a != a and b != b)  # NaN settings are the same setting
    pair = (id(a), id(b))
    if pair in seen:  # a cycle (a helper holding its module): the same unless shown otherwise elsewhere
        return True
    seen.add(pair)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k], seen) for k in a)
    if isinstance(a, (set, frozenset)):
        return _equal(a, b)
    if isinstance(a, types.MethodType):
        return _same(a.__func__, b.__func__, seen) and _same(a.__self__, b.__self__, seen)
    if isinstance(a, types.FunctionType):
        return _same_function(a, b, seen)
    if isinstance(a, functools.partial):
        return all(_same(x, y, seen) for x, y in ((a.func, b.func), (a.args, b.args), (a.keywords, b.keywords)))
    if isinstance(a, torch.nn.Module):
        return _same(_attributes(a), _attributes(b), seen)
    if type(a).__eq__ is not object.__eq__:  # the object says what equal means
        return _equal(a, b)
    if hasattr(a, "__dict__") or hasattr(type(a), "__slots__"):  # an object that carries behaviour
        return _same(_attributes(a), _attributes(b), seen)
    return False


def _same_function(a: types.FunctionType, b: types.FunctionType, seen: set) -> bool:
    """The same code, globals, defaults and captured values (a closure made per layer)."""
    if a.__code__ is not b.__code__ and a.__code__ != b.__code__ or a.__globals__ is not b.__globals__:
        return False
    cells = [(x.cell_contents, y.cell_contents) for x, y in zip(a.__closure__ or (), b.__closure__ or ())
             if _filled(x) and _filled(y)]
    if len(a.__closure__ or ()) != len(cells):
        return False
    return all(_same(x, y, seen) for x, y in ((a.__defaults__, b.__defaults__), (a.__kwdefaults__, b.__kwdefaults__),
                                              *cells, (_function_dict(a), _function_dict(b))))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell: a name the function defines later
        return False
    return True


def _function_dict(f: types.FunctionType) -> dict:
    return {k: v for k, v in f.__dict__.items() if k != "__wrapped__"} if f.__dict__ else {}


def _attributes(obj: Any) -> dict:
    """An object's attributes; a module's hooks as the functions they call."""
    out = dict(getattr(obj, "__dict__", {}))
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out.setdefault(name, getattr(obj, name))
    if isinstance(obj, torch.nn.Module):
        out.update(hook_functions(obj))
    return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object that cannot say (an array's == is elementwise)
        return False
