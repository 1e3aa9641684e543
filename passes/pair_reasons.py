"""Why a linear map over (what looks like) pairs is left alone - in words a user understands.

Two kinds of look-alike: the map's input copies elements of its operands but not as pairs
(h_i, h_j) - seed 000's ``cat(..., dim=1)`` scrambles rows (:func:`not_pairs` shows which rows
each entry holds); or the input is *computed* from pairs, by a nonlinearity (GATv2) or a product
``h_i * h_j`` (:func:`upstream_reason`), so no split exists.

>>> upstream_reason(m, probe, modules, Weights())                       # doctest: +SKIP
'a nonlinearity (leaky_relu, node leaky_relu) comes between the pairs and this linear map (GATv2-style ...'
"""
from __future__ import annotations

import operator
import re
from typing import Mapping, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from fxmem.capture import source_line
from fxmem.passes.base import Probe
from fxmem.passes.data_movement import (CONCATENATIONS, Movement, Provenance, as_gather, method_name, op_name,
                                        provenance, trace_movement)
from fxmem.passes.linear_maps import LinearMap, Weights, linear_map


def variable_name(node: torch.fx.Node) -> str:
    """The user's variable name for a node (``h`` from ``h = torch.matmul(...)``), else the node's."""
    if node.op in ("get_attr", "placeholder"):
        return str(node.target)
    line = source_line(node)
    found = re.match(r"\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)", line.code) if line else None
    return found.group(1) if found else node.name


