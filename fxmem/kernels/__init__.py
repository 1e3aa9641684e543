"""Kernel knowledge: what real kernels do that fake ones do not, in one registry.

The simulation asks three questions of every aten call, and one of every torch function:

* :func:`hidden_program` - what scratch does the real kernel allocate around its outputs?
* :func:`output_storage` - is a real output's storage larger than the fake one?
* :func:`output_layout` - does the real kernel lay an output out otherwise (contiguous)?
* :func:`engine_takes_over` - does the real engine write the result into an existing buffer?
* :class:`RealPaths` - does a composite take another code path for real tensors?
* :func:`symbolic_impl` - does the fake kernel read sizes as numbers (and so fix the user's dims)?
* :func:`check_call` - would the real kernel accept the call at all (:mod:`~fxmem.kernels.accepts`)?

Rules live in :mod:`~fxmem.kernels.scalars` (wrapped Python numbers, dtype casts),
:mod:`~fxmem.kernels.cpu` (CPU kernels' scratch), :mod:`~fxmem.kernels.calibrate` (opaque
oneDNN/batch-norm kernels, measured and fitted), :mod:`~fxmem.kernels.rnn` (oneDNN's LSTM, measured
at fixed sizes), :mod:`~fxmem.kernels.engine` (autograd engine),
:mod:`~fxmem.kernels.real_paths` (composites), :mod:`~fxmem.kernels.symbolic` (fake kernels that
read sizes as numbers) and :mod:`~fxmem.kernels.fused` (fxmem's own fused operators, :mod:`fxmem.ops`).
Users describe their own ops with
:func:`register` or ``fxmem.analyze(..., kernels={op: fn})``.

>>> [r.name for r in REGISTRY.rules(Kind.HIDDEN)][:2]          # doctest: +SKIP
['aten.repeat', 'aten._scaled_dot_product_flash_attention_for_cpu']
"""
from __future__ import annotations

from typing import Any

from .. import _torch_compat as tc
from ..errors import ProfilerBusyError

from . import calibrate, cpu, cuda, edge_fused, engine, fused, real_paths, rnn, scalars, symbolic  # noqa: F401 - registers the built-in rules
from .accepts import FakeKernelFails, KernelRefuses, check_call, real_accepts
from .real_paths import RealPaths
from .registry import ANY, CHECKED, OUT, REGISTRY, Call, Keep, Kind, OutAt, Rule, Unknown, register, unregister

__all__ = ["environment", "hidden_program", "output_layout", "output_storage", "engine_takes_over", "symbolic_impl",
           "check_call", "KernelRefuses", "FakeKernelFails", "real_accepts", "RealPaths", "register", "unregister", "REGISTRY", "Rule", "Kind", "Call", "Keep",
           "Unknown", "OUT", "OutAt", "ANY", "CHECKED"]


def hidden_program(call: Call, used: set | None = None) -> list:
    """The hidden-allocation program of one aten call ([] when the real kernel hides nothing).

    On CPU, wrapped Python numbers exist for the whole call, around the op's own program. Each
    rule that contributed is added to ``used``.
    """
    outer = (scalars.wrapped_numbers(call) or scalars.foreach_numbers(call)) if call.device == "cpu" else []
    found = REGISTRY.lookup(Kind.HIDDEN, call.func, call.device)
    try:
        inner = found.fn(call) if found is not None else None
    except ProfilerBusyError as busy:  # a calibration measures with the profiler: not while the user's records
        inner = Unknown(call.op, f"its scratch is measured once by a real run (then kept on disk), and {busy}")
    if inner and used is not None:
        used.add(found)
    if isinstance(inner, Unknown):
        return outer + [inner] if outer else [inner]
    if not inner:
        return outer
    if not outer:
        return list(inner)
    i = outer.index(OUT)
    return outer[:i] + list(inner) + outer[i + 1:]


def output_storage(call: Call) -> dict:
    """Outputs whose real storage is larger than the fake one: ``{output index: bytes}``."""
    found = REGISTRY.lookup(Kind.OUTPUT_STORAGE, call.func, call.device)
    return found.fn(call) if found is not None else {}


def engine_takes_over(call: Call, table: Any, between_nodes: bool, node: str) -> Any:
    """The argument whose buffer the real engine reuses for this call's output, or None."""
    found = REGISTRY.lookup(Kind.ENGINE, call.func, call.device)
    return found.fn(call, table, between_nodes, node) if found is not None else None


def symbolic_impl(call_func: Any, device: str) -> Rule | None:
    """The rule computing ``call_func`` on fake tensors with symbolic sizes kept, or None."""
    return REGISTRY.lookup(Kind.SYMBOLIC, call_func, device)


def environment(device: str = "cpu") -> dict:
    """What about this process decides which kernels run and what they allocate: the intra-op
    thread count (oneDNN and batch norm pick their paths and per-thread buffers by it), whether
    oneDNN is used, and the CPU's vector width (oneDNN's blocked layouts pad channels to it).
    Part of every analysis' key: a report made under another environment is re-made."""
    import torch

    return {"threads": torch.get_num_threads(),
            "onednn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
            "cpu_capability": tc.cpu_capability()}


def output_layout(call: Call) -> dict:
    """Outputs whose real layout differs from the fake one: ``{output index: memory format}``."""
    found = REGISTRY.lookup(Kind.OUTPUT_LAYOUT, call.func, call.device)
    return found.fn(call) if found is not None else {}
