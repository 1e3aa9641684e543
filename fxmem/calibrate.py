"""Calibrating opaque CPU kernels: measure their hidden buffers, fit them, verify the fit.

Some kernels allocate through PyTorch's allocator in ways no formula in PyTorch describes: a
oneDNN convolution reorders its input, weights and output into blocked layouts whose channel
padding depends on the CPU's vector width (16 on AVX-512, 8 on AVX2) and on oneDNN's choice of
implementation. For those, fxmem runs the real kernel on small inputs of the *same* channels,
kernel and strides, reads the allocator's events, and fits every hidden buffer as

    bytes = a * numel(input) + b * numel(output) + c      (a, b, c exact rationals)

on three shapes, then checks the fit on two more. The guarantee: exact wherever the kernel keeps
the layout it chose at the sampled shapes; a fit that fails its check is not used and the report
says the op's workspace is unknown instead of guessing.

>>> prog = conv_program(x, w, b, (1, 1), (1, 1), (1, 1), False, (0, 0), 1, out)   # doctest: +SKIP
[Fraction(16, 3)*in + 128 + ..., OUT, ...]
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
from fractions import Fraction
from typing import Any, Callable, Sequence

import sympy
import torch

from . import _torch_compat as tc

OUT = "OUT"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One real run: the hidden-allocation deltas (``OUT`` where outputs appear) and numels."""

    program: tuple
    in_numel: int
    out_numel: int


def run_and_read(fn: Callable[[], Any]) -> tuple[tuple, Any]:
    """Run ``fn`` for real under the profiler; the allocation deltas it made, OUT for its result."""
    from torch.profiler import ProfilerActivity, profile

    with tc.real_mode():
        for _ in range(2):  # warm-up: first calls create oneDNN primitives and caches
            fn()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        out_ptrs = {t.untyped_storage().data_ptr() for t in outs}
        events = _memory_events(prof)
    # an output is the *last* block born at its address (a temporary may have lived there before)
    last_birth = {addr: i for i, (addr, nbytes) in enumerate(events) if nbytes > 0 and addr in out_ptrs}
    program: list = []
    born: dict[int, int] = {}
    for i, (addr, nbytes) in enumerate(events):
        if nbytes > 0:
            if last_birth.get(addr) == i:
                if OUT not in program:
                    program.append(OUT)
                continue
            born[addr] = nbytes
            program.append(nbytes)
        elif addr in born:  # frees of blocks born before this call are not ours
            program.append(-born.pop(addr))
    if OUT not in program:
        program.append(OUT)
    return tuple(program), out


def _memory_events(prof: Any) -> list[tuple[int, int]]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    mem = [e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    mem.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    return [(int(e["args"]["Addr"]), int(e["args"]["Bytes"])) for e in mem]


# Column sets tried in order: when numel(out) is proportional to numel(in) for every shape of an
# op (a same-padding convolution), the samples cannot separate the two and a smaller basis is used.
_BASES = ((0, 1, 2), (1, 2), (0, 2), (2,))


def fit(samples: Sequence[Sample]) -> list | None:
    """Fit each hidden delta as ``(a, b, c)`` over (in_numel, out_numel, 1); None if it doesn't hold.

    Enough samples to determine the fit are solved exactly; every other sample must then be
    reproduced exactly.
    """
    shapes = {tuple(p if p == OUT else (p > 0) for p in s.program) for s in samples}
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
            if p == OUT:
                fitted.append(OUT)
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
    import itertools

    for pick in itertools.combinations(range(len(rows)), len(cols)):
        if sympy.Matrix([[rows[i][c] for c in cols] for i in pick]).det() != 0:
            return list(pick)
    return None


def symbolic_program(fitted: list, in_numel: Any, out_numel: Any) -> list:
    """The fitted program with the op's own (symbolic) numels substituted."""
    out = []
    for item in fitted:
        if item == OUT:
            out.append(OUT)
            continue
        sign, a, b, c = item
        expr = sympy.Rational(a.numerator, a.denominator) * in_numel + sympy.Rational(b.numerator, b.denominator) * out_numel + sympy.Rational(c.numerator, c.denominator)
        out.append(sign * expr)
    return out


# ------------------------------------------------------------------------------------------------
# convolution
# ------------------------------------------------------------------------------------------------
def _conv_samples(x_shape: Sequence[int | None], w_shape: Sequence[int], stride: Sequence[int],
                  padding: Sequence[int], dilation: Sequence[int], min_batch: int) -> list[list[int]]:
    """Small input shapes exercising the same kernel: symbolic positions (None) get varied values."""
    base = []
    for i, d in enumerate(x_shape):
        if d is not None:
            base.append(d)
        elif i == 0:
            base.append(min_batch)
        elif i == 1:
            raise ValueError("symbolic channel count")
        else:
            k = w_shape[i]
            j = i - 2
            need = dilation[j] * (k - 1) + 1 - 2 * padding[j]
            base.append(max(need, 1) + 2 * stride[j] + 1)
    shapes = [list(base)]
    free = [i for i, d in enumerate(x_shape) if d is None]
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


def _conv_fit(*key: Any) -> list | None:
    # one retry: a kernel's first runs in a process can still be settling its caches
    return _conv_fit_once(*key) or _conv_fit_once.__wrapped__(*key)


@functools.lru_cache(maxsize=256)
def _conv_fit_once(x_key: tuple, w_shape: tuple, has_bias: bool, stride: tuple, padding: tuple, dilation: tuple,
              transposed: bool, output_padding: tuple, groups: int, dtype: torch.dtype, min_batch: int) -> list | None:
    samples = []
    with tc.real_mode():
        w = torch.randn(w_shape, dtype=dtype)
        b = torch.randn(w_shape[1] * groups if transposed else w_shape[0], dtype=dtype) if has_bias else None
        for shape in _conv_samples(x_key, w_shape, stride, padding, dilation, min_batch):
            x = torch.randn(shape, dtype=dtype)

            def run(x: torch.Tensor = x) -> torch.Tensor:
                return torch.ops.aten.convolution.default(x, w, b, list(stride), list(padding), list(dilation),
                                                          transposed, list(output_padding), groups)

            program, out = run_and_read(run)
            samples.append(Sample(program, x.numel(), out.numel()))
            del out
    return fit(samples)


def conv_program(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                 output_padding: Sequence[int], groups: int, out: torch.Tensor) -> list | None:
    """Hidden-allocation program of a real CPU convolution with ``x``'s (symbolic) shape."""
    x_key = tuple(int(d) if isinstance(d, int) else None for d in x.shape)
    if x_key[1] is None or any(not isinstance(d, int) for d in w.shape):
        return None
    # The CPU backend choice (oneDNN vs. im2col) looks at the batch size: sample with a batch
    # that takes the same branch as the analysed one (ATen's use_mkldnn: N > 1, or N >= 16 for
    # single-threaded 1x1 convolutions).
    batch = x.shape[0]
    single_1x1 = (all(s == 1 for s in stride) and all(d == 1 for d in dilation) and all(k == 1 for k in w.shape[2:])
                  and torch.get_num_threads() == 1)
    if isinstance(batch, int):
        min_batch = batch
    else:
        min_batch = 16 if (single_1x1 and batch >= 16) else 2
    fitted = _conv_fit(x_key, tuple(w.shape), b is not None, tuple(stride), tuple(padding), tuple(dilation),
                       bool(transposed), tuple(output_padding), int(groups), x.dtype, min_batch)
    if fitted is None:
        return None
    return symbolic_program(fitted, tc.raw_expr(x.numel()), tc.raw_expr(out.numel()))
