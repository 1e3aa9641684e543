"""Independent measurement of a real run: what the allocator itself reports.

fxmem's predictions are checked against this, never against its own bookkeeping:

* CPU: PyTorch's profiler with ``profile_memory=True`` receives every allocation and free of the
  CPU allocator, with the block's address. The running total is summed here from the blocks the
  run itself allocated: the maximum is the peak above the start, the last value is what the run
  retained. A free of a block allocated before the run is left out, as the allocator's reporter
  leaves out most of them ("unknown size"); it does report some, with a wrong size, where an
  earlier profile left a stale entry for that address (its "Total Allocated" is then off too).
* CUDA: ``torch.cuda.max_memory_allocated`` / ``memory_allocated`` differences around the call,
  after a warm-up (cuBLAS allocates its workspace through the caching allocator on first use).

>>> m = measure(lambda: torch.randn(1000) * 2, device="cpu")   # doctest: +SKIP
>>> m.peak_above_start, m.retained                               # doctest: +SKIP
(8012, 4000)
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import sys
import tempfile
from typing import Any, Callable, Iterator

# What the profiler's native library (kineto) prints to stderr on every start and stop, whatever
# KINETO_LOG_LEVEL says: ``USDT:<date> <time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start``.
# A model with oneDNN convolutions is calibrated with dozens of profiler sessions. A CUDA build of
# torch on a machine without a GPU adds, on the first session, ``ERROR:... DeviceProperties.cpp:56]
# gpuGetDeviceCount failed with code 35``: kineto looking for GPUs it was not asked to trace.
_PROFILER_CHATTER = re.compile(r"^((USDT|STAGE):\S+ \S+ \d+:\d+ \S+\] "
                               r"|ERROR:\S+ \S+ \d+:\d+ DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed)")


@dataclasses.dataclass
class Measurement:
    """Bytes seen by the allocator during one call (above what was allocated before it)."""

    peak_above_start: int
    retained: int
    result: Any = None


def measure(fn: Callable[[], Any], device: str = "cpu", warmup: int = 1, keep_result: bool = False) -> Measurement:
    """Run ``fn()`` once for real (after ``warmup`` calls) and measure its memory."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    for _ in range(warmup):
        out = fn()
        del out
    if device == "cpu":
        # no gc.collect() first (a quarter of a second in a process that imported transformers): the
        # call runs with the collector off, and frees of blocks made before it are not counted
        return _measure_cpu(fn, keep_result)
    if device == "cuda":
        gc.collect()  # memory_allocated counts every free, so collect the warm-up's cycles before the start
        return _measure_cuda(fn, keep_result)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's cyclic collector off meanwhile (as it was after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def cpu_memory_profile() -> Iterator[Any]:
    """``torch.profiler.profile`` recording the CPU allocator's events, without the native
    library's start/stop lines on stderr (anything else it prints still reaches stderr)."""
    from torch.profiler import ProfilerActivity, profile

    from . import _torch_compat as tc
    from .errors import ProfilerBusyError

    if tc.profiler_active():  # torch keeps one session per process: starting ours would end the user's
        raise ProfilerBusyError(
            "your torch.profiler session is recording, and fxmem measures the CPU allocator with a profiler "
            "session of its own (one per process: starting it would end yours, and your profile would come "
            "back empty); call this outside your profiler session")
    with _filtered_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


