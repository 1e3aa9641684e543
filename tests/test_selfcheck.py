"""The report checks itself (fxmem.selfcheck): with real weights on the CPU, analyze runs the forward
once for real at the analysed sizes and compares the allocator's events with the simulation's. A
kernel's hidden scratch fxmem cannot know comes out flagged, naming where the two first part; exact
models stay exact; check=False never runs the model; meta models say they were not checked; the
user's model and RNG are untouched."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import load_example


@torch.library.custom_op("fxmem_selfcheck::hidden_scratch", mutates_args=())
def hidden_scratch(x: torch.Tensor) -> torch.Tensor:
    work = torch.empty(3 * x.numel(), dtype=x.dtype)  # a workspace its fake kernel does not show
    work.zero_()
    return x + work[: x.numel()].view_as(x)


@hidden_scratch.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesHiddenScratch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return hidden_scratch(self.lin(x)).relu()


class CountsRealCalls(nn.Module):
    real_calls = 0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if type(x) is torch.Tensor:  # not fx's Proxy, not a fake tensor: a real call
            type(self).real_calls += 1
        return self.lin(x)


def test_hidden_scratch_is_flagged_with_where_the_runs_part():
    for grad in (False, True):
        report = fxmem.analyze(UsesHiddenScratch(), ("B", 8), grad=grad)
        assert not report.exact and "different" in report.checked
        note = next(n for n in report.notes if n.startswith("self-check"))
        assert "test_selfcheck.py" in note and "first part" in note, note  # the line of the op
        b = report.hints["B"]
        assert f"{3 * b * 8 * 4:,}" in note or "-" in note


@pytest.mark.parametrize("make, specs", [
    (lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)), (("B", 16),)),
    (lambda: load_example("seed_attention").Attention(64, 8), (("B", "L", 64),)),
    (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()), (("B", 3, "H", "W"),)),
])
def test_exact_models_are_checked_and_stay_exact(make, specs):
    torch.manual_seed(0)
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    report = fxmem.analyze(model, *specs)
    assert report.exact and report.checked.startswith("checked against a real forward at") and \
        report.checked.endswith("equal"), (report.checked, report.notes)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm stats too
    assert torch.equal(rng, torch.get_rng_state())


def test_check_false_never_runs_the_model_and_meta_models_are_not_checked():
    CountsRealCalls.real_calls = 0
    report = fxmem.analyze(CountsRealCalls(), ("B", 8), check=False, mode="eager")
    assert CountsRealCalls.real_calls == 0 and "check=False" in report.checked
    checked = fxmem.analyze(CountsRealCalls(), ("B", 8), mode="eager")  # eager: the check calls the forward
    assert CountsRealCalls.real_calls >= 1 and checked.checked.endswith("equal")
    with torch.device("meta"):
        meta = nn.Linear(8, 8)
    assert "meta device" in fxmem.analyze(meta, ("B", 8)).checked
    with pytest.raises(fxmem.SpecError, match="check"):
        fxmem.analyze(nn.Linear(2, 2), ("B", 2), check="yes")


def test_training_steps_are_checked_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    report = fxmem.analyze(model, ("B", 16), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert report.checked.startswith("checked against a real forward and training step"), report.checked
    assert report.exact


def test_a_reanalysis_at_the_users_sizes_checks_itself_too():
    # evaluate() outside the formulas' region (B=1: a size PyTorch fixes) analyses again there; that
    # analysis is checked against a real run at the user's sizes like the first one
    report = fxmem.analyze(UsesHiddenScratch(), ("B", 8), grad=False)
    there, _ = report._at(dict(B=1))
    assert there is not report
    assert not there.exact and there.checked == "checked against a real forward at B=1: different (see the notes)"
    clean = fxmem.analyze(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), ("B", 8), grad=False)
    there, _ = clean._at(dict(B=1))
    assert there is not clean and there.exact and there.checked == "checked against a real forward at B=1: equal"
