"""``fxmem.measure``: what the CPU allocator did during a real call, independent of fxmem's analysis.

Every expectation is derived from tensor sizes (float32: 4 bytes an element), never from a run:
``measure`` (peak above the start, bytes retained, warm-up), ``allocator_events`` and
``trace_events`` on a small profile, ``measure_lines`` on a function of this file, and
``machine_name``. The profiler sees only the calling thread's allocations: one thread throughout.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fxmem.measure import allocator_events, machine_name, measure, measure_lines, trace_events

FLOAT = 4  # bytes of a float32 element


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's


def test_result_alive_while_measured_is_retained():
    m = measure(lambda: torch.empty(1000))
    assert (m.peak_above_start, m.retained) == (1000 * FLOAT, 1000 * FLOAT)
    assert m.result is None  # not kept unless asked


def test_temporaries_count_in_the_peak_only():
    # randn (4000) and the product (4000) are alive together; a Python scalar operand is wrapped in
    # a 0-dim int64 tensor (8 bytes) and cast to float32 (4 bytes) while the product is computed
    m = measure(lambda: torch.randn(1000) * 2)
    assert (m.peak_above_start, m.retained) == (2 * 1000 * FLOAT + 8 + 4, 1000 * FLOAT)
    m = measure(lambda: torch.randn(1000) + torch.randn(1000))  # tensors only: no wrapped scalar
    assert (m.peak_above_start, m.retained) == (3 * 1000 * FLOAT, 1000 * FLOAT)


def allocate_and_free():
    tmp = torch.empty(2000)
    out = torch.empty(100)  # both alive: 8400 bytes
    del tmp
    return out  # 400 bytes stay


def test_a_freed_temporary_is_in_the_peak_not_in_what_is_retained():
    m = measure(allocate_and_free, keep_result=True)
    assert (m.peak_above_start, m.retained) == ((2000 + 100) * FLOAT, 100 * FLOAT)
    assert isinstance(m.result, torch.Tensor) and m.result.shape == (100,)


def test_nothing_allocated_is_zero():
    m = measure(lambda: None)
    assert (m.peak_above_start, m.retained) == (0, 0)


def test_warmup_calls_come_first_and_are_not_measured():
    calls = []
    measure(lambda: calls.append(len(calls)), warmup=3)
    assert calls == [0, 1, 2, 3]
    calls.clear()
    measure(lambda: calls.append(len(calls)), warmup=0)
    assert calls == [0]


def cached_once():
    """Allocates a 2000-byte cache on its first call (like cuBLAS's workspace), then 400 bytes a call."""
    cache = {}

    def fn():
        if "w" not in cache:
            cache["w"] = torch.empty(500)
        return torch.empty(100)
    return fn


def test_warmup_keeps_one_time_allocations_out():
    cold = measure(cached_once(), warmup=0)
    assert (cold.peak_above_start, cold.retained) == ((500 + 100) * FLOAT, (500 + 100) * FLOAT)
    warm = measure(cached_once())  # warmup=1 by default
    assert (warm.peak_above_start, warm.retained) == (100 * FLOAT, 100 * FLOAT)


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        measure(lambda: None, device="tpu", warmup=0)


def profiled(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    return prof


def three_blocks():
    a = torch.empty(100)
    b = torch.empty(50)
    del a
    c = torch.empty(25)
    del b, c


def test_a_block_made_before_the_run_is_not_counted_when_the_run_frees_it():
    # The reporter keeps a size per address from any profile: a block made in a profile and freed
    # outside one leaves its size behind, and a later block at that address, made outside a profile,
    # is reported with that stale size when a profile sees it freed. 500 blocks of 72 bytes made in a
    # profile, freed outside; then 500 of 64 bytes, some at the same addresses (glibc reuses them).
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        first = [torch.empty(18) for _ in range(500)]
    stale = {t.data_ptr() for t in first}
    del first
    holder = [torch.empty(16) for _ in range(500)]
    if not any(t.data_ptr() in stale for t in holder):
        pytest.skip("the allocator reused no freed address: the stale size cannot be provoked here")
    m = measure(lambda: holder.clear(), warmup=0)  # frees only blocks made before the run
    assert (m.peak_above_start, m.retained) == (0, 0)
    m = measure(lambda: torch.empty(250), warmup=0)  # the run's own blocks still count
    assert (m.peak_above_start, m.retained) == (250 * FLOAT, 250 * FLOAT)


def test_allocator_events_in_order_with_signed_bytes():
    three_blocks()
    events = allocator_events(profiled(three_blocks))
    assert [size for _, size in events] == [400, 200, -400, 100, -200, -100]
    addr = [a for a, _ in events]
    assert addr[2] == addr[0] and addr[4] == addr[1] and addr[5] == addr[3]  # each free names its block
    assert addr[0] != addr[1] and addr[3] != addr[1]  # blocks alive together are distinct


def test_trace_events_carry_ops_and_the_running_total():
    three_blocks()
    events, mem = trace_events(profiled(three_blocks))
    assert sum(e.get("name") == "aten::empty" for e in events) == 3
    assert [int(e["args"]["Bytes"]) for e in mem] == [400, 200, -400, 100, -200, -100]
    totals = [int(e["args"]["Total Allocated"]) for e in mem]
    start = totals[0] - 400
    assert [t - start for t in totals] == [400, 600, 200, 300, 100, 0]
    assert all(e["args"]["Device Type"] == 0 for e in mem)  # CPU only
    assert [e["ts"] for e in mem] == sorted(e["ts"] for e in mem)


def lines_of_this_file():
    a = torch.empty(1000)
    b = torch.empty(250)
    del a
    c = torch.ones(10).add(torch.ones(10))  # temporaries freed within the line
    return b


def test_measure_lines_gives_the_total_after_each_line():
    code = lines_of_this_file.__code__
    first = code.co_firstlineno + 1
    label = os.path.basename(code.co_filename)
    got = measure_lines(lines_of_this_file, {code.co_filename})
    after = [1000, 1000 + 250, 250, 250 + 10, 250 + 10]  # elements alive after each line (c lives until the return)
    assert got == [(f"{label}:{first + k}", n * FLOAT) for k, n in enumerate(after)]


def test_measure_lines_ignores_other_files():
    assert measure_lines(lines_of_this_file, {"/nowhere/else.py"}) == []


def test_machine_name():
    name = machine_name("cpu")
    cpu, _, cores = name.rpartition(", ")
    assert cpu.strip() and cores == f"{os.cpu_count()} cores"
