"""Data movement: which fx nodes only copy elements around, and where each element of a tensor
comes from.

A GAT pair tensor ``[h_i || h_j]`` is built by ops that copy elements without computing anything
(``repeat``, ``expand``, ``view``, ``cat``, ...), spelled in many ways. To know *what* such a tensor
holds, whatever the spelling, :func:`provenance` runs those ops once more on tensors of unique ids
instead of values: each element of the result then names the source tensor and the element it is
a copy of.

>>> movement = trace_movement(x_node, env)                 # doctest: +SKIP
>>> where = provenance(movement, env, gm)                  # doctest: +SKIP
>>> where.source[0, 1, 2], where.flat[0, 1, 2]             # doctest: +SKIP
(0, 2)     # element [0, 1, 2] is a copy of element 2 (flat, row-major) of source 0
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping

import torch
import torch.fx

from fxmem import _torch_compat as tc

_ID_BITS = 40  # an id is (source number + 1) << 40 | flat index: 2**40 elements per source at most

# Tensor methods that only move elements: the value of every output element is the value of one
# input element, chosen by sizes alone (never by values). ``contiguous``/``clone`` copy without
# reordering. dtype casts are not here: ids must survive the op unchanged.
MOVEMENT_METHODS = frozenset({
    "repeat", "repeat_interleave", "expand", "expand_as", "broadcast_to", "unsqueeze", "squeeze",
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute", "transpose",
    "swapaxes", "swapdims", "movedim", "moveaxis", "t", "contiguous", "clone", "narrow", "select",
    "chunk", "split", "tensor_split", "unbind", "tile", "flip", "roll",
})
# torch.* functions that only move elements (the torch.Tensor.* spellings of the methods above are
# recognised as well).
MOVEMENT_FUNCTIONS = frozenset({
    torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack,
    torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze, torch.permute,
    torch.transpose, torch.swapaxes, torch.swapdims, torch.movedim, torch.moveaxis, torch.t,
    torch.narrow, torch.select, torch.repeat_interleave, torch.tile, torch.broadcast_to,
    torch.chunk, torch.split, torch.tensor_split, torch.unbind, torch.flip, torch.roll,
})
MOVEMENT_MODULES = (torch.nn.Flatten, torch.nn.Unflatten, torch.nn.Identity)
# Attribute reads that are views of the tensor (``h.T``).
MOVEMENT_ATTRIBUTES = frozenset({"T", "mT"})
# (op name, argument position) that only lend a shape: ``x.expand_as(other)`` copies x, not other.
SHAPE_ONLY_ARGUMENT = {"expand_as": 1, "view_as": 1, "reshape_as": 1}
# Ops that make a result from several operands laid side by side: the usual way pairs are joined.
CONCATENATIONS = frozenset({torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack})


def _einops_movements() -> frozenset:
    try:
        import einops
    except ImportError:  # einops is optional
        return frozenset()
    return frozenset({einops.rearrange, einops.repeat})


_EINOPS = _einops_movements()


def op_name(node: torch.fx.Node, modules: Mapping[str, torch.nn.Module] | None = None) -> str:
    """A short name of what ``node`` does: ``repeat``, ``cat``, ``leaky_relu``, ``LeakyReLU``."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_module":
        mod = (modules or {}).get(str(node.target))
        return type(mod).__name__ if mod is not None else str(node.target)
    if node.op == "call_function":
        if node.target is getattr and len(node.args) > 1:
            return str(node.args[1])
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def method_name(node: torch.fx.Node) -> str | None:
    """The Tensor method a node calls, for ``x.m(...)`` and ``torch.Tensor.m(x, ...)`` alike."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        name = getattr(node.target, "__name__", None)
        if name and getattr(torch.Tensor, name, None) is node.target:
            return name
    return None


def _has_tensor(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in tc.tree_leaves(value))


def _value(arg: Any, env: Mapping[torch.fx.Node, Any]) -> Any:
    return torch.fx.node.map_arg(arg, lambda n: env[n])


def is_movement(node: torch.fx.Node, env: Mapping[torch.fx.Node, Any],
                modules: Mapping[str, torch.nn.Module] | None = None) -> bool:
    """Whether ``node`` only copies elements of its tensor inputs, picked by sizes alone."""
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    out = env.get(node)
    if node.op == "call_function" and node.target is operator.getitem:
        base = node.args[0]
        if not isinstance(base, torch.fx.Node) or _has_tensor(_value(node.args[1:], env)):
            return False  # indexing with a tensor gathers by values
        if isinstance(env.get(base), torch.Tensor):
            return True
        # an element of chunk/split/unbind
        return isinstance(env.get(base), (tuple, list)) and is_movement(base, env, modules)
    if not (isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and out and _has_tensor(out))):
        return False
    if node.op == "call_module":
        return isinstance((modules or {}).get(str(node.target)), MOVEMENT_MODULES)
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in MOVEMENT_ATTRIBUTES
    name = method_name(node)
    if name in ("repeat_interleave",) or (node.op == "call_function" and node.target is torch.repeat_interleave):
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        if repeats is None:  # repeat_interleave(counts) alone builds indices from the counts' values
            return False
        return not _has_tensor(_value(repeats, env))  # repeats given per element is a gather
    if name in MOVEMENT_METHODS:
        return True
    return node.op == "call_function" and (node.target in MOVEMENT_FUNCTIONS or node.target in _EINOPS)


def data_inputs(node: torch.fx.Node, env: Mapping[torch.fx.Node, Any]) -> list[torch.fx.Node]:
    """The inputs whose elements ``node`` copies (not those that only give a size or a shape)."""
    skip = SHAPE_ONLY_ARGUMENT.get(method_name(node) or "")
    out: list[torch.fx.Node] = []
    # operands may come by position or by keyword (torch.cat(tensors=[x, y]))
    for pos, arg in [*enumerate(node.args), *node.kwargs.items()]:
        if pos == skip:
            continue
        for n in _nodes_in(arg):
            value = env.get(n)
            if (isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list)) and _has_tensor(value))) \
                    and n not in out:
                out.append(n)
    return out


def _nodes_in(arg: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(arg, lambda n: found.append(n) or n)
    return found


@dataclasses.dataclass
class Movement:
    """How tensor ``target`` is made from ``sources`` by copying only.

    ``nodes`` are the copying nodes between them in graph order (``target`` last, unless
    ``target`` is itself a source: then ``nodes`` is empty).
    """

    target: torch.fx.Node
    nodes: list[torch.fx.Node]
    sources: list[torch.fx.Node]

    @property
    def concatenations(self) -> list[torch.fx.Node]:
        """The nodes that lay several tensors side by side (``cat``, ``stack``)."""
        return [n for n in self.nodes if n.op == "call_function" and n.target in CONCATENATIONS]


def trace_movement(target: torch.fx.Node, env: Mapping[torch.fx.Node, Any],
                   modules: Mapping[str, torch.nn.Module] | None = None) -> Movement:
    """Walk back from ``target`` through copying nodes; the first computing nodes are the sources."""
    moving: set[torch.fx.Node] = set()
    sources: list[torch.fx.Node] = []
    stack, seen = [target], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_movement(n, env, modules):
            moving.add(n)
            stack.extend(reversed(data_inputs(n, env)))
        elif isinstance(env.get(n), torch.Tensor):
            sources.append(n)
    order = {n: k for k, n in enumerate(target.graph.nodes)}
    return Movement(target, sorted(moving, key=order.__getitem__), sorted(sources, key=order.__getitem__))


@dataclasses.dataclass
class Provenance:
    """For each element of a tensor: which source it copies (``source``, an index into
    ``Movement.sources``) and which element of it (``flat``, row-major)."""

    source: torch.Tensor
    flat: torch.Tensor
    source_shapes: list[tuple[int, ...]]

    @property
    def has_duplicates(self) -> bool:
        """Whether some source element is copied more than once (pairs replicate their operands)."""
        ids = (self.source << _ID_BITS) | self.flat
        return ids.numel() > 0 and torch.unique(ids).numel() < ids.numel()


def provenance(movement: Movement, env: Mapping[torch.fx.Node, Any],
               modules: Mapping[str, torch.nn.Module] | None = None) -> Provenance:
    """Run the copying nodes of ``movement`` on id tensors in place of its sources' values."""
    ids: dict[torch.fx.Node, Any] = {}
    shapes = []
    for k, s in enumerate(movement.sources):
        shape = tuple(env[s].shape)
        n = env[s].numel()
        if n >= 1 << _ID_BITS:
            raise ValueError(f"source {s.name} has {n} elements; probe at smaller sizes")
        ids[s] = ((k + 1) << _ID_BITS) + torch.arange(n, dtype=torch.int64).reshape(shape)
        shapes.append(shape)
    lookup = {**env, **ids}
    for node in movement.nodes:
        args = _value(node.args, lookup)
        kwargs = _value(node.kwargs, lookup)
        lookup[node] = run_node(node, args, kwargs, modules)
    out = lookup[movement.target]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"node {movement.target.name} is not a tensor")
    return Provenance((out >> _ID_BITS) - 1, out & ((1 << _ID_BITS) - 1), shapes)


