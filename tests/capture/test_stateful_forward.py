"""A forward that stores a computed value on its module (a call counter in a buffer, a cache of the
last activation) cannot be an fx graph: fx records the computation but not the assignment, so the
graph frees what the model keeps after the call, and the proxy fx leaves on the module recorded
into a finished trace when the graph ran (a TraceError from inside the simulation). The default
mode analyses the original forward instead, exactly; mode='graph' refuses, naming the line; the
user's model is never changed.
"""
from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch
import torch.nn as nn

import fxmem
from zoo import CachesActivation
from fxmem.errors import TraceError
from fxmem.measure import measure


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = 0
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        self.seen += 1
        return self.fc(x)


class ReplacesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("running", torch.zeros(16))

    def forward(self, x):
        h = self.fc(x)
        self.running = 0.9 * self.running + 0.1 * h.detach().mean(0)
        return h.relu()


class CachesInList(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.history = []

    def forward(self, x):
        h = self.inner(x)
        self.history = [h.sum(-1)]
        return h


MODELS = [CountsCalls, ReplacesBuffer, CachesActivation, CachesInList]


class KeepsInputAndSizes(nn.Module):
    """What it stores costs no memory: the input (alive anyway), its sizes; the buffer is read after."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))
        self.sizes = []

    def forward(self, x):
        self.last_input = x
        self.sizes.append(x.shape[0] * 2)
        self.scale = self.scale  # the same buffer stored back
        return self.fc(x) * self.scale


def test_storing_what_costs_no_memory_keeps_graph_mode_and_is_exact():
    import conftest
    model = KeepsInputAndSizes()
    report = conftest.check_against_real_run(model, (("B", 16),), [dict(B=5), dict(B=40)])
    assert report.mode == "graph"
    assert not hasattr(model, "last_input") and model.sizes == []


def _state(model):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)) for k, v in vars(model).items()
            if not k.startswith("_")} | {k: v.clone() for k, v in model.named_buffers()}


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_a_forward_that_stores_on_its_module_is_exact_in_the_default_mode(cls):
    torch.manual_seed(0)
    model = cls()
    before = _state(model)
    for grad in (True, False):
        report = fxmem.analyze(model, ("B", 16), grad=grad)
        assert report.mode == "eager" and "stores a tensor computed from its inputs" in report.capture.reason
        after = _state(model)
        assert after.keys() == before.keys() and all(
            torch.equal(after[k], v) if isinstance(v, torch.Tensor) else after[k] == v for k, v in before.items())
        for b in (5, 33):
            at = report.evaluate(B=b)
            assert (at["peak_above_resident"], at["retained"]) == _first_call(model, b, grad), (cls, b)


def _first_call(model, b, grad):
    """(peak above start, retained) bytes of a first call of a fresh copy of ``model`` at batch ``b``."""
    x = torch.randn(b, 16)
    with torch.set_grad_enabled(grad):
        copy.deepcopy(model)(x)  # warm-up on another copy: the measured call is a first call, as analysed
        fresh = copy.deepcopy(model)
        real = measure(lambda: fresh(x), warmup=0)
    return real.peak_above_start, real.retained


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_graph_mode_refuses_naming_the_attribute_and_line(cls):
    with pytest.raises(TraceError) as info:
        fxmem.analyze(cls(), ("B", 16), mode="graph")
    text = str(info.value)
    where = f"{os.path.basename(inspect.getsourcefile(cls))}:"  # the file that defines the model
    assert where in text and "self." in text and "mode='eager'" in text
