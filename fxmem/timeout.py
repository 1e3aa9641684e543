"""``timeout=``: a call that runs too long stops, and says where it was.

A forward that loops forever (``while True``) or waits (``time.sleep``) would hold an analysis
forever. With ``timeout=`` seconds (an :class:`~fxmem.AnalysisOptions` field, ``--timeout`` in the
CLI) :func:`deadline` starts a watchdog thread; when the time is up it raises an exception *in the
analysing thread* (``PyThreadState_SetAsyncExc``: it lands at the next Python instruction that
thread runs, in the user's forward or in fxmem). A signal (``SIGALRM``) would only reach the main
thread; this works from any thread. What unwinds is an ordinary exception, so every ``finally``
and ``with`` on the way runs: :mod:`fxmem.isolation` restores torch's global state and releases
its lock, the watchdog is stopped and joined, nothing is left behind. The caller gets
:class:`~fxmem.AnalysisTimeout` naming the phase (:func:`fxmem.progress.phase`) and what to do.

An exception only lands when Python code runs, so while the deadline is armed ``time.sleep`` on
the analysing thread sleeps in short slices (the function ``time.sleep`` only: a model that did
``from time import sleep`` keeps the uninterruptible one); a single long C call (one huge kernel,
a blocking read) is interrupted when it returns. A forward that catches every exception and
carries on is interrupted again every :data:`REPEAT_S` seconds.

>>> with deadline(None):      # no limit: nothing is started
...     pass
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import sys
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

from .errors import AnalysisTimeout
from .progress import phase_of

__all__ = ["deadline", "timed"]

F = TypeVar("F", bound=Callable[..., Any])

REPEAT_S = 1.0  # a forward that swallowed the interruption gets another this often
_SLICE_S = 0.05  # the longest uninterruptible sleep while a deadline is armed

# what to do, by the phase a timeout found the analysis in (fxmem.progress.phase names them)
_ADVICE = {
    "capture": "torch.fx was tracing the forward (running its Python code once): if it loops or waits (a while "
               "loop, time.sleep), fix that; a loop that ends on a tensor's value never ends under tracing, so "
               "try mode='eager' (--mode eager)",
    "simulation": "the forward was running on fake tensors: if it loops or waits (a while loop, time.sleep, a "
                  "lock), fix that; a very deep or large model may just need more time",
    "self-check": "the forward was running for real at small sizes to check the prediction: check=False skips "
                  "that run",
    "verification": "optimize was running the model and its rewrites for real to verify them; give a larger "
                    "timeout, or smaller probe_sizes=",
    "measurement": "validate was running the model for real at the dims asked for: try smaller dims",
    "model loading": "the CLI was importing your file and building the model: if that code loops or waits, "
                     "fix it",
}


class _Expired(BaseException):
    """What the watchdog raises in the analysing thread (a class: CPython instantiates it there,
    without arguments); :func:`deadline` replaces it with an :class:`AnalysisTimeout` that says more.
    Not an ``Exception``, as ``KeyboardInterrupt`` is not: the ``except Exception`` of a forward
    (or of fxmem's and torch's own error handling, which would retry or fall back) lets it pass."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("the analysis ran past its timeout= and was stopped",)))


class _Watchdog:
    """One armed deadline: a daemon thread that interrupts thread ``target`` after ``seconds``."""

    def __init__(self, seconds: float, target: int) -> None:
        self.seconds, self.target = seconds, target
        self.armed = True  # cleared (a plain store, no call) first thing when the block ends
        self.fired_in: str | None = None  # the phase the first interruption found
        self._stop = threading.Event()
        self._lock = threading.Lock()  # an interruption is raised only while armed
        self._thread = threading.Thread(target=self._watch, name="fxmem-timeout", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        wait = self.seconds
        while not self._stop.wait(wait):
            if _importing(self.target):
                wait = _SLICE_S  # an import cut short leaves a half-made module behind: after it
                continue
            with self._lock:
                if not self.armed:
                    return
                if self.fired_in is None:
                    self.fired_in = phase_of(self.target) or "setup"
                _raise_in(self.target, _Expired)
            wait = REPEAT_S

    def halt(self) -> None:
        """Stop and join the thread (after this, nothing more is raised; one raised just before
        may still be on its way: :func:`deadline` lets it land)."""
        self.armed = False
        self._stop.set()
        with self._lock:  # waits for an interruption being raised this instant
            pass
        self._thread.join()


def _importing(thread_id: int) -> bool:
    """Whether thread ``thread_id`` is importing a module (torch imports parts of itself lazily)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _raise_in(thread_id: int, exc: type[BaseException]) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next Python instruction. (Never withdrawn
    with NULL: CPython 3.11 then leaves the thread's eval breaker set for good, and a traced
    frame - eager mode's line tracer - spins on it forever.)"""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))


def supported() -> bool:
    """Whether this Python can interrupt another thread (CPython's C API through ctypes)."""
    return hasattr(ctypes, "pythonapi") and hasattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc")