def run_node(node: torch.fx.Node, args: tuple, kwargs: dict, modules: Mapping[str, torch.nn.Module] | None) -> Any:
    """Run one node's call on the given argument values (ids instead of data)."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    if node.op == "call_module":
        return (modules or {})[str(node.target)](*args, **kwargs)
    raise AssertionError(f"not a copying node: {node.format_node()}")


# --- gathers: rows picked by an index tensor (values choose them, not sizes) ---------------------------

@dataclasses.dataclass(frozen=True)
class Gather:
    """``node`` picks rows of ``source`` along ``dim`` by the 1-D integer tensor ``index``."""

    node: torch.fx.Node
    source: torch.fx.Node
    index: torch.fx.Node
    dim: int


def as_gather(node: Any, env: Mapping) -> Gather | None:
    """The gather ``node`` is (``S[idx]``, ``S[:, idx]``, ``index_select``), or None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        source, key = node.args
        key = key if isinstance(key, tuple) else (key,)
        tensors = [k for k, item in enumerate(key) if isinstance(item, torch.fx.Node)]
        if len(tensors) != 1 or any(item != slice(None) for item in key[:tensors[0]]) or \
                any(item not in (slice(None), Ellipsis) for item in key[tensors[0] + 1:]):
            return None
        dim, index = tensors[0], key[tensors[0]]
    elif (node.op == "call_function" and node.target is torch.index_select) or method_name(node) == "index_select":
        if len(node.args) != 3:
            return None
        source, dim, index = node.args
    else:
        return None
    s, i = env.get(source), env.get(index) if isinstance(index, torch.fx.Node) else None
    if not (isinstance(source, torch.fx.Node) and isinstance(s, torch.Tensor) and isinstance(i, torch.Tensor)
            and isinstance(dim, int) and i.dim() == 1 and not i.is_floating_point() and i.dtype != torch.bool):
        return None
    dim = dim % s.dim()
    return Gather(node, source, index, dim) if dim < s.dim() - 1 else None
