"""Gathered pairs: the pair-linear rule for edge lists, where pairs are rows picked by index tensors.

    cat([h[dst], h[src]], -1) @ a   =   (h @ a[:F])[dst] + (h @ a[F:])[src]

Edge-list GATs (pyGAT's sparse layer, PyG-style code) build one row ``[h_dst || h_src]`` per
edge: an E x 2F tensor, kept for backward. A map linear in the features commutes with picking
rows, so it can be applied to the N node rows first and the E-row results picked after: the E x 2F
tensor is never built. The rule matches by meaning: the map's input must be a concatenation, along
the features, of two *gathers* - ``S[idx]``, ``S[:, idx]``, ``S.index_select(d, idx)`` with ``idx``
a 1-D integer tensor and ``d`` not the feature dim - and running those nodes on tensors of unique
ids at the probe sizes must give exactly ``[ids(S1)[idx1] || ids(S2)[idx2]]`` (whatever the
spelling). Look-alikes - a concatenation along the edges, a nonlinearity or a product between the
gathers and the map (GATv2) - are declined by :mod:`.pair_linear` and :mod:`.pair_reasons`.

>>> plan = gathered(linear_map_node, probes, modules)       # doctest: +SKIP
GatheredPlan(map=..., halves=((h, dst, 0), (h, src, 0)))
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Mapping, Sequence

import torch
import torch.fx

from fxmem.passes.base import Probe
from fxmem.passes.data_movement import Gather, as_gather, run_node, trace_movement
from fxmem.passes.linear_maps import SPLITS, LinearMap
from fxmem.passes.pair_reasons import index_name, variable_name


@dataclasses.dataclass(frozen=True)
class GatheredPlan:
    """A linear map over ``[gather_1 || gather_2]``: apply it to each source, then gather."""

    map: LinearMap
    halves: tuple  # (Gather, Gather)
    concat: torch.fx.Node


def gathered(m: LinearMap, probes: Sequence[Probe], modules: Mapping) -> GatheredPlan | str | None:
    """The plan when ``m``'s input is ``[gather_1 || gather_2]`` along the features; a reason when
    it is made from two gathers some other way (scrambled); None when no gather is involved."""
    env = probes[0].env
    movement = trace_movement(m.x, env, modules)
    cats = movement.concatenations
    if len(cats) != 1 or len(movement.sources) > 2:
        return None
    cat = cats[0]
    operands = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    if not isinstance(operands, (list, tuple)) or len(operands) != 2:
        return None
    halves = [as_gather(o, env) for o in operands]
    if not all(halves) or {h.node for h in halves} != set(movement.sources):
        return None
    f = m.features // 2
    for p in probes:
        if not _same_ids(m.x, movement.nodes, halves, p.env, modules):
            dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
            names = " and ".join(f"{variable_name(g.source)}[{index_name(g.index)}]" for g in halves)
            return (f"pairs are not one row per edge: the picked rows ({names}) are concatenated "
                    f"along dim {dim} (node {cat.name}) and laid out so that a row of the map's input mixes "
                    f"rows of different edges; left as it is")
    if any(env[g.node].shape[-1] != f for g in halves):
        return "the two gathered halves have different widths"
    return GatheredPlan(m, tuple(halves), cat)


def _same_ids(x: torch.fx.Node, moving: list, halves: list[Gather], env: Mapping, modules: Mapping) -> bool:
    """``x`` computed from unique ids is exactly the two sources' ids picked by their indices, side by side."""
    ids: dict = {}
    start = 0
    for g in halves:
        if g.source not in ids:
            shape = tuple(env[g.source].shape)
            n = env[g.source].numel()
            ids[g.source] = torch.arange(start, start + n, dtype=torch.int64).reshape(shape)
            start += n
    lookup = {**env, **ids}
    for n in [g.node for g in halves] + list(moving):
        lookup[n] = run_node(n, torch.fx.node.map_arg(n.args, lambda a: lookup[a]),
                             torch.fx.node.map_arg(n.kwargs, lambda a: lookup[a]), modules)
    got = lookup[x]
    want = torch.cat([ids[g.source].index_select(g.dim, env[g.index]) for g in halves], dim=-1)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and bool(torch.equal(got, want))


def describe(plan: GatheredPlan) -> str:
    (g1, g2), f = plan.halves, plan.map.features // 2
    s1, s2 = variable_name(g1.source), variable_name(g2.source)
    i1, i2 = index_name(g1.index), index_name(g2.index)
    return (f"gathered pairs x = [{s1}[{i1}] || {s2}[{i2}]] (node {plan.map.x.name}): the map is applied to the "
            f"rows of {s1}{'' if s1 == s2 else ' and ' + s2} first, L1({s1})[{i1}] + L2({s2})[{i2}], so the "
            f"tensor of 2x{f} features per picked row is not built")


def rewrite(graph: torch.fx.Graph, nodes: Mapping, plan: GatheredPlan) -> torch.fx.Node:
    """Insert ``L1(S1)[idx1] + L2(S2)[idx2]`` before the map; returns the sum."""
    m = plan.map
    g1, g2 = plan.halves
    e1, e2 = SPLITS[m.kind](graph, nodes, m, nodes[g1.source], nodes[g2.source], m.features // 2)
    picked = [graph.call_function(torch.index_select, (e, g.dim, nodes[g.index])) for e, g in ((e1, g1), (e2, g2))]
    total = graph.call_function(operator.add, tuple(picked))
    return graph.call_method("t", (total,)) if m.kind == "left" else total
