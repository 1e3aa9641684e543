"""report.snapshot(): the predicted run in PyTorch's memory-snapshot format, read by torch's own
torch.cuda._memory_viz (no GPU needed), and its replay against the allocator of a real run."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
from torch.cuda import _memory_viz as viz

import fxmem
from conftest import ROOT, load_example, real_inputs
from fxmem.measure import measure
from fxmem.records import Phase
from fxmem.training import default_loss, train_step

attention = load_example("seed_attention")
gat = load_example("seed_gat")
ADAMW = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731


def _replay(snap: dict) -> tuple[int, int]:
    """(peak, final) live bytes from the events alone, as memory_viz's timeline adds them up."""
    live = peak = 0
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= e["size"]
    return peak, live


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    model = attention.Attention(64, 8)
    return model, fxmem.analyze(model, ("B", "L", 64), optimizer=ADAMW)


@pytest.mark.parametrize("dims", [dict(B=3, L=11), dict(B=2, L=29)])
def test_replayed_events_reach_the_peak_a_real_run_reaches(report, dims):
    model, r = report
    resident = r.evaluate(**dims)["resident"]
    snap = r.snapshot(dims)
    peak, final = _replay(snap)
    xs = real_inputs(r, dims)
    m = measure(lambda: r.graph_module(*xs))  # the allocator's own counters, on a real run
    assert peak - resident == m.peak_above_start
    assert final - resident == m.retained
    # the training step: forward, backward, AdamW step, zero_grad, after a warm-up step
    step = r.snapshot(dims, train=True)
    opt = ADAMW(r.graph_module.parameters())
    train_step(r.graph_module, xs, opt, default_loss)
    m = measure(lambda: train_step(r.graph_module, xs, opt, default_loss))
    ev = r.evaluate(**dims)
    assert _replay(step)[0] == ev["train_peak"]
    assert _replay(step)[0] - ev["train_resident"] == m.peak_above_start


def test_torch_memory_viz_reads_it(report, tmp_path):
    _, r = report
    path = tmp_path / "attention.pickle"
    snap = r.snapshot(dict(B=3, L=11), path=str(path), train=True)
    with open(path, "rb") as f:
        assert pickle.load(f) == snap
    plain = lambda lines: lines  # noqa: E731  (torch's default fetches flamegraph.pl from the web)
    assert "active_allocated" in viz.memory(snap, format_flamegraph=plain)
    forward = r.snapshot(dict(B=3, L=11))
    assert "seed_attention.py" in viz.segments(forward, format_flamegraph=plain)  # what the forward keeps
    assert "optimizer_state" in viz.segments(snap, format_flamegraph=plain)
    assert "total_allocated" in viz.segsum(snap)
    assert "entries" in viz.trace(snap)
    assert "snapshot.pickle" in viz.trace_plot(snap) and "snapshot.pickle" in viz.segment_plot(snap)
    # the segments the training step leaves that the forward does not (gradients freed, state kept)
    viz.compare(forward["segments"], snap["segments"], format_flamegraph=plain)


def test_every_allocation_is_a_storage_of_the_report_with_its_line(report):
    _, r = report
    snap = r.snapshot(dict(B=3, L=11))
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    storages = [s for s in r.storages if (s.step is None and s.role.value != "optimizer_state")
                or (s.step is not None and s.phase == Phase.FORWARD)]
    named = [e for e in allocs if "hidden scratch" not in str(e["frames"])]
    assert len(named) == len(storages)
    lines = {f["line"] for e in named for f in e["frames"] if f["filename"].endswith("seed_attention.py")}
    assert lines, "frames carry the user's source lines"
    # every fx node that allocates appears in some frame
    nodes = {s.node for s in storages if s.node and s.step is not None}
    text = str(allocs)
    assert all(f"fx node {n}" in text for n in nodes)


