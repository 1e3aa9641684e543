"""Every ``fxmem.optimize`` call says what it tried: one entry schema for every pass (the rules,
reorder, recompute, the switch between two forms), a record per rule also where nothing matched,
and a ``budget=`` that cannot be met is an error, never silence."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import edge_spellings as S
import fxmem
from fxmem.passes import GRAPH_PASSES, PASSES
from fxmem.passes.base import LOG_KEYS, STATUSES
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
