"""Capture by ``torch.fx`` symbolic tracing, that also wraps helper libraries, with errors that point
at the user's source line.

Helper libraries such as einops call into their own backends with a ``Proxy`` and fail; fx's
``autowrap_modules`` turns each of their functions into one graph node instead, which then runs on
fake tensors like any other call.

Tracing runs the model's Python code, so it runs on a copy (sharing the parameters and buffers):
counters, caches and attributes that ``forward`` sets are the copy's, never the user's model's.
Buffers are traced as graph values, so an in-place update of one is recorded, not executed. The
model is traced as it is *called*: its own forward hooks are part of the graph (fx alone would
call ``forward`` and leave them out), as are the hooks of its submodules.

>>> gm = trace(torch.nn.Linear(4, 2))
>>> [n.op for n in gm.graph.nodes]
['placeholder', 'call_module', 'output']
"""
from __future__ import annotations

import copy
import math
import traceback
from types import ModuleType
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from ..caches import private_caches
from ..isolation import isolated
from ..progress import phased
from .. import _torch_compat as tc
from ..errors import TraceError
from .contexts import ModeWatch
from .source import in_library, is_user_file, model_files, raised_at, short_path


def helper_modules() -> tuple[ModuleType, ...]:
    """Modules whose functions become single fx nodes: ``math`` and, when installed, ``einops``."""
    mods: list[ModuleType] = [math]
    try:
        import einops

        mods.append(einops)
    except ImportError:  # einops is optional
        pass
    return tuple(mods)


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf_modules: Sequence[type] = (), called: bool = False):
        super().__init__(autowrap_modules=helper_modules())
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True  # buffer updates in forward are recorded, not run
        self._extra_leaves = tuple(leaf_modules)
        self._called = called
        self._modes = ModeWatch()  # autocast / no_grad inside forward are not recorded: refuse them

    def create_proxy(self, kind: str, target: Any, *args: Any, **kwargs: Any) -> Any:
        if kind in ("call_function", "call_method", "call_module"):
            self._modes.check(type(self.root).__name__)
        return super().create_proxy(kind, target, *args, **kwargs)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if m is self.root:  # called through __call__ for its hooks: trace into it
            return False
        if self._extra_leaves and isinstance(m, self._extra_leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> tuple:
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        if not (self._called and is_module):
            return fn, args
        # the same arguments, through the module's __call__: its hooks run (and are traced) too
        return (lambda root, *rest: torch.nn.Module.__call__(root, *rest)), args


def check_leaf_modules(leaf_modules: Any) -> tuple[type, ...]:
    """``leaf_modules`` as a tuple of nn.Module classes (fx does not trace into them)."""
    if isinstance(leaf_modules, (str, type)) or not isinstance(leaf_modules, (list, tuple, set, frozenset)):
        raise TraceError(f"leaf_modules must be a list of nn.Module classes, e.g. [MyBlock], got {leaf_modules!r}")
    for cls in leaf_modules:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TraceError(f"leaf_modules: {cls!r} is not an nn.Module class; pass the class itself "
                             f"(e.g. leaf_modules=[torch.nn.Linear]), not {type(cls).__name__}")
    return tuple(leaf_modules)


@isolated
@phased("capture")
def trace(model: torch.nn.Module, leaf_modules: Sequence[type] = (),
          concrete_args: Mapping[str, Any] | None = None, keep_stores: bool = False) -> torch.fx.GraphModule:
    """Symbolically trace ``model`` (as it is called, hooks included) into a GraphModule that
    shares its parameters and buffers; ``model`` itself is left as it was.

    ``concrete_args`` fixes arguments the analysis gives no input for (``mask=None``).
    ``keep_stores``: a value the forward stores on a submodule (``self.attn = p_attn``) is stored
    by the graph too (a :func:`store` node), on the modules the graph then has - what a rewrite
    of the model must keep (``fxmem.optimize``); without it such a forward is refused.
    Raises :class:`TraceError` naming the user's ``file:line`` when fx cannot trace it.
    """
    if isinstance(model, torch.fx.GraphModule):
        return model
    leaf_modules = check_leaf_modules(leaf_modules)
    hooks = tc.module_hooks(model)
    if hooks.get("backward"):
        raise TraceError(f"{type(model).__name__} has backward hooks on the model itself, which fx tracing cannot "
                         f"follow; analyse with mode='eager' (the model's own call, hooks included)")
    twin = private_copy(model)
    tracer = _Tracer(leaf_modules, called=bool(hooks.get("forward")))
    try:
        with private_caches([twin]) as caches:  # (fx's Proxies never reach the model code's caches)
            graph = tracer.trace(twin, concrete_args=dict(concrete_args) if concrete_args else None)
    except TraceError:
        raise
    except Exception as exc:  # fx raises many types; all of them mean "cannot trace"
        raise _trace_error(model, exc) from exc
    kept = _check_state(model, twin, keep_stores)
    output = next(n for n in graph.nodes if n.op == "output")
    for name, proxy in kept:  # stored again when the graph runs, after what it stores is computed
        path, _, attr = name.rpartition(".")
        with graph.inserting_before(output):
            graph.call_function(store, (graph.get_attr(path), attr, proxy.node))
    cached = [c.where for c in caches if c.entries]
    if cached:  # a graph would build on every call what the model builds on its first only
        raise TraceError(f"cannot trace {type(model).__name__} faithfully: its forward calls functools.lru_cache "
                         f"functions ({', '.join(cached)}), whose results a graph would compute again on every call "
                         f"(the model builds them on its first call only); analyse the original forward with "
                         f"mode='eager' (mode='auto' does so by itself)")
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    _keep_unread_tensors(gm, tracer.root)
    return gm


def _keep_unread_tensors(gm: torch.fx.GraphModule, root: torch.nn.Module) -> None:
    """Put on ``gm`` the parameters and buffers of ``root`` its graph never reads.

    fx copies only what the graph uses, but the user's model holds the rest in memory all the
    same (a head never called, a pooler): they are resident, and an optimizer built over
    ``model.parameters()`` sees them. The graph's code is unchanged.
    """
    have = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    for kind, named in (("parameter", root.named_parameters(remove_duplicate=False)),
                        ("buffer", root.named_buffers(remove_duplicate=False))):
        for qual, t in list(named):
            if id(t) in have:
                continue
            have.add(id(t))
            *path, leaf = qual.split(".")
            owner: torch.nn.Module = gm
            for part in path:
                child = getattr(owner, part, None)
                if child is None:
                    child = torch.nn.Module()
                    owner.add_module(part, child)
                owner = child
            if not isinstance(owner, torch.nn.Module) or hasattr(owner, leaf):
                continue  # the name means something else on gm: leave gm's own
            if kind == "parameter":
                owner.register_parameter(leaf, t)
            else:
                owner.register_buffer(leaf, t, persistent=False)


@tc.side_effect
def store(module: torch.nn.Module, name: str, value: Any) -> None:
    """``module.name = value``, as the traced forward did (``self.attn = p_attn``): a graph node
    that dead-code elimination keeps (:func:`trace` with ``keep_stores``)."""
    setattr(module, name, value)


def _check_state(model: torch.nn.Module, twin: torch.nn.Module, keep: bool = False) -> list:
    """Refuse a trace whose forward stored a newly computed tensor on a module (``self.seen += 1``
    on a buffer, ``self.cache = h * 2``): the graph does not record the assignment, so it neither
    keeps the stored tensor alive after the call (the model does) nor updates it. Raises
    :class:`TraceError` (mode='auto' then analyses the original forward). With ``keep``, a traced
    value stored as it is on a submodule is returned as ``(name, proxy)`` instead, for the graph
    to store (on the root module, or inside a container, it is refused all the same).

    What costs no memory is allowed - an input kept (``self.last_input = x``), a size or dtype
    (``self.history.append(x.shape[0])``) - and the module gets its value from before the call
    back, so that no proxy of the finished trace is left for the graph to read."""
    stored = [(name, value) for name, value in tc.module_attribute_values(twin) if _proxies(value)]
    kept = [(name, value) for name, value in stored if keep and "." in name and isinstance(value, torch.fx.Proxy)]
    allocating = [(name, p) for name, value in stored for p in _proxies(value)
                  if not _costs_nothing(p.node) and all(name != k for k, _ in kept)]
    if allocating:
        name, proxy = allocating[0]
        line = _user_line(proxy.node.stack_trace or "")
        names = ", ".join(dict.fromkeys(f"self.{n}" for n, _ in allocating))
        raise TraceError(
            f"cannot trace {type(model).__name__} faithfully{f' at {line}' if line else ''}\n  forward stores a "
            f"tensor computed from its inputs on the module ({names}); an fx graph does not record that "
            f"assignment, so it would free (and never update) what the model keeps after the call\n  what to do: "
            f"analyse with mode='eager' (the model's own forward; the default mode='auto' falls back to it by "
            f"itself)")
    originals = dict(tc.module_attribute_values(model))
    for name, _ in stored:
        path, _, attr = name.rpartition(".")
        owner = twin.get_submodule(path) if path else twin
        if name in originals:
            setattr(owner, attr, originals[name])
        else:
            delattr(owner, attr)
    return kept


# a node whose value is a Python size or a tensor's metadata (no storage of its own)
_METADATA = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride", "is_contiguous",
                               "get_device", "element_size"})


