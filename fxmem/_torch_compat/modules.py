"""``torch.nn.Module`` internals: the tables a module keeps its parameters, buffers, children and hooks
in (``_parameters``, ``_buffers``, ``_modules``, ``_forward_hooks`` ..., the global hooks of
``torch.nn.modules.module``), and the initialisers a model's constructor calls (``torch.nn.init``, the
modules' ``reset_parameters``).

fxmem makes a structural copy of a model whose tensors are fake, reorders or takes apart a copy's
children, reads which hooks a call of a module runs, and builds a model with symbolic hyperparameters
while parameter initialisation does nothing.

On a torch upgrade, what breaks here: the names and shapes of those tables, the hook flags
(``_forward_hooks_with_kwargs``, ``_forward_hooks_always_called``, ``_is_full_backward_hook``),
``_non_persistent_buffers_set``, the ``_global_*_hooks`` of ``torch.nn.modules.module``, which module
classes define ``reset_parameters``.

Imports none of the package's other modules.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


# nn.Module's own tables (hooks, flags, non-persistent buffer names), as its constructor makes them
_MODULE_TABLES = tuple(k for k, v in torch.nn.Module().__dict__.items() if isinstance(v, (dict, set)))


def fake_module_copy(module: torch.nn.Module, make: Any, memo: dict | None = None) -> torch.nn.Module:
    """A structural copy of ``module`` whose tensors are ``make(t, trainable)``; ``module`` is untouched.

    Parameters, buffers and plain tensor attributes of every submodule are replaced; shared (tied)
    tensors and modules stay shared. ``trainable`` is True for parameters. Each copy has hook tables
    of its own (holding the same hooks): a hook registered on a copy (``fully_shard``'s) is neither
    registered on ``module`` nor on another copy of it.
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    new = object.__new__(type(module))
    memo[id(module)] = new
    new.__dict__.update(module.__dict__)
    for name in _MODULE_TABLES:
        table = module.__dict__.get(name)
        if isinstance(table, (dict, set)):
            new.__dict__[name] = type(table)(table)

    def fake(t: torch.Tensor | None, trainable: bool) -> torch.Tensor | None:
        if t is None:
            return None
        key = ("t", id(t))
        if key not in memo:
            memo[key] = make(t, trainable)
        return memo[key]

    new.__dict__["_parameters"] = {k: fake(v, True) for k, v in module._parameters.items()}
    new.__dict__["_buffers"] = {k: fake(v, False) for k, v in module._buffers.items()}
    new.__dict__["_modules"] = {k: (fake_module_copy(v, make, memo) if v is not None else None)
                                for k, v in module._modules.items()}
    for k, v in list(new.__dict__.items()):
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            new.__dict__[k] = fake(v, False)
    return new


def order_like(out: torch.nn.Module, model: torch.nn.Module) -> None:
    """Reorder ``out``'s own children, parameters and buffers so those ``model`` also has come in
    ``model``'s order (``out``'s others after them): ``out.parameters()`` then lists shared
    parameters as ``model.parameters()`` does (an optimizer state loaded by position matches)."""
    for table in ("_modules", "_parameters", "_buffers"):
        held, mine = out.__dict__[table], model.__dict__[table]
        ordered = {k: held[k] for k in mine if k in held}
        ordered.update((k, v) for k, v in held.items() if k not in ordered)
        held.clear()
        held.update(ordered)


def pop_child(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """Remove the child ``name`` of ``module`` and return it."""
    return module.__dict__["_modules"].pop(name)


def non_persistent_buffers(module: torch.nn.Module) -> set:
    """Names of ``module``'s own buffers that are left out of its ``state_dict``."""
    return set(module._non_persistent_buffers_set)


def tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Plain tensor attributes (neither parameters nor buffers) of every submodule, by qualified name."""
    found = []
    for prefix, m in module.named_modules():
        for k, v in m.__dict__.items():
            if isinstance(v, torch.Tensor):
                found.append((f"{prefix}.{k}" if prefix else k, v))
    return found


def module_attribute_values(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(qualified name, value)`` of every attribute, buffer and parameter of every submodule."""
    found = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        own = {k: v for k, v in m.__dict__.items() if k not in ("_buffers", "_parameters", "_modules")}
        own.update({**m.__dict__.get("_buffers", {}), **m.__dict__.get("_parameters", {})})
        for k, v in own.items():
            found.append((f"{prefix}.{k}" if prefix else k, v))
    return found


# the hook tables a call of a module consults (each an OrderedDict handle id -> hook), by kind
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hook_tables(module: torch.nn.Module) -> list[tuple[str, dict]]:
    """``(kind, table)`` of ``module``'s own forward and backward hooks (tables present on it)."""
    return [(k.strip("_"), module.__dict__[k]) for k in _HOOK_TABLES if isinstance(module.__dict__.get(k), dict)]


def add_hook(target: torch.nn.Module, source: torch.nn.Module, kind: str, key: int, fn: Any) -> None:
    """Put hook ``fn`` (handle id ``key`` in ``source``'s table ``kind``) on ``target`` the same way:
    its flags (keyword arguments, always called, a full backward hook) go with it."""
    getattr(target, f"_{kind}")[key] = fn
    for flags in (f"_{kind}_with_kwargs", f"_{kind}_always_called"):
        if key in getattr(source, flags, {}):
            getattr(target, flags)[key] = getattr(source, flags)[key]
    if kind == "backward_hooks":
        target._is_full_backward_hook = source._is_full_backward_hook


def global_hook_tables() -> list[tuple[str, dict]]:
    """``(kind, table)`` of the hooks registered for every module (``register_module_forward_hook``)."""
    import torch.nn.modules.module as nn_module

    return [(f"global{k}", getattr(nn_module, f"_global{k}")) for k in _HOOK_TABLES
            if isinstance(getattr(nn_module, f"_global{k}", None), dict)]


def module_hooks(module: torch.nn.Module) -> dict[str, int]:
    """How many forward and backward hooks apply to a call of ``module`` itself (its own and global)."""
    import torch.nn.modules.module as nn_module

    forward = len(module._forward_hooks) + len(module._forward_pre_hooks)
    forward += len(getattr(nn_module, "_global_forward_hooks", {})) + len(getattr(nn_module, "_global_forward_pre_hooks", {}))
    backward = len(module._backward_hooks) + len(getattr(module, "_backward_pre_hooks", {}))
    backward += len(getattr(nn_module, "_global_backward_hooks", {})) + len(getattr(nn_module, "_global_backward_pre_hooks", {}))
    return {"forward": forward, "backward": backward}


# ---------------------------------------------------------------------------------------------
# building a model with symbolic hyperparameters
# ---------------------------------------------------------------------------------------------
def _init_functions() -> list[tuple[Any, str]]:
    import torch.nn.init as init

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    return [(init, n) for n in names]


def _reset_methods() -> list[tuple[Any, str]]:
    import torch.nn.modules as modules

    found = []
    for mod_name in dir(modules):
        mod = getattr(modules, mod_name)
        for cls in vars(mod).values() if isinstance(mod, type(modules)) else []:
            if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
                for meth in ("reset_parameters", "_reset_parameters"):
                    if meth in cls.__dict__:
                        found.append((cls, meth))
    return found


@contextlib.contextmanager
def skip_parameter_init() -> Iterator[None]:
    """Parameter initialisation does nothing (torch.nn.init functions, modules' reset_parameters).

    A patch, not a mode: ``reset_parameters`` does Python arithmetic on sizes (``1 / math.sqrt(fan_in)``)
    that would force a symbolic size to a number, and no torch function mode sees Python arithmetic.
    Scoped to the ``with`` block, which builds one model.
    """
    saved = []
    for owner, name in _init_functions():
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, lambda tensor, *a, **k: tensor)
    for owner, name in _reset_methods():
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, lambda self, *a, **k: None)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
