"""Would the real kernel accept this call? A model that cannot run must not get numbers.

Fake (meta) kernels compute output shapes; many do not check what the real CPU kernel checks: that
``mat1`` and ``mat2`` have one dtype (a float64 input into a float32 ``Linear``), that the dtype is
implemented at all (``abs`` on ``bool``), that a layout is supported (a sparse weight in
``addmm``). So every distinct call is also run for real, once, on small real tensors of the same
dtypes and layouts, with the sizes the fake run had evaluated at small values. When the real
kernel raises at the analysis' own example sizes too, the model cannot run, and the analysis is
refused with the kernel's message (:class:`KernelRefuses`, turned into a
:class:`fxmem.errors.KernelError` naming the fx node or source line).

Sizes tried, smallest first: the smallest of every dim ``min(example, k)``, k = 1, 2, 4, 8, that
lies inside the region the analysis relied on (every shape guard holds) and gives the call no
zero-size dim, the largest such one, and the example sizes (only when the tensors stay small,
:data:`PROBE_ELEMENTS`). A failure at a smaller size that goes away at a larger one is a size
limit of the kernel (a 3x3 convolution of a 1x1 image), not a refusal. A real kernel is never
handed a zero-size dim the model does not have at the example sizes (some die on it: flash
attention's CPU kernel on an empty key sequence ends the process with SIGFPE), and a call with a
zero-size dim, or of a custom op, runs in a child process (:mod:`.isolated`): a crash there is a
refusal naming the op.

>>> check_call(call, env, cache)           # doctest: +SKIP
"""
from __future__ import annotations

import functools
from typing import Any

import sympy
import torch

from .. import _torch_compat as tc
from .isolated import run_isolated
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
    # its workspace argument is what its forward wrote: a stand-in of the fake's (empty) size makes
    # oneDNN read past it (SIGSEGV). kernels/rnn.py runs it for real after a real forward instead
    *(getattr(aten, n) for n in ("mkldnn_rnn_layer_backward",) if hasattr(aten, n)),
})


class KernelRefuses(RuntimeError):
    """The real kernel raised on a call the fake kernel accepted."""

    def __init__(self, op: str, kind: str, message: str, sizes: str):
        self.op, self.kind, self.message, self.sizes = op, kind, message, sizes
        if self.crashed:
            super().__init__(f"the real kernel of {op} {'kills the process running it' if kind == 'crash' else kind}"
                             f" ({message}) when run for real at {sizes} on stand-in tensors of the shapes and "
                             f"dtypes the fake kernel gave (fxmem ran it in a separate process)")
        else:
            super().__init__(f"the real kernel of {op} raises {kind}: {message} (run for real at {sizes}, "
                             f"where the fake kernel gave shapes)")

    @property
    def crashed(self) -> bool:
        """The kernel died or hung instead of raising (see :mod:`.isolated`)."""
        return self.kind in ("crash", "does not return")


class FakeKernelFails(RuntimeError):
    """The fake (meta) kernel raised on a call the real kernel accepts at the same sizes: a limit
    of PyTorch's fake tensors, not of the user's input (see :func:`real_accepts`)."""

    def __init__(self, op: str, error: BaseException, sizes: str):
        self.op, self.error, self.sizes = op, error, sizes
        super().__init__(f"PyTorch's fake kernel of {op} raises {type(error).__name__}: {first_line(error)}; the real "
                         f"kernel accepts the same call (run for real at {sizes})")


def real_accepts(call: Call, env: Any) -> str | None:
    """Where the real CPU kernel accepts ``call`` (a call its fake kernel raised on): the label of
    the sizes it ran at (the example sizes, or smaller ones inside the region), or None when it
    raises at all of them or cannot be run (CUDA, a foreign op, tensors too large)."""
    if call.device != "cpu" or _skip(call.func) or _foreign(call.func) or not call.tensors:
        return None
    hints = tc.symbol_hints(env)
    tree = (call.args, call.kwargs)
    points = [(EXAMPLE, hints)] + _small_points(env, hints, {})
    for label, values in points:
        described = _concrete(tree, values, limit=PROBE_ELEMENTS, keyed=False)
        if described is None or described[1]:  # no zero-size dims here: never isolated, never fatal
            continue
        with tc.real_mode(), torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                args = _build(described[0])
                call.func(*args[0], **args[1])
                return label
            except Exception:  # noqa: BLE001 - the real kernel refuses too
                continue
    return None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# fxmem's fused attention with dropout draws from the generator (a run on stand-ins would move the
