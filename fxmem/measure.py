"""Independent measurement of a real run: what the allocator itself reports.

fxmem's predictions are checked against this, never against its own bookkeeping:

* CPU: PyTorch's profiler with ``profile_memory=True`` receives every allocation and free of the
  CPU allocator together with the allocator's running total ("Total Allocated"). The total is
  process-wide and carries over between profiling sessions, so it is read relative to its value
  just before the first event: the maximum is the peak above the start, the last value is what the
  run retained.
* CUDA: ``torch.cuda.max_memory_allocated`` / ``memory_allocated`` differences around the call,
  after a warm-up (cuBLAS allocates its workspace through the caching allocator on first use).

>>> m = measure(lambda: torch.randn(1000) * 2, device="cpu")   # doctest: +SKIP
>>> m.peak_above_start, m.retained                               # doctest: +SKIP
(8012, 4000)
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile
from typing import Any, Callable


@dataclasses.dataclass
class Measurement:
    """Bytes seen by the allocator during one call (above what was allocated before it)."""

    peak_above_start: int
    retained: int
    result: Any = None


def measure(fn: Callable[[], Any], device: str = "cpu", warmup: int = 1, keep_result: bool = False) -> Measurement:
    """Run ``fn()`` once for real (after ``warmup`` calls) and measure its memory."""
    for _ in range(warmup):
        out = fn()
        del out
    gc.collect()
    if device == "cpu":
        return _measure_cpu(fn, keep_result)
    if device == "cuda":
        return _measure_cuda(fn, keep_result)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def _measure_cpu(fn: Callable[[], Any], keep_result: bool) -> Measurement:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    totals = _cpu_totals(prof)
    m = Measurement(max([0, *totals]), totals[-1] if totals else 0, out if keep_result else None)
    del out
    return m


def _cpu_totals(prof: Any) -> list[int]:
    # The chrome trace is the one stable, documented export that carries "Total Allocated".
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
    if not mem:
        return []
    start = int(mem[0]["args"]["Total Allocated"]) - int(mem[0]["args"]["Bytes"])
    return [int(e["args"]["Total Allocated"]) - start for e in mem]


def _measure_cuda(fn: Callable[[], Any], keep_result: bool) -> Measurement:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    retained = torch.cuda.memory_allocated() - start
    m = Measurement(peak, retained, out if keep_result else None)
    del out
    return m
