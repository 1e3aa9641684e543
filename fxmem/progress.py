"""Progress of slow steps, visible from Python: fxmem logs it on the ``fxmem`` logger (INFO:
tracing, simulating, calibrating kernels, re-analysing outside the formulas' region), and
``verbose=True`` (an :class:`~fxmem.AnalysisOptions` field) prints those records to stderr.

>>> import logging; logging.getLogger("fxmem").setLevel(logging.INFO)     # doctest: +SKIP

Each step also names its *phase* while it runs (:func:`phase`: capture, simulation, self-check,
verification, measurement ...), readable from another thread (:func:`phase_of`), so that an
analysis stopped by ``timeout=`` (:mod:`fxmem.timeout`) can say where it was.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_SHOWING = threading.local()  # a handler is already printing this thread's progress (nested analyses)
# thread id -> the phase it is in; a dict, not a threading.local: the timeout's watchdog reads it
# from its own thread. An entry lives only while its phase() block runs.
_PHASES: dict[int, str] = {}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """This thread is in phase ``name`` while the block runs (the phase around it afterwards)."""
    me = threading.get_ident()
    outer = _PHASES.get(me)
    _PHASES[me] = name
    try:
        yield
    finally:
        if outer is None:
            _PHASES.pop(me, None)
        else:
            _PHASES[me] = outer


def phased(name: str) -> Callable[[F], F]:
    """Decorate a step: each call of it runs in phase ``name`` (see :func:`phase`)."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate


def phase_of(thread_id: int) -> str | None:
    """The phase thread ``thread_id`` is in (None outside every :func:`phase` block)."""
    return _PHASES.get(thread_id)


@contextlib.contextmanager
def progress_to_stderr() -> Iterator[None]:
    """Print the ``fxmem`` logger's INFO records (progress) to stderr while the block runs
    (``verbose=True``); the logger's level and handlers are as they were afterwards."""
    logger = logging.getLogger("fxmem")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("fxmem: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    outer = showing()
    _SHOWING.on = True
    try:
        yield
    finally:
        _SHOWING.on = outer
        logger.removeHandler(handler)
        logger.setLevel(level)


def showing() -> bool:
    """Whether :func:`progress_to_stderr` is already active on this thread."""
    return getattr(_SHOWING, "on", False)