# user's random stream) or from a generator state it was given (a stand-in is no valid state); its
# blocks are those of fxmem::masked_attention, which is run. The edge list's dropout likewise (its
# sorted edge list is no stand-in either; tests/kernels/test_edge_attention.py runs it against the allocator)
_SKIP_NAMES = frozenset({"fxmem::masked_attention_dropout", "fxmem::masked_attention_dropout_backward",
                         "fxmem::edge_dropout", "fxmem::edge_dropout_backward"})


def _skip(func: Any) -> bool:
    if getattr(func, "is_view", False) or tc.op_packet(func) in _SKIP:
        return True
    if getattr(func, "name", lambda: "")() in _SKIP_NAMES:
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
    points = [(label, values) for label, values in _small_points(env, hints, cache)] + [(EXAMPLE, hints)]
    tree = (call.args, call.kwargs)
    foreign = _foreign(call.func)
    try:
        concrete = _choose(tuple((label, _concrete(tree, values, limit=PROBE_ELEMENTS)) for label, values in points))
        error = _outcome(call.func, concrete, _environment(), foreign)
    except _Unhashable:  # an argument that cannot be a key: run it here, uncached
        concrete = _choose(tuple((label, _concrete(tree, values, limit=PROBE_ELEMENTS, keyed=False))
                                 for label, values in points))
        error = _outcome.__wrapped__(call.func, concrete, _environment(), foreign)
    if error is not None:
        cache[key] = KernelRefuses(call.op, error[0], error[1], error[2])
        raise cache[key]


EXAMPLE = "the example sizes"
_STEPS = (1, 2, 4, _SMALL)  # every dim min(example, k): the smaller probes, smallest first


def _small_points(env: Any, hints: dict, cache: dict) -> list[tuple[str, dict]]:
    """The sizes ``{symbol: min(example, k)}`` (k in :data:`_STEPS`) that lie inside the region the
    analysis has relied on so far (every shape guard holds there), smallest first.

    A point outside the region is not a size the model runs at: ``S=1`` makes ``S//4`` zero, and a
    guarded ``(S//4)**2 // (S//4)`` divides by zero there. Guards only grow during a simulation, so
    each point keeps how many guards it passed (``cache``: the recorder's, one per simulation)."""
    state = cache.get(_POINTS)
    if state is None or state[0] != hints:
        candidates: list = []
        for k in _STEPS:
            values = {s: min(int(v), k) for s, v in hints.items()}
            if values != hints and values not in [c[1] for c in candidates]:
                candidates.append((f"every dim min(example, {k})", values))
        state = cache[_POINTS] = [hints, candidates, [True] * len(candidates), 0]
    _, candidates, valid, checked = state
    guards = tc.shape_guards(env)
    for g in guards[checked:]:
        for i, (_, values) in enumerate(candidates):
            if valid[i] and not _holds(g, values):
                valid[i] = False
    state[3] = len(guards)
    return [point for point, ok in zip(candidates, valid) if ok]


_POINTS = "probe points"  # the cache's entry for :func:`_small_points` (the other keys are tuples)


def _holds(guard: Any, values: dict) -> bool:
    """Whether a shape guard is true at ``values`` (False where it cannot be decided there)."""
    try:
        result = guard.xreplace({s: sympy.Integer(v) for s, v in values.items()})
    except (ZeroDivisionError, TypeError, ValueError, OverflowError):
        return False
    return result is sympy.true


def _choose(concrete: tuple) -> tuple:
    """The probes to run, smallest first: the smallest point where the call has no zero-size dim,
    the largest such one below the example, and the example sizes (zero-size dims allowed there:
    the model itself runs them; :func:`_outcome` isolates them). At most three real runs."""
    small = [(label, tree) for label, tree in concrete[:-1] if tree is not None and not tree[1]]
    chosen = small[:1] + small[1:][-1:]
    label, tree = concrete[-1]
    return tuple(chosen + ([(label, tree)] if tree is not None else []))