def _costs_nothing(node: torch.fx.Node) -> bool:
    """Whether storing ``node``'s value on a module keeps no memory the graph would free: an input,
    a parameter or buffer read as it is, or sizes and metadata (and arithmetic on them)."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op == "call_function":
        if node.target is getattr:
            return len(node.args) > 1 and node.args[1] in _METADATA
        if getattr(node.target, "__module__", None) in ("_operator", "operator", "builtins"):
            args = [a for a in tc.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
            return all(a.op != "placeholder" and a.op != "get_attr" and _costs_nothing(a) for a in args)
    return False


def _proxies(value: Any) -> list:
    """The fx proxies in ``value`` (itself, or inside a list, tuple or dict)."""
    if isinstance(value, torch.fx.Proxy):
        return [value]
    if isinstance(value, (list, tuple, dict)):
        try:
            return [v for v in tc.tree_leaves(value) if isinstance(v, torch.fx.Proxy)]
        except Exception:  # noqa: BLE001 - a container pytree cannot flatten holds no traced value we know of
            return []
    return []


def _user_line(stack_trace: str) -> str:
    """The last ``file:line: code`` of the user's own files in an fx node's stack trace."""
    found = ""
    lines = stack_trace.splitlines()
    for i, text in enumerate(lines):
        text = text.strip()
        if text.startswith('File "'):
            path, _, rest = text[6:].partition('", line ')
            if is_user_file(path):
                code = lines[i + 1].strip() if i + 1 < len(lines) else ""
                found = f"{short_path(path)}:{rest.split(',')[0]}: {code}"
    return found


def private_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose Python state is its own and whose tensors are the model's.

    What ``forward`` does to ``self`` while it is traced (a call counter, a cache, an attribute set
    to an intermediate value) then happens to the copy. Tensors are shared, not copied: no memory.
    """
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    memo.update({id(t): t for _, t in tc.tensor_attributes(model)})
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # an attribute that cannot be copied (a lock, a generator): copy the module tree
        return tc.fake_module_copy(model, lambda t, trainable: t)