def index_name(node: torch.fx.Node) -> str:
    """``edge_index[1]`` (``norm[:, None]``) for a constant index into a node, else the user's variable name."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        key = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if all(k is None or isinstance(k, (int, slice)) for k in key):
            parts = [str(k) if isinstance(k, int) else "None" if k is None else ":" for k in key]
            while len(parts) > 1 and parts[-1] == ":":
                parts.pop()
            return f"{variable_name(node.args[0])}[{', '.join(parts)}]"
    return variable_name(node)


def _row(prov: Provenance, movement: Movement, pos: tuple, lo: int, f: int) -> str:
    """``h[0, 2]`` if the half at ``pos`` copies one row of a source in order, else a short note."""
    src, flat = prov.source[pos + (slice(lo, lo + f),)], prov.flat[pos + (slice(lo, lo + f),)]
    if torch.unique(src).numel() != 1:
        return "parts of several tensors"
    k, start = int(src[0]), int(flat[0])
    shape, name = prov.source_shapes[k], variable_name(movement.sources[k])
    first = start % shape[-1]
    if not torch.equal(flat, start + torch.arange(f)) or first + f > shape[-1]:
        return f"scattered elements of {name}"
    index, rest = [], start // shape[-1]
    for size in reversed(shape[:-1]):
        index.append(rest % size)
        rest //= size
    features = [] if f == shape[-1] else [f"{first}:{first + f}"]
    return f"{name}[{', '.join([str(i) for i in reversed(index)] + features)}]"


def not_pairs(m: LinearMap, movement: Movement, prov: Provenance, probe: Probe, modules: Mapping) -> str:
    """Why the elements copied into ``m.x`` are not (row i, row j) pairs: which rows some entries
    hold at the probe sizes, and a concatenation along a non-feature dim if that is the cause."""
    f = m.features // 2
    shape = tuple(prov.source.shape[:-1])
    at = ", ".join(f"{k}={v}" for k, v in probe.sizes.items())
    varying = [ax for ax, s in enumerate(shape) if s > 1]
    if len(varying) == 1:
        return (f"the concatenated tensor has one axis besides the features (dim {varying[0]}, size "
                f"{shape[varying[0]]}{f' at {at}' if at else ''}), so there are no (i, j) axes to split along; "
                f"if it holds pairs in a merged i*N + j layout, view it as [..., N, N, 2F] before the linear map")
    axes = varying[-2:]
    picks = []
    for offsets in ((0, 1), (1, 0)) if len(axes) == 2 else ((1,),):
        pos = [0] * len(shape)
        for ax, o in zip(axes, offsets):
            pos[ax] = o
        pos_t = tuple(pos)
        picks.append(f"entry {list(pos_t)} holds ({_row(prov, movement, pos_t, 0, f)} || "
                     f"{_row(prov, movement, pos_t, f, f)})")
    names = sorted({variable_name(s) for s in movement.sources})
    text = (f"pairs are not ({names[0]}_i, {names[0]}_j): " if len(names) == 1 else
            "pairs are not (row i, row j) of its operands: ") + f"{'; '.join(picks)}" + (f" (at {at})" if at else "")
    for cat in movement.concatenations:
        out = probe.env[cat]
        dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
        if cat.target is torch.stack or not isinstance(dim, int):
            continue
        dim = dim % out.ndim
        if dim != out.ndim - 1:
            line = source_line(cat)
            text += (f". The concatenation ({cat.name}{f' at {line}' if line else ''}) runs along dim {dim} "
                     f"(size {out.shape[dim]}), not along the features (dim {out.ndim - 1}), so after the view "
                     f"entry (i, j) combines rows picked by their position in the stacked tensor - this looks "
                     f"like a bug in the original; cat on the feature dim (dim={out.ndim - 1} or -1) was "
                     f"probably intended. Left as it is: a rewrite keeps what the code computes")
            break
    return text


# Ops between pairs and the linear map that make a split impossible, or that pass values through.
NONLINEAR_FUNCTIONS = frozenset({
    F.relu, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.softplus, F.hardtanh,
    F.relu6, F.prelu, F.softmax, F.log_softmax, F.sigmoid, F.tanh, torch.relu, torch.tanh,
    torch.sigmoid, torch.exp, torch.log, torch.softmax, torch.abs, torch.sqrt, torch.square,
    torch.pow, torch.sin, torch.cos, operator.pow, operator.abs,
})
NONLINEAR_METHODS = frozenset({"relu", "tanh", "sigmoid", "exp", "log", "softmax", "abs", "sqrt", "square",
                               "pow", "sin", "cos", "leaky_relu", "elu", "gelu"})
NONLINEAR_MODULES = (torch.nn.ReLU, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.SELU, torch.nn.CELU, torch.nn.GELU,
                     torch.nn.SiLU, torch.nn.Mish, torch.nn.Softplus, torch.nn.Hardtanh, torch.nn.ReLU6,
                     torch.nn.PReLU, torch.nn.Softmax, torch.nn.LogSoftmax, torch.nn.Sigmoid, torch.nn.Tanh)
PRODUCTS = frozenset({operator.mul, torch.mul, operator.truediv, torch.div, "mul", "div"})
SUMS = frozenset({operator.add, torch.add, operator.sub, torch.sub, "add", "sub"})
PASS_THROUGH = frozenset({F.dropout, "dropout"})


def _kind(node: torch.fx.Node, modules: Mapping) -> str | None:
    key = node.target if node.op == "call_function" else method_name(node) if node.op == "call_method" else None
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if isinstance(mod, NONLINEAR_MODULES):
            return "nonlinear"
        if isinstance(mod, torch.nn.Dropout):
            return "elementwise"
        return "linear" if isinstance(mod, torch.nn.Linear) else None
    if key in NONLINEAR_FUNCTIONS or key in NONLINEAR_METHODS:
        return "nonlinear"
    if key in PRODUCTS:
        return "product"
    if key in SUMS:
        return "sum"
    if key in PASS_THROUGH:
        return "elementwise"
    return None


def _picks_rows(node: torch.fx.Node, env: Mapping) -> bool:
    """Whether ``node`` picks rows by an index tensor (``h[dst]``): one side of an edge's pair."""
    return as_gather(node, env) is not None


