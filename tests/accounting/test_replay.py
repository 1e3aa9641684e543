"""The one replay (fxmem/accounting/replay.py) and the Evaluation it feeds (fxmem/accounting/plan.py):
a hand-written recording whose live bytes are known at every moment, walked symbolically and with
numbers; and the Evaluation's mapping behaviour."""
from __future__ import annotations

import itertools
import operator

import sympy
import torch

import fxmem
from fxmem.accounting.replay import liveness, walk
from fxmem.accounting.symbolic import Evaluator, add_terms, terms, to_expr
from fxmem.kernels import OUT
from fxmem.records import FREE, NODE, STEP, Node, Recording, Role, Step, Storage

B = sympy.Symbol("B", integer=True, positive=True)


def _storage(i: int, nbytes, step=None, role=Role.ACTIVATION, node=None) -> Storage:
    return Storage(i, sympy.sympify(nbytes), torch.float32, (), role, f"s{i}", node=node, step=step)


def _node(name: str) -> Node:
    return Node(name, "call_function", name, "", None, [], [], [], 0, 0)


# a: 4B allocated by node "a"; b: 8B with a 2B scratch before its output, by node "b" (a dies there);
# c: 16 bytes by node "c". Live bytes: a=4B | scratch: 4B+2B, then 4B+2B+8B | after b: 8B | c: 8B+16.
STORAGES = [_storage(0, 100, role=Role.INPUT), _storage(1, 4 * B, 0, node="a"), _storage(2, 8 * B, 1, node="b"),
            _storage(3, 16, 2, node="c")]
STEPS = [Step(0, "a", "aten.x", [1], []), Step(1, "b", "aten.y", [2], [2 * B, OUT, -2 * B]), Step(2, "c", "aten.z", [3], [])]
EVENTS = [(STEP, 0), (NODE, 0), (STEP, 1), (FREE, 1), (NODE, 1), (STEP, 2), (NODE, 2)]
REC = Recording(STORAGES, STEPS, [_node("a"), _node("b"), _node("c")], EVENTS, [], None, {}, "cpu", forward_end=5)


def numeric(b: int):
    return walk(REC, lambda i: int(STORAGES[i].bytes.subs(B, b)), lambda p: int(p.subs(B, b)), 0,
                operator.add, operator.neg, lambda d: d > 0, mark=REC.forward_end)


def test_numeric_walk_has_every_moment():
    w = numeric(10)
    assert [v for _, v in w.candidates] == [40, 60, 140, 96]  # a; scratch; scratch + b; c
    assert [s for s, _ in w.candidates] == [0, 1, 1, 2]
    assert w.after_node == [40, 80, 96]
    assert (w.at_mark, w.forward_candidates, w.final) == (80, 3, 96)


def test_symbolic_walk_agrees_with_numbers_everywhere():
    at = Evaluator({B: 3})
    w = walk(REC, lambda i: terms(STORAGES[i].bytes), lambda p: terms(p), {}, add_terms,
             lambda t: {m: -c for m, c in t.items()}, lambda t: at(t) > 0, mark=REC.forward_end)
    assert to_expr(w.at_mark) == 8 * B
    for b in (1, 2, 7, 1000):
        n = numeric(b)
        assert [int(to_expr(c).subs(B, b)) for _, c in w.candidates] == [v for _, v in n.candidates]
        assert [int(to_expr(c).subs(B, b)) for c in w.after_node] == n.after_node


def test_liveness_attributes_moments_to_nodes():
    live = liveness(REC.nodes, STEPS, numeric(10), {"B": 10}, 100, [100, 40, 80, 16])
    assert live.high == [40, 140, 96] and live.after == [40, 80, 96]
    assert (live.peak_node, live.peak_above_resident, live.peak) == ("b", 140, 240)


def test_evaluation_reads_like_a_dict_of_its_numbers():
    report = fxmem.analyze(torch.nn.Linear(6, 4), ("B", 6), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    ev = report.evaluate(B=5)
    assert dict(ev) == {k: ev[k] for k in ev} and "liveness" not in ev
    assert set(ev) == {"resident", "peak", "peak_above_resident", "retained", "saved", "output", "train_resident",
                       "train_peak", "train_peak_above_resident", "grads", "optimizer_state", "train_retained"}
    assert ev == dict(ev) and repr(ev) == repr(dict(ev))
    assert ev.liveness.peak == ev["peak"] and report.evaluate(B=5) is ev  # computed once per dims
    forward_only = fxmem.analyze(torch.nn.Linear(6, 4), ("B", 6)).evaluate(B=5)
    assert "train_peak" not in forward_only and len(forward_only) == 6


def test_pruned_peak_equals_the_walk_on_a_grid():
    report = fxmem.analyze(torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Linear(32, 3)),
                           ("B", "N", 6))
    for b, n in itertools.product((2, 9, 300), (2, 5, 77)):  # inside the region (B, N >= 2)
        assert report.at(report.peak, B=b, N=n) == report.evaluate(B=b, N=n)["peak"]
