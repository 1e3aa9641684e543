"""Devices and builds: ``torch.cuda`` (the caching allocator's recorded history,
``torch.cuda.memory._record_memory_history`` / ``_snapshot``; whether a GPU is visible) and
``torch.backends`` (whether this is a CUDA build; the vector instruction set ATen's CPU kernels use).

Simulating CUDA with fake tensors needs a CUDA build of torch but no GPU, except for backward (torch's
autograd engine initialises the device's context first).

On a torch upgrade, what breaks here: ``_record_memory_history``'s arguments and ``_snapshot``'s format
(the dict pytorch.org/memory_viz opens), ``torch.backends.cpu.get_cpu_capability``, and whether fake
CUDA tensors still abort a CPU-only build (pytorch/pytorch#92627 for backward).

Imports none of the package's other modules.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


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


def fake_cuda_backward_possible() -> bool:
    """Whether backward can run on fake ``cuda`` tensors here: torch's autograd engine initialises
    the device's context first (pytorch/pytorch#92627: fake tensors create one real CUDA tensor for
    that), which needs a visible GPU."""
    return torch.cuda.is_available()


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


def cpu_capability() -> str:
    """The vector instruction set ATen's CPU kernels were dispatched to (``"AVX512"``, ``"AVX2"`` ...)."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return str(get()) if get is not None else "unknown"