def _pairs_upstream(node: torch.fx.Node, env: Mapping, modules: Mapping, is_weight: Weights,
                    depth: int = 0) -> list[torch.fx.Node] | None:
    """The computing nodes between ``node`` and where pairs are formed upstream, or None."""
    movement = trace_movement(node, env, modules)
    if movement.nodes and provenance(movement, env, modules).has_duplicates:
        return []
    if movement.concatenations and len(movement.sources) == 2 and all(_picks_rows(s, env) for s in movement.sources):
        return []  # [h[dst] || h[src]]: pairs of gathered rows
    for s in movement.sources:
        kind = _kind(s, modules)
        lm = linear_map(s, env, modules, is_weight) if kind is None else None
        if kind is None and lm is None:
            continue
        inputs = [lm.x] if lm is not None else [a for a in s.all_input_nodes
                                                 if isinstance(env.get(a), torch.Tensor) and not is_weight(a)]
        if kind in ("product", "sum") and len(inputs) >= 2 and (
                env[s].numel() > max(env[a].numel() for a in inputs) or all(_picks_rows(a, env) for a in inputs)):
            return [s]  # broadcasts its operands against each other, or combines picked rows: pairs
        if depth < 4:
            for a in inputs:
                below = _pairs_upstream(a, env, modules, is_weight, depth + 1)
                if below is not None:
                    return [s] + below
    return None


def upstream_reason(m: LinearMap, probe: Probe, modules: Mapping, is_weight: Weights) -> str | None:
    """Why a linear map whose input is computed from pairs (not copied from them) is left alone."""
    path = _pairs_upstream(m.x, probe.env, modules, is_weight)
    if not path:
        return None
    env = probe.env
    for s in path:
        if _kind(s, modules) == "nonlinear":
            return (f"a nonlinearity ({op_name(s, modules)}, node {s.name}) comes between the pairs and this "
                    f"linear map (GATv2-style a·σ(W[h_i || h_j])): σ mixes h_i and h_j, so the map has no "
                    f"split into a term in h_i plus a term in h_j")
    for s in path:
        operands = [a for a in s.all_input_nodes if isinstance(env.get(a), torch.Tensor) and not is_weight(a)]
        if _kind(s, modules) == "product" and len(operands) >= 2:
            return (f"features are combined with {op_name(s, modules)} (node {s.name}: a product/bilinear "
                    f"pair h_i * h_j), not concatenated: a·(h_i * h_j) has no split into a term in h_i plus "
                    f"a term in h_j")
    ops = ", ".join(f"{op_name(s, modules)} ({s.name})" for s in path)
    return (f"values are computed ({ops}) between the pairs and this linear map; only linear maps applied "
            f"to a plain concatenation of pairs are decomposed")



# --- the nearest pair tensor, where the rule finds none ---------------------------------------------

def _site(node: torch.fx.Node) -> str:
    line = source_line(node)
    return f"{node.name} ({line})" if line else node.name


def nearest(gm: torch.fx.GraphModule, probes: Sequence[Probe]) -> str | None:
    """The pair-linear rule's nearest candidate where it finds none: a concatenation feeding a
    linear map whose halves are not rows i and j (no element copied twice), or pairs of rows built
    by copies that no linear map reads."""
    env, modules = probes[0].env, dict(gm.named_modules())
    is_weight = Weights()
    for node in gm.graph.nodes:
        m = linear_map(node, env, modules, is_weight)
        cats = trace_movement(m.x, env, modules).concatenations if m is not None else []
        if cats:
            return (f"{_site(cats[-1])}: a concatenation feeding {op_name(node, modules)} (node {node.name}), but "
                    f"the halves are not rows i and j: no element of its operands is copied twice, so it pairs no "
                    f"row i with every row j (a concatenation of two tensors, nothing to split away)")
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in CONCATENATIONS or not isinstance(env.get(node), torch.Tensor):
            continue
        movement = trace_movement(node, env, modules)
        if movement.nodes and provenance(movement, env, modules).has_duplicates:
            readers = ", ".join(f"{op_name(u, modules)} (node {u.name})" for u in list(node.users)[:2])
            return (f"{_site(node)}: copies of rows concatenated (pairs), read by {readers or 'nothing'}, not by a "
                    f"linear map (a matmul with a weight, nn.Linear, F.linear, (x * a).sum(-1))")
    return None
