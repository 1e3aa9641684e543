"""Measured kernel workspaces (fxmem.kernels.measured): where no fit from small samples describes a
oneDNN kernel's scratch, it is a function of the kernel's input sizes whose value is one real run of
that kernel alone. Checked against real training steps at sizes the analysis never saw, from the
one simulation; on every CPU (the fits are switched off here, so the measured path is taken
whichever oneDNN path this CPU has)."""
from __future__ import annotations

import pytest
import torch

import fxmem
from conftest import check_steps_against_report
from fxmem.kernels import calibrate, measured
from fxmem.kernels.measured import MeasuredBytes, MeasureError, summarize
from fxmem.kernels.registry import OUT, OutAt
from zoo import StridedNet


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


@pytest.fixture
def no_fits(monkeypatch):
    """Every calibrated kernel (convolutions, batch norms) measured instead of fitted."""
    monkeypatch.setattr(calibrate, "_fit_cached", lambda *a, **k: None)


def test_stretches_keep_every_moment_of_the_call():
    """A real convolution backward's program (recorded on 2 threads of an AMD EPYC) read as (up, down) per stretch between
    its outputs: the live bytes at every moment are the real ones."""
    program = (2304, 18432, 4608, 61488, -61488, -18432, -2304, 4608, OUT, -4608, -4608, 2304, 4608, 18432, 128,
               -4608, -2304, OutAt(2), OutAt(1), -18432, -128)
    markers, stretches = summarize(program)
    assert markers == (OUT, OutAt(2), OutAt(1))
    assert stretches == [(86832, 77616), (16256, 6912), (0, 0), (0, 18560)]
    # the most held at any moment of each stretch, and where each ends, as in the real program
    level = 0
    for k, part in enumerate([program[:8], program[9:17], (), program[19:]]):
        start, high = level, level
        for p in part:
            level += p
            high = max(high, level)
        assert (high - start, high - level) == stretches[k]
    assert level == 0


def test_measured_training_step_is_exact_at_unseen_sizes_from_one_simulation(no_fits):
    torch.manual_seed(0)
    model = StridedNet().train()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw, check=False, hints=dict(B=7, H=41, W=37))
    assert report.exact, report.notes
    assert report.formulas()["train_peak"].has(MeasuredBytes)
    assert any("measured by one real run" in n for n in report.notes)
    assert "ws" in report.summary()
    sizes = [dict(B=2, H=96, W=80), dict(B=5, H=13, W=70), dict(B=3, H=64, W=64), dict(B=2, H=17, W=9)]
    inside = [d for d in sizes if report._holds_at(d)]
    assert len(inside) >= 3, report.region
    check_steps_against_report(model, report, sizes, adamw)
    for d in inside:  # answered from the same recording: no new simulation
        assert report._at(d)[0]._plan.rec is report._plan.rec, d
    # and a size PyTorch treats apart (B=1): its own analysis, measured and exact in turn
    check_steps_against_report(model, report, [dict(B=1, H=20, W=24)], adamw)


def test_a_size_too_large_to_measure_is_refused_not_guessed(no_fits, monkeypatch):
    torch.manual_seed(0)
    model = StridedNet().train()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw, check=False, hints=dict(B=3, H=20, W=20))
    monkeypatch.setattr(measured, "MEASURE_ELEMENTS", 10_000)
    with pytest.raises(MeasureError, match=r"convolution.*real run"):
        report.evaluate(B=40, H=64, W=64)
    with pytest.raises(MeasureError):
        report.max_size("B", "1GiB", train=True, H=64, W=64)


def test_a_workspace_unknown_at_the_example_sizes_sends_other_sizes_to_their_own_analysis(no_fits, monkeypatch):
    """Example sizes too large to measure there and no fit: the workspace is unknown, the report
    says so, and a size asked is analysed where the kernel can be measured - never a number from
    formulas known to lack a buffer (before: 27 % under a real step, silently)."""
    torch.manual_seed(0)
    model = StridedNet().train()
    monkeypatch.setattr(measured, "MEASURE_ELEMENTS", 1000)
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw, check=False, hints=dict(B=7, H=41, W=37))
    assert not report.exact and any("cannot predict" in n for n in report.notes)
    monkeypatch.setattr(measured, "MEASURE_ELEMENTS", 1 << 24)
    sizes = [dict(B=2, H=96, W=80), dict(B=3, H=30, W=31)]
    check_steps_against_report(model, report, sizes, adamw)
    assert all(report._at(d)[0] is not report for d in sizes)


def test_past_the_largest_run_a_workspace_is_extended_along_the_batch_or_refused(no_fits, monkeypatch):
    """A size whose kernel input is larger than one real run may be: the kernel is measured at three
    batch sizes up to that size and extended along the batch where the three lie on one line. The
    answer is the real step's (a batch of 100 against the allocator), or, on a CPU whose buffers do
    not grow along one line, a refusal - never a number from a guess."""
    torch.manual_seed(0)
    model = StridedNet().train()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw, check=False, hints=dict(B=7, H=41, W=37))
    monkeypatch.setattr(measured, "MEASURE_ELEMENTS", 16 * 24 * 24 * 20)  # c2's input: a batch of 20 at most
    try:
        check_steps_against_report(model, report, [dict(B=100, H=24, W=24)], adamw)
    except MeasureError as refused:
        assert "one line" in str(refused) or "whole bytes" in str(refused)


def test_a_kernel_that_orders_its_outputs_otherwise_sends_that_size_to_its_own_analysis(no_fits, monkeypatch):
    """Where a measured kernel allocates its outputs in another order than where it was recorded,
    its program cannot be read into the recorded one: that size is analysed (and exact), not
    answered from a program of another shape."""
    from fxmem.accounting.plan import MemoryPlan
    from fxmem.kernels.measured import StructureChanged

    torch.manual_seed(0)
    model = StridedNet().train()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw, check=False, hints=dict(B=7, H=41, W=37))
    evaluate = MemoryPlan.evaluate

    def changed(plan, values):
        if plan is report._plan:
            raise StructureChanged("aten.convolution_backward allocates its outputs in another order")
        return evaluate(plan, values)

    monkeypatch.setattr(MemoryPlan, "evaluate", changed)
    size = dict(B=3, H=30, W=31)
    check_steps_against_report(model, report, [size], adamw)
    assert report._at(size)[0] is not report


def test_example_sizes_too_large_to_run_once_are_measured_along_the_batch_not_fitted(monkeypatch):
    """Example sizes past one real run (here lowered: a batch of 20 of c2's input at most) are
    measured at three batches up to that and extended along the batch where that holds at the
    example sizes: exact against real steps there and past them. On a CPU where the buffers do not
    grow along one line the kernel is fitted instead, and the report says the fit is not checked
    above a size and is not exact - never exact on an unchecked fit."""
    torch.manual_seed(0)
    model = StridedNet().train()
    monkeypatch.setattr(measured, "MEASURE_ELEMENTS", 16 * 24 * 24 * 20)
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw, check=False, hints=dict(B=40, H=24, W=24))
    fitted = [f for f in report._plan.rec.fits if f.fitted is not None]
    if fitted:  # this CPU's buffers do not extend along the batch
        assert not report.exact and any("not checked" in n for n in report.notes), report.notes
        return
    assert report.exact, report.notes
    assert report.formulas()["train_peak"].has(MeasuredBytes)
    check_steps_against_report(model, report, [dict(B=40, H=24, W=24), dict(B=33, H=24, W=24)], adamw)
