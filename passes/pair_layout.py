"""Pair layout: where each half of a pair tensor comes from, as a recipe that holds at every size.

From the provenance of a pair tensor's elements at two or more probe sizes
(:mod:`fxmem.passes.data_movement`), each half ``x[..., :F]`` / ``x[..., F:]`` must be an affine
view of one operand: ``flat = offset + sum(stride_k * index_k)``. Such a view is a plain block of
the operand - ``operand.reshape(..)[fixed parts].permute(..)`` with size 1 on the axes it is
broadcast along - and :class:`Arrangement` is that recipe, with sizes written in terms of the
operand's own dims (so it holds for every N, not only the probed ones).

>>> arrangement(halves, movement.sources, shapes, half_shapes)          # doctest: +SKIP
Arrangement(source=matmul, reshape=None, index=None, permute=None, unsqueeze=(2,), axes=frozenset({0, 1}))
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx

from fxmem.passes.data_movement import Provenance


@dataclasses.dataclass(frozen=True)
class Arrangement:
    """How to lay one operand out along the pair tensor's axes, size 1 where it is broadcast:
    ``source.reshape(reshape)[index].permute(permute)``, then ``unsqueeze`` at each listed axis.

    ``reshape`` entries are ints or ``(source dims, multiplier, divisor)``: the product of those
    dims' sizes times the multiplier, floor-divided by the divisor.
    """

    source: torch.fx.Node
    reshape: tuple | None
    index: tuple | None
    permute: tuple | None
    unsqueeze: tuple
    axes: frozenset  # non-feature axes of the pair tensor along which the operand varies



def half_strides(prov: Provenance, lo: int, f: int) -> tuple[int, list[int], int] | str:
    """(source, stride per axis, offset) if the half ``[..., lo:lo+f]`` is an affine view of one source."""
    src, flat = prov.source[..., lo:lo + f], prov.flat[..., lo:lo + f]
    found = torch.unique(src)
    if found.numel() != 1:
        return "mixes operands"
    base = int(flat.reshape(-1)[0])
    strides, expected = [], torch.full(flat.shape, base, dtype=torch.int64)
    for ax, size in enumerate(flat.shape):
        if size == 1:
            strides.append(0)
            continue
        unit = [0] * flat.ndim
        unit[ax] = 1
        stride = int(flat[tuple(unit)]) - base
        strides.append(stride)
        expected = expected + stride * torch.arange(size).reshape([-1 if q == ax else 1 for q in range(flat.ndim)])
    if not torch.equal(expected, flat):
        return "not a regular view"
    return int(found[0]), strides, base


def _layers(strides: list[int], sizes: tuple, offset: int, numel: int) -> tuple[list, list] | None:
    """Factor the source's flat index space into axes, outermost first: ``(size, pair-tensor axis)``
    for the axes the half varies along, ``(size, None)`` for the parts it holds fixed (with the
    fixed index in ``digits``). None when the half is no plain sub-block of the source."""
    used = sorted((s, ax) for ax, s in enumerate(strides) if s != 0)
    inner: list[tuple[int, int | None]] = []
    cur = 1
    for stride, ax in used:
        if stride < cur or stride % cur:
            return None  # overlapping or reversed
        if stride > cur:
            inner.append((stride // cur, None))
        inner.append((sizes[ax], ax))
        cur = stride * sizes[ax]
    if numel % cur:
        return None
    if numel // cur > 1:
        inner.append((numel // cur, None))
    layers = inner[::-1]
    digits, rest = [], offset
    for size, _ in inner:
        digits.append(rest % size)
        rest //= size
    digits.reverse()
    if rest or any(d for (_, ax), d in zip(layers, digits) if ax is not None):
        return None  # starts in the middle of an axis it varies along
    return layers, digits


def _align(refined: list[int], shape: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Group the factored axes with the source's dims: one dim split into several axes, several
    dims merged into one axis, or one to one. Size-1 dims are left out: the reshape drops them."""
    dims = [j for j, s in enumerate(shape) if s != 1]
    groups, i, j = [], 0, 0
    while i < len(refined):
        if j >= len(dims):
            return None
        gi, gj, pr, ps = [i], [dims[j]], refined[i], shape[dims[j]]
        while pr != ps:
            if pr < ps:
                i += 1
                if i >= len(refined):
                    return None
                gi.append(i)
                pr *= refined[i]
            else:
                j += 1
                if j >= len(dims):
                    return None
                gj.append(dims[j])
                ps *= shape[dims[j]]
        if len(gi) > 1 and len(gj) > 1:
            return None
        groups.append((gi, gj))
        i, j = i + 1, j + 1
    return groups if j == len(dims) else None


