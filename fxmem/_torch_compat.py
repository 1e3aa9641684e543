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

Supported: torch 2.5 and newer.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

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
from torch.utils._python_dispatch import TorchDispatchMode

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
    "storage_key",
    "plain_sympy",
    "fake_cuda_is_safe",
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
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    # FakeTensor's dispatch cache rebuilds outputs through sympy on every hit; measured slower
    # than recomputing for our single pass over each graph.
    mode.cache_enabled = False
    return mode, env


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


def unbacked_symbols(expr: sympy.Expr) -> set[sympy.Symbol]:
    """Symbols created for data-dependent sizes (``nonzero`` ...); they have no example value."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return set(free_unbacked_symbols(expr))


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage: equal for views, ``expired()`` once it is freed."""
    return StorageWeakRef(t.untyped_storage())


def storage_nbytes(t: torch.Tensor) -> Any:
    """Bytes of ``t``'s whole storage (int or SymInt); views share it."""
    return t.untyped_storage().nbytes()


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
_NUMBERS = (bool, int, float, complex, torch.SymInt, torch.SymFloat, torch.SymBool)


def plain_number(value: Any) -> Any:
    """A representative Python number of the same kind (its value never matters, its type does)."""
    if isinstance(value, torch.SymBool):
        return True
    if isinstance(value, torch.SymInt):
        return 1
    if isinstance(value, torch.SymFloat):
        return 1.0
    return value


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
def saved_tensor_hooks(pack: Any) -> Iterator[None]:
    """Call ``pack(t)`` for every tensor autograd saves; the tensor itself is what gets saved."""

    def _pack(t: torch.Tensor) -> torch.Tensor:
        pack(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
        yield


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
    try:
        low = bound_sympy(expr, vr).lower
    except Exception:  # value-range analysis does not know every function
        return None
    try:
        return int(sympy.floor(low))
    except (TypeError, ValueError, OverflowError):
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


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """ATen's ``is_non_overlapping_and_dense`` (the layout condition of in-place reuse)."""
    import torch._prims_common as prims_common

    check = getattr(prims_common, "is_non_overlapping_and_dense", None) or getattr(
        prims_common, "is_non_overlapping_and_dense_or_false")
    return bool(check(t))