_ACTIVE = threading.local()  # this thread's armed watchdog (nested calls run under the outermost)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Run the block with at most ``seconds`` (None: no limit); past them, raise
    :class:`~fxmem.AnalysisTimeout` naming the phase. Nested deadlines on a thread (``optimize``
    analysing inside itself) are the outermost one: the time is the whole call's."""
    if seconds is None or getattr(_ACTIVE, "watch", None) is not None or not supported():
        yield
        return
    watch = _Watchdog(seconds, threading.get_ident())
    _ACTIVE.watch = watch
    try:
        with _sliced_sleep(watch.target):
            watch.start()
            yield
    except _Expired:
        watch.armed = False  # first: no second interruption while this one unwinds
        raise AnalysisTimeout(_message(seconds, watch.fired_in or "setup")) from None
    except Exception as exc:
        watch.armed = False
        if watch.fired_in is None:
            raise
        # once the time is up, what escapes is the interruption's doing, even where code on the way
        # (a bare except in the forward, a library) turned it into an error of its own
        raise AnalysisTimeout(_message(seconds, watch.fired_in)) from exc
    finally:
        watch.armed = False
        _ACTIVE.watch = None
        while True:  # an interruption that lands while the watchdog stops is the one being stopped
            try:
                watch.halt()
                for _ in range(3):  # a loop checks for pending interruptions: one still on its way lands here
                    pass
                break
            except _Expired:
                continue
    if watch.fired_in is not None:
        # the block returned although its time was up: the interruption landed where something
        # swallowed it (a weakref callback - the storage table's record of a death -, a bare
        # except) and the call went on without that work, so what it computed is not returned
        raise AnalysisTimeout(_message(seconds, watch.fired_in))


def timed(options_in: str | None) -> Callable[[F], F]:
    """Decorate a public entry point: the whole call runs under :func:`deadline` of its
    ``timeout=`` - read from its ``options=`` and, when ``options_in`` names its ``**`` dict of
    option values (``"option_values"``), from ``timeout=`` there (checked first, as
    :class:`~fxmem.AnalysisOptions` checks it)."""
    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with deadline(_timeout_of(signature, options_in, args, kwargs)):
                return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate


def _timeout_of(signature: inspect.Signature, options_in: str | None, args: tuple, kwargs: dict) -> float | None:
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None  # the call itself raises it
    values = bound.get(options_in, {}) if options_in else {}
    seconds = values.get("timeout", getattr(bound.get("options"), "timeout", None))
    if seconds is None:
        return None
    from .options import AnalysisOptions

    return AnalysisOptions.of(timeout=seconds).timeout  # a SpecError now for a value that means nothing


def _message(seconds: float, phase: str) -> str:
    advice = _ADVICE.get(phase, "the model may be very large, or its code may loop or wait")
    return (f"fxmem stopped after timeout={seconds:g} s, in the {phase} phase.\n"
            f"  what to do: {advice}; pass a larger timeout= (--timeout SECONDS), or timeout=None for no limit")


@contextlib.contextmanager
def ctrl_c() -> Iterator[None]:
    """Ctrl-C raises ``KeyboardInterrupt`` while the block runs, as Python's own handler does -
    except during an import, where it is raised as soon as the import is done: torch imports parts
    of itself from C++ (the first fx trace symbolizes tracebacks, importing ``torch._inductor``)
    and drops an exception raised there, so a Ctrl-C at that moment would be lost. Main thread
    only (elsewhere the block just runs); the previous handler is put back."""
    import signal

    if threading.current_thread() is not threading.main_thread() or not supported():
        yield
        return
    me = threading.get_ident()

    def handler(signum: int, frame: Any) -> None:
        if not _importing(me):
            raise KeyboardInterrupt
        threading.Thread(target=_after_import, args=(me, KeyboardInterrupt), name="fxmem-ctrl-c", daemon=True).start()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _after_import(thread_id: int, exc: type[BaseException]) -> None:
    while _importing(thread_id):
        time.sleep(0.01)  # (the module's _REAL_SLEEP: this thread is never sliced)
    _raise_in(thread_id, exc)


_REAL_SLEEP = time.sleep
_SLICED: set[int] = set()  # the threads whose time.sleep is sliced (those with an armed deadline)
_SLICED_LOCK = threading.Lock()
_OUTER_SLEEP: list = []  # what time.sleep was before the first deadline armed (put back by the last)


def _sleep(seconds: float) -> None:
    """``time.sleep``, in short slices on a thread with an armed deadline (each slice runs Python
    code, where the watchdog's exception can land)."""
    if threading.get_ident() not in _SLICED:
        return _REAL_SLEEP(seconds)
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return None
        _REAL_SLEEP(min(left, _SLICE_S))


@contextlib.contextmanager
def _sliced_sleep(thread_id: int) -> Iterator[None]:
    """``time.sleep`` is :func:`_sleep` while the block runs (put back when no deadline is armed)."""
    with _SLICED_LOCK:
        if not _SLICED:
            _OUTER_SLEEP.append(time.sleep)
            time.sleep = _sleep
        _SLICED.add(thread_id)
    try:
        yield
    finally:
        with _SLICED_LOCK:
            _SLICED.discard(thread_id)
            if not _SLICED:
                time.sleep = _OUTER_SLEEP.pop()