def arrangement(halves: list, sources: list[torch.fx.Node], shapes: list[list[tuple]],
                 half_shapes: list[tuple]) -> Arrangement | str:
    """Combine one half's layout at every probe into sizes that hold for all sizes.

    ``halves[p]`` is ``(source, strides, offset)`` at probe p, ``shapes[p]`` the sources' shapes
    and ``half_shapes[p]`` the half's shape (the pair tensor's, last dim F).
    """
    rank = len(half_shapes[0])
    per_probe = []
    for p, (k, strides, offset) in enumerate(halves):
        shape = shapes[p][k]
        found = _layers(strides, half_shapes[p], offset, math.prod(shape))
        if found is None:
            return "not a plain block of the operand"
        layers, digits = found
        groups = _align([s for s, _ in layers], shape)
        if groups is None:
            return "not a plain block of the operand"
        key = (k, tuple(ax for _, ax in layers), tuple(d for (_, ax), d in zip(layers, digits) if ax is None),
               tuple((tuple(gi), tuple(gj)) for gi, gj in groups))
        per_probe.append((key, [s for s, _ in layers], shape))
    if any(key != per_probe[0][0] for key, _, _ in per_probe):
        return "laid out differently at different sizes"
    (k, axes, digits, groups), refined0, shape0 = per_probe[0]
    refined = [r for _, r, _ in per_probe]
    shape_at = [s for _, _, s in per_probe]
    const_r = [all(r[i] == refined0[i] for r in refined) for i in range(len(refined0))]
    const_s = [all(s[j] == shape0[j] for s in shape_at) for j in range(len(shape0))]
    spec: list[Any] = [None] * len(refined0)
    for gi, gj in groups:
        if len(gi) == 1:  # one axis from one dim or from several merged dims
            i = gi[0]
            varying = tuple(j for j in gj if not const_s[j])
            spec[i] = refined0[i] if const_r[i] else (varying, math.prod(shape0[j] for j in gj if const_s[j]), 1)
        else:  # one dim split into several axes: at most one of them may vary with the sizes
            varying = [i for i in gi if not const_r[i]]
            if len(varying) > 1:
                return "splits one dim of the operand into several that vary with the sizes"
            for i in gi:
                spec[i] = refined0[i] if const_r[i] else \
                    ((gj[0],), 1, math.prod(refined0[q] for q in gi if q != i))
    same_shape = all(len(r) == len(s) and tuple(r) == tuple(s) for r, s in zip(refined, shape_at))
    kept = [ax for ax in axes if ax is not None]
    index = None
    if None in axes:  # pick the fixed parts (a head, a slice of features) with one getitem
        fixed = iter(digits)
        index = tuple(slice(None) if ax is not None else next(fixed) for ax in axes)
    order = tuple(sorted(range(len(kept)), key=kept.__getitem__))
    return Arrangement(
        sources[k], None if same_shape else tuple(spec), index,
        order if order != tuple(range(len(kept))) else None,
        tuple(a for a in range(rank) if a not in kept), frozenset(a for a in kept if a < rank - 1))


def _emit_size(graph: torch.fx.Graph, source: torch.fx.Node, spec: Any) -> Any:
    if isinstance(spec, int):
        return spec
    dims, multiplier, divisor = spec
    out: Any = None
    for j in dims:
        size = graph.call_method("size", (source, j))
        out = size if out is None else graph.call_function(operator.mul, (out, size))
    if multiplier != 1:
        out = graph.call_function(operator.mul, (out, multiplier))
    if divisor != 1:
        out = graph.call_function(operator.floordiv, (out, divisor))
    return out


def emit_arrangement(graph: torch.fx.Graph, source: torch.fx.Node, a: Arrangement,
                     shared: dict | None = None) -> torch.fx.Node:
    """Insert the nodes that lay ``source`` out as ``a`` says (views of it, as long as the source
    is contiguous). ``shared`` reuses the reshape and indexing between both halves of one pair."""
    shared = {} if shared is None else shared
    key = (source, a.reshape, repr(a.index))  # slices are not hashable before Python 3.12
    if key not in shared:
        t = source
        if a.reshape is not None:
            t = graph.call_method("reshape", (t, *[_emit_size(graph, source, s) for s in a.reshape]))
        if a.index is not None:
            t = graph.call_function(operator.getitem, (t, a.index))
        shared[key] = t
    t = shared[key]
    if a.permute is not None:
        t = graph.call_method("permute", (t, *a.permute))
    for axis in a.unsqueeze:
        t = graph.call_method("unsqueeze", (t, axis))
    return t

