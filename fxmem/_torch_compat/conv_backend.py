"""Fake convolutions without guards from a question whose answer changes nothing: ATen's
``_select_conv_backend`` (``torch._C``), asked by torch's fake kernel for ``aten.convolution`` and
``convolution_backward`` (``torch._subclasses.fake_impls.conv``) only to pick the output's memory
format.

ATen's CPU backend choice (``ConvParams::use_mkldnn`` in ``Convolution.cpp``) is an ``or`` of
conditions that starts with ``input.size(0) >= 16``, then ``input.size(0) > 1`` and
``numel > 20480``: on fake tensors each comparison it evaluates becomes a guard, so a CNN analysed
at batch 97 held for ``B >= 16`` only - though a 3x3 convolution takes oneDNN at every batch and,
whatever backend ATen picks, a contiguous input and weight give a contiguous output. Here, when every
backend a CPU input can take gives the same memory format for this input and weight (asked of ATen's
own ``_conv_determine_backend_memory_format``, on the fake tensors), the backend question runs with
the ShapeEnv's guards suppressed: the formulas then hold on both sides of a comparison that decides
nothing about the output. What a backend allocates is not decided here: the calibrated kernel rules
(:mod:`fxmem.kernels.calibrate`) sample real runs in the regime of the example sizes and guard the
sizes themselves where the regime depends on them (a single-threaded 1x1 convolution from batch 16).

On a torch upgrade, what breaks here: the names ``torch._C._select_conv_backend``,
``torch._C._conv_determine_backend_memory_format`` and ``torch._C._ConvBackend``, fake_impls' lookup
of ``_select_conv_backend`` on ``torch._C`` at call time, and ``ShapeEnv.suppress_guards``. Where any
is missing, convolutions keep torch's own guards (the region is narrower, never wrong).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

aten = torch.ops.aten

CONV_OPS = frozenset(op for op in (getattr(aten.convolution, "default", None),
                                   getattr(getattr(aten, "_convolution", None), "default", None),
                                   getattr(getattr(aten, "_convolution", None), "deprecated", None),
                                   getattr(aten.convolution_backward, "default", None)) if op is not None)

# the backends ATen can pick for a CPU input (the others belong to CUDA, ROCm and Apple devices)
_NOT_CPU = ("Cudnn", "Cuda", "Miopen", "Mps")
# fake_impls looks the function up on torch._C at each call: swapping it is how the question is
# asked unguarded; one lock, so concurrent analyses never restore each other's wrapper
_LOCK = threading.RLock()


def _cpu_backends() -> list:
    enum = getattr(torch._C, "_ConvBackend", None)
    if enum is None:
        return []
    return [getattr(enum, name) for name in dir(enum)
            if name[:1].isupper() and not name.startswith(_NOT_CPU) and name.isidentifier()]


def _one_format(input: Any, weight: Any) -> bool:
    """Whether every backend a CPU input can take gives ``input`` and ``weight`` one memory format."""
    determine = getattr(torch._C, "_conv_determine_backend_memory_format", None)
    backends = _cpu_backends()
    if determine is None or not backends:
        return False
    formats = set()
    for backend in backends:
        try:
            formats.add(determine(input, weight, backend))
        except Exception:  # noqa: BLE001 - a backend that cannot take this input: do not assume
            return False
    return len(formats) == 1


def _unguarded(original: Any) -> Any:
    def select(input: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
        env = next((d.node.shape_env for t in (input, weight) for d in t.shape if isinstance(d, torch.SymInt)), None)
        if env is None or getattr(input, "device", None) is None or input.device.type != "cpu" \
                or not hasattr(env, "suppress_guards") or not _one_format(input, weight):
            return original(input, weight, *args, **kwargs)
        with env.suppress_guards():
            return original(input, weight, *args, **kwargs)

    select.__wrapped__ = original
    return select


@contextlib.contextmanager
def backend_question_unguarded(func: Any) -> Iterator[None]:
    """While the fake kernel of ``func`` runs: if it is a convolution, ATen's backend question is
    asked without guards where its answer cannot change the output's memory format (see above)."""
    original = getattr(torch._C, "_select_conv_backend", None)
    if func not in CONV_OPS or original is None:
        yield
        return
    with _LOCK:
        original = torch._C._select_conv_backend
        torch._C._select_conv_backend = _unguarded(original)
        try:
            yield
        finally:
            torch._C._select_conv_backend = original
