"""Calibrating opaque CPU kernels: measure their hidden buffers, fit them, verify the fit.

Some kernels allocate through PyTorch's allocator in ways no formula in PyTorch describes: a
oneDNN convolution reorders its input, weights and output into blocked layouts whose channel
padding depends on the CPU's vector width (16 on AVX-512, 8 on AVX2) and keeps per-thread scratch
sized by its blocking (more at a 96x41 image than at 96x42); batch norm keeps per-thread or
per-channel temporaries that differ between its contiguous, channels-last and 2-D paths.

Wherever the example sizes can be run once (:data:`fxmem.kernels.measured.MEASURE_ELEMENTS`), such
a kernel's hidden buffers are *measured functions* of its input's sizes
(:mod:`fxmem.kernels.measured`): one real run of the kernel alone at each size asked, cached. A fit
from small samples would need that same run at every size asked to be trusted there (oneDNN picks
its scratch by size), and where it was off the size was analysed again: ResNet-18 (width 16) with
fits answered 943 random sizes in 120 s from 45 analyses, 10 of them new simulations; measured, all
1,000 in 82 s from its first (``python benchmarks/pieces_speed.py --cases resnet18 --reps 1 --cnn-limit 120``,
before and after this change, same machine).

Where the example sizes are too large to run once, the kernel is measured at three batches up to
that size and each buffer extended along the batch where the runs lie on one line and that holds
at the example sizes (:func:`fxmem.kernels.measured.value_of`). Only where even that cannot be
done (fewer than :data:`~fxmem.kernels.measured.BATCHES_TO_EXTEND` images run once, or buffers
that do not grow along one line) fxmem runs the real kernel on small inputs with
the *same* channels, kernel, strides, dtype and memory layout, reads the allocator's events, and
fits every hidden buffer as

    bytes = a * numel(driver input) + b * numel(output) + c      (a, b, c exact rationals)

on a few shapes, then checks the fit on the others, and once more on a real run toward the
example sizes (scaled down to at most 2**20 elements); each size asked later is checked by a real
run of the kernel there (:func:`fit_holds`; a size where the fit is off is simulated). Where the
kernel behaves otherwise toward the example sizes, the fit is redone from there on (a guard in the
region). The guarantee: exact at every size a measured kernel is measured, and wherever a fitted
kernel keeps the behaviour it showed at the sampled and checked shapes; a fit that fails its
checks is not used and the report says the op's workspace is unknown instead of guessing. A size
whose input is too large for that check (:data:`VERIFY_ELEMENTS`) is not proven: a report with
fitted kernels says so in its notes and is not ``exact``.

Each op has an *adapter* (data): which argument (by schema name) drives the symbolic sizes, how
to build the real call at a sampled shape, and which number plays "output". Adapters exist for
``convolution``, ``convolution_backward``, ``native_batch_norm`` and ``native_batch_norm_backward``;
each registers a HIDDEN rule in :mod:`fxmem.kernels.registry`.

>>> program_for_call(Call(torch.ops.aten.convolution.default, args, {}, outputs, "cpu"))   # doctest: +SKIP
[192, 1728, 8*in + ..., OUT, ...]
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import logging
from fractions import Fraction
from typing import Any, Callable, Iterator, Sequence

import sympy
import torch

from .. import _torch_compat as tc
from ..progress import phased
from ..measure import allocator_events, cpu_memory_profile
from . import calibration_cache
from . import measured
from ..errors import MeasureError
from .measured import StructureChanged, measured_program, register_kernel, summarize, value_of
from .regimes import condition, either
from .registry import OUT, Call, OutAt, Unknown, hidden, require_args

log = logging.getLogger(__name__)  # progress: a calibration runs real kernels for a few seconds


@dataclasses.dataclass(frozen=True)
class Sample:
    """One real run: the hidden-allocation deltas (``OUT`` where outputs appear) and numels."""

    program: tuple
    in_numel: int
    out_numel: int


def run_and_read(fn: Callable[[], Any]) -> tuple[tuple, Any]:
    """Run ``fn`` for real under the profiler; the allocation deltas it made, OUT for its result."""
    with tc.real_mode():
        for _ in range(2):  # warm-up: first calls create oneDNN primitives and caches
            fn()
        with cpu_memory_profile() as prof:  # quiet: a CNN is calibrated with dozens of sessions
            out = fn()
        outs = [t for t in tc.tree_leaves(out) if isinstance(t, torch.Tensor)]
        position: dict[int, int] = {}  # data pointer -> first output position with that storage
        for k, t in enumerate(outs):
            if t.numel():
                position.setdefault(t.untyped_storage().data_ptr(), k)
        events = allocator_events(prof)
    # an output is the *last* block born at its address (a temporary may have lived there before)
    last_birth = {addr: i for i, (addr, nbytes) in enumerate(events) if nbytes > 0 and addr in position}
    program: list = []
    born: dict[int, int] = {}
    grouping = False  # the last event was an output birth: the next one joins OUT
    for i, (addr, nbytes) in enumerate(events):
        if nbytes > 0 and last_birth.get(addr) == i:
            if OUT not in program:
                program.append(OUT)
            elif not (grouping and program[-1] is OUT):  # born later than the first outputs, after scratch
                program.append(OutAt(position[addr]))
            grouping = True
            continue
        grouping = False
        if nbytes > 0:
            born[addr] = nbytes
            program.append(nbytes)
        elif addr in born:  # frees of blocks born before this call are not ours
            program.append(-born.pop(addr))
    if OUT not in program:
        program.append(OUT)
    return tuple(program), out


def _marker(p: Any) -> bool:
    return p is OUT or p == OUT or isinstance(p, OutAt)


# Column sets tried in order: when numel(out) is proportional to numel(in) for every shape of an
# op (a same-padding convolution, batch norm), the samples cannot separate the two.
_BASES = ((0, 1, 2), (1, 2), (0, 2), (2,))


def fit(samples: Sequence[Sample]) -> list | None:
    """Fit each hidden delta as ``(sign, a, b, c)`` over (in_numel, out_numel, 1); None if it fails.

    Enough samples to determine the fit are solved exactly; every other sample must then be
    reproduced exactly.
    """
    shapes = {tuple(p if _marker(p) else (p > 0) for p in s.program) for s in samples}
    if len(shapes) != 1:
        return None  # the kernel changed its behaviour between shapes
    rows = [(s.in_numel, s.out_numel, 1) for s in samples]
    for cols in _BASES:
        chosen = _independent(rows, cols)
        if chosen is None:
            continue
        m = sympy.Matrix([[rows[i][c] for c in cols] for i in chosen])
        fitted: list = []
        for k, p in enumerate(samples[0].program):
            if _marker(p):
                fitted.append(p)
                continue
            sol = m.LUsolve(sympy.Matrix([abs(samples[i].program[k]) for i in chosen]))
            coef = [Fraction(0)] * 3
            for c, v in zip(cols, sol):
                coef[c] = Fraction(int(v.p), int(v.q))
            if any(sum(coef[c] * r[c] for c in range(3)) != abs(s.program[k]) for r, s in zip(rows, samples)):
                fitted = []
                break
            fitted.append((1 if p > 0 else -1, *coef))
        if fitted:
            return fitted
    return None


def _independent(rows: Sequence[tuple], cols: tuple) -> list[int] | None:
    """Indices of ``len(cols)`` rows whose restriction to ``cols`` is invertible."""
    for pick in itertools.combinations(range(len(rows)), len(cols)):
        if sympy.Matrix([[rows[i][c] for c in cols] for i in pick]).det() != 0:
            return list(pick)
    return None


def symbolic_program(fitted: list, in_numel: sympy.Expr, out_numel: sympy.Expr) -> list:
    """The fitted program with the op's own (symbolic) numels substituted."""
    out = []
    for item in fitted:
        if _marker(item):
            out.append(item)
            continue
        sign, a, b, c = item
        q = lambda f: sympy.Rational(f.numerator, f.denominator)  # noqa: E731
        out.append(sign * (q(a) * in_numel + q(b) * out_numel + q(c)))
    return out


