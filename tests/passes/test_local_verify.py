"""Verification region by region (passes/local_verify.py): a rewrite is checked against the part of
the graph it replaced at every verification size, alike regions once, and the whole model against
the rewrite at the smallest size. Each test is a rewrite that one half alone would let through, or
decline: wrong only beyond the smallest size (the regions catch it), wrong in one layer of many
alike ones (that layer is no longer alike: checked on its own), exact in its region but moving the
random draws that follow (the whole model catches it), and exact in the model but not on inputs
the region never gets from it (kept: a region that differs hands the decision to the whole model).
"""
from __future__ import annotations

import operator
import sys

import pytest
import torch
import torch.fx
from torch import nn

import fxmem
from fxmem.passes import Finding, Pass, register, unregister
from fxmem.passes.verify import compare
from fxmem.passes.local_verify import regions, verify_regions
from equivalence import assert_same_in_every_mode

RULE = "test-cat-self-sum"


def _find(gm: torch.fx.GraphModule, probes, settings) -> list[Finding]:
    """``torch.cat([h, h], 1).sum(1, ...)``: twice the sum of h."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_method" or node.target != "sum" or node.args[1:] != (1,):
            continue
        cat = node.args[0]
        if not (isinstance(cat, torch.fx.Node) and cat.op == "call_function" and cat.target is torch.cat):
            continue
        parts = cat.args[0]
        if cat.args[1:] == (1,) and len(parts) == 2 and parts[0] is parts[1] and len(cat.users) == 1:
            layer = str(list(node.meta.get("nn_module_stack", {}).values())[-1:])
            found.append(Finding(RULE, node, "match", "a tensor concatenated with itself, then summed",
                                 plan=(parts[0], layer), frees=frozenset({cat})))
    return found


def _rewriter(how):
    """A rewrite of the sites ``_find`` finds: ``how(graph, h, kwargs, layer)`` builds the new value."""
    def rewrite(graph: torch.fx.Graph, nodes, finding: Finding, gm: torch.fx.GraphModule) -> torch.fx.Node:
        h, layer = finding.plan
        with graph.inserting_before(nodes[finding.node]):
            return how(graph, nodes[h], dict(finding.node.kwargs), layer)
    return rewrite


def _twice(graph, h, kw, layer, factor=2.0):
    return graph.call_function(operator.mul, (graph.call_method("sum", (h, 1), kw), factor))


def _first_four_rows(graph, h, kw, layer):
    """Exact where dim 1 has 4 rows - the smallest size optimize verifies at here - wrong elsewhere."""
    rows = graph.call_function(operator.getitem, (h, (slice(None), slice(None, 4))))
    return _twice(graph, rows, kw, layer)


def _off_in_layer_2(graph, h, kw, layer):
    return _twice(graph, h, kw, layer, 2.001 if "layers.2" in layer else 2.0)


def _draw_after(x):
    torch.rand(())  # a random number drawn after the value is made: the region's own outputs do not change
    return x


def _then_draws(graph, h, kw, layer):
    return graph.call_function(_draw_after, (_twice(graph, h, kw, layer),))


def _stops_gradient(graph, h, kw, layer):
    return _twice(graph, graph.call_method("detach", (h,)), kw, layer)


class Layer(nn.Module):
    def __init__(self, c: int, p: float):
        super().__init__()
        self.lin, self.drop = nn.Linear(c, c), nn.Dropout(p)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, c))

    def forward(self, x):
        h = torch.ones_like(x) * self.scale  # needs no gradient in the model (it depends on no parameter)
        s = torch.cat([h, h], 1).sum(1, keepdim=True)
        return self.drop(self.lin(x) + 0.01 * s)


class Stack(nn.Module):
    def __init__(self, layers: int = 4, c: int = 16, p: float = 0.0):
        super().__init__()
        self.layers = nn.ModuleList(Layer(c, p) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture
def rule():
    def use(how):
        register(Pass(RULE, _find, _rewriter(how), looks_for="cat([h, h], 1).sum(1)"))
    yield use
    if any(p.name == RULE for p in fxmem.passes.PASSES):
        unregister(RULE)


def _entries(opt):
    return [e for e in opt.meta["fxmem"] if e["rule"] == RULE]


def _optimized(rule, how, **stack):
    """The model (a Stack) and fxmem.optimize of it with the test rule rewriting as ``how`` does."""
    rule(how)
    torch.manual_seed(0)
    model = Stack(**stack)
    return model, fxmem.optimize(model, ("B", "N", 16))


def test_an_exact_rewrite_is_kept_and_checked_once_for_its_alike_layers(rule, monkeypatch):
    rule(_twice)
    torch.manual_seed(0)
    model = Stack()
    driver = sys.modules["fxmem.passes.optimize"]
    calls = []

    def counted(*a, **k):
        calls.append(type(a[0]).__name__)
        return compare(*a, **k)
    monkeypatch.setattr(driver, "compare", counted)
    opt = fxmem.optimize(model, ("B", "N", 16))
    assert [e["status"] for e in _entries(opt)] == ["applied"] * 4, _entries(opt)
    # one run of the whole model (at the smallest size) and one of the four alike regions
    assert calls.count("Stack") == 1 and len(calls) == 2, calls
    assert_same_in_every_mode(model, opt, [torch.randn(3, 7, 16)])


def test_a_rewrite_wrong_beyond_the_smallest_size_is_declined(rule):
    model, opt = _optimized(rule, _first_four_rows)
    entries = _entries(opt)
    assert entries and all(e["status"] == "declined" and e["verification"].startswith("failed") for e in entries)
    assert_same_in_every_mode(model, opt, [torch.randn(3, 6, 16)])


def test_a_rewrite_wrong_in_one_of_the_alike_layers_fails_there_only(rule):
    model, opt = _optimized(rule, _off_in_layer_2)
    failed = {e["where"].split(" ")[0]: (e["verification"] or "").startswith("failed") for e in _entries(opt)}
    assert failed == {"sum_1": False, "sum_2": False, "sum_3": True, "sum_4": False}, _entries(opt)
    assert any(e["status"] == "applied" for e in _entries(opt))
    assert_same_in_every_mode(model, opt, [torch.randn(3, 6, 16)])


def test_a_rewrite_that_moves_the_random_draws_after_it_is_declined(rule):
    model, opt = _optimized(rule, _then_draws, p=0.5)
    entries = _entries(opt)
    assert entries and all(e["status"] == "declined" and e["verification"].startswith("failed") for e in entries)
    assert_same_in_every_mode(model, opt, [torch.randn(3, 6, 16)])


def test_a_rewrite_exact_in_the_model_but_not_in_its_region_alone_is_kept(rule):
    # the region gets its input with a gradient when checked alone (detach changes that gradient);
    # in the model that input needs none, and the whole model, compared at every size, decides
    model, opt = _optimized(rule, _stops_gradient)
    assert [e["status"] for e in _entries(opt)] == ["applied"] * 4, _entries(opt)
    assert all(e["verification"] == "passed" for e in _entries(opt))
    assert_same_in_every_mode(model, opt, [torch.randn(3, 6, 16)])


def test_regions_of_recomputed_blocks_are_one_per_block_and_a_wrong_block_is_named():
    from fxmem.passes.modes import trace_modes
    from fxmem.passes.segments import Recomputed, blocks, extract

    torch.manual_seed(0)
    model = Stack(layers=3)
    gm = trace_modes(model).graph_module
    plan = extract(gm, [(b, "whole") for b in blocks(gm)])
    found = regions(gm, plan)
    assert found is not None and len(found) == 3
    xs = [(torch.randn(2, 3 + k, 16),) for k in range(3)]
    seen = []
    diff = verify_regions(gm, plan, xs, lambda a, b, inputs: seen.append(1) or compare(a, b, inputs))
    assert diff.ok and seen == [1], seen  # alike: one check for the three blocks
    # a block whose recomputed code differs from what it replaced: found, and the region named
    with torch.no_grad():
        wrong = extract(gm, [(b, "whole") for b in blocks(gm)])
    recomputed = [n for n in wrong.graph.nodes if n.op == "call_function" and "recompute" in n.name]
    body = recomputed[1].target.code
    for n in body.graph.nodes:
        if n.op == "call_method" and n.target == "sum":
            n.args = (n.args[0], 1)
            n.kwargs = {}  # no keepdim: other shapes
    body.recompile()
    old = recomputed[1].target
    recomputed[1].target = Recomputed(body, old.attributes, old.selective, old.block)  # its own code's key
    wrong.recompile()
    bad = verify_regions(gm, wrong, xs, compare)
    assert not bad.ok and "region" in bad.where, bad
