"""Run a real kernel where it cannot take the user's process down with it.

Some real CPU kernels do not check what they are given and die instead of raising:
``aten._scaled_dot_product_flash_attention_for_cpu`` on an empty key sequence ends the interpreter
with SIGFPE (exit 136, nothing printed); a custom op's C++ kernel may abort. fxmem's kernel probes
(:mod:`fxmem.kernels.accepts`) run such calls - a custom op (any namespace but ``aten``/``prims``),
or a call with a zero-size dim - through :func:`run_isolated`: in a forked child process, which
reports whether the kernel returned, raised (its error type and first line) or died (the signal).
The parent only waits; a crash becomes an answer, never a dead interpreter. The child may not write
a core file: it is a copy of the user's process (a model of several GiB makes a core file as large),
written into the user's working directory on machines that keep core dumps.

Where the platform cannot fork (Windows), the call is not run at all (``None``: nothing known).

>>> run_isolated(lambda: torch.ones(2).sum())          # doctest: +SKIP
('ok', '')
"""
from __future__ import annotations

import os
import pickle
try:
    import resource
except ImportError:  # Windows: no fork either, nothing is isolated there
    resource = None
import select
import signal
import time
import warnings
from typing import Any, Callable

import torch

TIMEOUT_S = 60.0  # a probe runs on a few small tensors; far longer than that is a hung kernel


def can_isolate() -> bool:
    """Whether :func:`run_isolated` can run anything on this platform (it needs ``os.fork``)."""
    return hasattr(os, "fork") and hasattr(os, "waitpid")


def _no_core_file() -> None:
    """Forbid this (child) process a core file: a kernel that dies here is an answer, not a crash to
    debug, and the dump would copy the whole of the user's process onto their disk."""
    if resource is not None:
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ValueError, OSError):  # a platform without the limit: nothing more can be done
            pass


def run_isolated(fn: Callable[[], Any], timeout_s: float = TIMEOUT_S) -> tuple[str, str] | None:
    """Run ``fn`` in a forked child: ``("ok", "")``, ``("raises", "<Type>: <first line>")``,
    ``("crash", "signal SIGFPE")`` (or an exit status), ``("hang", ...)`` after ``timeout_s``
    seconds (the child is killed), or None where the platform cannot fork."""
    if not can_isolate():
        return None
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python >= 3.12 warns on fork in a threaded process
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: run, report, leave without running any of the parent's exit code
        code = 0
        try:
            os.close(read_end)
            _no_core_file()
            # one thread: a forked child must not enter the parent's OpenMP pool
            torch.set_num_threads(1)
            try:
                fn()
                answer = ("ok", "")
            except BaseException as exc:  # noqa: BLE001 - the kernel's error is the answer
                text = str(exc).strip()
                answer = ("raises", f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": "))
            os.write(write_end, pickle.dumps(answer))
        except BaseException:  # noqa: BLE001 - nothing may escape into the parent's code
            code = 3
        finally:
            os._exit(code)
    os.close(write_end)
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "hang", f"did not return within {timeout_s:g} s"
            ready, _, _ = select.select([read_end], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return "crash", f"signal {name}"
    if data:
        try:
            answer = pickle.loads(data)
        except Exception:  # noqa: BLE001 - a torn message: the child died while writing
            answer = None
        if isinstance(answer, tuple) and len(answer) == 2:
            return answer
    return "crash", f"exit status {os.WEXITSTATUS(status)}"