# ------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------
def layout_key(t: torch.Tensor) -> tuple:
    """How ``t`` is laid out, independent of its sizes: dim order by stride, broadcast dims, and
    whether it has gaps (a slice of a larger tensor: kernels copy those where they would not copy a
    dense permutation, so a stand-in must have gaps too)."""
    strides = [int(s) if isinstance(s, int) else s for s in t.stride()]
    zero = tuple(i for i, s in enumerate(strides) if s == 0)
    order = tuple(sorted(range(t.dim()), key=lambda i: (-strides[i] if strides[i] != 0 else 1, i)))
    gapped = not zero and t.dim() > 0 and not tc.non_overlapping_and_dense(t)
    return order, zero, gapped, _size_one_strides(t)


def _size_one_strides(t: torch.Tensor) -> tuple:
    """How the stride of each size-1 dim relates to the others, so a stand-in at other sizes has it
    too: a size-1 dim's stride is arbitrary, but kernels read it to pick a memory format (a (B, 1, L)
    transpose with strides (L, 1, 1) is not laid out like a contiguous one, (L, L, 1), to oneDNN).
    Each entry: (dim, "inner", j) - the stride of dim j times its size; (dim, "same", j) - dim j's
    stride; (dim, "one", None)."""
    shape, strides = list(t.shape), list(t.stride())
    expr = [tc.raw_expr(s) for s in strides]
    out = []
    for i, d in enumerate(shape):
        if not (isinstance(d, int) and d == 1) or expr[i] == 0:
            continue  # a sized dim, or a broadcast one (``zero`` has those)
        rule = None
        for j in range(len(shape)):
            if j == i or (isinstance(shape[j], int) and shape[j] == 1):
                continue
            if expr[i] == expr[j]:
                rule = (i, "same", j)
            elif sympy.expand(expr[i] - expr[j] * tc.raw_expr(shape[j])) == 0:
                rule = (i, "inner", j)
            if rule is not None:
                break
        if rule is None and expr[i] == 1:
            rule = (i, "one", None)
        if rule is not None:
            out.append(rule)
    return tuple(out)


