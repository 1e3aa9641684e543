"""``torch.compile(model, backend=fxmem.backend(...))``: the compiled model runs as it would without
fxmem (same outputs), and each captured graph's formulas equal the allocator's counters on real
runs of the compiled model at sizes the analysis never saw."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from fxmem.measure import measure
from fxmem.training import default_loss, train_step


class Scatter(nn.Module):
    """GNN-style code torch.fx cannot trace (``torch.zeros(x.size(0), F)``), a buffer, and a dropout
    probability Dynamo passes to the graph as a tensor it makes at each call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.p = 0.25

    def forward(self, x, index):
        h = F.dropout(self.lin(x), self.p, self.training) * self.scale
        out = torch.zeros(x.size(0), 16)
        return out.index_add(0, index, h).relu()


def _inputs(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 6, generator=g), torch.randint(0, n, (n,), generator=g)]


def _compiled(model, **options):
    torch._dynamo.reset()
    b = fxmem.backend(names={"x": ("N", 6), "index": ("N",)}, **options)
    return torch.compile(model, backend=b, dynamic=True), b


def test_compiled_forward_is_unchanged_and_its_formulas_match_real_runs():
    model = Scatter().train()
    with pytest.raises(fxmem.TraceError):
        fxmem.analyze(model, ("N", 6), fxmem.TensorSpec(("N",), dtype=torch.int64), mode="graph")
    compiled, b = _compiled(model)
    xs = _inputs(40)
    torch.manual_seed(1)
    got = compiled(*xs)
    torch.manual_seed(1)
    assert torch.equal(got, model(*xs))
    report = b.report
    assert "torch.compile" in report.capture.text and [s.text for s in report.specs] == ["(N, 6)", "(N)"]
    assert any("0.25" in n for n in report.notes)  # the dropout probability Dynamo wraps in a tensor
    assert report.peak.free_symbols == {report.symbols["N"]}
    for n in (7, 23):
        xs = _inputs(n, seed=n)
        m = measure(lambda: compiled(*xs))
        ev = report.evaluate(N=n)
        assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained), n


def test_compiled_training_step_matches_real_runs():
    model = Scatter().train()
    compiled, b = _compiled(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    compiled(*_inputs(40))
    report = b.report
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    for n in (9, 31):
        xs = _inputs(n, seed=n)
        train_step(compiled, xs, opt, default_loss)  # the optimizer's state exists: a steady state
        m = measure(lambda: train_step(compiled, xs, opt, default_loss))
        ev = report.evaluate(N=n)
        assert (ev["train_peak"] - ev["train_resident"], ev["train_retained"]) == (m.peak_above_start, m.retained)


def test_graph_breaks_give_one_report_per_graph_with_named_dims():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(h.relu())

    model = Broken()
    torch._dynamo.reset()
    b = fxmem.backend(names={"x": ("B", "N", 6)})
    compiled = torch.compile(model, backend=b, dynamic=True)
    x = torch.randn(5, 7, 6)
    assert torch.equal(compiled(x), model(x))
    first, second = b.reports
    assert [s.text for s in first.specs] == ["(B, N, 6)"]
    assert [s.text for s in second.specs] == ["(h_0, h_1, 8)"]  # the local the Python between passes on
    assert "graph break" in " ".join(second.notes) and "graph 2" in second.capture.text
    with pytest.raises(fxmem.SpecError, match="2 graph"):
        b.report


def test_static_compile_gives_the_numbers_of_the_size_it_was_compiled_for():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    torch._dynamo.reset()
    b = fxmem.backend(names={"input": ("B", 6)})
    compiled = torch.compile(model, backend=b, dynamic=False)
    x = torch.randn(5, 6)
    compiled(x)
    report = b.report
    assert not report.symbols and any("B" in n and "dynamic=True" in n for n in report.notes)
    m = measure(lambda: compiled(x))
    assert report.evaluate()["peak_above_resident"] == m.peak_above_start


def test_backend_arguments_are_checked():
    with pytest.raises(fxmem.SpecError, match="names"):
        fxmem.backend(names=["B", "N"])
    with pytest.raises(fxmem.SpecError, match="tuple of names"):
        fxmem.backend(names={"x": "B"})
    with pytest.raises(fxmem.SpecError, match="mode"):
        fxmem.backend(mode="eager")


def test_hugging_face_gpt2_compiled_with_the_backend_matches_real_runs():
    transformers = pytest.importorskip("transformers")
    from corpus.models import CORPUS

    model = CORPUS["gpt2"].build().train()
    torch._dynamo.reset()
    b = fxmem.backend(names={"input_ids": ("B", "L")})
    compiled = torch.compile(model, backend=b, dynamic=True)
    ids = torch.randint(0, 100, (3, 9))
    torch.manual_seed(0)
    got = compiled(ids)
    torch.manual_seed(0)
    assert torch.equal(got, copy.deepcopy(model)(ids))
    report = b.report
    for dims in (dict(B=2, L=12), dict(B=4, L=5)):
        ids = torch.randint(0, 100, (dims["B"], dims["L"]))
        m = measure(lambda: compiled(ids))
        ev = report.evaluate(**dims)
        assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained), dims


def test_activation_checkpointing_in_a_compiled_model_matches_real_runs():
    """Dynamo keeps torch.utils.checkpoint as a higher-order op; the graph runs it, so nothing inside
    is saved for backward and backward recomputes it: forward and SGD step exact on real runs."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(checkpoint(lambda t: self.a(t).relu().exp(), x, use_reentrant=False))

    torch._dynamo.reset()
    b = fxmem.backend(names={"x": ("B", 8)}, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    compiled = torch.compile(Checkpointed(), backend=b, dynamic=True)
    compiled(torch.randn(5, 8))
    report = b.report
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    for n in (7, 30):
        xs = [torch.randn(n, 8)]
        m = measure(lambda: compiled(*xs))
        ev = report.evaluate(B=n)
        assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained)
        train_step(compiled, xs, opt, default_loss)
        m = measure(lambda: train_step(compiled, xs, opt, default_loss))
        assert (ev["train_peak"] - ev["train_resident"], ev["train_retained"]) == (m.peak_above_start, m.retained)
