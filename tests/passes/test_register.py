"""fxmem.passes.register: a rule from the user's own code runs as the built-in ones do - its sites
accepted by the formulas, verified against the model (outputs and gradients, train and eval mode)
and recorded - and unregister removes it; a clash of names, an unknown name or a non-rule is a
SpecError that says what to do."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from torch import nn

import fxmem
from fxmem.errors import SpecError
from fxmem.passes import Finding, Pass, register, unregister
from equivalence import assert_same_in_every_mode

RULE = "cat-self-sum"


def _find(gm: torch.fx.GraphModule, probes, settings) -> list[Finding]:
    """``cat([h, h], d).sum(d)``: the sum of a tensor concatenated with itself, twice its sum."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_method" or node.target != "sum" or len(node.args) != 2 or node.kwargs:
            continue
        cat = node.args[0]
        if not (isinstance(cat, torch.fx.Node) and cat.op == "call_function" and cat.target is torch.cat):
            continue
        parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
        if len(parts) == 2 and parts[0] is parts[1] and node.args[1] == dim and len(cat.users) == 1:
            found.append(Finding(RULE, node, "match", "a tensor concatenated with itself, then summed over that dim",
                                 plan=(parts[0], dim), frees=frozenset({cat})))
    return found


def _rewrite(graph: torch.fx.Graph, nodes, finding: Finding, gm: torch.fx.GraphModule) -> torch.fx.Node:
    source, dim = finding.plan
    with graph.inserting_before(nodes[finding.node]):
        total = graph.call_method("sum", (nodes[source], dim))
        return graph.call_function(operator.mul, (total, 2))


class CatSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 64)

    def forward(self, x):
        h = self.lin(x)
        return torch.cat([h, h], -1).sum(-1)


@pytest.fixture
def registered():
    rule = register(Pass(RULE, _find, _rewrite, looks_for="cat([h, h], d).sum(d)"))
    yield rule
    if any(p.name == RULE for p in fxmem.passes.PASSES):
        unregister(RULE)


def test_a_registered_rule_is_applied_verified_and_recorded(registered):
    torch.manual_seed(0)
    model = CatSum()
    opt = fxmem.optimize(model, ("B", 6))
    entry = next(e for e in opt.meta["fxmem"] if e["rule"] == RULE)
    assert entry["status"] == "applied" and entry["verification"] == "passed", entry
    assert not any(n.target is torch.cat for n in opt.graph.nodes)
    before = fxmem.analyze(model, ("B", 6), check=False)
    after = fxmem.analyze(opt, ("B", 6), check=False)
    assert after.evaluate(B=64)["peak"] < before.evaluate(B=64)["peak"]
    assert_same_in_every_mode(model, opt, [torch.randn(5, 6)])
    # removed: the next call does not look for it
    unregister(RULE)
    again = fxmem.optimize(model, ("B", 6))
    assert not any(e["rule"] == RULE for e in again.meta["fxmem"])


def test_a_registered_rule_that_finds_nothing_says_what_it_looked_for(registered):
    opt = fxmem.optimize(nn.Sequential(nn.Linear(6, 6), nn.ReLU()), ("B", 6))
    entry = next(e for e in opt.meta["fxmem"] if e["rule"] == RULE)
    assert entry["status"] == "no match" and "cat([h, h], d).sum(d)" in entry["reason"]


def test_bad_registrations_are_refused_with_what_to_do(registered):
    with pytest.raises(SpecError, match="registered already; unregister"):
        register(Pass(RULE, _find, _rewrite))
    with pytest.raises(SpecError, match="no rule of that name"):
        register(Pass("other", _find, _rewrite), before="no-such-rule")
    with pytest.raises(SpecError, match="expected a fxmem.passes.Pass"):
        register(_find)
    with pytest.raises(SpecError, match="no rule of that name"):
        unregister("no-such-rule")
    names = [p.name for p in fxmem.passes.PASSES]
    first = register(Pass("first", _find, _rewrite), before="pair-linear")
    try:
        assert fxmem.passes.PASSES[names.index("pair-linear")] is first
    finally:
        unregister("first")


def _wrong_output(gm: torch.fx.GraphModule, line) -> tuple:
    """A whole-graph pass that proposes the graph with its output scaled by 1.5 (not what it computes)."""
    import copy

    from fxmem.passes.base import log_entry

    graph = copy.deepcopy(gm.graph)
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        scaled = graph.call_function(operator.mul, (out.args[0], 1.5))
    out.args = (scaled,)
    proposed = torch.fx.GraphModule(gm, graph)
    return proposed, log_entry("scale-output", "applied", "CatSum", "applied: scaled by its own criterion")


class _Refused(Exception):
    pass


def _refuse(entry, diff):
    raise _Refused(f"{entry['rule']}: {diff.where}")


@pytest.mark.parametrize("failed", [None, _refuse])
def test_a_whole_graph_pass_proposes_and_the_driver_verifies(failed):
    """What a whole-graph pass (reorder, recompute) proposes is verified by optimize's driver, as a
    rule's rewrite is: a proposal that differs from the model is declined (the graph before it is
    returned), or the pass's ``failed`` raises (recompute: a budget it cannot meet is an error)."""
    from fxmem.passes import GRAPH_PASSES, GraphPass

    torch.manual_seed(0)
    model = CatSum()
    GRAPH_PASSES.append(GraphPass("scale-output", _wrong_output, "a scaled output", failed=failed))
    try:
        if failed is not None:
            with pytest.raises(_Refused, match="scale-output: output 0"):
                fxmem.optimize(model, ("B", 6))
            return
        opt = fxmem.optimize(model, ("B", 6))
    finally:
        GRAPH_PASSES.pop()
    entry = next(e for e in opt.meta["fxmem"] if e["rule"] == "scale-output")
    assert entry["status"] == "declined" and entry["verification"].startswith("failed"), entry
    assert_same_in_every_mode(model, opt, [torch.randn(5, 6)])
