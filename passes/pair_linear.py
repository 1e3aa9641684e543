"""The pair-linear rule: a linear map applied to pairs ``[h_i || h_j]`` splits into two small terms.

    a · [h_i || h_j]        =  a[:F] · h_i  +  a[F:] · h_j
    W [h_i || h_j] + b      =  W[:, :F] h_i + b  +  W[:, F:] h_j

so the ``[.., N, N, 2F]`` pair tensor of GAT attention (and the ``repeat`` copies that build it)
is never needed: the result is the broadcast sum of a ``[.., N, 1, k]`` and a ``[.., 1, N, k]``
tensor. pyGAT fixed its own code this way by hand; PyG's ``DenseGATConv`` is written that way.
Edge-list GATs pick the pairs by index, ``[h[dst] || h[src]]`` (E x 2F): the same split is applied
to the node rows before picking them (:mod:`.gathered_pairs`). The halves may also be sums of copies
times numbers (:func:`.data_movement.terms`): EdgeConv's ``W [x_i || x_j - x_i] + b`` over kNN
neighbours is ``W1 x_i + b - W2 x_i + W2 x_j``, each copy mapped at its own size (``x_i`` broadcast
along k), so the ``[.., N, k, 2F]`` input and ``x_j - x_i`` are never built.

The rule matches by meaning, not spelling. A *linear map* is a node linear in the last dim of its
input ``x`` with weights that do not depend on the inputs (table ``LINEAR_MAPS``). ``x`` is a
*pair tensor* when running the copying ops that build it on id tensors
(:mod:`fxmem.passes.data_movement`) shows: the first half of the last dim copies one operand's
features in order, the second half another's, each operand varies along some axes of ``x`` and is
broadcast along the others, and some axis is the first operand's alone (i) and some the
second's alone (j). Look-alikes are declined with the reason: a nonlinearity before the map
(GATv2), products ``h_i * h_j``, and pairs that are not (row i, row j) - such as seed 000's
``cat(..., dim=1)``, which scrambles rows.

>>> [f.status for f in find(gm, probes)]                         # doctest: +SKIP
['match']
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxmem.passes.base import Finding, Probe
from fxmem.passes.data_movement import (Movement, Provenance, Terms, combination, provenance, terms, trace_combination,
                                        trace_movement)
from fxmem.passes.gathered_pairs import GatheredPlan, gathered
from fxmem.passes.gathered_pairs import describe as describe_gathered
from fxmem.passes.gathered_pairs import rewrite as rewrite_gathered
from fxmem.passes.linear_maps import SPLITS, TERMS, LinearMap, Weights, linear_map
from fxmem.passes.pair_layout import Arrangement, arrangement, emit_arrangement, half_strides
from fxmem.passes.pair_reasons import not_pairs, upstream_reason, variable_name

RULE = "pair-linear"


@dataclasses.dataclass(frozen=True)
class PairPlan:
    """A linear map over pairs, and where the two halves of its input come from."""

    map: LinearMap
    left: Arrangement
    right: Arrangement
    # the pair tensor's axis that merges (i, j) into one, i*N + j (``[B, N*N, 2F]``): the halves are
    # laid out on it split in two, and the sum is flattened back; None when the axes are (.., i, j, ..)
    merged: int | None = None


def _decode(m: LinearMap, movements: list[Movement], provs: list[Provenance], probes: Sequence[Probe],
            modules: Mapping) -> PairPlan | str | None:
    """The plan if ``m.x`` holds pairs (h_i, h_j); otherwise why not, in words; None where one side
    alone is broadcast (:func:`_combined` reads it)."""
    if any([s.name for s in mv.sources] != [s.name for s in movements[0].sources] for mv in movements):
        return "the tensor is built differently at different sizes"
    f = m.features // 2
    merged = None
    provs_unsplit = provs
    halves = _halves(provs, f)
    if halves is None:  # perhaps (i, j) merged into one axis, i*N + j: split it and look again
        for axis, split in _splits(provs):
            halves = _halves(split, f)
            if halves is not None:
                merged, provs = axis, split
                break
        else:
            return not_pairs(m, movements[0], provs[0], probes[0], modules)
    half_shapes = [tuple(pv.source.shape[:-1]) + (f,) for pv in provs]
    arranged = [arrangement(halves[h], movements[0].sources, [pv.source_shapes for pv in provs], half_shapes)
                for h in (0, 1)]
    if any(isinstance(a, str) for a in arranged):
        return not_pairs(m, movements[0], provs[0], probes[0], modules)
    left, right = arranged
    rank = provs[0].source.ndim
    for a in (left, right):
        if rank - 1 in a.unsqueeze and f > 1:
            return f"the features of {variable_name(a.source)} are not copied in order (one value fills the half)"
    shape = provs[0].source.shape
    spare = [ax for ax in range(rank - 1) if shape[ax] > 1 and ax not in left.axes | right.axes]
    if spare:
        return f"dim {spare[0]} of the pair tensor repeats the same pairs; not a plain pair tensor"
    if not (left.axes - right.axes) or not (right.axes - left.axes):
        return None  # one side broadcast (x_i with gathered neighbours x_j): split term by term, if at all
    if merged is not None and not ({merged, merged + 1} <= (left.axes ^ right.axes)):
        return not_pairs(m, movements[0], provs_unsplit, probes[0], modules)
    return PairPlan(m, left, right, merged)


def _halves(provs: Sequence[Provenance], f: int) -> list[list] | None:
    """Each half's (source, strides, offset) at every probe, or None where one is no affine view."""
    halves: list[list] = [[], []]
    for prov in provs:
        for h in (0, 1):
            found = half_strides(prov, h * f, f)
            if isinstance(found, str):
                return None
            halves[h].append(found)
    return halves