def real_like(layout: tuple, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A real tensor of ``shape`` laid out like the fake one ``layout`` describes (ones)."""
    order, zero, gapped, ones = layout
    base_shape = [1 if i in zero else d for i, d in enumerate(shape)]
    dense_shape = [base_shape[i] for i in order]
    if gapped:  # one more element along the innermost dim, sliced off: a gap in every row
        dense_shape[-1] += 1
    # constant values: these kernels allocate by size, layout and dtype, never by value (a kernel that
    # did could not be predicted from shapes at all); filling is a fraction of randn's cost, which was
    # a third of a measured kernel's time per size, and no random stream is touched
    dense = torch.ones(dense_shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(dense_shape, dtype=dtype)
    if gapped:
        dense = dense.narrow(len(order) - 1, 0, dense_shape[-1] - 1)
    inverse = [order.index(i) for i in range(len(order))]
    t = dense.permute(inverse).expand(list(shape))
    if not ones:
        return t
    strides = list(t.stride())
    for i, how, j in ones:  # size-1 dims: the stride the fake tensor's relation gives (see layout_key)
        if i < len(shape) and shape[i] == 1:
            strides[i] = 1 if how == "one" else strides[j] if how == "same" else strides[j] * shape[j]
    return t.as_strided(t.shape, strides, t.storage_offset())


def sample_shapes(shape: Sequence[Any], minimum: Sequence[int]) -> list[list[int]]:
    """Small shapes for a driver tensor: constant dims kept, symbolic ones varied from ``minimum``."""
    free = [i for i, d in enumerate(shape) if not isinstance(d, int)]
    base = [d if isinstance(d, int) else minimum[i] for i, d in enumerate(shape)]
    shapes = [list(base)]
    for n, i in enumerate(free):
        s = list(base)
        s[i] += 1 + n
        shapes.append(s)
    for bump in (2, 3):
        s = list(base)
        for n, i in enumerate(free):
            s[i] += bump + (n % 2)
        shapes.append(s)
    return shapes



# ------------------------------------------------------------------------------------------------
# adapters: how to run one op for real at a sampled shape, arguments bound by schema name
# ------------------------------------------------------------------------------------------------
Frozen = dict  # argument name -> hashable stand-in (see _freeze)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How to calibrate one op.

    ``driver``: the argument whose symbolic sizes are sampled; ``grad``: an argument with the same
    symbolic sizes that is rebuilt for each sample (a backward's incoming gradient);
    ``minimum(frozen, shape)``: the smallest sample sizes; ``build(frozen, x)``: the real call at
    driver ``x`` and a function of its result giving the second fitting feature ("output" numel);
    ``feature(call)``: the same quantity for the fake call, symbolically.
    """

    driver: str
    minimum: Callable[[Frozen, tuple], list[int]]
    build: Callable[[Frozen, torch.Tensor], tuple[Callable[[], Any], Callable[[Any], int]]]
    feature: Callable[[Call], Any]
    grad: str | None = None


def _spatial_minimum(key: tuple, shape: tuple, batch: int) -> list[int]:
    kernel, stride, padding, dilation = key
    out = []
    for i, d in enumerate(shape):
        if i == 0:
            out.append(batch)
        elif i == 1:
            out.append(1)
        else:
            j = i - 2
            need = dilation[j] * (kernel[j] - 1) + 1 - 2 * padding[j] if kernel else 1
            out.append(max(need, 1) + 2 * (stride[j] if stride else 1) + 1)
    return out


def _freeze(value: Any) -> Any:
    """A hashable stand-in for an argument: tensors by (shape, dtype, layout), lists as tuples."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(int(d) if isinstance(d, int) else None for d in value.shape), value.dtype,
                layout_key(value))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _is_tensor(f: Any) -> bool:
    return isinstance(f, tuple) and bool(f) and f[0] == "T"


def _real_arg(frozen: Any) -> Any:
    if _is_tensor(frozen):
        _, shape, dtype, layout = frozen
        if any(d is None for d in shape):
            raise ValueError("symbolic non-driver tensor")
        return real_like(layout, shape, dtype)
    if isinstance(frozen, tuple):
        return [_real_arg(f) for f in frozen]
    return frozen


def _real_args(frozen: Frozen, skip: tuple = ()) -> dict:
    return {name: _real_arg(f) for name, f in frozen.items() if name not in skip}


def _has_symbolic_tensor(f: Any) -> bool:
    if _is_tensor(f):
        return any(d is None for d in f[1])
    if isinstance(f, tuple):
        return any(_has_symbolic_tensor(v) for v in f)
    return False


aten = torch.ops.aten


def _conv_key(frozen: Frozen) -> tuple:
    w = frozen["weight"]
    return tuple(w[1][2:]), tuple(frozen["stride"]), tuple(frozen["padding"]), tuple(frozen["dilation"])


def _conv_batch(frozen: Frozen, shape: tuple) -> int:
    # ATen's use_mkldnn: a single-threaded 1x1 convolution uses oneDNN only from batch 16 on.
    kernel, stride, _, dilation = _conv_key(frozen)
    batch = shape[0]
    if isinstance(batch, int):
        return batch
    single_1x1 = all(s == 1 for s in stride) and all(d == 1 for d in dilation) and all(k == 1 for k in kernel) \
        and torch.get_num_threads() == 1
    return 16 if (single_1x1 and batch >= 16) else 2


ONEDNN_BATCH1_ELEMENTS = 20480  # ATen's use_mkldnn: a batch-1 input larger than this goes to oneDNN


def _conv_minimum(frozen: Frozen, shape: tuple) -> list[int]:
    """Smallest sample sizes, in the same oneDNN regime as the example sizes: ATen sends a batch-1
    convolution (one group, a kernel of at most 3 on a side) to oneDNN only when its input has more
    than 20480 elements - a comparison on the user's sizes, so it becomes a guard of the region."""
    minimum = _spatial_minimum(_conv_key(frozen), shape, _conv_batch(frozen, shape))
    kernel = _conv_key(frozen)[0]
    if minimum[0] != 1 or frozen.get("groups", 1) != 1 or all(k > 3 for k in kernel) or len(shape) < 3:
        return minimum
    numel = 1
    for d in shape:
        numel = numel * d
    if not bool(numel > ONEDNN_BATCH1_ELEMENTS):  # a guard either way
        return minimum
    free = [i for i in range(2, len(shape)) if not isinstance(shape[i], int)]
    if not free:
        return minimum
    fixed = 1  # the samples keep the concrete dims (channels) as they are
    for i, d in enumerate(minimum):
        if i not in free:
            fixed *= shape[i] if isinstance(shape[i], int) else d
    side = 1
    while fixed * side ** len(free) <= ONEDNN_BATCH1_ELEMENTS:
        side += 1
    return [max(m, side) if i in free else m for i, m in enumerate(minimum)]


def _conv_forward(frozen: Frozen, x: torch.Tensor) -> tuple:
    args = _real_args(frozen, skip=("input",))
    return (lambda: aten.convolution.default(input=x, **args)), lambda out: out.numel()


_CONV_GEOMETRY = ("stride", "padding", "dilation", "transposed", "output_padding", "groups")


def _conv_backward(frozen: Frozen, x: torch.Tensor) -> tuple:
    args = _real_args(frozen, skip=("input", "grad_output"))
    with torch.no_grad():
        out_shape = aten.convolution.default(x, args["weight"], None, *[args[k] for k in _CONV_GEOMETRY]).shape
    grad = real_like(frozen["grad_output"][3], list(out_shape), frozen["grad_output"][2])
    return (lambda: aten.convolution_backward.default(grad_output=grad, input=x, **args)), lambda out: grad.numel()


def _bn_forward(frozen: Frozen, x: torch.Tensor) -> tuple:
    args = _real_args(frozen, skip=("input",))
    return (lambda: aten.native_batch_norm.default(input=x, **args)), lambda out: x.numel()


def _bn_backward(frozen: Frozen, x: torch.Tensor) -> tuple:
    args = _real_args(frozen, skip=("input", "grad_out"))
    grad = real_like(frozen["grad_out"][3], list(x.shape), frozen["grad_out"][2])
    if args.get("save_invstd") is not None:  # must be positive to be a plausible input
        args["save_invstd"] = args["save_invstd"].abs() + 1
    return (lambda: aten.native_batch_norm_backward.default(grad_out=grad, input=x, **args)), lambda out: x.numel()


def _bn_minimum(frozen: Frozen, shape: tuple) -> list[int]:
    return [d if isinstance(d, int) else (2 if i == 0 else 3) for i, d in enumerate(shape)]


ADAPTERS: dict[Any, Adapter] = {
    aten.convolution.default: Adapter(
        "input", _conv_minimum, _conv_forward, lambda call: call.outputs[0].numel()),
    aten.convolution_backward.default: Adapter(
        "input", _conv_minimum, _conv_backward,
        lambda call: call.arg("grad_output").numel(), grad="grad_output"),
    aten.native_batch_norm.default: Adapter("input", _bn_minimum, _bn_forward, lambda call: call.arg("input").numel()),
    aten.native_batch_norm_backward.default: Adapter(
        "input", _bn_minimum, _bn_backward, lambda call: call.arg("input").numel(), grad="grad_out"),
}
require_args(aten.convolution.default, "input", "weight", *_CONV_GEOMETRY)
require_args(aten.convolution_backward.default, "grad_output", "input", "weight", *_CONV_GEOMETRY)
require_args(aten.native_batch_norm.default, "input")
require_args(aten.native_batch_norm_backward.default, "grad_out", "input", "save_invstd")


@functools.lru_cache(maxsize=512)
def _fit_cached(op: Any, frozen_items: tuple, min_shape: tuple, threads: int, retry: bool = False) -> list | None:
    """The fit for one calibration key: from this process' memory, else the on-disk cache a previous
    process on this CPU and torch wrote (see :mod:`fxmem.kernels.calibration_cache`), else measured.
    ``retry``: a failed fit is measured once more (oneDNN's first runs may still be settling its
    caches). A failure is kept too (as an empty program: a fit never is one), so the next process
    does not measure it again either."""
    key = calibration_cache.entry_key("fit", op, frozen_items, min_shape, threads)
    cached = calibration_cache.load(key)
    if cached is not None:
        return cached or None
    fitted = _fit(op, frozen_items, min_shape)
    if fitted is None and retry:
        fitted = _fit(op, frozen_items, min_shape)
    calibration_cache.store(key, fitted or [])
    return fitted


@phased("kernel calibration")
def _fit(op: Any, frozen_items: tuple, min_shape: tuple) -> list | None:
    adapter = ADAPTERS[op]
    frozen = dict(frozen_items)
    _, shape, dtype, layout = frozen[adapter.driver]
    log.info("calibrating %s on small real tensors", getattr(op, "__name__", op))
    samples = []
    with tc.real_mode():
        for s in sample_shapes(shape, min_shape):
            x = real_like(layout, s, dtype)
            call, feature = adapter.build(frozen, x)
            program, out = run_and_read(call)
            samples.append(Sample(program, x.numel(), feature(out)))
            del out
    return fit(samples)


def program_for_call(call: Call) -> list | Unknown | None:
    """Hidden-allocation program of a real CPU run of ``call`` at its (symbolic) shapes, an
    :class:`Unknown` saying why it cannot be known exactly, or None (no adapter, no fit)."""
    adapter = ADAPTERS.get(call.func)
    if adapter is None:
        return None
    frozen = {name: _freeze(v) for name, v in call.bound.items()}
    if not _is_tensor(frozen.get(adapter.driver)):
        return None
    for name, f in frozen.items():  # every other tensor must have constant sizes
        if name not in (adapter.driver, adapter.grad) and _has_symbolic_tensor(f):
            return None
    x = call.arg(adapter.driver)
    if any(isinstance(d, torch.SymInt) and tc.unbacked_symbols(tc.raw_expr(d)) for d in x.shape):
        # a fit is chosen and checked at the example sizes, and guarded where it holds: a size the data
        # decides (x[mask], nonzero: K1) has neither an example nor guards
        return Unknown(call.op, "its workspace is fitted to its input's sizes, and this input's size is decided "
                                "by the data (a K dim, see report.data_dims)")
    min_shape = tuple(adapter.minimum(frozen, tuple(x.shape)))
    # the thread count is part of the key: oneDNN picks its path (and its buffers) by it
    key = (call.func, tuple(frozen.items()), min_shape, torch.get_num_threads())
    # measured wherever the example sizes run once: as exact as a fit checked at each size (the same
    # one run per kernel and size), and never a new simulation where a fit would be off
    found = _measured(call, key[1], x)
    if found is not None:
        return found
    free = [i for i, d in enumerate(x.shape) if not isinstance(d, int)]
    hint = tuple(tc.size_hint(d) for d in x.shape)
    if any(hint[i] < min_shape[i] for i in free):  # below the smallest sampled sizes: never seen
        return _below_samples(call, key[1], x, hint, free)
    fitted = _fit_cached(*key, retry=True)
    if fitted is None:
        return _other_regime(call, adapter, frozen, x, min_shape)
    check = _check_shape(x, min_shape)
    if check is not None and not _holds_at(fitted, _sample_at(call.func, key[1], check, key[3])):
        return _larger_regime(call, adapter, frozen, x, min_shape, check)
    # the fit holds from the smallest sampled sizes on (a 3x3 convolution on AVX2 takes another oneDNN
    # path at H = 2 than at the sampled H = 4..7); below them the kernel is measured: a regime of the
    # formulas (kernels.regimes), not a guard - a ResNet's last stage samples 4x4 inputs, and as a
    # guard that read H >= 97 for the image, every smaller image a new simulation
    program = _fitted(call, frozen, x, fitted, minimum=min_shape)
    below = [x.shape[i] >= min_shape[i] for i in free]
    if any(condition(c) is not True for c in below):
        markers = tuple(p for p in fitted if _marker(p))
        found = _measured(call, key[1], x, markers)
        for c in below:
            program = either(c, program, found)
    return program


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted program used in a recording, to check at the sizes a user asks (:func:`fit_holds`):
    the op, its frozen arguments, the thread count, the driver's shape (ShapeEnv expressions).
    ``fitted`` None: a calibrated kernel whose workspace was unknown at the example sizes."""

    op: Any
    items: tuple
    threads: int
    shape: tuple
    fitted: tuple | None
    minimum: tuple = ()  # the smallest sampled driver: below it the kernel is measured, not fitted


_FITS: contextvars.ContextVar[list | None] = contextvars.ContextVar("fxmem_fits", default=None)


@contextlib.contextmanager
def recording_fits() -> Iterator[list]:
    """Collect every :class:`Fit` the calibrated rules use while the block runs (a simulation)."""
    fits: list = []
    token = _FITS.set(fits)
    try:
        yield fits
    finally:
        _FITS.reset(token)


def _fitted(call: Call, frozen: dict, x: torch.Tensor, fitted: list, minimum: tuple = ()) -> list:
    """The fitted program at the call's symbolic sizes, recorded (a fit is checked at the sampled
    sizes and toward the example sizes only: see :func:`fit_holds`)."""
    fits = _FITS.get()
    if fits is not None:
        fits.append(Fit(call.func, tuple(frozen.items()), torch.get_num_threads(),
                        tuple(tc.raw_expr(d) for d in x.shape), tuple(fitted), tuple(minimum)))
    return symbolic_program(fitted, tc.raw_expr(x.numel()), tc.raw_expr(ADAPTERS[call.func].feature(call)))


VERIFY_ELEMENTS = 1 << 22  # elements: the largest driver a fit is checked at, at a size a user asks


def fit_holds(fit: Fit, shape: tuple) -> bool | None:
    """Whether ``fit`` gives exactly what a real run of its kernel at driver ``shape`` keeps (one
    real run, cached in memory and on disk); None where ``shape`` is too large to run
    (:data:`VERIFY_ELEMENTS`): oneDNN picks its scratch by size, and a fit sampled at small sizes
    and checked toward the example sizes is not proven between them."""
    if fit.fitted is None or _numel(shape) > VERIFY_ELEMENTS or min(shape, default=1) < 1:
        return None
    if fit.minimum and any(d < m for d, m in zip(shape, fit.minimum)):
        return None  # below the samples: the kernel is measured there, not fitted
    return _holds_at(list(fit.fitted), _sample_at(fit.op, fit.items, tuple(shape), fit.threads))


def _below_samples(call: Call, frozen_items: tuple, x: torch.Tensor, hint: tuple, free: list) -> list | Unknown:
    """The example sizes lie below the smallest sizes a fit samples: the kernel's workspace as a
    measured function of its input's sizes (:mod:`fxmem.kernels.measured`), or, too large to run
    once, unknown."""
    found = _measured(call, frozen_items, x)
    if found is not None:
        return found
    return Unknown(call.op, f"its input at the example sizes ({'x'.join(map(str, hint))}) is smaller along a "
                            f"dim than the sizes its buffers are measured at, and too large to run once; give "
                            f"concrete sizes for exact numbers")


def _measured(call: Call, frozen_items: tuple, x: torch.Tensor, markers: tuple | None = None) -> list | None:
    """The kernel's hidden program as measured functions of its input's sizes: one real run at the
    example sizes gives the order of its outputs (and the values there); every other size is one
    real run of this kernel alone when asked (cached). None where the example sizes are too large
    to run (:data:`fxmem.kernels.measured.MEASURE_ELEMENTS`). With ``markers`` (the outputs' order
    a fit showed) no run at the example sizes is needed: a size where the kernel orders them
    otherwise is found when it is asked (:class:`~fxmem.kernels.measured.StructureChanged`)."""
    threads = torch.get_num_threads()
    extended = False  # the example sizes too large to run once: measured along the batch
    if markers is None:
        shape = hint = tuple(tc.size_hint(d) for d in x.shape)
        if _numel(hint) > measured.MEASURE_ELEMENTS:  # read here: a test may lower it
            # the largest batch that runs once shows the outputs' order (checked at the hint below)
            top = measured.MEASURE_ELEMENTS // max(_numel(hint[1:]), 1)
            if top < measured.BATCHES_TO_EXTEND:
                return None
            shape, extended = (top, *hint[1:]), True
        markers, _ = summarize(_sample_at(call.func, frozen_items, shape, threads).program)
    key = register_kernel((call.func, frozen_items, threads, markers), call.op, markers,
                          functools.partial(_program_of, call.func, frozen_items, threads))
    if extended:
        # too large to run once: measured at three batches and extended along the batch
        # (measured._along_batch) - used only where that holds at the example sizes themselves;
        # elsewhere a fit from small samples (checked toward the example sizes)
        try:
            value_of(key, 0, 0, hint)
        except (MeasureError, StructureChanged):
            return None
    return measured_program(key, markers, [d if isinstance(d, int) else tc.raw_expr(d) for d in x.shape])


def _program_of(op: Any, frozen_items: tuple, threads: int, shape: tuple) -> tuple:
    """The real program of ``op`` with its driver at ``shape`` (one run, cached): a measured term's value."""
    return _sample_at(op, frozen_items, tuple(shape), threads).program