def _foreign(func: Any) -> bool:
    """An op from outside PyTorch's own namespaces (a custom op, an extension's C++ kernel): its
    real kernel may not check its input, so it only ever runs isolated."""
    namespace = getattr(func, "namespace", None) or getattr(getattr(func, "overloadpacket", None), "namespace", "")
    return namespace not in ("aten", "prims")


def _environment() -> tuple:
    """What besides the call may decide a real kernel's answer: threads, default dtype, oneDNN."""
    return torch.get_num_threads(), torch.get_default_dtype(), torch.backends.mkldnn.enabled


@functools.lru_cache(maxsize=4096)
def _outcome(func: Any, concrete: tuple, environment: tuple, foreign: bool = False) -> tuple[str, str, str] | None:
    """``(error type, message, sizes)`` when the real kernel raises (or dies) at the example sizes
    (the last of ``concrete``) and at every smaller size it could run at; None when it accepts one
    of them.

    A function of the op, the concrete dtypes, layouts and sizes (:func:`_concrete`) and
    :func:`_environment` only, so it is remembered for the process: a model analysed again, or at
    another size in the same region, does not run its kernels again. The stand-ins are made and
    run under a forked RNG: probing never moves the user's random stream. A foreign op, or a call
    with a zero-size dim, runs in a child process (:mod:`.isolated`): a kernel that dies there is
    an answer (a crash), not the end of the user's interpreter.
    """
    error = None
    for label, (tree, zero) in concrete:
        with tc.real_mode(), torch.random.fork_rng(devices=[]), torch.no_grad():
            if foreign or zero:
                answer = run_isolated(functools.partial(_run, func, tree))
                if answer is None or answer[0] == "ok":  # None: cannot isolate here, so it is not run
                    return None
                if answer[0] == "raises":
                    kind, _, message = answer[1].partition(": ")
                else:
                    kind, message = "crash" if answer[0] == "crash" else "does not return", answer[1]
                error = (kind, message or kind, label)
                continue
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
    if error is not None and error[2] == EXAMPLE:
        return error
    return None


def _run(func: Any, tree: Any) -> None:
    args = _build(tree)
    func(*args[0], **args[1])


def _concrete(tree: Any, values: dict, limit: int, keyed: bool = True) -> Any:
    """``(description, zero)``: ``tree`` at sizes ``values`` as a hashable description (tensors as
    dtype, layout and shape; sizes as ints) and whether a tensor dim or a symbolic size is zero
    there - or None when a size is not a number (a division by zero: the point is outside the
    model's domain) or the tensors exceed ``limit`` elements.
    :func:`_build` makes the real stand-ins from it. ``keyed``: leaves are kept as they are (no
    hash needed); otherwise an unhashable leaf raises :class:`_Unhashable`."""
    budget = [limit]
    zero = [False]

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
            zero[0] = zero[0] or 0 in shape
            numel = 1
            for d in shape:
                numel *= d
            budget[0] -= numel
            if budget[0] < 0:
                raise _Skip
            if v.layout not in (torch.strided, torch.sparse_coo, torch.sparse_csr):
                raise _Skip
            strides = None
            if v.layout == torch.strided:  # the real call's strides (a transposed operand): kernels check them
                strides = tuple(size(d) for d in v.stride())
                if strides == _contiguous(shape):
                    strides = None
            return ("tensor", v.dtype, v.layout, shape, strides)
        if isinstance(v, torch.SymInt):
            n = size(v)
            zero[0] = zero[0] or n == 0
            return ("int", n)
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
        described = describe(tree)
    except _Skip:
        return None
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None
    return described, zero[0]


def _build(described: Any) -> Any:
    """Real stand-ins for a :func:`_concrete` description: random floats, zero integers."""
    kind = described[0]
    if kind == "tensor":
        _, dtype, layout, shape, strides = described
        numel = 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if strides and 0 not in shape else None
        size = [numel] if numel is not None else shape
        if dtype.is_floating_point or dtype.is_complex:
            t = torch.rand(size, dtype=dtype)
        else:
            t = torch.zeros(size, dtype=dtype)
        if numel is not None:
            t = t.as_strided(shape, strides)
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


def _contiguous(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class _Unhashable(Exception):
    pass


class _Skip(Exception):
    pass