@contextlib.contextmanager
def _filtered_native_stderr() -> Iterator[None]:
    """Send file descriptor 2 to a temporary file meanwhile (C++ code writes there, below Python's
    ``sys.stderr``), then pass on every line that is not the profiler's chatter."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not _PROFILER_CHATTER.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _measure_cpu(fn: Callable[[], Any], keep_result: bool) -> Measurement:
    with _no_gc(), cpu_memory_profile() as prof:  # a collection inside the call frees what it did not make
        out = fn()
    totals = _cpu_totals(prof)
    m = Measurement(max([0, *totals]), totals[-1] if totals else 0, out if keep_result else None)
    del out
    return m


def trace_events(prof: Any) -> tuple[list[dict], list[dict]]:
    """A finished CPU profile's events: (all events, the CPU allocator's memory events in order).

    The chrome trace is the one stable, documented export that carries the allocator's running
    total ("Total Allocated", which :func:`_own_blocks` does not trust) and the block addresses.
    """
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
    return events, mem


def allocator_events(prof: Any) -> list[tuple[int, int]]:
    """The CPU allocator's events of a finished profile, in order: ``(address, bytes)``, bytes < 0 for a
    free. Only the blocks allocated within the profile: see :func:`_own_blocks`."""
    return [(a, n) for a, n, _ in _own_blocks(trace_events(prof)[1])]


def _own_blocks(mem: list[dict]) -> list[tuple[int, int, dict]]:
    """``(address, bytes, event)`` of the memory events of blocks allocated within the profile; a free
    carries the size its block was allocated with.

    Why: the reporter keeps a size per address from any profile and forgets it only on a free seen while
    profiling. A block made in one profile and freed outside any leaves a stale size behind; a later block
    at that address, made outside a profile and freed inside this one, is reported with the stale size
    (seen: -72 bytes for a 64-byte buffer replaced by a module's forward). Frees of blocks made before the
    profile are not this run's memory either way."""
    live: dict[int, int] = {}
    own = []
    for e in mem:
        address, nbytes = int(e["args"]["Addr"]), int(e["args"]["Bytes"])
        if nbytes > 0:
            live[address] = nbytes
            own.append((address, nbytes, e))
        elif address in live:
            own.append((address, -live.pop(address), e))
    return own


def _running_totals(own: list[tuple[int, int, dict]]) -> list[int]:
    """Bytes allocated by the profiled run and not yet freed, after each of its events."""
    totals, total = [], 0
    for _, nbytes, _ in own:
        total += nbytes
        totals.append(total)
    return totals


def _cpu_totals(prof: Any) -> list[int]:
    return _running_totals(_own_blocks(trace_events(prof)[1]))


def _measure_cuda(fn: Callable[[], Any], keep_result: bool) -> Measurement:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with _no_gc():
        out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    retained = torch.cuda.memory_allocated() - start
    m = Measurement(peak, retained, out if keep_result else None)
    del out
    return m


def measure_lines(fn: Callable[[], Any], files: set[str], warmup: int = 1) -> list[tuple[str, int]]:
    """Run ``fn()`` for real (CPU) and read the allocator's total after every executed line of
    ``files``: ``[("file.py:35", bytes above the start), ...]`` in execution order.

    Each line runs inside a profiler ``record_function`` span named after it, so the allocator's
    own events can be assigned to lines; nothing of fxmem's analysis is involved.
    """
    import torch

    for _ in range(warmup):
        out = fn()
        del out
    gc.collect()
    spans: list = []

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event in ("line", "return") and spans and spans[-1][1] is frame:
            spans[-1][2].__exit__(None, None, None)
            spans.pop()
        if event == "line":
            label = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
            rf = torch.profiler.record_function(f"fxmem_line {label}")
            rf.__enter__()
            spans.append((label, frame, rf))
        return local

    def global_trace(frame: Any, event: str, arg: Any) -> Any:
        return local if event == "call" and frame.f_code.co_filename in files else None

    with cpu_memory_profile() as prof:
        previous = sys.gettrace()
        sys.settrace(global_trace)
        try:
            out = fn()
        finally:
            sys.settrace(previous)
        del out
    events, mem = trace_events(prof)
    own = _own_blocks(mem)
    totals = _running_totals(own)
    lines = sorted((e for e in events if str(e.get("name", "")).startswith("fxmem_line ") and e.get("ph") == "X"),
                   key=lambda e: e["ts"])
    result = []
    for span in lines:
        end = span["ts"] + span["dur"]
        before = [t for (_, _, e), t in zip(own, totals) if e["ts"] <= end]
        total = before[-1] if before else 0
        result.append((span["name"][len("fxmem_line "):], total))
    return result


def machine_name(device: str = "cpu") -> str:
    """The GPU's name, or the CPU's model and core count (for benchmark and validation records)."""
    import platform

    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def record_snapshot(fn: Callable[[], Any], device: str = "cpu") -> dict:
    """A real run of ``fn()`` as a PyTorch memory snapshot (the dict ``torch.cuda.memory._snapshot()``
    returns), to set beside fxmem's predicted one (``report.snapshot``) in memory_viz.

    CUDA: the caching allocator's own recorded history. CPU (no such recorder): the CPU allocator's
    events from the profiler, as ``alloc`` / ``free_completed`` events of device 0 with their real
    addresses and sizes in bytes (no Python frames: the profiler does not give them), and the
    blocks still allocated at the end as one segment each."""
    if device == "cuda":
        from . import _torch_compat as tc

        with tc.cuda_memory_history() as take:
            out = fn()
            snap = take()
        del out
        return snap
    with cpu_memory_profile() as prof:
        out = fn()
    del out
    trace, live = [], {}
    for k, (address, nbytes) in enumerate(allocator_events(prof)):
        if nbytes > 0:
            live[address] = nbytes
            trace.append({"action": "alloc", "addr": address, "size": nbytes, "stream": 0, "time_us": k,
                          "frames": []})
        elif address in live:  # a free of a block allocated before the run is not part of it
            size = live.pop(address)
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": address, "size": size, "stream": 0, "time_us": k,
                              "frames": []})
    segments = [{"device": 0, "address": a, "total_size": n, "allocated_size": n, "active_size": n,
                 "requested_size": n, "stream": 0, "segment_type": "small" if n < 2**20 else "large",
                 "blocks": [{"address": a, "size": n, "requested_size": n, "state": "active_allocated",
                             "frames": []}]} for a, n in live.items()]
    return {"segments": segments, "device_traces": [trace]}