CHECK_ELEMENTS = 1 << 20  # the driver of the run that checks a fit toward the example sizes: at most this many elements


def _check_shape(x: torch.Tensor, min_shape: tuple, limit: int = CHECK_ELEMENTS) -> tuple | None:
    """Where a fit from small samples is checked before it is used: the example sizes, scaled down
    (every symbolic dim by one factor) to at most ``limit`` elements; None when that is no larger
    than the samples were.

    Why: oneDNN decides its scratch by the problem's size and the thread count - a 3x3 convolution's
    weight gradient on 2 threads splits the batch between them, with a 45,312-byte reduction buffer,
    once batch x height x width passes about 2,048, never at the sampled 2..5 x 4..8 - so a fit from
    small samples alone can be silently wrong at the sizes the user asks about."""
    free = [i for i, d in enumerate(x.shape) if not isinstance(d, int)]
    if not free:
        return None
    shape = [tc.size_hint(d) for d in x.shape]
    if _numel(shape) > limit:
        factor = (limit / _numel(shape)) ** (1 / len(free))
        for i in free:
            shape[i] = max(int(shape[i] * factor), min_shape[i], 1)
        while _numel(shape) > limit and any(shape[i] > min_shape[i] for i in free):
            i = max(free, key=lambda k: shape[k] - min_shape[k])
            shape[i] -= 1
    largest = [max(s[i] for s in sample_shapes(x.shape, min_shape)) for i in range(len(shape))]
    if all(shape[i] <= largest[i] for i in free):
        return None
    return tuple(shape)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _larger_regime(call: Call, adapter: Adapter, frozen: dict, x: torch.Tensor, min_shape: tuple,
                   check: tuple) -> list | Unknown:
    """The fit from small samples is wrong toward the example sizes: the kernel keeps other buffers
    there. Where a real run at the example sizes is small enough, its workspace becomes a measured
    function of its input's sizes (exact at every size, one real run of this kernel alone per size
    asked: :mod:`fxmem.kernels.measured`). Else fit again from the checked shape up, guarded (the
    region then says ``B >= 10, H >= 55, ...``), and check that fit once more nearer the example
    sizes; a fit that fails is not used: the workspace is unknown (the report says so) rather than
    a fit known to be wrong."""
    items = tuple(frozen.items())
    threads = torch.get_num_threads()
    found = _measured(call, items, x)
    if found is not None:
        return found
    fitted = _fit_cached(call.func, items, check, threads)
    further = _check_shape(x, check, limit=4 * CHECK_ELEMENTS)
    if fitted is not None and (further is None or _holds_at(fitted, _sample_at(call.func, items, further, threads))):
        for i, d in enumerate(x.shape):  # a guard: the formula holds from the checked sizes on
            if not isinstance(d, int):
                bool(d >= check[i])
        return _fitted(call, frozen, x, fitted)
    names = "x".join(str(d) for d in check)
    return Unknown(call.op, f"its kernel keeps different buffers at different sizes (no one fit holds from small "
                            f"sizes to a {names} input, nor from there to nearer the example sizes); give example "
                            f"sizes (hints=) near the sizes you ask about, with at most {measured.MEASURE_ELEMENTS:,} "
                            f"elements in its input, or concrete sizes, for exact numbers")