def test_refusals_and_bad_paths():
    r = fxmem.analyze(gat.GraphAttentionLayerFixed(6, 8), ("B", "N", 6), ("B", "N", "N"))
    with pytest.raises(fxmem.SpecError, match="optimizer="):
        r.snapshot(dict(B=2, N=5), train=True)
    with pytest.raises(fxmem.FxMemError, match="cannot write"):
        r.snapshot(dict(B=2, N=5), path="/nonexistent-folder/x.pickle")


def test_cli_writes_a_snapshot(tmp_path):
    out = tmp_path / "gat.pickle"
    res = subprocess.run([sys.executable, "-m", "fxmem", "analyze", "examples/seed_gat.py:GraphAttentionLayerFixed",
                          "--init", "in_features=6", "--init", "out_features=8", "--input", "B,N,6", "--input", "B,N,N",
                          "--dims", "B=2,N=9", "--snapshot", str(out)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    with open(out, "rb") as f:
        snap = pickle.load(f)
    r = fxmem.analyze(gat.GraphAttentionLayerFixed(6, 8), ("B", "N", 6), ("B", "N", "N"))
    assert _replay(snap)[0] == r.evaluate(B=2, N=9)["peak"]


@pytest.mark.cuda_sim
def test_simulated_cuda_sizes_are_blocks():
    r = fxmem.analyze(attention.Attention(64, 8), ("B", "L", 64), device="cuda")
    snap = r.snapshot(dict(B=3, L=11))
    assert all(e["size"] % 512 == 0 for e in snap["device_traces"][0] if e["action"] == "alloc")
    assert _replay(snap)[0] == r.evaluate(B=3, L=11)["peak"]


def test_by_line_prints_as_a_table_and_dir_is_the_public_api():
    r = fxmem.analyze(attention.Attention(64, 8), ("B", "L", 64), mode="eager")
    rows = r.by_line(dict(B=64, L=32))
    text = str(rows)
    assert text.splitlines()[0].split()[:2] == ["line", "code"] and "LineRow(" not in text
    assert all(len(line) <= 200 for line in text.splitlines())
    assert len(text.splitlines()) == len(rows) + 2 and rows[0].code  # still a list of rows
    symbolic = str(r.by_line())  # formulas are cut to the column, whole on the rows
    assert all(len(line) <= 200 for line in symbolic.splitlines())
    names = dir(fxmem)
    assert "analyze" in names and "AnalysisOptions" in names
    assert not {"Any", "sys", "importlib", "types", "warnings", "ensure_passes"} & set(names)


def test_validate_writes_the_predicted_and_the_real_run_side_by_side(tmp_path):
    torch.manual_seed(0)
    model = attention.Attention(64, 8)
    dims = dict(B=3, L=13)
    result = fxmem.validate(model, ("B", "L", 64), dims=dims, device="cpu", optimizer=ADAMW,
                            snapshot=tmp_path / "snaps")
    assert result.ok, result
    rows = {r.what: r for r in result.rows}
    resident = fxmem.analyze(model, ("B", "L", 64), optimizer=ADAMW).evaluate(**dims)
    plain = lambda lines: lines  # noqa: E731
    for name, row, start in (("forward", "forward: peak above resident", resident["resident"]),
                             ("step", "training step: peak above resident", resident["train_resident"])):
        with open(tmp_path / "snaps" / f"predicted_{name}.pickle", "rb") as f:
            predicted = pickle.load(f)
        with open(tmp_path / "snaps" / f"real_{name}.pickle", "rb") as f:
            real = pickle.load(f)
        # the real snapshot is the allocator's events of a run (above what was allocated before it):
        # its peak is the measured one, and the predicted snapshot's peak above resident matches it
        assert _replay(real)[0] == rows[row].measured == _replay(predicted)[0] - start
        for snap in (predicted, real):  # both open in torch's own viewer code
            assert "total_allocated" in viz.segsum(snap) and "entries" in viz.trace(snap)
            viz.memory(snap, format_flamegraph=plain)
