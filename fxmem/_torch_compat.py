"""Every use of private PyTorch API in fxmem lives here, so a torch upgrade touches one file.

What we borrow, and why:

* ``ShapeEnv`` / ``FakeTensorMode`` - PyTorch already propagates sympy shapes through every aten
  op; running a model on fake tensors whose sizes are ``SymInt`` gives us each storage's size as a
  sympy expression without allocating anything.
* ``TorchDispatchMode`` - sees every aten op *below* autograd and composite decompositions, so it
  sees the contiguous copies ``matmul`` makes, not just the fx node that asked for them.
* ``StorageWeakRef`` - tells when a storage has died, i.e. when the real allocator would free it.
* ``torch.utils._sympy.functions`` - PyTorch's own sympy functions (``FloorDiv`` ...), converted to
  plain sympy before anything reaches a user.
* ``torch.utils._pytree`` - the leaves of nested outputs (tuples, dicts, dataclasses).
* op objects (``OpOverload``) and their schemas - kernel rules are keyed by op and read arguments by
  name; ``nn.Module`` internals - a structural copy of a model whose tensors are fake.

``tests/test_torch_compat.py`` fails when any other module of fxmem touches private torch API.

Supported: torch 2.5 and newer.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from typing import Any, Callable, Iterator, Sequence

import sympy
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch._ops import OpOverload, OpOverloadPacket
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode
from .output_strides import aten_output_strides
from .view_strides import size_one_strides

try:  # torch >= 2.1
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
except ImportError:  # pragma: no cover - very old torch
    GuardOnDataDependentSymNode = RuntimeError  # type: ignore[misc,assignment]

__all__ = [
    "DATA_DEPENDENT_ERRORS",
    "UNSUPPORTED_OP_ERRORS",
    "DispatchMode",
    "FakeTensor",
    "new_fake_mode",
    "make_dim_symbol",
    "make_symint",
    "size_expr",
    "shape_guards",
    "symbol_lower_bound",
    "symbol_upper_bound",
    "pinned_dims",
    "storage_key",
    "plain_sympy",
    "fake_cuda_is_safe",
    "matmul_decomposition",
    "order_like",
    "pop_child",
    "op_name",
    "op_packet_name",
    "python_number_in_tensor_slot",
]

DispatchMode = TorchDispatchMode
DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)
UNSUPPORTED_OP_ERRORS: tuple[type[BaseException], ...] = (UnsupportedOperatorException,)


def new_fake_mode() -> tuple[FakeTensorMode, ShapeEnv]:
    """A fake-tensor mode backed by a fresh ShapeEnv.

    ``duck_shape=False``: two dims whose example sizes happen to be equal must stay distinct
    symbols (duck sizing would silently merge ``B`` and ``N``). Inputs that are real tensors are
    converted rather than rejected, so a stray constant cannot abort the analysis.
    """
    try:  # replaying ShapeEnv events is for torch.compile's debugging; we never replay
        env = ShapeEnv(duck_shape=False, should_record_events=False)
    except TypeError:  # pragma: no cover - older torch
        env = ShapeEnv(duck_shape=False)
    mode = _FakeMode(shape_env=env, allow_non_fake_inputs=True)
    return mode, env


class _FakeMode(FakeTensorMode):
    """FakeTensorMode with its dispatch cache used where a hit is cheaper than the fake kernel.

    The cache (keyed by op and the inputs' symbolic metadata; torch's own, the one torch.compile
    uses) rebuilds a hit's outputs from sympy expressions. That is cheaper than recomputing a
    meta kernel or a Python decomposition with symbolic sizes (``native_layer_norm``: ~8 ms per
    call uncached, ~3 ms as a hit; ``addmm`` ~2.7 -> 1.5 ms), but dearer than a view's kernel
    (``detach`` ~0.1 -> 0.5 ms), and ``_unsafe_view`` is never cached (torch bypasses it).
    Measured on a 12-block GPT stack: 1.27 s -> 1.01 s (cache off / on for all ops: 1.20 s).

    Each mode keeps its entries to itself. torch files a call whose inputs have no symbol (a
    parameter's, every call of an analysis at concrete sizes) in one dict for the whole process,
    ``FakeTensorMode.cache``, shared by every fake mode: the user's ``torch.compile`` and every
    earlier analysis. A hit rebuilds the output from what was recorded by whichever mode made the
    entry, under whatever was set then and is not in the key, so one analysis's result could
    depend on what ran before it in the process (it did: a recomputation plan's training-step
    peak came out 532 KiB higher after 619 other tests ran in the process). Here that dict is
    this mode's own while the mode dispatches, and torch's is left as it was.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._views: dict = {}  # (op, input geometry, target shape) -> the view's (sizes, strides, offset)
        self._concrete: dict = {}  # this mode's entries for calls without a symbol (see above)

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        process_wide = FakeTensorMode.cache
        FakeTensorMode.cache = self._concrete
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            FakeTensorMode.cache = process_wide

    def _dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _RESHAPES and not kwargs:
            return self._reshape(func, types, args)
        view = getattr(func, "is_view", False)
        self.cache_enabled = not (view or func in _NOT_CACHED)
        try:
            out = super().dispatch(func, types, args, kwargs)
        except RuntimeError as exc:
            if _CONCRETE_ONLY in str(exc):
                out = self._symbolic_inner_calls(func, types, args, kwargs)
            elif "Expected IntList but got GenericList" in str(exc):
                # a C++ meta kernel that takes int[] where the op's schema says SymInt[] (upsampling's
                # backward, given an input size with a symbol and an output size Python already made a
                # number): fix those sizes at their example values, as an int-only kernel would (the
                # report names every dim that fixes), and run it again
                args, kwargs = _int_lists(args), _int_lists(kwargs or {})
                out = super().dispatch(func, types, args, kwargs)
            else:
                raise
        if view:
            return out
        # ATen's strides at size-1 dims (and empty_like's preserved layout), which kernels read to
        # pick a memory format and Python's references choose otherwise
        if isinstance(out, FakeTensor):
            return _with_aten_strides(func, args, kwargs or {}, out)
        if isinstance(out, tuple) and out and all(isinstance(o, FakeTensor) for o in out):
            return tuple(_with_aten_strides(func, args, kwargs or {}, o) for o in out)
        return out

    def _symbolic_inner_calls(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """The fake kernel again, its inner calls through PyTorch's Python dispatcher. A Python meta
        kernel or decomposition that calls another op with symbolic sizes (``baddbmm``'s meta
        broadcasting ``self`` with ``expand``, linear upsampling's decomposition indexing with
        broadcast indices) reaches that op's C++ composite, which takes sizes as numbers and raises
        (torch 2.13); the Python dispatcher runs the symbolic implementation of the same op, as
        torch.compile's tracing does, so the output (shape, strides) is the meta kernel's own."""
        from torch._dispatch.python import enable_python_dispatcher

        with enable_python_dispatcher():
            return super().dispatch(func, types, args, kwargs)

    def _reshape(self, func: Any, types: Any, args: Any) -> Any:
        """``view`` / ``_unsafe_view``: their fake kernel works the new strides out in Python over
        SymInts (~2-3 ms a call here), and ends in an ``as_strided`` of the input. A view of the
        same geometry (sizes, strides, offset over the same size expressions) into the same shape
        always gets the same strides, and the ShapeEnv's guards only grow, so a repeat re-checks
        nothing new: it becomes that ``as_strided`` directly (~1 ms)."""
        key = _reshape_key(self, func, args)
        hit = self._views.get(key) if key is not None else None
        if hit is not None:
            return torch.ops.aten.as_strided.default(args[0], *hit)
        self.cache_enabled = False
        out = super().dispatch(func, types, args, {})
        a = args[0]
        if isinstance(out, FakeTensor) and isinstance(a, FakeTensor) and out is not a:
            # ATen's strides at size-1 dims, which kernels read to pick a memory format
            fixed = size_one_strides(a.shape, a.stride(), out.shape, out.stride())
            if fixed is not None:
                out = torch.ops.aten.as_strided.default(a, out.shape, fixed, out.storage_offset())
        if (key is not None and isinstance(out, FakeTensor) and out is not a and out.fake_mode is self
                and out.untyped_storage()._cdata == a.untyped_storage()._cdata):
            self._views[key] = (out.size(), out.stride(), out.storage_offset())
        return out


# what a C++ wrapper that takes sizes as numbers says when handed a symbolic size
_CONCRETE_ONLY = "SymIntArrayRef expected to contain only concrete integers"


def _int_lists(values: Any) -> Any:
    """``values`` (args or kwargs) with every list of sizes made plain ints (a guard per SymInt)."""
    def fix(v: Any) -> Any:
        if isinstance(v, (list, tuple)) and v and all(isinstance(d, (int, torch.SymInt)) for d in v) \
                and any(isinstance(d, torch.SymInt) for d in v):
            return type(v)(int(d) for d in v)
        return v
    if isinstance(values, dict):
        return {k: fix(v) for k, v in values.items()}
    return tuple(fix(v) for v in values)


def _with_aten_strides(func: Any, args: tuple, kwargs: dict, out: FakeTensor) -> FakeTensor:
    operands = None if mutates(func) else tensor_iterator_operands(func, args, kwargs)
    fixed = aten_output_strides(func, args, kwargs, operands, out)
    if fixed is None:
        return out
    return torch.ops.aten.as_strided.default(out, out.shape, fixed, out.storage_offset())


_NOT_CACHED = frozenset({torch.ops.aten._unsafe_view.default})
_RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def _reshape_key(mode: Any, func: Any, args: Any) -> tuple | None:
    """What a reshape's result geometry depends on, or None where it is not to be remembered
    (not our fake tensor, a constant, a size the data decides, torch's size-oblivious setting)."""
    if len(args) != 2 or not isinstance(args[0], FakeTensor):
        return None
    a = args[0]
    if a.fake_mode is not mode or a.constant is not None or a.layout != torch.strided:
        return None
    if getattr(torch.fx.experimental._config, "backed_size_oblivious", False):
        return None
    exprs = []
    for v in (*a.size(), *a.stride(), a.storage_offset(), *args[1]):
        if isinstance(v, torch.SymInt):
            e = v.node.expr
            if e.free_symbols and unbacked_symbols(e):
                return None
            exprs.append(e)
        elif isinstance(v, int):
            exprs.append(v)
        else:
            return None
    return (func, a.dtype, a.device, a.dim(), len(args[1]), tuple(exprs))


def make_dim_symbol(env: ShapeEnv, name: str, hint: int) -> sympy.Symbol:
    """A ShapeEnv size symbol standing for the user's dim ``name`` (example value ``hint``)."""
    from torch._dynamo.source import ConstantSource  # imported by fake tensors anyway

    return env.create_symbol(hint, ConstantSource(f"fxmem_dim_{name}"), dynamic_dim=DimDynamic.DYNAMIC)


def make_symint(env: ShapeEnv, expr: sympy.Expr, hint: int) -> Any:
    """A SymInt for ``expr`` (over ShapeEnv symbols), or a plain int if ``expr`` is a number."""
    if expr.is_number:
        return int(expr)
    return env.create_symintnode(expr, hint=hint)


def size_expr(env: ShapeEnv, value: Any) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression over ShapeEnv symbols, with env's facts applied."""
    if isinstance(value, torch.SymInt):
        return env.simplify(value.node.expr)
    if isinstance(value, sympy.Expr):
        return value if value.is_number else env.simplify(value)
    return sympy.Integer(int(value))


def simplify(env: ShapeEnv, expr: sympy.Basic) -> sympy.Basic:
    """``expr`` (a size or a guard) with what the ShapeEnv knows applied."""
    return env.simplify(expr)


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Torch's own log lines about fake-tensor failures stay out of the user's stderr (fxmem reports
    the failure itself, with the node, the line and the user's dims)."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def replacements(env: ShapeEnv) -> dict:
    """What the ShapeEnv found each symbol to equal (a number when it specialised it)."""
    return dict(getattr(env, "replacements", {}))


def shape_guards(env: ShapeEnv) -> list[sympy.Expr]:
    """The boolean facts about sizes that the traced computation relied on."""
    return [g.expr for g in env.guards]


def symbol_lower_bound(env: ShapeEnv, sym: sympy.Symbol) -> int:
    """The smallest value ``sym`` may take under the analysis (2 for size symbols: 0/1 specialise)."""
    vr = env.var_to_range.get(sym)
    if vr is None:
        return 1
    lower = vr.lower
    try:
        return int(lower)
    except (TypeError, ValueError):
        return 1


def symbol_upper_bound(env: ShapeEnv, sym: sympy.Symbol) -> int | None:
    """The largest value ``sym`` may take under the analysis (None: unbounded).

    A guard such as ``B < 64`` refines the symbol's range; the bound is part of where the
    formulas hold even when the guard itself simplifies away.
    """
    vr = env.var_to_range.get(sym)
    if vr is None or not getattr(vr.upper, "is_Integer", False):  # oo / int_oo: unbounded
        return None
    upper = int(vr.upper)
    return upper if upper < 2**62 else None


def pinned_dims(env: ShapeEnv, symbols: dict) -> dict:
    """``{name: value or expression}`` for each user dim the analysis no longer treats as free.

    ``symbols`` maps dim names to what :func:`make_dim_symbol` returned: a number when PyTorch
    specialised the dim on creation (example size 0 or 1), else a ShapeEnv symbol. A symbol is
    pinned when an op forced it to a number (``int(size)`` in a kernel, an equality guard) or
    found it equal to an expression in other symbols (returned over ShapeEnv symbols).
    """
    found = replacements(env)
    out = {}
    for name, sym in symbols.items():
        if not isinstance(sym, sympy.Symbol):
            out[name] = sympy.Integer(int(sym))
            continue
        r = found.get(sym)
        if r is not None and r != sym:
            out[name] = env.simplify(r)
            continue
        upper = symbol_upper_bound(env, sym)
        if upper is not None and upper == symbol_lower_bound(env, sym):
            out[name] = sympy.Integer(upper)
    return out


def pin_symbols(values: Sequence[Any]) -> None:
    """Fix every symbol the SymInts in ``values`` are made of at its example size (a guard each), as
    ``int(size)`` does for a size that is one symbol: where a kernel fixes a product (``B*N``), its
    factors are fixed too, so every expression over them becomes a number."""
    for v in values:
        if not isinstance(v, torch.SymInt):
            continue
        env = v.node.shape_env
        hints = symbol_hints(env)
        for sym in sorted(v.node.expr.free_symbols, key=str):
            hint = hints.get(sym)
            if hint is not None:
                env.evaluate_expr(sympy.Eq(sym, hint))


def known_true(cond: Any) -> bool:
    """Whether a condition on sizes (a bool or a SymBool) holds for every value of its symbols,
    without adding a guard (False where that is not known)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(cond))


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (no data: an analysis, or a tracer, runs it)."""
    return isinstance(t, FakeTensor)


def size_hint(value: Any) -> int:
    """The example value of a size (an int, or a SymInt at the analysis' example sizes)."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    return int(value)


def symbol_hints(env: ShapeEnv) -> dict:
    """``{ShapeEnv symbol: example value}`` of every size symbol of the analysis."""
    values = getattr(env, "backed_var_to_val", None)
    if values is None:
        values = env.var_to_val
    return dict(values)


def unbacked_symbols(expr: sympy.Expr) -> set[sympy.Symbol]:
    """Symbols created for data-dependent sizes (``nonzero`` ...); they have no example value."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return set(free_unbacked_symbols(expr))


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage: equal for views, ``expired()`` once it is freed."""
    return StorageWeakRef(t.untyped_storage())


def expired_keys(cdatas: Any) -> list:
    """Those of ``cdatas`` (``storage_key(t).cdata`` values, kept alive by their StorageWeakRef)
    whose storage was freed: ``StorageWeakRef.expired`` without a Python call per key."""
    expired = torch.UntypedStorage._expired
    return [k for k in cdatas if expired(k)]


def storage_nbytes(t: torch.Tensor) -> Any:
    """Bytes of ``t``'s whole storage (int or SymInt); views share it."""
    return t.untyped_storage().nbytes()


def tree_leaves(tree: Any) -> list:
    """The leaves of a nested structure of tuples, lists, dicts (and registered containers)."""
    return _pytree.tree_leaves(tree)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """``(leaves, structure)`` of a nested structure; :func:`tree_unflatten` puts it back."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    return _pytree.tree_unflatten(leaves, spec)


def torch_release() -> str:
    """This torch's ``major.minor`` (``"2.13"``), as kernel rules state what they were checked on."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def is_op(obj: Any) -> bool:
    """Whether ``obj`` is a torch op (``torch.ops.aten.mm`` or ``torch.ops.aten.mm.default``)."""
    return isinstance(obj, (OpOverload, OpOverloadPacket))


def op_packet(func: Any) -> Any:
    """The op packet of an overload (``aten.mul.Tensor`` -> ``aten.mul``); anything else as it is."""
    return getattr(func, "overloadpacket", func)


def argument_names(op: Any) -> list[str]:
    """The names of an op overload's schema arguments (a packet: its default overload's)."""
    if isinstance(op, OpOverloadPacket):
        op = getattr(op, "default", None) or getattr(op, op.overloads()[0])
    return [a.name for a in op._schema.arguments]


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes into (in-place ops, ``out=``): its schema marks them."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


def bind_arguments(func: Any, args: tuple, kwargs: dict) -> dict:
    """The arguments of one call of ``func`` by schema name, in schema order (only those given)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return dict(kwargs)
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
    return out


def fake_module_copy(module: torch.nn.Module, make: Any, memo: dict | None = None) -> torch.nn.Module:
    """A structural copy of ``module`` whose tensors are ``make(t, trainable)``; ``module`` is untouched.

    Parameters, buffers and plain tensor attributes of every submodule are replaced; shared (tied)
    tensors and modules stay shared. ``trainable`` is True for parameters.
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    new = object.__new__(type(module))
    memo[id(module)] = new
    new.__dict__.update(module.__dict__)

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


def tensor_hooks(t: torch.Tensor) -> list[tuple[str, Any]]:
    """``(kind, hook)`` of a tensor's own gradient hooks (``register_hook``, post-accumulate-grad)."""
    found = []
    for kind, attr in (("gradient", "_backward_hooks"), ("post-accumulate-grad", "_post_accumulate_grad_hooks")):
        table = getattr(t, attr, None)
        found += [(kind, fn) for fn in (table.values() if isinstance(table, dict) else ())]
    return found


def global_hook_tables() -> list[tuple[str, dict]]:
    """``(kind, table)`` of the hooks registered for every module (``register_module_forward_hook``)."""
    import torch.nn.modules.module as nn_module

    return [(f"global{k}", getattr(nn_module, f"_global{k}")) for k in _HOOK_TABLES
            if isinstance(getattr(nn_module, f"_global{k}", None), dict)]


def profiler_active() -> bool:
    """Is a ``torch.profiler`` / autograd profiler session recording in this process?"""
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except AttributeError:  # an older build: the Python flag torch.profiler keeps
        return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def module_hooks(module: torch.nn.Module) -> dict[str, int]:
    """How many forward and backward hooks apply to a call of ``module`` itself (its own and global)."""
    import torch.nn.modules.module as nn_module

    forward = len(module._forward_hooks) + len(module._forward_pre_hooks)
    forward += len(getattr(nn_module, "_global_forward_hooks", {})) + len(getattr(nn_module, "_global_forward_pre_hooks", {}))
    backward = len(module._backward_hooks) + len(getattr(module, "_backward_pre_hooks", {}))
    backward += len(getattr(nn_module, "_global_backward_hooks", {})) + len(getattr(nn_module, "_global_backward_pre_hooks", {}))
    return {"forward": forward, "backward": backward}


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


def op_name(func: Any) -> str:
    """``aten.mm.default`` -> ``aten.mm``; overload kept only when it is not ``default``."""
    name = str(func)
    return name[: -len(".default")] if name.endswith(".default") else name


def op_packet_name(func: Any) -> str:
    """``aten.mul.Tensor`` -> ``aten.mul``."""
    packet = getattr(func, "overloadpacket", None)
    return str(packet) if packet is not None else str(func)


def python_number_in_tensor_slot(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Python numbers passed where the schema wants a ``Tensor``.

    The Python arg parser wraps such a number into a 0-dim CPU tensor before the op runs (a real
    8-byte allocation on CPU); under a dispatch mode it shows up again as the plain number.
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, None)
        if isinstance(value, _NUMBERS) and isinstance(arg.type, torch._C.TensorType):
            found.append(plain_number(value))
    return found


def tensor_iterator_operands(func: Any, args: tuple, kwargs: dict) -> list[tuple[tuple, tuple]] | None:
    """The (sizes, strides) of the operands ATen's TensorIterator gets for ``func``: its tensor
    arguments, and ``((), ())`` for a Python number in a ``Tensor`` slot (wrapped into a 0-dim
    tensor first, as ATen's ``.Scalar`` overloads wrap their ``self``/``other``: ``eq(x, 0)``); None
    where an argument is a list of tensors (not an iterator op)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    found = []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, None)
        if isinstance(value, torch.Tensor):
            found.append((tuple(value.shape), tuple(value.stride())))
        elif isinstance(value, _NUMBERS) and (isinstance(arg.type, torch._C.TensorType) or arg.name in _WRAPPED):
            found.append(((), ()))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return None
    return found


_WRAPPED = frozenset({"self", "other"})


def mutates(func: Any) -> bool:
    """Whether ``func`` writes into an argument (in place or ``out=``)."""
    schema = getattr(func, "_schema", None)
    return schema is None or bool(schema.is_mutable)


def scalar_args(func: Any, args: tuple, kwargs: dict, names: tuple = ("other",)) -> list[Any]:
    """Python numbers passed in the ``Scalar`` slots called ``names`` of ``func``'s schema."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, None)
        if arg.name in names and isinstance(value, _NUMBERS) and isinstance(arg.type, torch._C.NumberType):
            found.append(plain_number(value))
    return found


# Python numbers, and symbolic ones (a SymInt numel passed as a Scalar is wrapped like an int)
NUMBERS = _NUMBERS = (bool, int, float, complex, torch.SymInt, torch.SymFloat, torch.SymBool)


def plain_number(value: Any) -> Any:
    """A representative Python number of the same kind (its value never matters, its type does)."""
    if isinstance(value, torch.SymBool):
        return True
    if isinstance(value, torch.SymInt):
        return 1
    if isinstance(value, torch.SymFloat):
        return 1.0
    return value


def matmul_decomposition() -> Any:
    """ATen's Python decomposition of ``matmul`` (the C++ algorithm, written with symbolic sizes), or
    None where this torch has none."""
    try:
        from torch._decomp import decompositions
    except ImportError:
        return None
    return getattr(decompositions, "matmul", None)


def in_python_backward() -> bool:
    """Whether autograd is running a backward written in Python now (a custom ``autograd.Function``'s):
    its ``x * 0.5`` wraps the number afresh, where a C++ formula passes the wrapped number it saved."""
    node = torch._C._current_autograd_node()
    return isinstance(node, torch.autograd.function.BackwardCFunction)


def upsample_bindings() -> dict:
    """The Python bindings ``F.interpolate`` calls (``torch._C._nn.upsample_bilinear2d`` ...), each with
    its op packet: a binding takes the packet's ``.vec`` overload (an output size or scale factors),
    whose C++ composite reads a given output size as numbers and so refuses symbolic sizes."""
    found = {}
    for name in dir(torch._C._nn):
        packet = getattr(torch.ops.aten, name, None) if "upsample" in name else None
        if packet is not None and "vec" in packet.overloads() and "default" in packet.overloads():
            found[getattr(torch._C._nn, name)] = packet
    return found


def fake_cuda_is_safe() -> tuple[bool, str]:
    """Whether fake ``cuda`` tensors can be made here without aborting the interpreter.

    On a CPU-only build, a fake cuda tensor that requires grad raises a C++ error that kills the
    process (no Python exception to catch), so we refuse before creating one.
    """
    if not torch.backends.cuda.is_built():
        return False, (
            f"this torch ({torch.__version__}) is a CPU-only build, and simulating CUDA needs a CUDA "
            "build (no GPU required)"
        )
    return True, ""


@contextlib.contextmanager
def cuda_memory_history(stacks: str = "all") -> Iterator[Callable[[], dict]]:
    """Record the CUDA caching allocator's history while the block runs; yields a function that
    returns ``torch.cuda.memory._snapshot()`` (the dict pytorch.org/memory_viz opens). ``stacks``:
    "all" (Python and C++ frames) or "python" (much faster to record)."""
    from torch.cuda import memory

    memory._record_memory_history(max_entries=1_000_000, stacks=stacks)
    try:
        yield memory._snapshot
    finally:
        memory._record_memory_history(enabled=None)


def fake_cuda_backward_possible() -> bool:
    """Whether backward can run on fake ``cuda`` tensors here: torch's autograd engine initialises
    the device's context first (pytorch/pytorch#92627: fake tensors create one real CUDA tensor for
    that), which needs a visible GPU."""
    return torch.cuda.is_available()


@contextlib.contextmanager
def saved_tensor_hooks(pack: Any) -> Iterator[None]:
    """Call ``pack(t)`` for every tensor autograd saves; what it returns is what gets saved.

    With hooks, autograd hands a saved *output* to the pack hook with its ``grad_fn`` attached;
    keeping it as is would make a reference cycle (output -> grad_fn -> saved output) that no
    refcount breaks, so a graph nothing can reach any more (after ``.detach()`` or ``argmax``)
    would keep its saved tensors alive. Autograd's own packing saves outputs without their
    ``grad_fn``: ``pack`` should return a detached alias (same storage, same version counter).
    """

    def _pack(t: torch.Tensor) -> torch.Tensor:
        return pack(t)

    with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
        yield


def saved_tensor_hooks_in_effect() -> Any:
    """The innermost ``saved_tensors_hooks`` pair in effect (None when there is none): what
    ``torch.utils.checkpoint`` (non-reentrant) and ``save_on_cpu`` install around their code.
    Returns the string ``"unknown"`` on a torch that cannot tell."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return "unknown"
    try:
        return top(False)
    except TypeError:  # releases whose function takes no argument
        return top()


# ---------------------------------------------------------------------------------------------
# PyTorch's sympy functions -> plain sympy. Looked up by class name, because the set of classes
# (and their modules) moved between torch releases.
# ---------------------------------------------------------------------------------------------
def _floordiv(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return sympy.floor(a / b)


_CONVERSIONS = {
    "FloorDiv": _floordiv,
    "CleanDiv": lambda a, b: a / b,
    "IntTrueDiv": lambda a, b: a / b,
    "FloatTrueDiv": lambda a, b: a / b,
    "CeilDiv": lambda a, b: sympy.ceiling(a / b),
    "ModularIndexing": lambda x, d, m: sympy.Mod(sympy.floor(x / d), m),
    "PythonMod": sympy.Mod,
    "Mod": sympy.Mod,
    "PowByNatural": lambda a, b: a**b,
    "FloatPow": lambda a, b: a**b,
    "IntPow": lambda a, b: a**b,
    "TruncToInt": lambda x: sympy.sign(x) * sympy.floor(sympy.Abs(x)),
    "FloorToInt": sympy.floor,
    "CeilToInt": sympy.ceiling,
    "RoundToInt": lambda x: sympy.floor(x + sympy.Rational(1, 2)),
    "TruncToFloat": lambda x: sympy.sign(x) * sympy.floor(sympy.Abs(x)),
    "ToFloat": lambda x: x,
    "Identity": lambda x: x,
    "Max": sympy.Max,
    "Min": sympy.Min,
    "Where": lambda c, a, b: sympy.Piecewise((a, c), (b, True)),
}


def plain_sympy(expr: sympy.Basic) -> sympy.Basic:
    """Rewrite torch's sympy functions (``FloorDiv`` ...) as standard sympy, bottom up."""
    if not isinstance(expr, sympy.Basic) or expr.is_Atom:
        return expr
    args = [plain_sympy(a) for a in expr.args]
    convert = _CONVERSIONS.get(type(expr).__name__)
    if convert is not None and type(expr).__module__.startswith("torch"):
        return convert(*args)
    if any(a is not b for a, b in zip(args, expr.args)):
        return expr.func(*args)
    return expr


def lower_bound(expr: sympy.Expr, ranges: dict) -> int | None:
    """A proven lower bound of ``expr`` given ``{symbol: (low, high or None)}``, or None."""
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    vr = {s: ValueRanges(lo, sympy.oo if hi is None else hi) for s, (lo, hi) in ranges.items()}
    # torch logs a warning where it gives up on a sub-expression (x**-1 inside floor(c/x)) and
    # bounds it by (-oo, oo); that is an answer here, not a problem to print
    quiet = logging.getLogger("torch.utils._sympy.interp")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        low = bound_sympy(expr, vr).lower
    except Exception:  # value-range analysis does not know every function
        return None
    finally:
        quiet.setLevel(level)
    try:
        return int(sympy.floor(low))
    except (TypeError, ValueError, OverflowError, AttributeError):  # -oo (torch's int_oo): no bound
        return None


def real_mode() -> Any:
    """Context in which no fake/dispatch mode is active, so ops run for real."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def raw_expr(value: Any) -> sympy.Expr:
    """An int or SymInt as a sympy expression over ShapeEnv symbols (no simplification)."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


@contextlib.contextmanager
def optimizers_treat_fake_as_real() -> Iterator[None]:
    """Let torch.optim pick foreach/fused kernels for fake tensors as it would for real ones.

    ``_default_to_fused_or_foreach`` only accepts ``type(p) in _foreach_supported_types``; fake
    tensors would silently get the for-loop implementation (fewer temporaries) even on CUDA.
    """
    import torch.optim.optimizer as optim_mod
    import torch.utils._foreach_utils as foreach_utils

    lists = [getattr(m, "_foreach_supported_types", None) for m in (optim_mod, foreach_utils)]
    lists = [lst for lst in lists if isinstance(lst, list)]
    for lst in lists:
        lst.append(FakeTensor)
    try:
        yield
    finally:
        for lst in lists:
            if FakeTensor in lst:
                lst.remove(FakeTensor)


def cpu_capability() -> str:
    """The vector instruction set ATen's CPU kernels were dispatched to (``"AVX512"``, ``"AVX2"`` ...)."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return str(get()) if get is not None else "unknown"


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``t.suggest_memory_format()`` that works on symbolic strides (channels-last or contiguous)."""
    import torch._prims_common as prims_common

    suggest = getattr(prims_common, "suggest_memory_format", None)
    if suggest is not None:
        return suggest(t)
    return t.suggest_memory_format()  # pragma: no cover - torch < 2.6


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (autograd's view metadata)."""
    return bool(t._is_view())


def tensor_use_count(t: torch.Tensor) -> int:
    """How many C++ owners ``t``'s TensorImpl has (the engine's ``use_count()``; a Python object
    counts once however many Python names it has). Only differences between two tensors passed
    the same way mean something: the dispatcher's own references are in it."""
    return int(t._use_count())


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """ATen's ``is_non_overlapping_and_dense`` (the layout condition of in-place reuse)."""
    import torch._prims_common as prims_common

    check = getattr(prims_common, "is_non_overlapping_and_dense", None) or getattr(
        prims_common, "is_non_overlapping_and_dense_or_false")
    return bool(check(t))


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


def dynamo_example_value(node: Any) -> Any:
    """What TorchDynamo traced a placeholder of its graph with: a FakeTensor whose sizes are
    SymInts (or ints where Dynamo specialised), or a SymInt; None if the graph does not say."""
    return node.meta.get("example_value")


def dynamo_input_sizes(value: Any) -> list[sympy.Expr] | None:
    """The sizes of a Dynamo example tensor as sympy expressions over Dynamo's own symbols."""
    if not isinstance(value, torch.Tensor):
        return None
    return [raw_expr(d) for d in value.shape]


def dynamo_wrapped_number(node: Any, real: Any) -> bool:
    """Whether a Dynamo graph input is a Python float Dynamo wrapped into a 0-d float64 tensor
    (``specialize_float=False``; it makes the tensor at each call and reads it with ``.item()``),
    not a tensor the caller passed (those carry their ``__dict__`` as ``tensor_dict``)."""
    return (isinstance(real, torch.Tensor) and real.dim() == 0 and real.dtype == torch.float64
            and "tensor_dict" not in node.meta)


def dynamo_shape_guards(values: Sequence[Any]) -> list[sympy.Expr]:
    """The size guards TorchDynamo's graph holds under (``s77 <= 10`` after a branch on a size),
    with the sizes it fixed put in (``Eq(s27, 16)`` becomes true and is left out)."""
    env = None
    for v in values:
        sizes = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        env = next((d.node.shape_env for d in sizes if isinstance(d, torch.SymInt)), None)
        if env is not None:
            break
    if env is None:
        return []
    fixed = replacements(env)
    out = []
    for g in env.guards:
        expr = g.expr.xreplace(fixed)
        if expr is not sympy.true and expr != sympy.true:
            out.append(expr)
    return out


def is_higher_order_op(target: Any) -> bool:
    """Whether an fx node's target is a higher-order operator (checkpoint, cond, wrap, ...), which
    runs a subgraph of its own."""
    from torch._ops import HigherOrderOperator

    return isinstance(target, HigherOrderOperator)



# --- torch.distributed: the fake process group, DTensor internals (fxmem.distributed) ---

def distributed_available() -> bool:
    import torch.distributed as dist
    return dist.is_available()


# c10d's process-group state lives in module globals that _World's properties read; a private
# world swaps them all (and the default group) for fresh ones, so that fxmem's fake group never
# shares a name, a map entry or the default slot with a group the user started
_C10D_MAPS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")
_C10D_VALUES = ("_group_count", "_backend", "_default_pg_init_method")
_private_worlds = itertools.count()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int, device: str = "cpu") -> Iterator[Any]:
    """torch's in-process fake process group (backend ``"fake"``: collectives do nothing) of
    ``world_size`` ranks, seen from ``rank``, with a 1-D ``device`` mesh over it.

    It lives in a private copy of c10d's state: a process group the user started (their default
    group, their sub-groups, the names torch's C++ registry resolves them by, ``sys.excepthook``,
    the global rank) is set aside while the fake one runs and is back, untouched, on exit; fxmem's
    groups are shut down and unregistered by name (never ``destroy_process_group``, which would
    unregister every group of the process)."""
    import sys

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved = {n: getattr(c10d, n) for n in (*_C10D_MAPS, *_C10D_VALUES) if hasattr(c10d, n)}
    world, hook = c10d._world, sys.excepthook
    users_rank = dist.get_rank() if dist.is_initialized() else -1
    for name in _C10D_MAPS:
        if name in saved:
            setattr(c10d, name, type(saved[name])())
    c10d._world = c10d._World()
    # default names are str(group_count): start far from the user's so the C++ registry never
    # holds two groups under one name
    c10d._group_count = (1 << 30) + (next(_private_worlds) << 16)
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        yield init_device_mesh(device, (world_size,))
    finally:
        try:
            for pg, name in list(c10d._world.pg_names.items()):
                with contextlib.suppress(Exception):
                    pg.shutdown()
                with contextlib.suppress(Exception):
                    c10d._unregister_process_group(name)
        finally:
            for name, value in saved.items():
                setattr(c10d, name, value)
            c10d._world = world
            sys.excepthook = hook
            torch._C._distributed_c10d._set_global_rank(users_rank)


def dtensor_type() -> type | None:
    """DTensor's class (None where torch.distributed is not built)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4 or no distributed
        return None
    return DTensor


def dtensor_type_if_loaded() -> type | None:
    """DTensor's class if ``torch.distributed.tensor`` was imported (else no DTensor can exist;
    importing it costs a fifth of a second)."""
    import sys
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's data: a DTensor's local shard, else ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


@contextlib.contextmanager
def dtensor_propagation_quiet(quiet: Any) -> Iterator[None]:
    """DTensor's sharding propagation runs each op once on global-shape fake tensors to learn the
    output's metadata; no real run allocates those. ``quiet()`` (a context manager) is entered
    around it, through the hook DTensor itself offers for that section (``_fake_mode_lock``)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    old = ShardingPropagator.__dict__.get("_fake_mode_lock")
    if old is None:
        raise RuntimeError("this torch's DTensor has no ShardingPropagator._fake_mode_lock")

    class _Quiet:
        def __enter__(self) -> None:
            self._cm = quiet()
            self._cm.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return self._cm.__exit__(*exc)

    ShardingPropagator._fake_mode_lock = _Quiet()
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = old


def fsdp1_type() -> type | None:
    import sys
    if "torch.distributed.fsdp" not in sys.modules:  # no FSDP1 module can exist: skip the import
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return FullyShardedDataParallel


def fsdp2_state(module: torch.nn.Module) -> Any:
    """FSDP2's state of a module ``fully_shard`` was applied to (None if it was not)."""
    import sys
    if "torch.distributed.fsdp" not in sys.modules:  # fully_shard was never imported
        return None
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:
        return None
    return _get_module_fsdp_state(module)


def fsdp2_managed(module: torch.nn.Module) -> set[int]:
    """``id()`` of every sharded parameter FSDP2 manages in ``module``'s tree (its own DTensors)."""
    ids: set[int] = set()
    for sub in module.modules():
        state = fsdp2_state(sub)
        if state is None:
            continue
        for group in _fsdp2_param_groups(state):
            for fsdp_param in group.fsdp_params:
                ids.add(id(fsdp_param.sharded_param))
    return ids


def _fsdp2_param_groups(state: Any) -> list:
    groups = list(getattr(state, "_fsdp_param_groups", None) or [])
    if not groups and getattr(state, "_fsdp_param_group", None) is not None:  # torch < 2.10
        groups = [state._fsdp_param_group]
    return groups


# FSDPParamGroup's settings that FSDPModule's setters change after fully_shard (those this torch has)
_FSDP2_KNOBS = ("reduce_grads", "all_reduce_grads", "reshard_after_backward", "reduce_scatter_max_input_buffers",
                "gradient_divide_factor", "reduce_scatter_unused_params", "force_sum_reduction_for_comms",
                "unshard_async_op", "unshard_in_backward")


def fsdp2_groups(root: torch.nn.Module) -> list[dict]:
    """What ``fully_shard`` was applied to in ``root``'s tree, children first, as plain data:
    ``modules`` (the modules of one call), ``mesh``, ``kwargs`` (the call's keyword arguments
    that matter for memory: ``reshard_after_forward``, ``mp_policy``, ``offload_policy``,
    ``placements`` by parameter name), ``knobs`` (settings changed after the call), ``forward``
    / ``backward`` prefetch (module lists), ``unsupported`` (what cannot be recreated, named)."""
    order: list[torch.nn.Module] = []

    def post(m: torch.nn.Module, seen: set) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            post(child, seen)
        order.append(m)
    post(root, set())
    out, done = [], set()
    for m in order:
        state = fsdp2_state(m)
        if state is None or id(state) in done:
            continue
        done.add(id(state))
        groups = _fsdp2_param_groups(state)
        unsupported = []
        if len(groups) > 1:
            unsupported.append("a shard_placement_fn placing parameters on several meshes")
        group = groups[0] if groups else None
        mesh = group.mesh_info.mesh if group is not None else None
        if getattr(state, "_auto_reshard_after_forward", False):
            reshard: Any = None
        elif group is None or group.post_forward_mesh_info is None:
            reshard = False
        elif group.post_forward_mesh_info is group.mesh_info or \
                group.post_forward_mesh_info.mesh is group.mesh_info.mesh:
            reshard = True
        else:
            reshard = int(group.post_forward_mesh_info.shard_mesh_size)
        kwargs: dict = {"reshard_after_forward": reshard, "mp_policy": getattr(state, "_mp_policy", None)}
        placements: dict = {}
        knobs: dict = {}
        if group is not None:
            kwargs["mp_policy"] = group.mp_policy
            kwargs["offload_policy"] = group.offload_policy
            for fp in group.fsdp_params:
                info = fp._module_info
                placements[(id(info.module), info.param_name)] = fp.fsdp_placement
            knobs = {k: getattr(group, k) for k in _FSDP2_KNOBS if hasattr(group, k)}
            if getattr(group, "_all_reduce_hook", None) is not None:
                unsupported.append("an all-reduce hook (set_all_reduce_hook)")
            for attr, default in (("_all_gather_comm", "DefaultAllGather"),
                                  ("_reduce_scatter_comm", "DefaultReduceScatter")):
                comm = getattr(group, attr, None)
                if comm is not None and type(comm).__name__ != default:
                    unsupported.append(f"a custom collective ({type(comm).__name__})")
        out.append(dict(modules=tuple(state._modules), mesh=mesh, kwargs=kwargs, placements=placements,
                        knobs=knobs, unsupported=unsupported,
                        forward=[s._modules[0] for s in getattr(state, "_states_to_forward_prefetch", [])],
                        backward=[s._modules[0] for s in getattr(state, "_states_to_backward_prefetch", [])]))
    return out


def fsdp2_set_knobs(module: torch.nn.Module, knobs: dict) -> None:
    """Give the param group of ``module`` (fully_shard applied) the settings ``knobs``."""
    for group in _fsdp2_param_groups(fsdp2_state(module)):
        for k, v in knobs.items():
            setattr(group, k, v)


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                 "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _from_fsdp(fn: Any) -> bool:
    fn = getattr(fn, "hook", fn)  # _WrappedHook (state-dict hooks)
    fn = getattr(fn, "func", fn)  # functools.partial
    owner = getattr(fn, "__self__", None)
    where = type(owner).__module__ if owner is not None else getattr(fn, "__module__", "") or ""
    return where.startswith("torch.distributed.fsdp")


def fsdp2_unsharded_copy(root: torch.nn.Module) -> torch.nn.Module:
    """``root`` as it was before ``fully_shard``: the same module classes and attributes, each
    sharded parameter a meta tensor of its full size and dtype (no data, no memory), FSDP2's
    classes, hooks and registry entries left out. Other parameters and buffers are ``root``'s
    own tensors (shared, never written: the analysis copies them)."""
    from torch.distributed._composable.contract import REGISTRY_KEY
    from torch.distributed.fsdp import FSDPModule

    _COMPOSABLE_KEY = REGISTRY_KEY[:REGISTRY_KEY.rindex("_")]

    placements: dict = {}
    for sub in root.modules():
        state = fsdp2_state(sub)
        for group in _fsdp2_param_groups(state) if state is not None else []:
            for fp in group.fsdp_params:
                info = fp._module_info
                for m, n in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                    placements[(id(m), n)] = fp
    made: dict[int, torch.nn.Module] = {}
    full: dict[int, torch.nn.Parameter] = {}

    def copy(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) in made:
            return made[id(m)]
        cls = type(m)
        if isinstance(m, FSDPModule):
            cls = cls.__mro__[getattr(FSDPModule, "_orig_cls_mro_index", 2)]
        new = cls.__new__(cls)
        made[id(m)] = new
        d = {k: v for k, v in m.__dict__.items()  # composable APIs' state and registry keys share a prefix
             if not k.startswith(_COMPOSABLE_KEY) and k not in ("_is_fsdp_managed_module", "_fsdp_use_orig_params")}
        for k in _MODULE_HOOKS:  # FSDP2's hooks (all-gather before forward, ...) stay behind
            if isinstance(d.get(k), dict):
                d[k] = type(d[k])((key, hook) for key, hook in d[k].items() if not _from_fsdp(hook))
        kept = {key for k in _MODULE_HOOKS if isinstance(d.get(k), dict) for key in d[k]}
        for k in _HOOK_FLAGS:  # the flags of hooks left behind go with them
            if isinstance(d.get(k), dict):
                d[k] = type(d[k])((key, f) for key, f in d[k].items() if key in kept)
        params = type(m._parameters)()
        for name, p in m._parameters.items():
            fp = placements.get((id(m), name))
            if fp is None:
                params[name] = p
                continue
            if id(fp) not in full:
                full[id(fp)] = torch.nn.Parameter(torch.empty(tuple(fp._orig_size), dtype=fp.sharded_param.dtype,
                                                              device="meta"),
                                                  requires_grad=fp.sharded_param.requires_grad)
            params[name] = full[id(fp)]
        d["_parameters"] = params
        d["_modules"] = type(m._modules)((k, None if c is None else copy(c)) for k, c in m._modules.items())
        object.__setattr__(new, "__dict__", d)
        return new
    return copy(root)


def ddp_settings(model: torch.nn.Module) -> dict:
    """The keyword arguments a ``DistributedDataParallel`` was built with, as far as they decide
    its memory, and ``unsupported``: what fxmem cannot recreate, named."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    kw: dict = {"static_graph": bool(getattr(model, "static_graph", False))}
    # the constructor's flags, read back from the attributes of the same names (those this torch has;
    # broadcast_buffers is deprecated for forward_sync_buffers where that exists)
    for name in ("forward_sync_buffers", "find_unused_parameters", "gradient_as_bucket_view", "batched_grad_copy",
                 "skip_all_reduce_unused_params"):
        if name in accepted and hasattr(model, name):
            kw[name] = getattr(model, name)
    if "forward_sync_buffers" not in kw:
        kw["broadcast_buffers"] = model.broadcast_buffers
    if not getattr(model, "bucket_bytes_cap_default", False):
        kw["bucket_cap_mb"] = model.bucket_bytes_cap / 2 ** 20  # a power of two: exact
    caps = list(getattr(model, "bucket_bytes_cap_list", []) or [])
    if caps and "bucket_cap_mb_list" in accepted:
        kw["bucket_cap_mb_list"] = [c / 2 ** 20 for c in caps]
    unsupported = []
    if getattr(model, "mixed_precision", None) is not None:
        unsupported.append("mixed_precision=")
    if getattr(model, "_comm_hooks", None):
        unsupported.append("a communication hook (register_comm_hook)")
    if getattr(model, "_delay_all_reduce_params", None):
        unsupported.append("parameters whose all-reduce is delayed (delay_all_reduce_named_params=)")
    if getattr(model, "_use_python_reducer", False):
        unsupported.append("the Python reducer")
    return dict(kwargs=kw, ignore=set(getattr(model, "parameters_to_ignore", ()) or ()),
                world_size=model.process_group.size(), rank=model.process_group.rank(), unsupported=unsupported)


@contextlib.contextmanager
def on_storage_resize(callback: Any) -> Iterator[None]:
    """Call ``callback(storage, old_nbytes, new_nbytes)`` after every ``UntypedStorage.resize_``.

    Resizing a storage in place is an allocation (or a free) no aten op shows: FSDP2 frees its
    unsharded parameters with ``untyped_storage().resize_(0)`` and allocates them again with
    ``resize_(nbytes)``. The method is restored on exit."""
    cls = torch.UntypedStorage
    original = cls.__dict__.get("resize_")
    base = cls.resize_

    def resize_(self: Any, size: Any) -> Any:
        old = self.nbytes()
        out = base(self, size)
        callback(self, old, int(size))
        return out

    cls.resize_ = resize_
    try:
        yield
    finally:
        if original is None:
            del cls.resize_
        else:
            cls.resize_ = original


def watch_storage(storage: Any, died: Callable[[Any], None]) -> Any:
    """A ``weakref.ref`` to ``storage`` (an ``untyped_storage()``) calling ``died(ref)`` when the
    storage itself is freed - not when its Python object is dropped: torch keeps a storage's Python
    object alive as long as its C++ storage lives (PyObject preservation), so the callback fires at
    exactly the moment ``StorageWeakRef.expired()`` turns True. Lets a caller hear each death
    instead of scanning every live storage (O(live) per poll)."""
    return weakref.ref(storage, died)


def storage_weakref(storage: Any) -> StorageWeakRef:
    """The weak reference :func:`storage_key` gives for a tensor of ``storage``."""
    return StorageWeakRef(storage)


@contextlib.contextmanager
def ddp_on_fake_tensors() -> Iterator[None]:
    """Let ``DistributedDataParallel(...)`` be built on fake tensors: its start-up checks that every
    rank's parameters have the same shapes and broadcasts rank 0's values (C++ reading the data,
    which fake tensors do not have). Neither keeps memory; both are skipped while building."""
    import torch.nn.parallel.distributed as ddp

    saved = {name: getattr(ddp, name) for name in ("_verify_param_shape_across_processes", "_sync_module_states")
             if hasattr(ddp, name)}
    for name in saved:
        setattr(ddp, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ddp, name, fn)


@contextlib.contextmanager
def fsdp_meshes_outside_fake() -> Iterator[None]:
    """Let ``fully_shard(..., reshard_after_forward=<int>)`` run on fxmem's fake copy: it builds the
    post-forward DeviceMesh (groups of that many ranks) from the mesh's rank tensor, whose values a
    DeviceMesh reads. The mesh is a real tensor fxmem made before the fake mode; this builds the
    sub-mesh with no mode active (a mesh holds ranks, never the model's memory)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard
    except ImportError:  # torch without FSDP2: nothing to patch
        yield
        return
    modules = [m for m in (_fsdp_init, _fully_shard) if hasattr(m, "_get_post_forward_mesh_info")]
    saved = [(m, m._get_post_forward_mesh_info) for m in modules]

    def outside_fake(original: Callable) -> Callable:
        def build(*args: Any, **kwargs: Any) -> Any:
            with real_mode():
                return original(*args, **kwargs)
        return build

    for m, fn in saved:
        m._get_post_forward_mesh_info = outside_fake(fn)
    try:
        yield
    finally:
        for m, fn in saved:
            m._get_post_forward_mesh_info = fn


class _OneStream:
    """A CUDA stream or event where there is no GPU: FSDP2 orders its collectives with streams and
    events, which order work on the device but allocate nothing; the simulation runs in program
    order, which is the order FSDP2's events enforce."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __enter__(self) -> "_OneStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def record(self, *args: Any) -> "_OneStream":
        return self

    def record_event(self, *args: Any) -> "_OneStream":
        return self

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    wait_stream = wait_event = wait = synchronize = _nothing

    def query(self) -> bool:
        return True


class _HostStreams:
    """What FSDP2 reads of ``torch.cuda`` (its "device handle") for a CUDA mesh without a GPU."""

    Stream = Event = _OneStream
    _current = _OneStream()

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def current_stream(*args: Any) -> _OneStream:
        return _HostStreams._current

    @staticmethod
    def stream(s: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def synchronize(*args: Any) -> None:
        return None


@contextlib.contextmanager
def fsdp_without_gpu(device: str) -> Iterator[None]:
    """FSDP2 on a CUDA mesh in a CUDA build of torch with no GPU (fxmem's fake tensors on
    ``device="cuda"``): FSDP2's modules get :class:`_HostStreams` as their CUDA device handle."""
    if device != "cuda" or torch.cuda.is_available():
        yield
        return
    try:
        from torch.distributed.fsdp._fully_shard import (_fsdp_collectives, _fsdp_init, _fsdp_param_group,
                                                         _fsdp_state)
    except ImportError:
        yield
        return
    modules = [m for m in (_fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state)
               if hasattr(m, "_get_device_handle")]
    saved = [(m, m._get_device_handle) for m in modules]

    def handle(device_type: str = "cuda", _original: Callable = saved[0][1] if saved else None) -> Any:
        return _HostStreams if device_type == "cuda" else _original(device_type)

    for m, _ in saved:
        m._get_device_handle = handle
    try:
        yield
    finally:
        for m, fn in saved:
            m._get_device_handle = fn


class _ReducerWithoutRebuild:
    """DDP's reducer, except that it keeps its first bucket assignment: rebuilding it (in the order
    gradients arrived) broadcasts bucket indices as data fake tensors do not have. The rebuilt
    buckets hold the same parameters' bytes, allocated once; only their grouping differs."""

    def __init__(self, reducer: Any):
        object.__setattr__(self, "_reducer", reducer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


class _Made(TorchDispatchMode):
    """Weak references to every tensor an op makes in here (see :func:`tensors_made`)."""

    def __init__(self, into: list) -> None:
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.into.extend(weakref.ref(t) for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def tensors_made() -> Iterator[list]:
    """A list that fills with weak references to the tensors made in here (by any op, also from
    C++: DDP's reducer allocates its buckets and maps in its constructor). Torch keeps a tensor's
    Python object alive as long as C++ holds the tensor, so the references that are alive
    afterwards are the tensors something kept."""
    made: list = []
    with _Made(made):
        yield made


def ddp_reducer_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of a DDP ``model``'s reducer, in its variable order (as
    ``DistributedDataParallel._build_params_for_reducer`` lists them: each module's own parameters
    that require grad and are not ignored, shared ones once)."""
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    seen: set = set()
    out = []
    for name, module in model.module.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{name}.{pname}" not in ignored and p not in seen:
                seen.add(p)
                out.append(p)
    return out


def ddp_used_map(model: torch.nn.Module) -> torch.Tensor | None:
    """The device side of a DDP ``model``'s map of which parameters got a gradient (int32, one per
    reducer parameter), which the reducer keeps where ``static_graph=True`` or
    ``find_unused_parameters=True``; None where it keeps none."""
    try:
        t = model.reducer._get_local_used_map()
    except Exception:  # noqa: BLE001 - a reducer without one (never initialised)
        return None
    return t if isinstance(t, torch.Tensor) and t.numel() else None


class _UsedMapReads(TorchDispatchMode):
    """DDP's reducer reading its used-parameter map on fake tensors (see :func:`ddp_used_map_reads`)."""

    def __init__(self, params: list, device_map: torch.Tensor, host_map: torch.Tensor | None) -> None:
        super().__init__()
        self.params = params
        self.maps = {storage_key(device_map).cdata}
        if host_map is not None:
            self.maps.add(storage_key(host_map).cdata)

    def _is_map(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype == torch.int32 and storage_key(t).cdata in self.maps

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args and self._is_map(args[0]):
            return int(self.params[args[0].storage_offset()].grad is not None)
        if func is torch.ops.aten.copy_.default and len(args) > 1 and self._is_map(args[0]):
            self.maps.add(storage_key(args[1]).cdata)  # the map's other side (host <-> device)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def ddp_used_map_reads(model: torch.nn.Module, host_map: torch.Tensor | None = None) -> Iterator[None]:
    """Let a DDP ``model``'s reducer read its used-parameter map on fake tensors.

    With ``static_graph=True`` or ``find_unused_parameters=True`` the reducer asks, for each
    parameter after backward, ``local_used_map_[i].item() == 0`` ("did parameter i get no
    gradient?") to decide whether to write the reduced bucket back into its ``.grad``. A fake
    tensor has no value; the answer is whether parameter i's ``.grad`` is defined then: a parameter
    that got a gradient this step has one (the map says 1), and one that did not has none after
    ``zero_grad(set_to_none=True)`` (the map says 0). Where a ``.grad`` of zeros was kept
    (``set_to_none=False``) the answer can differ from the map's, but then either answer
    allocates nothing: the bucket is copied into the existing ``.grad``, or it is left alone.
    ``host_map``: the reducer's host-side map where known (the device side is found from the
    reducer, the host side also from the copies between them)."""
    device_map = ddp_used_map(model)
    if device_map is None:
        yield
        return
    with _UsedMapReads(ddp_reducer_params(model), device_map, host_map):
        yield


def ddp_keep_buckets(model: torch.nn.Module) -> None:
    """See :class:`_ReducerWithoutRebuild` (``model`` is fxmem's fake DDP copy)."""
    model.reducer = _ReducerWithoutRebuild(model.reducer)


def fsdp_mem_tracker() -> type:
    """torch's ``FSDPMemTracker`` (``torch.distributed._tools``): its per-rank figures are what
    benchmarks/fsdp.py sets fxmem's beside."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    return FSDPMemTracker


def record_function_ops() -> frozenset:
    """The ops ``torch.profiler.record_function`` enters and exits a label with (every overload)."""
    packets = [getattr(torch.ops.profiler, name, None) for name in ("_record_function_enter_new",
                                                                    "_record_function_exit")]
    return frozenset(getattr(p, n) for p in packets if p is not None for n in p.overloads())


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes of a real DDP model's gradient buckets, as DDP's own logging data counts them (0 if
    ``model`` is not DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return 0
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(v) for v in sizes.split(",") if v.strip())


def dynamo_cache_entries(code: Any) -> int:
    """How many compiled frames TorchDynamo keeps for a code object (0 where this torch cannot say)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - older torch
        return 0
    return len(_debug_get_cache_entry_list(code))


def forget_compiled(code: Any) -> None:
    """Drop what TorchDynamo keeps for ``code`` once a capture is done: its compiled frames, and
    with them the globals Dynamo installed in the frame's module (``__builtins_dict___0``,
    ``__compiled_fn_...``), removed by cleanup hooks when the compiled code dies. Left until
    interpreter exit, those hooks run after the module's dict was cleared and print "Exception
    ignored ... KeyError: '__builtins_dict___0'"; run now, they find their globals."""
    try:
        from torch._dynamo.eval_frame import reset_code
    except ImportError:  # pragma: no cover - older torch
        return
    reset_code(code)


def is_compiled_function(fn: Any) -> bool:
    """Whether ``fn`` is what ``torch.compile`` returns: a function wrapped by TorchDynamo (it keeps
    the original as ``_torchdynamo_orig_callable``), or a compiled module (``OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule
    return isinstance(fn, OptimizedModule) or hasattr(fn, "_torchdynamo_orig_callable")
