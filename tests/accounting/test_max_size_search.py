"""max_size searches from the analysis' example size, not from 1: where the fixed dims lie outside
the formulas' region it re-analyses once near the answer (size 1 is specialised by PyTorch and
would need an analysis of its own), and its answer is the one a scan over evaluate() gives.
A 0 carries a one-line reason with what the model states alone need."""
from __future__ import annotations

import warnings

import pytest
import torch

import fxmem
from fxmem.units import format_bytes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


def test_outside_the_region_one_reanalysis_and_the_scanned_answer():
    report = fxmem.analyze(_model(), ("B", "N", 16))
    answer = report.max_size("B", budget=200_000, N=1)  # N=1 lies outside the region (N >= 2)
    regions = [region for region, _ in report.regions()]
    assert len(regions) == 2, regions  # the analysis and one re-analysis at N=1: none at B=1
    scanned = max(b for b in range(1, 2 * answer + 2) if report.evaluate(B=b, N=1)["peak"] <= 200_000)
    assert answer == scanned


@pytest.mark.parametrize("budget", [3_000, 40_000])
def test_small_answers_still_reach_one(budget):
    report = fxmem.analyze(_model(), ("B", "N", 16))
    answer = report.max_size("B", budget=budget, N=3)
    fitting = [b for b in range(1, 200) if report.evaluate(B=b, N=3)["peak"] <= budget]
    assert answer == (max(fitting) if fitting else 0)


def test_zero_says_what_the_model_states_need():
    model = _model()
    report = fxmem.analyze(model, ("B", 16), optimizer=torch.optim.AdamW)
    states = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # params, 2 moments (grads: zeroed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answer = report.max_size("B", budget=states // 2, train=True)
    assert answer == 0
    resident = report.evaluate(B=1)["train_resident"]
    assert resident >= states
    assert format_bytes(resident) in answer.reason and "resident alone" in answer.reason
    assert any(answer.reason in str(w.message) for w in caught)
