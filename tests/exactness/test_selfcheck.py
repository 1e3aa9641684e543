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
from conftest import load_example, real_inputs, real_resident
from fxmem.selfcheck import small_point


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



@torch.library.custom_op("fxmem_selfcheck::batched_scratch", mutates_args=())
def batched_scratch(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 1:
        return x.clone()
    work = torch.empty(3 * x.numel(), dtype=x.dtype)  # only for a batch: hidden from the fake kernel
    work.zero_()
    return x + work[: x.numel()].view_as(x)


@batched_scratch.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesBatchedScratch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return batched_scratch(self.lin(x)).relu()


def test_a_reanalysis_keeps_the_doubt_its_model_s_real_run_raised():
    # the first analysis' real run (B=2) disagreed; the re-analysis at B=1 agrees with its own real
    # run there, but it is the same model's kernels: its numbers are flagged too, saying from where
    report = fxmem.analyze(UsesBatchedScratch(), ("B", 8), grad=False)
    assert not report.exact
    there, _ = report._at(dict(B=1))
    assert there is not report and there.checked == "checked against a real forward at B=1: equal"
    assert not there.exact
    inherited = [n for n in there.notes if n.startswith("from the analysis at B=")]
    assert inherited and "self-check: a real forward at B=2" in inherited[0], there.notes
    assert report._at(dict(B=1))[0] is there and there.notes.count(inherited[0]) == 1  # once, however often asked


# --- every number a user reads: resident, train_resident, train_peak, optimizer_state, grads ---

@torch.library.custom_op("fxmem_selfcheck::padded_copy", mutates_args=())
def padded_copy(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(2 * x.numel(), dtype=x.dtype)[: x.numel()]  # twice the copy: its fake kernel does not say
    return out.view_as(x).copy_(x)


@padded_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class PaddedMomentum(torch.optim.Optimizer):
    """SGD with momentum whose buffer a custom kernel makes in a storage twice its size."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = padded_copy(p.grad)
                else:
                    state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


class CutTable(nn.Module):
    """A position table cut from a longer one when built: the buffer is a view, and the model holds
    the whole table's storage (16 KiB for 512 B of rows)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("pe", torch.randn(256, 16)[:8])

    def forward(self, x):
        return self.lin(x) + self.pe


class TiedHead(nn.Module):
    """An embedding and an output head sharing one weight: counted once in memory, twice by a naive
    sum over modules."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids))))


class HalfTrained(nn.Module):
    """Half of a weight trains: its gradient is a slice of cat's backward, and ``.grad`` keeps that
    whole storage (2,048 B for a 512 B parameter)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(8, 16))
        self.register_buffer("frozen", torch.randn(24, 16))

    def forward(self, x):
        return x @ torch.cat([self.p, self.frozen]).t()


def _self_check_note(report, quantity):
    return next(n for n in report.notes if n.startswith("self-check") and f" {quantity} " in n)


def test_optimizer_state_larger_than_predicted_is_caught():
    # the peak above the resident bytes is the same in both runs (the buffer is made in the first
    # step); only the absolute numbers differ: the real state is 576 B, the prediction 288 B
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    report = fxmem.analyze(model, ("B", 8), optimizer=PaddedMomentum)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.optimizer_state == params
    assert not report.exact and report.checked.endswith(": different (see the notes)"), report.checked
    assert "a real training step" not in " ".join(report.notes)  # not the peak: the absolute numbers
    note = _self_check_note(report, "optimizer_state")
    assert f"optimizer_state {2 * params:,} B (the analysis says {params:,} B, {-params:+,} B)" in note, note
    assert "train_resident" in note and "train_peak" in note and " grads " not in note


@pytest.mark.parametrize("optimizer", [None, lambda p: torch.optim.Adam(p)])
def test_resident_is_checked_against_the_real_storages(optimizer):
    # the analysis counts a view's own bytes; the real model holds the table it was cut from: the
    # self-check counts the real storages and says so (or, once the analysis counts the whole
    # storage, agrees with it)
    model = CutTable()
    report = fxmem.analyze(model, ("B", 8, 16), optimizer=optimizer)
    dims = small_point(report)
    real = real_resident(model, real_inputs(report, dims))
    predicted = report.evaluate(**dims)["resident"]
    if predicted == real:
        assert report.exact and report.checked.endswith("equal"), report.notes
        return
    assert not report.exact and "different" in report.checked
    assert f"resident {real:,} B (the analysis says {predicted:,} B" in _self_check_note(report, "resident")
    if optimizer is not None:
        assert "train_resident" in " ".join(report.notes)


@pytest.mark.parametrize("make, specs, optimizer", [
    (lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)), (("B", 16),),
     lambda p: torch.optim.AdamW(p, lr=1e-3)),
    (lambda: load_example("seed_attention").Attention(64, 8), (("B", "L", 64),), lambda p: torch.optim.Adam(p)),
    (TiedHead, (fxmem.TensorSpec(("B", "L"), dtype=torch.int64),), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    (HalfTrained, (("B", 16),), lambda p: torch.optim.Adam(p)),
])
def test_every_number_of_a_training_step_is_checked_and_exact_models_stay_exact(make, specs, optimizer):
    # shared weights, Adam's 4-byte step counters, a gradient whose storage is larger than its
    # parameter: the self-check counts real storages once each, and these models stay "equal"
    torch.manual_seed(0)
    report = fxmem.analyze(make(), *specs, optimizer=optimizer)
    assert report.exact and report.checked.startswith("checked against a real forward and training step") and \
        report.checked.endswith("equal"), (report.checked, report.notes)


