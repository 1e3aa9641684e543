"""The pair-linear rule on edge lists (``fxmem.passes.gathered_pairs``): a linear map over rows picked
by an edge list, ``[h[dst] || h[src]] @ a``, becomes ``(h @ a1)[dst] + (h @ a2)[src]``.

Each spelling is rewritten and computes what the original does (outputs, gradients, every mode:
``equivalence.py``), fxmem's analysis of the result equals the CPU allocator on real runs, and the
E x 2F tensor is gone; look-alikes (GATv2's nonlinearity before ``a``, products of the two rows,
rows concatenated along the edges) are declined with the reason.
"""
from __future__ import annotations

import pytest
import torch

from zoo import edge_spellings as S
import fxmem
from conftest import check_against_real_run, check_training_against_real_run
from equivalence import assert_same_in_every_mode
from fxmem.passes.modes import trace_modes

AT = ({"N": 6, "E": 11}, {"N": 9, "E": 30})


def pair_entries(opt) -> list[dict]:
    return [r for r in opt.meta["fxmem"] if r["rule"] == "pair-linear" and r["status"] != "no match"]


def inputs(cls, sizes: dict, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sizes["N"], S.FIN, generator=gen), S.edges((2, sizes["E"]), sizes)]


@pytest.mark.parametrize("cls", S.GATHERED, ids=lambda c: c.__name__)
def test_gathered_pairs_are_split(cls):
    torch.manual_seed(0)
    model = cls()
    opt = fxmem.optimize(model, *cls.SPECS)
    # decided by formula: the record of the side where it pays says applied (a switch picks the side)
    applied = [e for e in pair_entries(opt) if e["status"] == "applied"]
    assert len(applied) == 1, [e["reason"] for e in pair_entries(opt)]
    (entry,) = applied
    assert entry["details"].startswith("gathered pairs") and "edge_index[" in entry["details"]
    assert not any(n.target is torch.cat for n in opt.graph.nodes)
    for at in AT:
        assert_same_in_every_mode(model, opt, inputs(cls, at))
    sizes = [{"N": 23, "E": 70}, {"N": 40, "E": 200}]
    after = check_against_real_run(opt, cls.SPECS, sizes, makers=S.EDGES)
    before = fxmem.analyze(model, *cls.SPECS)
    big = {"N": 1000, "E": 50000}
    assert after.evaluate(**big)["peak"] < before.evaluate(**big)["peak"]
    assert after.evaluate(**big)["saved"] < before.evaluate(**big)["saved"]
    check_training_against_real_run(opt, cls.SPECS, sizes[:1], lambda p: torch.optim.Adam(p), makers=S.EDGES)


@pytest.mark.parametrize("cls,node,words", [
    (S.EdgeGATv2, "matmul", ["nonlinearity (leaky_relu", "GATv2"]),
    (S.EdgeProduct, "matmul_1", ["combined with mul", "product/bilinear"]),
    (S.EdgeScrambled, "matmul_1", ["not one row per edge", "along dim 0"]),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_gathered_lookalike_is_declined(cls, node, words):
    torch.manual_seed(0)
    model = cls()
    opt = fxmem.optimize(model, *cls.SPECS)
    entry = next(r for r in pair_entries(opt) if r["where"].split()[0] == node)
    assert entry["status"] == "declined"
    for w in words:
        assert w in entry["details"], entry["details"]
    assert opt.code == trace_modes(model).graph_module.code


def test_gatv2_first_linear_is_split_only_where_it_pays():
    # W [x_dst || x_src] with W: 2x5 -> 8: the two 8-wide halves picked per edge take more than the
    # 10-wide pairs, so fxmem's analysis keeps the original
    torch.manual_seed(0)
    opt = fxmem.optimize(S.EdgeGATv2(), *S.EdgeGATv2.SPECS)
    entry = next(r for r in pair_entries(opt) if r["where"].startswith("w "))
    assert entry["status"] == "declined" and entry["reason"].startswith("declined: exact, but no memory saved")
