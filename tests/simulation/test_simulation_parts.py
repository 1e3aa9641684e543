"""The parts of the simulation (fxmem/simulation/): the storage table, the event log, the recorder
and autograd's bookkeeping - each on its own, and the recorder on *real* tensors, where its walk must
agree with the CPU allocator's own counters."""
from __future__ import annotations

import operator

import pytest
import torch

from fxmem import _torch_compat as tc
from fxmem.accounting.replay import walk
from fxmem.kernels import OUT
from fxmem.measure import measure
from fxmem.records import FREE, NODE, STEP, Node, Phase, Recording, Role, SavedBy
from fxmem.simulation.autograd import Autograd
from fxmem.simulation.events import EventLog
from fxmem.simulation.recorder import Recorder
from fxmem.simulation.storages import StorageTable


@pytest.fixture
def parts():
    _, env = tc.new_fake_mode()
    table, log = StorageTable(env, "cpu"), EventLog()
    return table, log, Recorder(table, log, Autograd(table, log), "cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's


def test_views_share_a_storage_and_deaths_are_seen_once(parts):
    table, _, _ = parts
    x = torch.randn(4, 5)
    i = table.add(x, Role.INPUT, "x")
    assert table.lookup(x.t()) == i and table.lookup(x[1:]) == i
    assert table.storages[i].bytes == 80 and table.storages[i].shape == (4, 5)
    y = torch.randn(3)
    j = table.add(y, Role.ACTIVATION, "y", node="n", step=0, op="aten.randn")
    assert table.dead() == []
    del y
    assert table.dead() == [j] and table.dead() == []
    del x  # resident storages are not the run's to free
    assert table.dead() == []


def test_another_device_is_not_counted(parts):
    table, _, _ = parts
    assert table.add(torch.empty(3, device="meta"), Role.INPUT, "m") is None


def test_event_log_attributes_to_where_the_run_is():
    log = EventLog()
    log.enter("linear")
    with log.at("loss", Phase.LOSS):
        step = log.step("aten.sum", [0], [])
        assert (step.node, step.phase) == ("loss", Phase.LOSS)
    assert (log.node, log.phase) == ("linear", Phase.FORWARD)
    log.freed([0])
    log.ended(Node("loss", "phase", "loss", "", None, [], [], [], 0, 1))
    assert log.events == [(STEP, 0), (FREE, 0), (NODE, 0)]
    log.note("a"), log.note("a")
    assert log.notes == ["a"]


def run_recorded(parts, fn):
    table, log, recorder = parts
    with recorder:
        out = fn()
        recorder.end_node()
    return out


def test_recorder_sees_every_allocation_including_hidden_scratch(parts):
    table, log, _ = parts

    def fn():
        a = torch.randn(10)
        b = a * 2  # a Python number: the CPU kernel wraps it (8 bytes) and casts it (4 bytes)
        del a
        return b.view(5, 2)  # a view allocates nothing

    out = run_recorded(parts, fn)
    steps = [(s.op, [table.storages[i].bytes for i in s.allocs], [p if p is OUT else int(p) for p in s.program])
             for s in log.steps]
    assert steps == [("aten.randn", [40], []), ("aten.mul.Tensor", [40], [8, 4, OUT, -4, -8])]
    assert (FREE, log.steps[0].allocs[0]) in log.events  # a died after the multiplication
    assert table.lookup(out) == log.steps[1].allocs[0]


def test_a_walk_of_the_recording_matches_the_allocator(parts):
    """The recorder's events, walked with its sizes, give the peak and retained bytes the CPU
    allocator measured for the same real computation."""
    table, log, recorder = parts

    def fn():
        h = torch.randn(64, 32)
        g = (h * 0.5).relu()
        t = torch.cat([g, h], dim=1).sum(0)
        del h, g
        return t + 1

    measured = measure(fn, warmup=1)
    out = run_recorded(parts, fn)
    recorder.poll()
    rec = Recording(table.storages, log.steps, log.nodes, log.events, log.notes, table.env, {}, "cpu")
    w = walk(rec, lambda i: int(table.storages[i].bytes), lambda p: int(p), 0, operator.add, operator.neg,
             lambda d: d > 0)
    assert max(v for _, v in w.candidates) == measured.peak_above_start
    assert w.final == measured.retained == out.numel() * 4


def test_saved_tensors_are_attributed_to_the_op_that_saved_them(parts):
    table, log, recorder = parts
    w = torch.randn(6, 6, requires_grad=True)
    table.add(w, Role.PARAMETER, "w")
    log.enter("matmul")
    with tc.saved_tensor_hooks(recorder.saved), recorder:
        x = torch.randn(3, 6)
        y = (x @ w).sin()
        recorder.end_node()
    saved = {table.storages[i].op: table.storages[i].saved_by for i in range(len(table.storages))
             if table.storages[i].saved_by}
    assert saved["aten.randn"] == [SavedBy("matmul", "aten.mm")]  # x, saved by mm for w's gradient
    assert saved["aten.mm"] == [SavedBy("matmul", "aten.sin")]  # the product, saved by sin
    assert y.requires_grad