def test_a_global_tensor_the_forward_reads_is_resident_for_real_too():
    # not an attribute of the model: the self-check finds it among what the real forward reads
    for mode in ("graph", "eager"):
        report = fxmem.analyze(ReadsAGlobal(), ("B", 8, 16), mode=mode, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        assert report.exact and report.checked.endswith("equal"), (mode, report.checked, report.notes)
        assert report.resident.subs(report.symbols["B"], 0) == (16 * 16 + 16 + 8 * 16) * 4


GLOBAL_TABLE = torch.randn(8, 16)


class ReadsAGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) + GLOBAL_TABLE


def test_a_storage_counted_resident_by_mistake_is_caught(monkeypatch):
    # GPT-NeoX's class of error, made again on purpose: the engine rule says "in place" for a gradient
    # something else still holds, and the lost record is counted as resident. The peak above the
    # resident bytes stays right, so only the absolute numbers tell
    from fxmem.kernels import engine
    from fxmem.simulation.storages import StorageTable
    from zoo import ParallelResidual

    monkeypatch.setattr(engine, "_engine_holds_the_last_reference", lambda old, new: True)
    model = nn.Sequential(nn.Linear(16, 16), ParallelResidual(), ParallelResidual())
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    # the simulation's own guard: a buffer it said was reused is still in use - never resident
    guarded = fxmem.analyze(model, ("B", "L", 16), optimizer=sgd)
    assert not guarded.exact and any("still in use here" in n for n in guarded.notes), guarded.notes
    B, L = guarded.symbols["B"], guarded.symbols["L"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert guarded.resident == params + 64 * B * L
    # without the guard the self-check catches it, naming resident and train_resident
    monkeypatch.setattr(StorageTable, "moved_from", lambda self, t: None)
    wrong = fxmem.analyze(model, ("B", "L", 16), optimizer=sgd)
    assert wrong.resident != params + 64 * B * L and not wrong.exact and "different" in wrong.checked
    dims = small_point(wrong)
    real = real_resident(model, real_inputs(wrong, dims))
    assert f"resident {real:,} B (the analysis says {wrong.evaluate(**dims)['resident']:,} B" in \
        _self_check_note(wrong, "resident")
    assert "train_resident" in _self_check_note(wrong, "train_resident")
