"""The fused message-passing rule: gather -> per-edge message -> scatter-add becomes one sparse-dense
product over a CSR adjacency built once from the edge list (:mod:`fxmem.ops.spmm`; seed 003).

    zeros(N, F).index_add_(0, dst, x[src] * w[:, None])    ->   spmm(A, x),  A[dst_e, src_e] = w_e

The message ``x[src] * w`` is E x F and autograd keeps it; the product builds nothing E x F (DGL's
fused send-and-receive). Spellings: ``index_add_``/``index_add``/``torch.index_add``,
``scatter_add_``/``scatter_add`` and ``scatter_reduce(..., "sum")`` with the target index broadcast
over the features, into a tensor made by ``zeros``/``zeros_like``/``new_zeros``; the message is a
gather ``x[src]`` / ``x.index_select(0, src)``, alone or times per-edge weights broadcast over the
features (``w[:, None]``, ``w.view(-1, 1)``, and per head ``w[:, :, None]`` with x [N, H, F]). The rule
checks at the probe sizes that the fused product gives the scatter's value; the memory analysis
before and after decides whether it pays (the CSR structure costs 16 bytes per edge, the message
4·F: for a narrow message it may not). Edge lists used by several layers share one structure.
Declined, with the reason: messages computed otherwise (an MLP on [x_i || x_j], a product of two
gathers), scatters into a tensor that is not zeros, reductions other than a sum.

>>> [f.status for f in find(gm, probes)]                              # doctest: +SKIP
['match']
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxmem.ops.spmm import csr_structure, spmm
from fxmem.passes.base import Finding, Probe
from fxmem.passes.data_movement import Gather, as_gather, is_movement, method_name, op_name
from fxmem.passes.pair_reasons import index_name, variable_name

RULE = "fused-message-passing"
SETTINGS: dict = {}

_ZEROS = frozenset({torch.zeros, torch.zeros_like, "new_zeros", "zero_"})
_INDEX_ADD = frozenset({"index_add", "index_add_", torch.index_add})
_SCATTER_ADD = frozenset({"scatter_add", "scatter_add_", torch.scatter_add})
_SCATTER_REDUCE = frozenset({"scatter_reduce", "scatter_reduce_", torch.scatter_reduce})
_MULS = frozenset({operator.mul, torch.mul, "mul"})


@dataclasses.dataclass(frozen=True)
class MessagePlan:
    """One gather -> message -> scatter-add chain."""

    scatter: torch.fx.Node
    base: torch.fx.Node  # the zeros the messages are added into
    rows: tuple  # the number of targets: ("size", node, dim), ("item", sizes node, k), ("node", n), ("int", n)
    dst: torch.fx.Node
    gather: Gather  # x[src]
    weight: torch.fx.Node | None
    in_place: bool
    message: torch.fx.Node
    rows_at: tuple = ()  # the number of targets at each probe: layers whose counts agree share a structure


def _key(node: torch.fx.Node) -> Any:
    return node.target if node.op == "call_function" else method_name(node)


def _arg(node: torch.fx.Node, pos: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[pos] if len(node.args) > pos else default


def _scatter(node: torch.fx.Node) -> tuple | None:
    """(base, dim, index, message, in place, reduction) of a scatter-add node, or None."""
    key = _key(node)
    if key in _INDEX_ADD:
        if _arg(node, 4, "alpha", 1) != 1:
            return None
        return node.args[0], _arg(node, 1, "dim"), _arg(node, 2, "index"), _arg(node, 3, "source"), \
            key == "index_add_", "sum"
    if key in _SCATTER_ADD:
        return node.args[0], _arg(node, 1, "dim"), _arg(node, 2, "index"), _arg(node, 3, "src"), \
            key == "scatter_add_", "sum"
    if key in _SCATTER_REDUCE:
        return node.args[0], _arg(node, 1, "dim"), _arg(node, 2, "index"), _arg(node, 3, "src"), \
            key == "scatter_reduce_", _arg(node, 4, "reduce")
    return None


def _rows(base: torch.fx.Node, env: Mapping) -> tuple | None:
    """How the rewritten graph gets the number of target rows without building ``base``; None if
    ``base`` is not made as zeros."""
    # by how it is made: the probe's value of an in-place target is the sums, not the zeros
    key = _key(base)
    if key not in _ZEROS:
        return None
    if key is torch.zeros_like and isinstance(base.args[0], torch.fx.Node):
        return ("size", base.args[0], 0)
    if key == "zero_" and isinstance(base.args[0], torch.fx.Node):
        return ("size", base.args[0], 0)
    sizes = base.args[1:] if key == "new_zeros" else base.args
    first = sizes[0] if sizes else None
    if isinstance(first, (tuple, list)):
        first = first[0] if first else None
    if isinstance(first, int):
        return ("int", first)
    if isinstance(first, torch.fx.Node):
        return ("item", first, 0) if isinstance(env.get(first), (tuple, list)) else ("node", first)
    return ("size", base, 0)


def _target_index(index: Any, message: torch.fx.Node, env: Mapping, modules: Mapping) -> torch.fx.Node | None:
    """The 1-D target list behind a scatter index (``dst.view(-1, 1).expand_as(msg)``), checked on values."""
    node = index
    while isinstance(node, torch.fx.Node) and env.get(node) is not None and env[node].dim() > 1 \
            and is_movement(node, env, modules):
        inputs = [a for a in node.all_input_nodes if isinstance(env.get(a), torch.Tensor)
                  and env[a].dtype == env[node].dtype]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    value = env.get(node) if isinstance(node, torch.fx.Node) else None
    if value is None or value.dim() != 1 or value.is_floating_point():
        return None
    full = env[index]
    shape = [-1] + [1] * (full.dim() - 1)
    return node if full.shape[0] == value.shape[0] and bool(torch.equal(value.view(shape).expand_as(full), full)) \
        else None


def _message(message: Any, env: Mapping) -> tuple[Gather, torch.fx.Node | None] | str:
    """(the gather, the edge weights or None) of ``x[src]`` or ``x[src] * w``."""
    if not isinstance(message, torch.fx.Node):
        return "the message is not a tensor"
    found = as_gather(message, env)
    if found is not None:
        return (found, None) if found.dim == 0 else "the message gathers along another dim than the edges"
    if _key(message) in _MULS and len(message.args) == 2 and all(isinstance(a, torch.fx.Node) for a in message.args):
        for g, w in (message.args, message.args[::-1]):
            found = as_gather(g, env)
            if found is not None and found.dim == 0:
                return found, w
    return (f"the message is {op_name(message)} (node {message.name}), not x[src] or x[src] times per-edge weights: "
            f"only messages a sparse matrix times x can express are fused")


def _check_weights(w: torch.fx.Node, picked: torch.Tensor, env: Mapping) -> str | None:
    """Edge weights broadcast over the features: [E, .., 1] against the message [E, .., F]."""
    value = env.get(w)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return "the weights are not a float tensor"
    if value.dim() != picked.dim() or value.shape[0] != picked.shape[0] or value.shape[-1] != 1 or \
            any(a not in (1, b) for a, b in zip(value.shape[1:-1], picked.shape[1:-1])):
        return (f"the weights {tuple(value.shape)} are not one per edge (and head) broadcast over the features of "
                f"the message {tuple(picked.shape)}")
    return None


def find(gm: torch.fx.GraphModule, probes: Sequence[Probe], settings: Mapping[str, Any] | None = None) -> list[Finding]:
    """Every gather -> message -> scatter-add chain (a match) and every look-alike scatter (declined)."""
    modules = dict(gm.named_modules())
    findings = []
    for node in gm.graph.nodes:
        parts = _scatter(node)
        if parts is None:
            continue
        plan = _match(node, parts, probes, modules)
        if isinstance(plan, str):
            findings.append(Finding(RULE, node, "declined", plan))
        elif plan is not None:
            frees = frozenset(n for n in (plan.message, plan.gather.node, plan.base) if n is not None)
            findings.append(Finding(RULE, node, "match", _describe(plan), plan, frees))
    return findings


def _match(node: torch.fx.Node, parts: tuple, probes: Sequence[Probe], modules: Mapping) -> MessagePlan | str | None:
    env = probes[0].env
    base, dim, index, message, in_place, reduce = parts
    if not all(isinstance(a, torch.fx.Node) for a in (base, index, message)):
        return None
    if not isinstance(dim, int) or dim % env[base].dim() != 0:
        return "the scatter runs along another dim than the target rows (dim 0)"
    if reduce not in ("sum", "add"):
        return f"the scatter reduces with {reduce!r}; only sums are a sparse-dense product"
    others = [u for u in base.users if u is not node and u.op != "output" and _scatter(u) is not None]
    if others:
        return (f"several scatters add into {variable_name(base)} (nodes {node.name}, {others[0].name}): "
                f"fused one at a time they would not start from zeros; left as they are")
    rows = _rows(base, env)
    if rows is None:
        return (f"the messages are added into {variable_name(base)} (node {base.name}), which is not made as zeros: "
                f"only a sum from zero is A @ x")
    dst = index if env[index].dim() == 1 else _target_index(index, message, env, modules)
    if dst is None:
        return "the scatter's index is not one target per edge broadcast over the features"
    found = _message(message, env)
    if isinstance(found, str):
        return found
    gather, weight = found
    if weight is not None:
        bad = _check_weights(weight, env[gather.node], env)
        if bad is not None:
            return bad
    if env[gather.node].dim() < 2 or env[message].shape != env[gather.node].shape:
        return "the message is not one feature row per edge"
    plan = MessagePlan(node, base, rows, dst, gather, weight, in_place, message,
                       tuple(_rows_value(rows, p.env) for p in probes))
    for p in probes:
        got = fused_value(p.env[dst], p.env[gather.index], p.env[weight] if weight is not None else None,
                          p.env[gather.source], _rows_value(rows, p.env))
        want = p.env[node]
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            at = ", ".join(f"{k}={v}" for k, v in p.sizes.items())
            return f"the fused product does not reproduce the scatter at {at}; left as it is"
    return plan


def _rows_value(rows: tuple, env: Mapping) -> int:
    if rows[0] == "int":
        return rows[1]
    if rows[0] == "node":
        return int(env[rows[1]])
    if rows[0] == "item":
        return int(env[rows[1]][rows[2]])
    return int(env[rows[1]].shape[rows[2]])


# --- what the rewritten graph calls ------------------------------------------------------------------

def edge_weights(w: torch.Tensor | None, x: torch.Tensor, edges: int) -> torch.Tensor | None:
    """Weights [E, .., 1] (broadcast over heads or not) as [E, H] for x [M, .., F]."""
    if w is None:
        return None
    return w.expand(edges, *x.shape[1:-1], 1).reshape(edges, -1)


def fused_value(dst: torch.Tensor, src: torch.Tensor, w: torch.Tensor | None, x: torch.Tensor, n: Any,
                structure: tuple | None = None) -> torch.Tensor:
    """``zeros(n, ...).index_add_(0, dst, x[src] * w)`` as a CSR product (``structure`` reused when given)."""
    crow, col, perm = structure if structure is not None else csr_structure(dst, src, n)
    if w is not None and w.dtype != x.dtype:  # x[src] * w promotes (bf16 features, float32 weights under autocast)
        common = torch.promote_types(x.dtype, w.dtype)
        x, w = x.to(common), w.to(common)
    m = x.shape[0]
    x3 = x.reshape(m, -1, x.shape[-1])
    out = spmm(dst, src, crow, col, perm, edge_weights(w, x, dst.shape[0]), x3, n)
    return out.view(n, *x.shape[1:])


def _describe(plan: MessagePlan) -> str:
    g = plan.gather
    msg = f"{variable_name(g.source)}[{index_name(g.index)}]" + (
        f" * {index_name(plan.weight)}" if plan.weight is not None else "")
    return (f"messages {msg} (node {plan.message.name}) summed into the rows {index_name(plan.dst)}: one sparse-dense "
            f"product A @ {variable_name(g.source)} over a CSR adjacency (values: the weights), no message tensor "
            f"built or kept")


def rewrite(graph: torch.fx.Graph, nodes: Mapping, finding: Finding, gm: torch.fx.GraphModule) -> torch.fx.Node:
    """Insert the CSR structure (shared by chains over the same edges) and the product; returns it."""
    plan: MessagePlan = finding.plan
    old = nodes[plan.scatter]
    dst, src = nodes[plan.dst], nodes[plan.gather.index]
    with graph.inserting_before(old):
        n = _emit_rows(graph, nodes, plan.rows)
    structure = _shared_structure(graph, dst, src, n, plan.rows_at, old)
    with graph.inserting_before(old):
        weight = nodes[plan.weight] if plan.weight is not None else None
        new = graph.call_function(fused_value, (dst, src, weight, nodes[plan.gather.source], n, structure))
    if plan.in_place:  # later readers of the zeros read the sums
        base = nodes[plan.base]
        order = {x: k for k, x in enumerate(graph.nodes)}
        base.replace_all_uses_with(new, delete_user_cb=lambda user: order.get(user, -1) > order[old] and user is not new)
    return new


def _emit_rows(graph: torch.fx.Graph, nodes: Mapping, rows: tuple) -> Any:
    if rows[0] == "int":
        return rows[1]
    if rows[0] == "node":
        return nodes[rows[1]]
    if rows[0] == "item":
        return graph.call_function(operator.getitem, (nodes[rows[1]], rows[2]))
    return graph.call_method("size", (nodes[rows[1]], rows[2]))


def _shared_structure(graph: torch.fx.Graph, dst: torch.fx.Node, src: torch.fx.Node, n: Any, rows_at: tuple,
                      before: torch.fx.Node) -> torch.fx.Node:
    """The ``csr_structure(dst, src, n)`` node: one already in the graph for the same edges and as
    many targets (at every probe: the layers' ``h.size(0)`` are different nodes of one size), or a
    new one. (Verification checks the rewritten graph as a whole.)"""
    for existing in graph.nodes:
        if existing.op == "call_function" and existing.target is csr_structure and \
                _same_value(existing.args[0], dst) and _same_value(existing.args[1], src) and \
                (_same_value(existing.args[2], n) or existing.meta.get("fxmem_rows_at") == rows_at):
            return existing
    with graph.inserting_before(before):
        node = graph.call_function(csr_structure, (dst, src, n))
    node.meta["fxmem_rows_at"] = rows_at
    return node


_PURE = frozenset({operator.getitem, getattr, "size", "select"})


def _same_value(a: Any, b: Any) -> bool:
    """Whether two arguments are the same value: the same node, or the same pure read of the same
    values (``edge_index[1]`` written once per layer)."""
    if a is b:
        return True
    if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
        return (a.op == b.op and a.op in ("call_function", "call_method") and _key(a) in _PURE and a.target == b.target
                and len(a.args) == len(b.args) and all(_same_value(x, y) for x, y in zip(a.args, b.args))
                and a.kwargs == b.kwargs)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
