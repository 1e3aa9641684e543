"""``fxmem.passes.pair_layout``: each half of a pair tensor as a recipe over its operand that holds at every size.

For GAT pair spellings (``zoo/pair_spellings.py``, batched and unbatched, and seed 000's corrected
layer), the two probes' provenance goes through ``half_strides`` and ``arrangement``; the
arrangement is emitted with ``emit_arrangement`` into a fresh fx graph and run on the operand at a
third size the probes never saw: broadcast, it must equal the real pair tensor's half exactly,
with size 1 along the axes the operand does not vary on. Scrambled layouts (seed 000's
``cat(dim=1)``) and hand-built provenances that are no plain block get a reason string instead.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

from zoo import pair_spellings as P
from conftest import load_example
from fxmem.capture import trace
from fxmem.passes import Probe
from fxmem.passes.data_movement import Provenance, provenance, trace_movement
from fxmem.passes.linear_maps import Weights, linear_map
from fxmem.passes.pair_layout import Arrangement, arrangement, emit_arrangement, half_strides

seed_gat = load_example("seed_gat")
SEED_SPECS = (("B", "N", 6), ("B", "N", "N"))
PROBES = ({"B": 3, "N": 5, "M": 4}, {"B": 4, "N": 6, "M": 7})
UNSEEN = {"B": 2, "N": 7, "M": 3}


class PermutedSource(nn.Module):
    """h is [N, B, F] (node-major); pairs are [B, N, N, 2F]: the operand must be permuted."""

    SPECS = (("N", "B", P.FIN),)

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(P.FIN, P.FEAT))
        self.a = nn.Parameter(torch.randn(2 * P.FEAT, 1))

    def forward(self, x):
        h = x @ self.W
        n = h.shape[0]
        hb = h.permute(1, 0, 2)
        return torch.cat([hb.unsqueeze(2).expand(-1, -1, n, -1), hb.unsqueeze(1).expand(-1, n, -1, -1)], -1) @ self.a


def probe(gm: torch.fx.GraphModule, specs: tuple, sizes: dict, seed: int = 0) -> Probe:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tuple(sizes[d] if isinstance(d, str) else d for d in s), generator=gen) for s in specs]
    interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*xs)
    return Probe(sizes, interp.env)


def layouts(model: nn.Module, specs: tuple):
    """For each linear map over a tensor built by copies that repeat elements (as the pair-linear rule
    picks them): (graph, that tensor's node, F, [left, right] arrangements or reasons)."""
    gm = trace(model)
    modules = dict(gm.named_modules())
    probes = [probe(gm, specs, s) for s in PROBES]
    maps = [m for n in gm.graph.nodes if (m := linear_map(n, probes[0].env, modules, Weights())) is not None]
    found_pairs = False
    for m in maps:
        movements = [trace_movement(m.x, p.env, modules) for p in probes]
        provs = [provenance(mv, p.env, modules) for mv, p in zip(movements, probes)]
        if not provs[0].has_duplicates:  # h = x @ W: a linear map, but of no pair tensor
            continue
        found_pairs = True
        f = m.features // 2
        halves = []
        for lo in (0, f):
            found = [half_strides(pv, lo, f) for pv in provs]
            if any(isinstance(h, str) for h in found):
                halves.append(next(h for h in found if isinstance(h, str)))
                continue
            half_shapes = [tuple(p.env[m.x].shape[:-1]) + (f,) for p in probes]
            halves.append(arrangement(found, movements[0].sources, [pv.source_shapes for pv in provs], half_shapes))
        yield gm, m.x, f, halves
    assert found_pairs, "no linear map over pairs found"


def emitted(a: Arrangement) -> torch.fx.GraphModule:
    """A fresh graph: the operand in, laid out as ``a`` says, out."""
    graph = torch.fx.Graph()
    src = graph.placeholder("src")
    graph.output(emit_arrangement(graph, src, a))
    return torch.fx.GraphModule(nn.Module(), graph)


# (model, specs, pair-tensor axes the left operand varies along, those of the right one)
BATCHED, UNBATCHED = ({0, 1}, {0, 2}), ({0}, {1})
CASES = [
    (P.PyGATRepeat, P.PyGATRepeat.SPECS, *UNBATCHED),
    (P.RepeatInterleave, P.RepeatInterleave.SPECS, *UNBATCHED),
    (P.BatchedRepeatLastDim, P.BatchedRepeatLastDim.SPECS, *BATCHED),
    (P.ConstantK, P.ConstantK.SPECS, *BATCHED),  # N a Python int
    (P.LinearOnPairs, P.LinearOnPairs.SPECS, *BATCHED),
    (P.Expand, P.Expand.SPECS, *BATCHED),
    (P.Einops, P.Einops.SPECS, *BATCHED),
    (P.StackFlatten, P.StackFlatten.SPECS, *BATCHED),
    (P.VectorA, P.VectorA.SPECS, *BATCHED),
    (P.SwappedSides, P.SwappedSides.SPECS, {0, 2}, {0, 1}),  # [h_j || h_i]
    (P.Bipartite, P.Bipartite.SPECS, *BATCHED),
    (P.MultiHeadLinearPerHead, P.MultiHeadLinearPerHead.SPECS, *UNBATCHED),  # a reshape and a head index
    (P.MultiHeadMulSum, P.MultiHeadMulSum.SPECS, {0, 1, 3}, {0, 2, 3}),  # heads on axis 3
    (P.FlatRowsQueries, P.FlatRowsQueries.SPECS, *UNBATCHED),  # rows of B*N, reshaped from [B, N, F]
    (lambda: seed_gat.GraphAttentionLayerFixed(6, P.FEAT), SEED_SPECS, *BATCHED),
    (PermutedSource, PermutedSource.SPECS, *BATCHED),
]


@pytest.mark.parametrize("make,specs,left_axes,right_axes", CASES,
                         ids=[c[0].__name__ if isinstance(c[0], type) else "seed_gat_fixed" for c in CASES])
def test_arrangement_reproduces_each_half_at_an_unseen_size(make, specs, left_axes, right_axes):
    torch.manual_seed(0)
    model = make()
    for gm, x, f, halves in layouts(model, specs):
        assert all(isinstance(a, Arrangement) for a in halves), halves
        left, right = halves
        assert (left.axes, right.axes) == (left_axes, right_axes)
        real = probe(gm, specs, UNSEEN, seed=1).env
        pair = real[x]
        for a, lo in ((left, 0), (right, f)):
            got = emitted(a)(real[a.source])
            assert got.ndim == pair.ndim
            # size 1 on the axes the operand is broadcast along, full size on the others
            assert [got.shape[ax] for ax in range(pair.ndim - 1)] == \
                   [pair.shape[ax] if ax in a.axes else 1 for ax in range(pair.ndim - 1)]
            assert torch.equal(got.expand(pair[..., lo:lo + f].shape), pair[..., lo:lo + f])


def test_both_halves_share_one_reshape_and_index():
    torch.manual_seed(0)
    (gm, x, f, (left, right)), *_ = layouts(P.MultiHeadLinearPerHead(), P.MultiHeadLinearPerHead.SPECS)
    assert left.reshape is not None and left.index is not None
    graph, shared = torch.fx.Graph(), {}
    src = graph.placeholder("src")
    out = (emit_arrangement(graph, src, left, shared), emit_arrangement(graph, src, right, shared))
    graph.output(out)
    kinds = [n.target for n in graph.nodes if n.op in ("call_method", "call_function")]
    assert kinds.count("reshape") == 1 and kinds.count(operator.getitem) == 1 and kinds.count("unsqueeze") == 2
    real = probe(gm, P.MultiHeadLinearPerHead.SPECS, UNSEEN, seed=1).env
    got_left, got_right = torch.fx.GraphModule(nn.Module(), graph)(real[left.source])
    pair = real[x]
    assert torch.equal(got_left.expand(pair[..., :f].shape), pair[..., :f])
    assert torch.equal(got_right.expand(pair[..., f:].shape), pair[..., f:])


@pytest.mark.parametrize("make,specs", [(lambda: seed_gat.GraphAttentionLayer(6, P.FEAT), SEED_SPECS),
                                        (P.ScrambledHeads, P.ScrambledHeads.SPECS)], ids=["seed_cat_dim1", "heads"])
def test_scrambled_layout_is_a_reason_not_an_arrangement(make, specs):
    torch.manual_seed(0)
    for _, _, _, halves in layouts(make(), specs):
        # rows (i, j) hold two consecutive rows of [h repeated; h tiled]: no constant stride along j
        assert halves == ["not a regular view", "not a regular view"], halves


# --- half_strides and arrangement on hand-built provenances -----------------------------------------

def pygat_provenance(n: int, f: int) -> Provenance:
    """Element [i, j, c] of the [n, n, 2f] pair tensor of one [n, f] source: h[i, c], then h[j, c - f]."""
    i, j, c = torch.arange(n)[:, None, None], torch.arange(n)[None, :, None], torch.arange(2 * f)
    flat = torch.where(c < f, i * f + c, j * f + (c - f))
    return Provenance(torch.zeros_like(flat), flat, [(n, f)])


def test_half_strides_of_pygat_pairs():
    prov = pygat_provenance(5, 3)
    assert half_strides(prov, 0, 3) == (0, [3, 0, 1], 0)  # h_i: stride f along i, 0 along j
    assert half_strides(prov, 3, 3) == (0, [0, 3, 1], 0)
    assert half_strides(prov, 1, 3) == "not a regular view"  # straddles both halves
    mixed = Provenance(torch.tensor([[0, 1]]), torch.tensor([[0, 0]]), [(1,), (1,)])
    assert half_strides(mixed, 0, 2) == "mixes operands"


def test_arrangement_from_hand_built_halves():
    sources = ["h"]  # stands for the operand's node
    provs = [pygat_provenance(n, 3) for n in (4, 6)]
    shapes = [[(4, 3)], [(6, 3)]]
    half_shapes = [(4, 4, 3), (6, 6, 3)]
    right = arrangement([half_strides(p, 3, 3) for p in provs], sources, shapes, half_shapes)
    assert right == Arrangement("h", None, None, None, (0,), frozenset({1}))  # h.unsqueeze(0)
    swapped = [half_strides(provs[0], 0, 3), half_strides(provs[1], 3, 3)]
    assert arrangement(swapped, sources, shapes, half_shapes) == "laid out differently at different sizes"
    flipped = [(0, [-3, 0, 1], 9)]  # rows in reverse order: affine, but no plain block
    assert arrangement(flipped, sources, shapes[:1], half_shapes[:1]) == "not a plain block of the operand"
