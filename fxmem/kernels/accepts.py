"""Would the real kernel accept this call? A model that cannot run must not get numbers.

Fake (meta) kernels compute output shapes; many do not check what the real CPU kernel checks: that
``mat1`` and ``mat2`` have one dtype (a float64 input into a float32 ``Linear``), that the dtype is
implemented at all (``abs`` on ``bool``), that a layout is supported (a sparse weight in
``addmm``). So every distinct call is also run for real, once, on small real tensors of the same
dtypes and layouts, with the sizes the fake run had evaluated at small values. When the real
kernel raises at the analysis' own example sizes too, the model cannot run, and the analysis is
refused with the kernel's message (:class:`KernelRefuses`, turned into a
:class:`fxmem.errors.KernelError` naming the fx node or source line).

Sizes tried, smallest first: every dim 1, every dim ``min(example, 8)``, the example sizes (only
when the tensors stay small, :data:`PROBE_ELEMENTS`). A failure at a smaller size that goes away
at a larger one is a size limit of the kernel (a 3x3 convolution of a 1x1 image), not a refusal.

>>> check_call(call, env, cache)           # doctest: +SKIP
"""
from __future__ import annotations

import functools
from typing import Any

import sympy
import torch

from .. import _torch_compat as tc
from .registry import Call

PROBE_ELEMENTS = 1 << 22  # elements of all tensors of one probe at the example sizes (16 MiB float32)
_SMALL = 8

aten = torch.ops.aten
# ops whose real run on fresh stand-in tensors would not mean what it means in the model (views and
# metadata see the real storage and strides), that make tensors from nothing, or that only move data
_SKIP = frozenset({
    aten.detach, aten.alias, aten.lift_fresh, aten.lift_fresh_copy, aten._local_scalar_dense, aten.set_,
    aten.resize_, aten.resize_as_, aten.copy_, aten._to_copy, aten.clone, aten.empty_like, aten.zeros_like,
    aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like, aten.new_empty, aten.new_zeros,
    aten.new_ones, aten.new_full, aten.new_empty_strided, aten.empty_strided, aten.contiguous,
    aten.fill_, aten.zero_, aten.sym_size, aten.sym_stride, aten.sym_numel, aten.is_same_size,
    aten._assert_tensor_metadata, aten.normal_, aten.uniform_, aten.bernoulli_, aten.random_,
})


class KernelRefuses(RuntimeError):
    """The real kernel raised on a call the fake kernel accepted."""

    def __init__(self, op: str, kind: str, message: str, sizes: str):
        self.op, self.kind, self.message, self.sizes = op, kind, message, sizes
        super().__init__(f"the real kernel of {op} raises {kind}: {message} (run for real at {sizes}, "
                         f"where the fake kernel gave shapes)")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _skip(func: Any) -> bool:
    if getattr(func, "is_view", False) or tc.op_packet(func) in _SKIP:
        return True
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    return name.startswith("_foreach") or name.startswith("_fused")


def _freeze(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", value.dtype, value.layout, value.device.type,
                tuple(str(tc.raw_expr(d)) for d in value.shape) if value.layout == torch.strided else value.dim())
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", str(value.node.expr))
    try:
        hash(value)
    except TypeError:
        return ("?", id(value))
    return value


def check_call(call: Call, env: Any, cache: dict) -> None:
    """Raise :class:`KernelRefuses` if the real CPU kernel rejects ``call`` (results cached in ``cache``)."""
    if call.device != "cpu" or _skip(call.func) or not call.tensors:
        return
    key = (call.func, _freeze(call.args), _freeze(call.kwargs))
    if key in cache:
        if cache[key] is not None:
            raise cache[key]
        return
    cache[key] = None
    hints = tc.symbol_hints(env)
    sizes = [{s: 1 for s in hints}, {s: min(v, _SMALL) for s, v in hints.items()}, hints]
    try:
        concrete = tuple(_concrete((call.args, call.kwargs), values, limit=PROBE_ELEMENTS) for values in sizes)
        error = _outcome(call.func, concrete, _environment())
    except _Unhashable:  # an argument that cannot be a key: run it here, uncached
        error = _outcome.__wrapped__(call.func, tuple(_concrete((call.args, call.kwargs), values,
                                                                limit=PROBE_ELEMENTS, keyed=False)
                                                      for values in sizes), _environment())
    if error is not None:
        cache[key] = KernelRefuses(call.op, error[0], error[1], _LABELS[-1])
        raise cache[key]


_LABELS = ("every dim 1", f"every dim min(example, {_SMALL})", "the example sizes")


def _environment() -> tuple:
    """What besides the call may decide a real kernel's answer: threads, default dtype, oneDNN."""
    return torch.get_num_threads(), torch.get_default_dtype(), torch.backends.mkldnn.enabled