@functools.lru_cache(maxsize=512)
def _sample_at(op: Any, frozen_items: tuple, shape: tuple, threads: int) -> Sample:
    """One real run of ``op`` with its driver at ``shape`` (cached in memory and on disk)."""
    key = calibration_cache.entry_key("sample", op, frozen_items, shape, threads)
    cached = calibration_cache.load(key)
    if cached is not None and len(cached) >= 2:  # the program, then the two numels
        return Sample(tuple(cached[:-2]), cached[-2], cached[-1])
    sample = _real_sample(op, frozen_items, shape, "checking the fit of %s on a real run toward the example sizes")
    calibration_cache.store(key, [*sample.program, sample.in_numel, sample.out_numel])
    return sample


def _real_sample(op: Any, frozen_items: tuple, shape: tuple, why: str) -> Sample:
    """One real run of ``op`` with its driver at ``shape``; ``why`` is logged (progress)."""
    adapter = ADAPTERS[op]
    log.info(why, getattr(op, "__name__", op))
    frozen = dict(frozen_items)
    _, _, dtype, layout = frozen[adapter.driver]
    with tc.real_mode():
        x = real_like(layout, list(shape), dtype)
        run, feature = adapter.build(frozen, x)
        program, out = run_and_read(run)
        sample = Sample(program, x.numel(), feature(out))
        del out
    return sample