def _splits(provs: Sequence[Provenance]):
    """``(axis, provenances)`` with one non-feature axis of the pair tensor split in two, outer size
    the size of one of the operands' dims at every probe (``N*N`` -> ``(N, N)``): the merged
    ``i*N + j`` layout of ``cat([h.repeat_interleave(N, 1), h.repeat(1, N, 1)], -1)``."""
    seen = set()
    for axis in range(provs[0].source.ndim - 1):
        for k, shape in enumerate(provs[0].source_shapes):
            for d in range(len(shape)):
                outer = tuple(pv.source_shapes[k][d] for pv in provs)
                sizes = tuple(pv.source.shape[axis] for pv in provs)
                if (axis, outer) in seen or any(a < 2 or s % a or s // a < 2 for a, s in zip(outer, sizes)):
                    continue
                seen.add((axis, outer))
                split = []
                for pv, a in zip(provs, outer):
                    shape2 = (*pv.source.shape[:axis], a, pv.source.shape[axis] // a, *pv.source.shape[axis + 1:])
                    split.append(dataclasses.replace(pv, source=pv.source.reshape(shape2),
                                                     flat=pv.flat.reshape(shape2)))
                yield axis, split


# --- halves that are linear combinations of copies: EdgeConv's [x_i || x_j - x_i] -------------------

@dataclasses.dataclass(frozen=True)
class TermsPlan:
    """A linear map over ``x`` whose halves are sums of copies of operands times numbers: the map of
    each copy on its own, ``sum c * L_half(copy)``, broadcast-added (the bias once)."""

    map: LinearMap
    terms: tuple  # ((half 0 | 1, coefficient, Arrangement), ...)


def _combined(m: LinearMap, probes: Sequence[Probe], modules: Mapping, copies: bool = False) -> TermsPlan | str | None:
    """The plan if each half of ``m.x`` is a fixed linear combination of copies of its operands, one
    of them broadcast (smaller than ``x``): ``W [x_i || x_j - x_i] = (W1 - W2) x_i + W2 x_j``; a
    reason where such a tensor is no such sum; None where ``m.x`` is built otherwise: with no sum of
    copies (unless ``copies``: pairs with one side broadcast, handed on by :func:`_decode`), or with
    no copy broadcast (a concatenation of two tensors, nothing to build smaller)."""
    movements = [trace_combination(m.x, p.env, modules) for p in probes]
    if not movements[0].nodes or not (copies or any(combination(n, probes[0].env) for n in movements[0].nodes)):
        return None
    if any([s.name for s in mv.sources] != [s.name for s in movements[0].sources] for mv in movements):
        return "the tensor is built differently at different sizes"
    f = m.features // 2
    try:
        found = [terms(mv, p.env, modules) for mv, p in zip(movements, probes)]
    except (ValueError, TypeError, RuntimeError):  # an op that does not take ids: not plain copies
        return None
    listed = [_copies(t, f) for t in found]
    bad = next((x for x in listed if isinstance(x, str)), None)
    if bad is not None:
        return bad
    if any([c[:3] for c in x] != [c[:3] for c in listed[0]] for x in listed):
        return "the halves combine other copies at different sizes"
    half_shapes = [tuple(p.env[m.x].shape[:-1]) + (f,) for p in probes]
    shapes = [t.slots[0].source_shapes for t in found]
    out = []
    for q, (_, half, coefficient, _) in enumerate(listed[0]):
        arranged = arrangement([x[q][3] for x in listed], movements[0].sources, shapes, half_shapes)
        if isinstance(arranged, str):
            return f"a copy in half {half} of {m.x.name} is {arranged}"
        if len(half_shapes[0]) - 1 in arranged.unsqueeze and f > 1:
            return f"the features of {variable_name(arranged.source)} are not copied in order (one value fills the half)"
        out.append((half, coefficient, arranged))
    shape = half_shapes[0]
    full = {ax for ax in range(len(shape) - 1) if shape[ax] > 1}
    if all(a.axes == full for _, _, a in out):
        return None  # every copy as large as x: a concatenation of tensors, no pairs (nearest() says so)
    spare = sorted(full - {ax for _, _, a in out for ax in a.axes})
    if spare:
        return f"dim {spare[0]} of the map's input repeats the same values; not a plain sum of copies"
    return TermsPlan(m, tuple(out))


def _copies(found: Terms, f: int) -> list | str:
    """``[(slot, half, coefficient, (source, strides, offset))]``: each copy a half holds, at one probe."""
    out = []
    for k, (coefficients, prov) in enumerate(zip(found.coefficients, found.slots)):
        for half in (0, 1):
            c = coefficients[..., half * f:(half + 1) * f]
            if not bool((c != 0).any()):
                continue  # the slot is empty in this half
            first = c.reshape(-1)[0]
            if not bool((c == first).all()):
                return ("the halves are not fixed combinations of copies: a copy's coefficient changes along the "
                        "tensor (it is added to some pairs only)")
            at = half_strides(prov, half * f, f)
            if isinstance(at, str):
                return f"half {half} of the map's input is not a sum of plain copies of its operands ({at})"
            out.append((k, half, float(first), at))
    return out


def _describe_terms(plan: TermsPlan) -> str:
    m, f = plan.map, plan.map.features // 2
    parts = []
    for half, c, a in plan.terms:
        scale = "" if abs(c) == 1 else f"{abs(c):g} * "
        size_one = f" (size 1 along dims {list(a.unsqueeze)})" if a.unsqueeze else ""
        parts.append(f"{'-' if c < 0 else '+'} {scale}L{half + 1}({variable_name(a.source)}{size_one})")
    return (f"halves of the map's input (node {m.x.name}) are sums of copies: the {m.kind} map split at {f} "
            f"features into L1 and L2 gives {' '.join(parts).lstrip('+ ')}, each copy mapped at its own size and "
            f"the results broadcast-added, so the map's input and the sums in it are not built")


def _rewrite_terms(graph: torch.fx.Graph, nodes: Mapping, plan: TermsPlan) -> torch.fx.Node:
    """``sum c * L_half(copy)``: broadcast (small) terms first, so the one full-size sum is made last."""
    m, f, shared = plan.map, plan.map.features // 2, {}
    out = None
    for k, (half, c, a) in enumerate(sorted(plan.terms, key=lambda t: len(t[2].axes))):
        operand = emit_arrangement(graph, nodes[a.source], a, shared)
        term = TERMS[m.kind](graph, nodes, m, operand, half, f, c, k == 0)
        out = term if out is None else graph.call_function(operator.add, (out, term))
    return out


# --- the rule -----------------------------------------------------------------------------------------

SETTINGS: dict = {}  # nothing to set


def find(gm: torch.fx.GraphModule, probes: Sequence[Probe], settings: Mapping[str, Any] | None = None) -> list[Finding]:
    """Every linear map over pairs in ``gm`` (a match), and every look-alike (declined, with why)."""
    modules = dict(gm.named_modules())
    is_weight = Weights()
    findings = []
    for node in gm.graph.nodes:
        m = linear_map(node, probes[0].env, modules, is_weight)
        if m is None:
            continue
        picked = gathered(m, probes, modules)  # pairs of rows picked by an edge list
        if isinstance(picked, str):
            findings.append(Finding(RULE, node, "declined", picked))
            continue
        if picked is not None:
            frees = frozenset(trace_movement(m.x, probes[0].env, modules).nodes) | {g.node for g in picked.halves}
            findings.append(Finding(RULE, node, "match", describe_gathered(picked), picked, frees))
            continue
        if m.kind == "left":  # W @ xᵀ is split only for gathered pairs (a dense pair tensor is never 2-D)
            continue
        movements = [trace_movement(m.x, p.env, modules) for p in probes]
        if movements[0].nodes:
            provs = [provenance(mv, p.env, modules) for mv, p in zip(movements, probes)]
            if provs[0].has_duplicates:  # some element is copied many times: pairs, or a look-alike
                plan = _decode(m, movements, provs, probes, modules)
                if plan is None:
                    plan = _combined(m, probes, modules, copies=True) or (
                        "only one side is broadcast, and the halves are no sums of copies of rows")
                if isinstance(plan, str):
                    findings.append(Finding(RULE, node, "declined", plan))
                else:
                    findings.append(Finding(RULE, node, "match", _describe(plan, modules), plan,
                                            frozenset(movements[0].nodes)))
                continue
        combined = _combined(m, probes, modules)  # halves that are sums of copies: [x_i || x_j - x_i]
        if combined is not None:
            status = "declined" if isinstance(combined, str) else "match"
            findings.append(Finding(RULE, node, status, combined if status == "declined" else _describe(combined, modules),
                                    None if status == "declined" else combined,
                                    frozenset(trace_combination(m.x, probes[0].env, modules).nodes)))
            continue
        reason = upstream_reason(m, probes[0], modules, is_weight)
        if reason is not None:
            findings.append(Finding(RULE, node, "declined", reason))
    return findings


def _describe(plan: PairPlan | TermsPlan, modules: Mapping) -> str:
    if isinstance(plan, TermsPlan):
        return _describe_terms(plan)
    m, f = plan.map, plan.map.features // 2
    hi, hj = f"{variable_name(plan.left.source)}_i", f"{variable_name(plan.right.source)}_j"
    x = f"x = [{hi} || {hj}] (node {m.x.name})"
    w = _weight_name(m.weight)
    if m.kind == "matmul":
        split = f"x @ {w} = {hi} @ {w}[:{f}] + {hj} @ {w}[{f}:]"
    elif m.kind == "linear":
        split = f"linear(x) = linear({hi}, W[:, :{f}], b) + linear({hj}, W[:, {f}:])"
    else:
        split = f"(x * {w}).sum(-1) = ({hi} * {w}[..., :{f}]).sum(-1) + ({hj} * {w}[..., {f}:]).sum(-1)"
    merged = "" if plan.merged is None else f" (i and j merged in dim {plan.merged} as i*N + j: the sum is flattened back)"
    return f"pairs {x}: {split}, a broadcast add{merged}"


def _weight_name(ref: Any) -> str:
    if isinstance(ref, str):
        return ref
    return str(ref.target) if ref.op == "get_attr" else variable_name(ref)


def rewrite(graph: torch.fx.Graph, nodes: Mapping, finding: Finding, gm: torch.fx.GraphModule) -> torch.fx.Node:
    """Insert ``L1(h_i) + L2(h_j)`` before the linear map; returns the sum (the map's new value)."""
    plan: PairPlan = finding.plan
    if isinstance(plan, TermsPlan):
        with graph.inserting_before(nodes[plan.map.node]):
            return _rewrite_terms(graph, nodes, plan)
    if isinstance(plan, GatheredPlan):
        with graph.inserting_before(nodes[plan.map.node]):
            return rewrite_gathered(graph, nodes, plan)
    with graph.inserting_before(nodes[plan.map.node]):
        shared: dict = {}
        left = emit_arrangement(graph, nodes[plan.left.source], plan.left, shared)
        right = emit_arrangement(graph, nodes[plan.right.source], plan.right, shared)
        e1, e2 = SPLITS[plan.map.kind](graph, nodes, plan.map, left, right, plan.map.features // 2)
        out = graph.call_function(operator.add, (e1, e2))
        if plan.merged is not None:  # back to the model's merged i*N + j axis (a view of the sum)
            out = graph.call_method("flatten", (out, plan.merged, plan.merged + 1))
        return out
