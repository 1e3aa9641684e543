"""Data movement: which fx nodes only copy elements around, and where each element of a tensor
comes from.

A GAT pair tensor ``[h_i || h_j]`` is built by ops that copy elements without computing anything
(``repeat``, ``expand``, ``view``, ``cat``, ...), spelled in many ways. To know *what* such a tensor
holds, whatever the spelling, :func:`provenance` runs those ops once more on tensors of unique ids
instead of values: each element of the result then names the source tensor and the element it is
a copy of.

Sums of copies times numbers (EdgeConv's ``x_j - x_i``) are read the same way by :func:`terms`, one
slot of ids and coefficients per copy.

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
                   modules: Mapping[str, torch.nn.Module] | None = None, combinations: bool = False) -> Movement:
    """Walk back from ``target`` through copying nodes; the first computing nodes are the sources.
    ``combinations``: through linear combinations (:func:`combination`) of copies too
    (``x_j - x_i``); a combination of computed values (``a + b``) is a source."""
    moving: set[torch.fx.Node] = set()
    sources: list[torch.fx.Node] = []
    stack, seen = [target], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        combined = combination(n, env) if combinations else None
        # a sum of copies (x_j - x_i), not a value computed upstream of them (a + b: a source)
        if combined is not None and any(is_movement(a, env, modules) or combination(a, env) for a, _ in combined):
            moving.add(n)
            stack.extend(reversed([a for a, _ in combined]))
        elif is_movement(n, env, modules):
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


# --- linear combinations of copies: x_j - x_i, x_i + x_j, 2 * x_j ------------------------------------

# (op, how its operands combine): "add"/"sub" two tensors, "neg" one, "mul"/"div" one tensor by a
# Python number - every output element then a fixed combination of input elements at its position
COMBINATIONS = {operator.add: "add", torch.add: "add", "add": "add", operator.sub: "sub", torch.sub: "sub",
                "sub": "sub", operator.neg: "neg", torch.neg: "neg", "neg": "neg", operator.mul: "mul", torch.mul: "mul",
                "mul": "mul", operator.truediv: "div", torch.div: "div", torch.true_divide: "div", "div": "div",
                "true_divide": "div"}


def combination(node: torch.fx.Node, env: Mapping[torch.fx.Node, Any]) -> list[tuple[torch.fx.Node, float]] | None:
    """``[(operand, coefficient)]`` if ``node`` is a fixed linear combination of its tensor operands
    (``a - b``: ``[(a, 1.0), (b, -1.0)]``; ``2 * a``: ``[(a, 2.0)]``), else None."""
    key = node.target if node.op == "call_function" else method_name(node)
    how = COMBINATIONS.get(key) if node.op in ("call_function", "call_method") and not node.kwargs else None
    out = env.get(node)
    if how is None or not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    tensors = [a for a in node.args if isinstance(a, torch.fx.Node) and isinstance(env.get(a), torch.Tensor)]
    numbers = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(tensors) + len(numbers) != len(node.args) or any(env[a].dtype != out.dtype for a in tensors):
        return None
    if how in ("add", "sub") and len(tensors) == 2:
        return [(tensors[0], 1.0), (tensors[1], 1.0 if how == "add" else -1.0)]
    if how == "neg" and len(tensors) == 1:
        return [(tensors[0], -1.0)]
    if how == "mul" and len(tensors) == 1 and len(numbers) == 1:
        return [(tensors[0], float(numbers[0]))]
    if how == "div" and len(tensors) == 1 and len(numbers) == 1 and node.args[0] is tensors[0] and numbers[0]:
        return [(tensors[0], 1.0 / numbers[0])]
    return None


def trace_combination(target: torch.fx.Node, env: Mapping[torch.fx.Node, Any],
                      modules: Mapping[str, torch.nn.Module] | None = None) -> Movement:
    """:func:`trace_movement` walking back through linear combinations of copies too (``x_j - x_i``)."""
    return trace_movement(target, env, modules, combinations=True)


@dataclasses.dataclass
class Terms:
    """A tensor built by copies and linear combinations, as a sum of ``coefficients[k] * copy k``:
    slot k holds, per element, the coefficient (0 where the slot is empty there) and which element
    of which source it copies (``slots[k]``, a :class:`Provenance`)."""

    coefficients: list[torch.Tensor]
    slots: list[Provenance]


def _zero_like(value: Any) -> Any:
    """Zeros in place of every tensor of ``value`` (a tensor, or the tuple chunk/split give)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_zero_like(v) for v in value)
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value


def terms(movement: Movement, env: Mapping[torch.fx.Node, Any],
          modules: Mapping[str, torch.nn.Module] | None = None) -> Terms:
    """Run the copying and combining nodes of ``movement`` (:func:`trace_combination`) on
    coefficients and id tensors in place of its sources' values: each copy is carried in a slot of
    its own, so ``x_j - x_i`` gives two slots (coefficients 1 and -1) of the one source ``x``."""
    values: dict[torch.fx.Node, list] = {}  # node -> [(coefficients, ids)] per slot
    shapes = []
    for k, s in enumerate(movement.sources):
        shape = tuple(env[s].shape)
        if env[s].numel() >= 1 << _ID_BITS:
            raise ValueError(f"source {s.name} has {env[s].numel()} elements; probe at smaller sizes")
        ids = ((k + 1) << _ID_BITS) + torch.arange(env[s].numel(), dtype=torch.int64).reshape(shape)
        values[s] = [(torch.ones(shape, dtype=torch.float64), ids)]
        shapes.append(shape)
    for node in movement.nodes:
        combined = combination(node, env)
        if combined is not None:
            shape = env[node].shape
            values[node] = [(torch.broadcast_to(c * coef, shape), torch.broadcast_to(ids, shape))
                            for a, coef in combined for c, ids in values[a]]
            continue
        inputs = [a for a in data_inputs(node, env) if a in values]
        count = max(len(values[a]) for a in inputs)
        slots = []
        for k in range(count):  # slot k of every input, empty (zero) where an input has fewer
            run = []
            for part in (0, 1):
                lookup = dict(env)
                for a in inputs:
                    have = values[a]
                    lookup[a] = have[k][part] if k < len(have) else _zero_like(have[0][part])
                run.append(run_node(node, _value(node.args, lookup), _value(node.kwargs, lookup), modules))
            slots.append(tuple(run))
        values[node] = slots
    out = values[movement.target]
    if not all(isinstance(t, torch.Tensor) for slot in out for t in slot):
        raise TypeError(f"node {movement.target.name} is not a tensor")
    return Terms([c for c, _ in out], [Provenance((ids >> _ID_BITS) - 1, ids & ((1 << _ID_BITS) - 1), shapes)
                                       for _, ids in out])


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