def _holds_at(fitted: list, sample: Sample) -> bool:
    """Whether the fitted program gives exactly the real run ``sample``."""
    if len(fitted) != len(sample.program):
        return False
    for item, real in zip(fitted, sample.program):
        if _marker(item) or _marker(real):
            if not (_marker(item) and _marker(real) and item == real):
                return False
            continue
        sign, a, b, c = item
        if sign * (a * sample.in_numel + b * sample.out_numel + c) != real:
            return False
    return True


def _other_regime(call: Call, adapter: Adapter, frozen: dict, x: torch.Tensor,
                  min_shape: tuple) -> list | Unknown | None:
    """The kernel behaved differently across the smallest sampled shapes (oneDNN and batch norm pick
    paths by size and thread count). Measure it (:func:`_measured`: one real run at the example
    sizes, then one per size asked); where the example sizes are too large to run, fit from larger
    sizes on, guarded (the region then says ``B >= 4``). None if neither is possible."""
    free = [i for i, d in enumerate(x.shape) if not isinstance(d, int)]
    hint = [tc.size_hint(d) for d in x.shape]
    items = tuple(frozen.items())
    threads = torch.get_num_threads()
    # measured first: a fit from a shifted start holds only from there on, a guard that, for a deep
    # layer's input, reads as the image's example size (a ResNet-18's region was H >= 97)
    found = _measured(call, items, x)
    if found is not None:
        return found
    for shift in (1, 2):
        shifted = tuple(m + shift if i in free else m for i, m in enumerate(min_shape))
        if any(hint[i] < shifted[i] for i in free):
            break  # the example sizes lie below this regime
        fitted = _fit_cached(call.func, items, shifted, threads)
        if fitted is not None:
            check = _check_shape(x, shifted)
            if check is not None and not _holds_at(fitted, _sample_at(call.func, items, check, threads)):
                return _larger_regime(call, adapter, frozen, x, shifted, check)
            for i in free:  # a guard: the formula holds from here on
                bool(x.shape[i] >= shifted[i])
            return _fitted(call, frozen, x, fitted)
    check = _check_shape(x, min_shape)  # too large to run at the example sizes: fit from nearer them
    return None if check is None else _larger_regime(call, adapter, frozen, x, min_shape, check)


@hidden(*ADAPTERS, device="cpu")
def _calibrated_cpu(call: Call) -> list | Unknown | None:
    """oneDNN's blocked-layout reorders and batch norm's per-thread/per-channel temporaries are not
    described anywhere in PyTorch: measured and fitted on small real runs."""
    program = program_for_call(call)
    if program is None:
        program = Unknown(call.op, "its kernel's workspace could not be fitted at small sizes")
    if isinstance(program, Unknown) and _FITS.get() is not None:
        # unknown at these sizes; a simulation at the sizes a user asks may measure it there
        _FITS.get().append(Fit(call.func, (), torch.get_num_threads(), (), None))
    return program
