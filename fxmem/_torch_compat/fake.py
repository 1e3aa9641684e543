"""Fake tensors and symbolic shapes: ``torch._subclasses.fake_tensor`` (``FakeTensorMode``),
``torch.fx.experimental.symbolic_shapes`` (``ShapeEnv``, size symbols, SymInts, guards),
``torch.utils._sympy`` (torch's own sympy functions, value ranges), and storages' weak references
(``StorageWeakRef``).

PyTorch already propagates sympy shapes through every aten op: running a model on fake tensors whose
sizes are ``SymInt`` gives each storage's size as a sympy expression without allocating anything, and
a storage's weak reference tells when it died, i.e. when the real allocator would free it. torch's
sympy functions (``FloorDiv`` ...) are converted to plain sympy before anything reaches a user.

On a torch upgrade, what breaks here: ``FakeTensorMode.dispatch`` and its process-wide ``cache``, the
view and reshape kernels ``_FakeMode`` short-cuts, the message of a C++ wrapper refusing symbolic
sizes; ``ShapeEnv``'s constructor arguments, ``create_symbol`` / ``create_symintnode``,
``var_to_range``, ``var_to_val`` / ``backed_var_to_val``, ``replacements``, ``guards``; the exception
classes of data-dependent outputs; the names of torch's sympy functions (``_CONVERSIONS``) and
``bound_sympy``; ``UntypedStorage._expired``; torch.optim's ``_foreach_supported_types``.

Imports :mod:`.ops` (op schemas: which ops write, TensorIterator operands) and :mod:`.conv_backend`
(a convolution's backend question, asked without guards where its answer changes nothing).
"""
from __future__ import annotations

import contextlib
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
from torch.multiprocessing.reductions import StorageWeakRef

from ..output_strides import aten_output_strides
from ..view_strides import size_one_strides
from .conv_backend import CONV_OPS, backend_question_unguarded
from .ops import mutates, tensor_iterator_operands


try:  # torch >= 2.1
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
except ImportError:  # pragma: no cover - very old torch
    GuardOnDataDependentSymNode = RuntimeError  # type: ignore[misc,assignment]


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
            if func in CONV_OPS:  # ATen's backend question, unguarded where its answer changes nothing
                with backend_question_unguarded(func):
                    out = super().dispatch(func, types, args, kwargs)
            else:
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


def raw_expr(value: Any) -> sympy.Expr:
    """An int or SymInt as a sympy expression over ShapeEnv symbols (no simplification)."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


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


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage: equal for views, ``expired()`` once it is freed."""
    return StorageWeakRef(t.untyped_storage())


def storage_weakref(storage: Any) -> StorageWeakRef:
    """The weak reference :func:`storage_key` gives for a tensor of ``storage``."""
    return StorageWeakRef(storage)


def expired_keys(cdatas: Any) -> list:
    """Those of ``cdatas`` (``storage_key(t).cdata`` values, kept alive by their StorageWeakRef)
    whose storage was freed: ``StorageWeakRef.expired`` without a Python call per key."""
    expired = torch.UntypedStorage._expired
    return [k for k in cdatas if expired(k)]


def storage_nbytes(t: torch.Tensor) -> Any:
    """Bytes of ``t``'s whole storage (int or SymInt); views share it."""
    return t.untyped_storage().nbytes()


def watch_storage(storage: Any, died: Callable[[Any], None]) -> Any:
    """A ``weakref.ref`` to ``storage`` (an ``untyped_storage()``) calling ``died(ref)`` when the
    storage itself is freed - not when its Python object is dropped: torch keeps a storage's Python
    object alive as long as its C++ storage lives (PyObject preservation), so the callback fires at
    exactly the moment ``StorageWeakRef.expired()`` turns True. Lets a caller hear each death
    instead of scanning every live storage (O(live) per poll)."""
    return weakref.ref(storage, died)


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
