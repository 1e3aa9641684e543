"""Every public entry point runs *isolated*: one analysis at a time, and torch's global state as it found it.

Two promises, kept in one place:

* **No global state changes.** An analysis runs the model (on fake tensors, and sometimes real
  kernels on small probes), builds optimizers, enters autocast; ``validate`` runs the model for
  real. Whatever of that touches process-wide state - the CPU and CUDA random generators, Python's
  and numpy's ``random``, the default dtype, the number of threads, the deterministic-algorithms
  flags, grad / inference mode, autocast - is saved on entry and put back on exit, so a seeded
  training run gives the same numbers with or without an analysis before it.
* **Threads.** The simulation patches torch while it runs (tracer hooks, dispatch modes, the
  optimizers' view of fake tensors, the kernel calibration cache), which other threads would see.
  So analyses are serialised by one process-wide lock (re-entrant: ``optimize`` analyses inside
  itself): several threads may call fxmem at once and each gets exactly its own answer; they just
  take turns.

The ambient grad mode is *not* inherited: ``analyze(grad=True)`` inside ``torch.no_grad()`` or
``torch.inference_mode()`` still models a training forward (autograd records), as ``grad=`` says,
and says so in the report's notes; ``grad=False`` gives inference memory.

>>> import torch
>>> @isolated
... def noisy():
...     torch.rand(3)
...     torch.set_default_dtype(torch.float64)
>>> before = torch.get_rng_state()
>>> noisy()
>>> torch.equal(before, torch.get_rng_state()), torch.get_default_dtype()
(True, torch.float32)
"""
from __future__ import annotations

import contextlib
import functools
import random
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

import torch

__all__ = ["isolated", "ambient_grad_note", "LOCK"]

F = TypeVar("F", bound=Callable[..., Any])

LOCK = threading.RLock()  # one analysis at a time in this process (see the module docstring)
_DEPTH = threading.local()  # how deep this thread is in isolated calls (state is saved at the outermost)


def _autocast_state(device: str) -> Any:
    try:
        return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    except (TypeError, RuntimeError, AttributeError):  # a device type this build does not know
        return None


def _set_autocast(device: str, state: Any) -> None:
    if state is None:
        return
    try:
        torch.set_autocast_enabled(device, state[0])
        torch.set_autocast_dtype(device, state[1])
    except (TypeError, RuntimeError, AttributeError):
        pass


class _GlobalState:
    """A snapshot of torch's (and Python's) process-wide state that fxmem could touch."""

    def __init__(self) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        self.py_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.np_rng = numpy.random.get_state() if numpy is not None and hasattr(numpy, "random") else None
        self.grad = torch.is_grad_enabled()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.autocast = {d: _autocast_state(d) for d in ("cpu", "cuda")}

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            sys.modules["numpy"].random.set_state(self.np_rng)
        torch.set_grad_enabled(self.grad)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self.deterministic != (torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled()):
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        for device, state in self.autocast.items():
            if _autocast_state(device) != state:
                _set_autocast(device, state)


@contextlib.contextmanager
def isolation() -> Iterator[None]:
    """Hold the lock; at the outermost level, save the global state and restore it on exit.
    Inside, grad mode is on and inference mode off: each analysis sets the mode it models itself."""
    with LOCK:
        depth = getattr(_DEPTH, "n", 0)
        _DEPTH.n = depth + 1
        state = _GlobalState() if depth == 0 else None
        try:
            if depth == 0:
                _DEPTH.ambient = (state.grad, torch.is_inference_mode_enabled())
                with torch.inference_mode(False), torch.enable_grad():
                    yield
            else:
                yield
        finally:
            _DEPTH.n = depth
            if state is not None:
                state.restore()


def isolated(fn: F) -> F:
    """Decorate a public entry point: it runs under :func:`isolation`."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with isolation():
            try:
                return fn(*args, **kwargs)
            except RecursionError:
                from .errors import ModelError

                raise ModelError(
                    f"Python's recursion limit ({sys.getrecursionlimit()}) was exceeded: the "
                    f"model is nested too deeply (modules inside modules, thousands deep) or its code recurses "
                    f"without end; flatten the nesting (an nn.Sequential of the layers), or raise the limit with "
                    f"sys.setrecursionlimit") from None
    return wrapper  # type: ignore[return-value]


def ambient_grad_note(grad: bool) -> str | None:
    """The note a report carries when the caller's grad mode differs from what ``grad=`` models."""
    was_grad, was_inference = getattr(_DEPTH, "ambient", (True, False))
    if not grad or (was_grad and not was_inference):
        return None
    where = "torch.inference_mode()" if was_inference else "torch.no_grad()"
    return (f"called under {where}: fxmem models what grad=True says (a training forward, autograd records); "
            f"pass grad=False for inference memory")
