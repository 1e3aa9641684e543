"""A kernel's hidden buffers as *measured functions* of its input's sizes, not as a guess or a pin.

Some kernels keep scratch no formula describes: oneDNN's convolution backward (2 threads of an AMD
EPYC) keeps a buffer that grows with the image in no pattern a fit holds to - more at 96x41 than at
96x42, the same output width - and adds a reduction buffer past some batch x image size
(``benchmarks/measured_workspace.py`` prints them). Wherever the example sizes can be run once
(:mod:`fxmem.kernels.calibrate`: a fit is used only where they cannot, and below the sizes a fit
sampled), the kernel's hidden program becomes, per stretch between its outputs' births, two
numbers of its input's shape:

    [+up_0(shape), -down_0(shape), OUT, +up_1(shape), -down_1(shape), OutAt(2), ...]

``up_k`` is the most that stretch holds above where it started (>= 0) and ``down_k`` what it gives
back before the next output (>= 0): the live bytes at every moment of the call, and so every peak,
are those of the real kernel (its buffers are never visible outside the call). Each is a sympy
function, :class:`MeasuredBytes`, of the input's dims in the user's names - a formula term like
``ws1_up0(B, 16, H, W)`` - whose value at concrete sizes is one real run of that kernel alone at that
shape (milliseconds; cached in memory and on disk). So the analysis holds at every size, without
guards or a new simulation. A size whose input would be larger than :data:`MEASURE_ELEMENTS` is
measured at three batch sizes up to that and each buffer extended linearly in the batch where the
three runs lie exactly on one line (as a fit from samples is: checked at the points it was made from), else refused
(:class:`~fxmem.errors.MeasureError`), never guessed; a size where the kernel orders its outputs
otherwise raises :class:`StructureChanged` (the report then analyses that size).

>>> m = measured_program(key, (OUT,), (B, 16, H, W))                       # doctest: +SKIP
[ws1_up0(B, 16, H, W), -ws1_down0(B, 16, H, W), OUT, ws1_up1(B, 16, H, W), -ws1_down1(B, 16, H, W)]
>>> int(m[0].xreplace({B: 2, H: 6, W: 6}))      # one real run of that kernel   # doctest: +SKIP
86832
"""
from __future__ import annotations

import dataclasses
import threading
from fractions import Fraction
from typing import Any, Callable, Sequence

import sympy

from ..errors import FxMemError, MeasureError
from .registry import OUT, OutAt

__all__ = ["MeasuredBytes", "MeasureError", "StructureChanged", "register_kernel", "measured_program",
           "value_of", "MEASURE_ELEMENTS", "summarize"]

MEASURE_ELEMENTS = 1 << 24  # elements in the kernel's input: the largest one real run measures (64 MiB float32)
BATCHES_TO_EXTEND = 8  # the smallest largest-runnable batch a buffer is extended along the batch from


class StructureChanged(FxMemError):
    """At these sizes the measured kernel allocates its outputs in another order than where it was
    recorded: its program cannot be read into the recorded one (the report analyses those sizes)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One measured kernel configuration: what runs it at a shape and the outputs' order it showed."""

    label: str  # the op, for messages
    markers: tuple  # OUT / OutAt(i) in the order the kernel allocated its outputs
    measure: Callable[[tuple], tuple]  # driver shape -> the real program (allocator deltas and markers)


_KERNELS: list[Kernel] = []
_KEYS: dict[tuple, int] = {}
_LOCK = threading.Lock()


def register_kernel(identity: tuple, label: str, markers: tuple, measure: Callable[[tuple], tuple]) -> int:
    """The key of the kernel configuration ``identity`` (op, frozen arguments, thread count, output
    order), registered once per process: equal configurations share their measurements."""
    with _LOCK:
        if identity not in _KEYS:
            _KEYS[identity] = len(_KERNELS)
            _KERNELS.append(Kernel(label, tuple(markers), measure))
        return _KEYS[identity]


def _is_marker(p: Any) -> bool:
    return p is OUT or p == OUT or isinstance(p, OutAt)


def summarize(program: Sequence) -> tuple[tuple, list[tuple[int, int]]]:
    """A real program as its output markers and, per stretch around them, ``(up, down)``: the most
    held above the stretch's start and what it gives back by its end (both >= 0)."""
    markers, stretches = [], []
    level = start = high = 0
    for p in list(program) + [None]:
        if p is None or _is_marker(p):
            stretches.append((high - start, high - level))
            start = high = level
            if p is not None:
                markers.append(p)
            continue
        level += int(p)
        high = max(high, level)
    return tuple(markers), stretches


