"""Every ``fxmem.optimize`` call says what it tried: one entry schema for every pass (the rules,
reorder, recompute, the switch between two forms), a record per rule also where nothing matched,
and a ``budget=`` that cannot be met is an error, never silence."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zoo import edge_spellings as S
from conftest import load_example
import fxmem
from fxmem.passes import GRAPH_PASSES, PASSES
from fxmem.passes.base import FIELDS, LOG_KEYS, REASON_LIMIT, STATUSES
from fxmem.passes.recompute import BudgetError


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        h = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return self.fc(h)


class TrainOnlyScale(nn.Module):
    """Computes another thing in train mode than in eval mode (nothing can be rewritten)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            y = y * 2
        return y


def _check_schema(log: list[dict]) -> None:
    assert log
    for e in log:
        assert list(e)[:len(LOG_KEYS)] == list(LOG_KEYS), e
        assert e["status"] in STATUSES and e["reason"], e
        assert len(e["reason"]) <= REASON_LIMIT and "\n" not in e["reason"], e["reason"]


def test_nothing_matched_is_still_said_per_rule():
    torch.manual_seed(0)
    opt = fxmem.optimize(SmallCNN(), ("B", 3, "H", "W"))
    log = opt.meta["fxmem"]
    _check_schema(log)
    by_rule = {e["rule"]: e for e in log}
    assert [p.name for p in GRAPH_PASSES] == ["reorder", "recompute"]  # the whole-graph passes are the registry's
    for rule in [p.name for p in PASSES + GRAPH_PASSES]:
        assert rule in by_rule, rule
    for p in PASSES + GRAPH_PASSES[:1]:
        assert by_rule[p.name]["status"] == "no match" and p.looks_for in by_rule[p.name]["reason"]
    assert "no budget" in by_rule["recompute"]["reason"]
    assert [e["rule"] for e in log] == [p.name for p in PASSES + GRAPH_PASSES]  # in the registry's order


def test_every_entry_of_a_switched_call_has_the_schema():
    torch.manual_seed(0)
    opt = fxmem.optimize(S.GCNIndexAdd(), *S.GCNIndexAdd.SPECS)
    log = opt.meta["fxmem"]
    _check_schema(log)
    # decided entries name the formula comparison they rest on
    assert all(e["decision"] for e in log if e["rule"] == "fused-message-passing")
    (switch,) = [e for e in log if e["rule"] == "switch"]
    assert {e["when"] for e in log} == {switch["condition"], f"not ({switch['condition']})"}


def test_a_budget_that_cannot_be_met_is_an_error():
    torch.manual_seed(0)
    with pytest.raises(BudgetError, match="train and eval"):
        fxmem.optimize(TrainOnlyScale(), ("B", 6), budget="1KiB", dims={"B": 4096})
    # and one that is met is said
    opt = fxmem.optimize(TrainOnlyScale(), ("B", 6), budget="1GiB", dims={"B": 4})
    _check_schema(opt.meta["fxmem"])


