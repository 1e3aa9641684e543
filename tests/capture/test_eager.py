"""Eager mode runs the original forward (locals alive until it returns) and attributes memory to
source lines; checked against real runs of the original module, not the traced one."""
from __future__ import annotations

import contextlib

import pytest
import sympy
import torch
import torch.nn as nn

import fxmem
from conftest import check_training_against_real_run, load_example, real_inputs, real_resident
from fxmem.views import format_lines
from fxmem.measure import measure
from zoo.cases import CASES

attention = load_example("seed_attention")
gat = load_example("seed_gat")


def check_eager(model, specs, sizes, grad=True, makers=None):
    report = fxmem.analyze(model, *specs, mode="eager", grad=grad)
    for dims in sizes:
        xs = real_inputs(report, dims, makers)
        with contextlib.nullcontext() if grad else torch.no_grad():
            m = measure(lambda: model(*xs))
        pred = report.evaluate(**dims)
        assert (m.peak_above_start, m.retained) == (pred["peak_above_resident"], pred["retained"]), (dims, report.summary())
        assert pred["resident"] == real_resident(model, xs)
    return report


@pytest.mark.parametrize("name", ["seed002-attention", "seed000-layer-as-written", "seed000-network", "conv-pool",
                                  "transformer", "graph-index", "inplace", "einops"])
def test_eager_forward_matches_real_run_of_the_original(name):
    factory, specs, sizes, kw = CASES[name]
    torch.manual_seed(0)
    check_eager(factory().train(), specs, sizes, makers=kw.get("makers"))


def test_eager_works_where_fx_cannot_trace():
    class SizeBranch(nn.Module):  # control flow on a size: fx cannot trace it, eager mode can
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 8)

        def forward(self, x):
            if x.shape[1] > 16:
                x = x[:, :16]
            return self.lin(x).relu()

    with pytest.raises(fxmem.TraceError, match="mode='eager'"):
        fxmem.analyze(SizeBranch(), ("B", "N", 4), mode="graph")
    report = check_eager(SizeBranch(), (("B", "N", 4),), [dict(B=3, N=20), dict(B=2, N=9)])
    assert any("N" in g for g in report.region)  # the branch taken is a condition of the formulas
    # the default mode falls back to the original forward by itself, and says so and why
    auto = fxmem.analyze(SizeBranch(), ("B", "N", 4))
    assert auto.mode == "eager" and auto.capture.reason and "test_eager.py:" in auto.capture.reason
    assert auto.peak == report.peak and "capture: eager mode" in auto.summary()


def test_eager_keeps_locals_alive_until_return():
    """Seed 002: in the original forward `qkv` lives until the call returns, so the eager peak is
    higher than the traced module's, which frees it after its last use."""
    model = attention.Attention(512, 8)
    graph = fxmem.analyze(model, ("B", "L", 512))
    eager = fxmem.analyze(model, ("B", "L", 512), mode="eager")
    dims = dict(B=64, L=32)
    g, e = graph.evaluate(**dims), eager.evaluate(**dims)
    assert e["retained"] == g["retained"]  # what is kept after the call does not change
    assert e["peak"] - g["peak"] == 4 * 1024**2  # qkv's 12 MiB is still alive during proj: +4 MiB at the peak
    rows = {r.code: r for r in eager.by_line(dims)}
    qkv = rows["qkv = self.qkv(x)"]
    assert qkv.allocated == 64 * 32 * 1536 * 4 and qkv.memory == e["resident"] + qkv.allocated
    # every line of forward is a row, in order, and live bytes match the table's node values
    codes = [r.code for r in eager.by_line()]
    assert codes.index("qkv = self.qkv(x)") < codes.index("x = self.proj(x)")
    assert sympy.expand(eager.by_line()[-1].live - eager.retained) == 0  # after the return: what is retained


def test_by_line_in_graph_mode_merges_nodes_of_a_line():
    report = fxmem.analyze(gat.GraphAttentionLayerFixed(6, 16), ("B", "N", 6), ("B", "N", "N"))
    rows = report.by_line()
    pair_line = [r for r in rows if "torch.cat" in r.code]
    assert len(pair_line) == 1 and len(pair_line[0].nodes) >= 4  # repeat, view, repeat, cat on one line
    B, N = report.symbols["B"], report.symbols["N"]
    assert sympy.expand(pair_line[0].allocated - (64 + 64 + 128) * B * N**2) == 0
    text = format_lines(report.by_line(dict(B=4, N=500)))
    assert "memory" in text and "MiB" in text


def test_eager_training_step_matches_real_run():
    check_training_against_real_run(attention.Attention(64, 8), (("B", "L", 64),), [dict(B=4, L=32), dict(B=2, L=9)],
                                    lambda p: torch.optim.Adam(p), mode="eager")


def test_eager_errors_name_the_line():
    class Bad(nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3)

    with pytest.raises(fxmem.ShapeError, match=r"test_eager.py:\d+: return x @ torch.ones\(3, 3\)"):
        fxmem.analyze(Bad(), ("B", 4), mode="eager")
    with pytest.raises(fxmem.SpecError, match="mode='lazy'"):
        fxmem.analyze(Bad(), ("B", 4), mode="lazy")
    report = fxmem.analyze(Bad(), ("B", 3), mode="eager")
    assert "test_eager.py:" in report.diagram({"B": 2}).source  # lines are its boxes


def test_seed002_per_line_table_equals_a_real_run_line_by_line():
    """Seed 002's case (B=64, L=32, C=512, H=8, math mode): fxmem's per-line live bytes equal the
    CPU allocator's running total after each line of a real call of the original forward."""
    from fxmem.measure import measure_lines

    model = attention.Attention(512, 8)
    x = torch.randn(64, 32, 512)
    real = dict(measure_lines(lambda: model(x), {attention.__file__}))
    report = fxmem.analyze(model, ("B", "L", 512), mode="eager")
    rows = [r for r in report.by_line(dict(B=64, L=32)) if r.location in real]
    assert len(rows) >= 10
    for row in rows:
        assert row.live == real[row.location], (row.location, row.code, row.live, real[row.location])