def _trace_error(model: torch.nn.Module, exc: BaseException) -> TraceError:
    at = raised_at(exc, model_files(model))
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    library = any(in_library(f) for f in frames) and not any(is_user_file(f) for f in frames)
    where = at or f"{type(model).__name__}.forward ({_defined_at(model)})"
    reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    text = str(exc)
    eager = ("or analyse the original forward with mode='eager' (the default mode='auto' falls back to it by "
             "itself)")
    if at is None or library or " (called from " in at:
        # fx fails on the root forward (a wrapped forward) or inside a library: no leaf or wrap of the
        # user's can help
        advice = "fx symbolic tracing cannot follow this code; analyse the original forward with mode='eager' " \
                 "(the default mode='auto' falls back to it by itself), or capture with torch.compile and " \
                 "fxmem.backend(...)"
    elif "control flow" in text or "bool" in text.lower() and "proxy" in text.lower():
        advice = ("Python control flow depends on a tensor's value or size. Make the branch a leaf module "
                  f"(analyze(..., leaf_modules=[MyBlock])), rewrite it with tensor ops (torch.where), {eager}.")
    elif "cannot be interpreted as an integer" in text or "iterated" in text or "int()" in text:
        advice = ("a size is used as a Python int (range(N), int(N), a loop over a tensor). fx keeps sizes "
                  f"symbolic; use tensor ops, mark the enclosing module as a leaf (leaf_modules=[...]), {eager}.")
    else:
        advice = ("fx symbolic tracing cannot follow this code. Mark the module that contains it as a leaf "
                  f"(analyze(..., leaf_modules=[...])), wrap the function with torch.fx.wrap, {eager}.")
    return TraceError(f"cannot trace {type(model).__name__} at {where}\n  {reason}\n  what to do: {advice}")


def _defined_at(model: torch.nn.Module) -> str:
    """``file:line`` where the model's ``forward`` is defined (its wrapper's target, unwrapped)."""
    import inspect

    try:
        fn = inspect.unwrap(type(model).forward)
        return f"{short_path(inspect.getsourcefile(fn) or '?')}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return "unknown line"
