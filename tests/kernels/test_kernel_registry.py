"""The kernel registry (fxmem/kernels/registry.py): rules keyed by op objects, one per op, with the
torch releases they were checked on, and the extension point through which a user describes a
custom op's allocations - checked against a real run of such an op."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import check_against_real_run
from fxmem import _torch_compat as tc
from fxmem.kernels import CHECKED, OUT, REGISTRY, Call, Kind, Rule, register, unregister
from fxmem.kernels.cuda import GPU_CHECKED
from fxmem.kernels.registry import Registry, require_args

aten = torch.ops.aten


# --- a custom op whose real kernel uses a workspace the fake kernel cannot know about ------------
@torch.library.custom_op("fxmem_test::scratchy", mutates_args=())
def scratchy(x: torch.Tensor) -> torch.Tensor:
    work = torch.empty(2 * x.numel(), dtype=x.dtype)  # a workspace twice the input, freed on return
    work.zero_()
    return x + work[: x.numel()].view_as(x)


@scratchy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def scratch_rule(call: Call) -> list:
    """scratchy's workspace: twice its input, freed before it returns."""
    x = call.arg("x")
    work = 2 * x.numel() * x.element_size()
    return [work, OUT, -work]


class UsesScratchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scratchy(self.lin(x)).relu()


SIZES = [dict(B=3), dict(B=17), dict(B=40)]


def test_a_custom_op_described_by_the_user_matches_a_real_run():
    op = torch.ops.fxmem_test.scratchy.default
    report = check_against_real_run(UsesScratchy(), (("B", 8),), SIZES, grad=False, kernels={op: scratch_rule})
    assert any("fxmem_test.scratchy" in n and "kernels=" in n for n in report.notes), report.notes


def test_without_the_description_the_workspace_is_missing():
    """The rule is what makes it exact: without it the peak misses the workspace."""
    op = torch.ops.fxmem_test.scratchy.default
    with_rule = fxmem.analyze(UsesScratchy(), ("B", 8), grad=False, kernels={op: scratch_rule})
    without = fxmem.analyze(UsesScratchy(), ("B", 8), grad=False)
    B = with_rule.symbols["B"]
    assert with_rule.at(with_rule.peak - without.peak, B=10) == 2 * 10 * 8 * 4


def test_register_applies_to_every_analysis_until_unregistered():
    op = torch.ops.fxmem_test.scratchy.default
    rule = register(op, scratch_rule)
    try:
        check_against_real_run(UsesScratchy(), (("B", 8),), SIZES[:1], grad=False)
        with pytest.raises(ValueError, match="already registered"):
            register(op, scratch_rule)
    finally:
        unregister(rule)
    assert REGISTRY.lookup(Kind.HIDDEN, op, "cpu") is None


def test_bad_user_rules_are_clear_errors():
    op = torch.ops.fxmem_test.scratchy.default
    with pytest.raises(fxmem.SpecError, match="does not free what it allocates"):
        fxmem.analyze(UsesScratchy(), ("B", 8), grad=False, kernels={op: lambda call: [64, OUT]})
    with pytest.raises(fxmem.SpecError, match="exactly one fxmem.kernels.OUT"):
        fxmem.analyze(UsesScratchy(), ("B", 8), grad=False, kernels={op: lambda call: [64, -64]})
    with pytest.raises(fxmem.SpecError, match="is not a torch op"):
        fxmem.analyze(UsesScratchy(), ("B", 8), grad=False, kernels={"fxmem_test::scratchy": scratch_rule})


# --- the registry itself ---------------------------------------------------------------------------
def test_every_builtin_rule_is_keyed_by_an_op_object_and_says_where_it_was_checked():
    rules = [r for r in REGISTRY.rules() if not r.user]
    cuda = [r for r in rules if r.fn.__module__ == "fxmem.kernels.cuda"]
    assert len(cuda) >= 8 and all(r.device == "cuda" for r in cuda)
    assert len(rules) >= 20
    for r in rules:
        assert tc.is_op(r.key) or (r.kind == Kind.REAL_PATH and callable(r.key)), r
        # CUDA kernels' own rules were read and checked on the GPU machine's torch (tests/gpu)
        assert r.verified == (GPU_CHECKED if r in cuda else CHECKED) and r.why, r.name
    kinds = {r.kind for r in rules}
    assert kinds == {Kind.HIDDEN, Kind.OUTPUT_STORAGE, Kind.ENGINE, Kind.REAL_PATH, Kind.SYMBOLIC, Kind.OUTPUT_LAYOUT}


def test_an_overloads_own_rule_wins_over_its_packets():
    registry = Registry()
    packet = registry.add(Rule(aten.add, Kind.HIDDEN, "cpu", lambda call: None))
    own = registry.add(Rule(aten.add.Tensor, Kind.HIDDEN, "cpu", lambda call: None))
    assert registry.lookup(Kind.HIDDEN, aten.add.Tensor, "cpu") is own
    assert registry.lookup(Kind.HIDDEN, aten.add.Scalar, "cpu") is packet
    assert registry.lookup(Kind.HIDDEN, aten.add.Tensor, "cuda") is None
    with pytest.raises(ValueError, match="already registered"):
        registry.add(Rule(aten.add, Kind.HIDDEN, "cpu", lambda call: None))


def test_a_schema_change_fails_at_import_not_silently():
    require_args(aten.mm.default, "self", "mat2")
    with pytest.raises(ImportError, match="aten.mm has no argument.*'matrix'"):
        require_args(aten.mm.default, "self", "matrix")


def test_rules_not_checked_on_this_torch_are_noted():
    """A rule the numbers depend on that was never checked on this torch release is reported."""
    builtin = REGISTRY.lookup(Kind.HIDDEN, aten.repeat.default, "cpu")
    REGISTRY.remove(builtin)
    REGISTRY.add(Rule(builtin.key, builtin.kind, builtin.device, builtin.fn, ("1.0",)))
    try:
        class Repeats(nn.Module):
            def forward(self, x):
                return x.repeat(1, 2)

        report = fxmem.analyze(Repeats(), ("B", 3), grad=False)
    finally:
        REGISTRY.remove(REGISTRY.lookup(Kind.HIDDEN, aten.repeat.default, "cpu"))
        REGISTRY.add(builtin)
    assert any("aten.repeat" in n and "1.0" in n and "fxmem.validate" in n for n in report.notes), report.notes
    assert "aten.repeat" in report.facts["kernel_rules"]