@functools.lru_cache(maxsize=4096)
def _outcome(func: Any, concrete: tuple, environment: tuple) -> tuple[str, str] | None:
    """``(error type, message)`` when the real kernel raises at the example sizes (the last of
    ``concrete``) and at every smaller size it could run at; None when it accepts one of them.

    A function of the op, the concrete dtypes, layouts and sizes (:func:`_concrete`) and
    :func:`_environment` only, so it is remembered for the process: a model analysed again, or at
    another size in the same region, does not run its kernels again. The stand-ins are made and
    run under a forked RNG: probing never moves the user's random stream.
    """
    error = None
    for label, tree in zip(_LABELS, concrete):
        if tree is None:
            continue
        with tc.real_mode(), torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                args = _build(tree)
            except (TypeError, ValueError, OverflowError):
                continue
            try:
                func(*args[0], **args[1])
                return None
            except Exception as exc:  # noqa: BLE001 - any error of the real kernel
                # keep no reference to the exception: its traceback holds this frame - and the
                # real stand-ins; the caller's frame holds the fake outputs, whose extra
                # references would change what autograd does with them
                error = (type(exc).__name__, first_line(exc), label)
    if error is not None and error[2] == _LABELS[-1]:
        return error[0], error[1]
    return None


def _concrete(tree: Any, values: dict, limit: int, keyed: bool = True) -> Any:
    """``tree`` at sizes ``values``, as a hashable description (tensors as dtype, layout and shape;
    sizes as ints), or None when a size is not a number or the tensors exceed ``limit`` elements.
    :func:`_build` makes the real stand-ins from it. ``keyed``: leaves are kept as they are (no
    hash needed); otherwise an unhashable leaf raises :class:`_Unhashable`."""
    budget = [limit]

    def size(v: Any) -> int:
        e = tc.raw_expr(v) if isinstance(v, torch.SymInt) else sympy.Integer(int(v))
        n = e.xreplace({s: sympy.Integer(x) for s, x in values.items()}) if not e.is_number else e
        n = tc.plain_sympy(n)
        if not n.is_number:
            raise _Skip
        return int(n)

    def describe(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            shape = tuple(size(d) for d in v.shape)
            if any(d < 0 for d in shape):
                raise _Skip
            numel = 1
            for d in shape:
                numel *= d
            budget[0] -= numel
            if budget[0] < 0:
                raise _Skip
            if v.layout not in (torch.strided, torch.sparse_coo, torch.sparse_csr):
                raise _Skip
            return ("tensor", v.dtype, v.layout, shape)
        if isinstance(v, torch.SymInt):
            return ("int", size(v))
        if isinstance(v, torch.SymFloat):
            e = tc.plain_sympy(v.node.expr.xreplace({s: sympy.Integer(x) for s, x in values.items()}))
            if not e.is_number:
                raise _Skip
            return ("float", float(e))
        if isinstance(v, torch.SymBool):
            raise _Skip
        if isinstance(v, (list, tuple)):
            return ("list" if isinstance(v, list) else "tuple", tuple(describe(x) for x in v))
        if isinstance(v, dict):
            return ("dict", tuple((k, describe(x)) for k, x in v.items()))
        if keyed:
            try:
                hash(v)
            except TypeError:
                raise _Unhashable from None
            # the type and repr too: 1, 1.0 and True (or 0.0 and -0.0) are equal keys, not equal arguments
            return ("value", type(v), repr(v) if isinstance(v, (float, complex)) else None, v)
        return ("value", None, None, v)

    try:
        return describe(tree)
    except _Skip:
        return None
    except (TypeError, ValueError, OverflowError):
        return None


def _build(described: Any) -> Any:
    """Real stand-ins for a :func:`_concrete` description: random floats, zero integers."""
    kind = described[0]
    if kind == "tensor":
        _, dtype, layout, shape = described
        if dtype.is_floating_point or dtype.is_complex:
            t = torch.rand(shape, dtype=dtype)
        else:
            t = torch.zeros(shape, dtype=dtype)
        if layout == torch.sparse_coo:
            t = t.to_sparse()
        elif layout == torch.sparse_csr:
            t = t.to_sparse_csr() if t.dim() == 2 else t
        return t
    if kind in ("int", "float"):
        return described[1]
    if kind == "list":
        return [_build(x) for x in described[1]]
    if kind == "tuple":
        return tuple(_build(x) for x in described[1])
    if kind == "dict":
        return {k: _build(x) for k, x in described[1]}
    return described[3]


class _Unhashable(Exception):
    pass


class _Skip(Exception):
    pass