class UsedInAnotherOrder(nn.Module):
    """Submodules and parameters declared in one order, used by forward in another."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.second = nn.Linear(6, 6)
        self.first = nn.Linear(6, 6)
        self.bias = nn.Parameter(torch.zeros(6))

    def forward(self, x):
        return self.second(self.first(x) + self.bias) * self.scale


def test_parameters_come_in_the_models_order():
    model = UsedInAnotherOrder()
    opt = fxmem.optimize(model, ("B", 6))
    assert [id(p) for p in opt.parameters()] == [id(p) for p in model.parameters()]
    assert list(opt.state_dict()) == list(model.state_dict())


@torch.fx.wrap
def add_mask(attn, mask):
    """A mask add that torch.fx keeps as one call (timm's Attention(fused_attn=False) style)."""
    return attn + mask


class WrappedMaskAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = add_mask((q * 8 ** -0.5) @ k.transpose(-2, -1), mask)
        return attn.softmax(dim=-1) @ v


def test_sdpa_says_why_a_hidden_mask_add_is_not_matched():
    opt = fxmem.optimize(WrappedMaskAttention(), ("B", "L", 8), ("L", "L"))
    (entry,) = [e for e in opt.meta["fxmem"] if e["rule"] == "sdpa"]
    assert entry["status"] == "declined" and "add_mask" in entry["reason"] and "fx.wrap" in entry["reason"], entry


@torch.library.custom_op("fxmem_tests::halve_grad", mutates_args=())
def halve_grad(g: torch.Tensor) -> torch.Tensor:
    """A custom op with no fake kernel: fxmem cannot simulate it (real runs can)."""
    return g * 0.5


class NegatedGrad(torch.autograd.Function):
    """Identity forward, negated gradient: a custom backward, which a captured graph can lose."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -g


class WithCustomBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return NegatedGrad.apply(self.lin(x)) * 2


def test_a_capture_that_loses_a_custom_backward_is_refused():
    """fx refuses Function.apply (its forward changes grad mode); TorchDynamo's graph, as fxmem
    captures it, runs the forward alone. Returned as captured, it would train in the wrong direction."""
    torch.manual_seed(0)
    model = WithCustomBackward()
    x = torch.randn(3, 6)
    g_model = torch.autograd.grad(model(x).sum(), model.lin.weight)[0]
    g_plain = torch.autograd.grad((model.lin(x) * 2).sum(), model.lin.weight)[0]
    assert torch.allclose(g_model, -g_plain)  # the model's gradient is the custom backward's
    with pytest.raises(fxmem.TraceError, match="does not compute what the model does.*gradient of lin"):
        fxmem.optimize(model, ("B", 6))


class HalvedGrad(nn.Module):
    """A leaf module whose gradient hook calls an op fxmem cannot simulate: the forward can be
    analysed, the training step cannot."""

    def forward(self, y):
        y = y * 1.0
        if y.requires_grad:
            y.register_hook(halve_grad)
        return y


class GATWithHalvedGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gat = load_example("seed_gat").GraphAttentionLayerFixed(6, 16)
        self.halved = HalvedGrad()

    def forward(self, x, adj):
        return self.halved(self.gat(x, adj))


def test_a_training_step_fxmem_cannot_analyse_is_said_in_every_decision():
    """The decisions then rest on the forward and inference peaks, and say so (they used to fall
    back to them silently, as for a model with nothing to train)."""
    torch.manual_seed(0)
    model = GATWithHalvedGrad()
    specs = (("B", "N", 6), ("B", "N", "N"))
    with pytest.raises(fxmem.UnsupportedOpError, match="fxmem_tests::halve_grad"):
        fxmem.analyze(model, *specs, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), leaf_modules=[HalvedGrad])
    opt = fxmem.optimize(model, *specs, leaf_modules=[HalvedGrad])
    decided = [e for e in opt.meta["fxmem"] if e.get("decision")]
    assert decided and any(e["status"] == "applied" for e in decided)
    for e in decided:
        assert "the training step is not compared" in e["decision"] and "halve_grad" in e["decision"], e
        assert e["train_peak_before"] is None, e
    # what it returns still trains as the model does (the hook halves the gradients of both)
    x, adj = torch.randn(2, 9, 6), (torch.rand(2, 9, 9) > 0.5).float()
    model.eval(), opt.eval()
    ga = torch.autograd.grad(model(x, adj).sum(), model.gat.W)[0]
    gb = torch.autograd.grad(opt(x, adj).sum(), model.gat.W)[0]
    assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6)


class _Net(nn.Module):
    """Two blocks a budget can recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
                                      for _ in range(2)])

    def forward(self, x):
        return self.blocks(x)


def _formulas(e: dict) -> list[str]:
    return [e[k] for k in LOG_KEYS if k.endswith(("_before", "_after")) and isinstance(e[k], str)]


def test_every_record_has_a_one_line_reason_and_the_formulas_in_their_own_keys():
    """The reason is one line a user reads (at most REASON_LIMIT characters: what was decided and
    why, with the peaks at the example sizes); the formulas, condition, verification and grouping
    are keys of their own (FIELDS says what each holds)."""
    assert set(FIELDS) == set(LOG_KEYS) and all(FIELDS.values())
    seed_gat = load_example("seed_gat")
    specs = (("B", "N", 6), ("B", "N", "N"))
    torch.manual_seed(0)
    rewritten = fxmem.optimize(seed_gat.GraphAttentionLayerFixed(6, 16), *specs).meta["fxmem"]
    declined = fxmem.optimize(seed_gat.GraphAttentionLayer(6, 16), *specs).meta["fxmem"]
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    base = fxmem.analyze(_Net(), ("B", 16), optimizer=sgd).evaluate(B=4096)["train_peak"]
    budgeted = fxmem.optimize(_Net(), ("B", 16), budget=int(base * 0.8), dims={"B": 4096},
                              optimizer=sgd).meta["fxmem"]
    for log in (rewritten, declined, budgeted):
        _check_schema(log)
        for e in log:  # no formula in the reason: a peak formula has a ** or a * between dims
            assert not any(f in e["reason"] for f in _formulas(e) if len(f) > 12), e
    applied = [e for e in rewritten if e["status"] == "applied" and e["rule"] == "pair-linear"]
    assert applied
    for e in applied:
        assert e["reason"].startswith("applied: ") and " -> " in e["reason"] and "B=" in e["reason"], e
        assert "N**2" in e["peak_before"] and e["peak_after"] and e["verification"] == "passed"
        assert e["no_longer_built"] and e["details"].startswith("pairs x = [h_i || h_j]")
        assert e["bytes_after"]["peak"] < e["bytes_before"]["peak"] and set(e["sizes"]) == {"B", "N"}
    (look_alike,) = [e for e in declined if e["rule"] == "pair-linear"]
    assert look_alike["reason"].startswith("declined: pairs are not (h_i, h_j)")
    assert "looks like a bug" in look_alike["details"] and "looks like a bug" not in look_alike["reason"]
    assert "N**2" in look_alike["peak_before"] and look_alike["peak_after"] is None
    (recompute,) = [e for e in budgeted if e["rule"] == "recompute"]
    assert recompute["status"] == "applied" and recompute["reason"].startswith("applied: training-step peak")
    assert "FLOPs in backward" in recompute["flops"] and recompute["sizes"] == {"B": 4096}
    assert recompute["bytes_after"]["train_peak"] <= int(base * 0.8) < recompute["bytes_before"]["train_peak"]