def value_of(key: int, stretch: int, which: int, shape: Sequence[int]) -> int:
    """``up`` (which=0) or ``down`` (which=1) of stretch ``stretch`` of kernel ``key`` at ``shape``."""
    kernel = _KERNELS[key]
    shape = tuple(int(d) for d in shape)
    if min(shape, default=1) < 1:
        return 0
    if _numel(shape) > MEASURE_ELEMENTS:
        return _along_batch(key, shape)[stretch][which]
    return _stretches(kernel, shape)[stretch][which]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _stretches(kernel: Kernel, shape: tuple) -> list[tuple[int, int]]:
    markers, stretches = summarize(kernel.measure(shape))
    if markers != kernel.markers:
        raise StructureChanged(f"{kernel.label} allocates its outputs in another order at input "
                               f"{'x'.join(map(str, shape))} than where it was recorded")
    return stretches


def _along_batch(key: int, shape: tuple) -> list[tuple[int, int]]:
    """A shape too large to run once: the kernel at three batch sizes (its first dim) up to
    :data:`MEASURE_ELEMENTS` elements, and each of its buffers extended linearly in the batch where
    the three runs allocate the same buffers and each lies exactly on one line (oneDNN's reorders
    and per-image buffers grow with the batch; its per-thread scratch does not) - else refused
    (:class:`~fxmem.errors.MeasureError`). The moments are then read off the extended program (the
    most held in a stretch moves from a per-thread buffer to a per-image one as the batch grows)."""
    kernel = _KERNELS[key]
    per = _numel(shape[1:])
    top = MEASURE_ELEMENTS // max(per, 1)

    def refuse(why: str) -> MeasureError:
        return MeasureError(
            f"at these sizes {kernel.label}'s input is {'x'.join(map(str, shape))} ({_numel(shape):,} elements): its "
            f"workspace (scratch no formula describes) is measured by real runs of that kernel alone, up to "
            f"{MEASURE_ELEMENTS:,} elements, and {why}; ask at smaller sizes, or analyse with concrete sizes "
            f"(hints=) there and read report.exact")

    if top < BATCHES_TO_EXTEND:
        raise refuse(f"a batch of {top} is too small to tell how it grows with the batch")
    step = max(1, top // 8)  # the largest runs: oneDNN's batch thresholds (threads splitting it) lie lower
    batches = (top - 2 * step, top - step, top)
    programs = [tuple(kernel.measure((b, *shape[1:]))) for b in batches]
    if len({len(p) for p in programs}) != 1:
        raise refuse(f"at batch {', '.join(map(str, batches))} it allocates different buffers")
    program: list = []
    for items in zip(*programs):
        if any(_is_marker(p) for p in items):
            if not all(p == items[0] for p in items):
                raise refuse(f"at batch {', '.join(map(str, batches))} it allocates its outputs in another order")
            program.append(items[0])
            continue
        slope = Fraction(items[2] - items[0], batches[2] - batches[0])
        if items[0] + slope * (batches[1] - batches[0]) != items[1]:
            raise refuse(f"at batch {', '.join(map(str, batches))} a buffer of it does not grow along one line")
        value = items[0] + slope * (shape[0] - batches[0])
        if value.denominator != 1 or (value > 0) != (items[0] > 0):
            raise refuse("its buffers do not extend to this batch in whole bytes")
        program.append(int(value))
    markers, stretches = summarize(program)
    if markers != kernel.markers:
        raise StructureChanged(f"{kernel.label} allocates its outputs in another order at input "
                               f"{'x'.join(map(str, shape))} than where it was recorded")
    return stretches


class MeasuredBytes(sympy.Function):
    """Bytes of a measured kernel stretch at the input shape given by its arguments (see the module
    docstring): ``MeasuredBytes(key, stretch, which, *dims)``; a number once every dim is one."""

    is_integer = True
    is_nonnegative = True

    @classmethod
    def eval(cls, key: Any, stretch: Any, which: Any, *dims: Any) -> Any:
        if all(isinstance(d, sympy.Integer) for d in (key, stretch, which, *dims)):
            return sympy.Integer(value_of(int(key), int(stretch), int(which), [int(d) for d in dims]))
        return None

    def _sympystr(self, printer: Any) -> str:
        key, stretch, which, *dims = self.args
        return f"ws{key}_{'down' if int(which) else 'up'}{stretch}({', '.join(printer._print(d) for d in dims)})"

    def _latex(self, printer: Any) -> str:
        key, stretch, which, *dims = self.args
        return (r"\mathrm{ws}_{%s,%s%s}(%s)" % (key, "down" if int(which) else "up", stretch,
                                                ", ".join(printer._print(d) for d in dims)))


def measured_program(key: int, markers: Sequence, dims: Sequence[Any]) -> list:
    """The symbolic program of kernel ``key``: per stretch ``+up, -down``, then its marker."""
    out: list = []
    args = [sympy.sympify(d) for d in dims]
    for k in range(len(markers) + 1):
        out += [MeasuredBytes(key, k, 0, *args), -MeasuredBytes(key, k, 1, *args)]
        if k < len(markers):
            out.append(markers[k])
    return out
