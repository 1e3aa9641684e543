"""The parts of a masked softmax attention, read off a traced graph: what the fused-attention rule
(:mod:`.fused_attention`) and the SDPA rule (:mod:`.sdpa`) walk back through from the matmul.

* the product: any spelling of ``weights[.., i, j] · values[.., j, f]`` (``matmul``, ``@``, ``bmm``,
  ``einsum`` with any letters and axis order), read as an einsum equation as the SDPA rule reads its
  products (:func:`products`), with the permutations that lay its operands and result out as a matmul;
* walking back: the copying ops passed (:func:`_through_movement`), the broadcast an add's operands
  went through (:func:`_unexpanded`), dropout (its p and training flag), the softmax's dim, the
  LeakyReLU's slope;
* the mask: a ``where``/``masked_fill`` with a constant (:func:`_mask`), the comparison of one
  tensor with a number it comes from, or a bool tensor; an additive mask's problem in words;
* the axes: which axes of the scores each operand of ``s_i + t_j`` varies along (:func:`_axes`),
  also through reshapes the pair-linear rule left (found by running them on element ids).

Each reader returns what it found, or a string saying why the graph is not what the rule rewrites.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from fxmem.capture import source_line
from fxmem.passes.base import Probe
from fxmem.passes.data_movement import Provenance, is_movement, method_name, op_name, provenance, trace_movement
from fxmem.passes.modes import by_flag
from fxmem.passes.pair_layout import half_strides
from fxmem.passes.sdpa_parts import as_product

_MATMULS = frozenset({torch.matmul, operator.matmul, torch.bmm})
_SOFTMAX = frozenset({F.softmax, torch.softmax})
_LEAKY = frozenset({F.leaky_relu, torch.nn.functional.leaky_relu})
_ADDS = frozenset({operator.add, torch.add, "add"})
_COMPARISONS = {operator.gt: "gt", operator.ge: "ge", operator.lt: "lt", operator.le: "le", operator.eq: "eq",
                operator.ne: "ne", torch.gt: "gt", torch.ge: "ge", torch.lt: "lt", torch.le: "le", torch.eq: "eq",
                torch.ne: "ne", "gt": "gt", "ge": "ge", "lt": "lt", "le": "le", "eq": "eq", "ne": "ne"}
_FLIPPED = {"gt": "lt", "ge": "le", "lt": "gt", "le": "ge", "eq": "eq", "ne": "ne"}  # 0 < adj  ==  adj > 0
_NOTS = frozenset({operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "bitwise_not"})


# --- walking back from the matmul -------------------------------------------------------------------

def _target_key(node: torch.fx.Node) -> Any:
    return node.target if node.op == "call_function" else method_name(node)


def _is_matmul(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MATMULS) or method_name(node) in ("matmul", "bmm")


@dataclasses.dataclass(frozen=True)
class Product:
    """A product read as ``weights[batch.., i, j] · values[batch.., j, f]`` summed over j: the
    permutations that take each operand to that layout and the matmul's result ``[batch.., i, f]``
    to the node's own (None: already so)."""

    weights: torch.fx.Node
    values: torch.fx.Node
    weights_order: tuple | None = None
    values_order: tuple | None = None
    output_order: tuple | None = None
    problem: str | None = None  # why the letters fit no attention (the weights may still be a softmax)


def products(node: torch.fx.Node, env: Mapping) -> list[Product]:
    """Each way to read ``node`` as attention weights times values: one per operand that may hold
    the weights (the left one of a matmul; either of an einsum), with a ``problem`` where the
    letters do not fit ``weights[.., i, j] · values[.., j, f]``; [] where ``node`` is no product.

    >>> products(einsum_node, env)      # torch.einsum("ijh,jhf->ihf", a, g)   # doctest: +SKIP
    [Product(a, g, (2, 0, 1), (1, 0, 2), (1, 0, 2)), Product(g, a, problem='the product ...')]
    """
    read = as_product(node, env)
    if read is None:  # a matmul broadcasting one operand over the other's batch axes: as written
        plain = _is_matmul(node) and len(node.args) == 2 and not node.kwargs \
            and all(isinstance(a, torch.fx.Node) for a in node.args)
        return [Product(*node.args)] if plain else []
    left, right, (p, q, out) = read
    readings = [(left, right, p, q)]
    if node.op == "call_function" and node.target is torch.einsum:  # the weights may be either operand
        readings.append((right, left, q, p))
    return [_reading(node, w, v, a, b, out) for w, v, a, b in readings]


def _reading(node: torch.fx.Node, weights: torch.fx.Node, values: torch.fx.Node, w: str, y: str,
             z: str) -> Product:
    """The permutations for weights with letters ``w``, values ``y``, result ``z``, or why none."""
    j = [c for c in w if c in y and c not in z]  # summed: the columns the softmax normalises
    i = [c for c in w if c in z and c not in y]
    f = [c for c in y if c in z and c not in w]
    batch = [c for c in w if c in y and c in z]
    if not (len(i) == len(j) == len(f) == 1 and len(w) == len(y) == len(z) == len(batch) + 2):
        return Product(weights, values, problem=(
            f"the product {node.name} ({w},{y}->{z}) is not weights[.., i, j] · values[.., j, f]: it does not sum "
            f"one axis of the weights against the rows of the values, each output row i a weighted sum of value rows"))

    def order(have: str, want: list) -> tuple | None:
        out = tuple(have.index(c) for c in want)
        return None if out == tuple(range(len(out))) else out

    matmul = [*batch, i[0], f[0]]
    return Product(weights, values, order(w, [*batch, i[0], j[0]]), order(y, [*batch, j[0], f[0]]),
                   order("".join(matmul), list(z)))


def _module(node: torch.fx.Node, modules: Mapping) -> Any:
    return modules.get(str(node.target)) if node.op == "call_module" else None


def _arg(node: torch.fx.Node, pos: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[pos] if len(node.args) > pos else default


def _through_movement(node: Any, env: Mapping, modules: Mapping) -> tuple[Any, list]:
    """The first node above ``node`` that is not a copying op, and the copying nodes passed."""
    passed = []
    while isinstance(node, torch.fx.Node) and is_movement(node, env, modules) and node.op != "call_module":
        inputs = [a for a in node.all_input_nodes if isinstance(env.get(a), torch.Tensor)]
        if len(inputs) != 1:
            break
        passed.append(node)
        node = inputs[0]
    return node, passed


_BROADCASTS = {"expand", "expand_as", torch.broadcast_to}


def _unexpanded(add: torch.fx.Node, probes: Sequence[Probe]) -> tuple:
    """The sum's operands with an explicit broadcast (``.expand``, ``expand_as``, ``broadcast_to``)
    taken off, where the sum broadcasts to the same shape without it at every probe: public code
    writes ``s.expand(B, N, N) + t.expand(B, N, N)``, which is s_i + t_j with two N x N views."""
    def source(node: Any) -> Any:
        if isinstance(node, torch.fx.Node) and _target_key(node) in _BROADCASTS and node.args \
                and isinstance(node.args[0], torch.fx.Node):
            return node.args[0]
        return node

    u, v = add.args
    bare = (source(u), source(v))
    if bare == (u, v):
        return u, v
    for probe in probes:
        a, b, out = (probe.env.get(n) for n in (*bare, add))
        if not all(isinstance(t, torch.Tensor) for t in (a, b, out)):
            return u, v
        try:
            if tuple(torch.broadcast_shapes(a.shape, b.shape)) != tuple(out.shape):
                return u, v  # the expand adds an axis neither side has: read as written
        except RuntimeError:
            return u, v
    return bare


def _dropout(node: torch.fx.Node, modules: Mapping) -> tuple[float, Any, str | None] | None:
    """(p, training, module path) if ``node`` is a dropout."""
    mod = _module(node, modules)
    if isinstance(mod, torch.nn.Dropout):
        return float(mod.p), None, str(node.target)
    if (node.op == "call_function" and node.target is F.dropout) or method_name(node) == "dropout":
        return _dropout_p(_arg(node, 1, "p", 0.5), _arg(node, 2, "training", True))
    return None


def _dropout_p(p: Any, training: Any) -> tuple[float, Any, None] | None:
    """``(p, training, None)``, where ``p`` may be ``p if self.training else 0`` read by the graph (a
    :func:`~.modes.by_flag` node: TorchDynamo inlines ``nn.Dropout`` that way); None where p is
    another computed value."""
    if isinstance(p, torch.fx.Node):
        if not (p.op == "call_function" and p.target is by_flag and len(p.args) == 3):
            return None
        flag, when_training, otherwise = p.args
        if not isinstance(when_training, (int, float)) or otherwise != 0 or training not in (True, flag):
            return None
        return float(when_training), flag, None
    if not isinstance(p, (int, float)):
        return None
    return float(p), training, None


def _softmax_dim(node: torch.fx.Node, modules: Mapping) -> Any:
    mod = _module(node, modules)
    if isinstance(mod, torch.nn.Softmax):
        return mod.dim
    if (node.op == "call_function" and node.target in _SOFTMAX) or method_name(node) == "softmax":
        if _arg(node, 3 if node.target is F.softmax else 2, "dtype") is not None:
            return None
        return _arg(node, 1, "dim")
    return None


def _leaky_slope(node: torch.fx.Node, modules: Mapping) -> float | None:
    mod = _module(node, modules)
    if isinstance(mod, torch.nn.LeakyReLU):
        return float(mod.negative_slope)
    if (node.op == "call_function" and node.target in _LEAKY) or method_name(node) == "leaky_relu":
        return float(_arg(node, 1, "negative_slope", 0.01))
    return None


@dataclasses.dataclass
class _Mask:
    scores: Any  # the branch holding the scores
    fill: Any  # a number or a node
    cond: Any
    keep: bool  # cond says what stays (where(cond, e, fill)) or what is replaced (masked_fill)
    additive: bool = False  # cond is added to the scores (softmax(e + mask)), fill unused


def _mask(node: torch.fx.Node, env: Mapping, modules: Mapping) -> _Mask | str:
    key = _target_key(node)
    if key in (torch.where, "where") and len(node.args) == 3:
        cond, a, b = node.args
        # which branch is constant: where(adj > 0, e, fill) or where(adj == 0, fill, e)
        a_const, b_const = _constant(a, env), _constant(b, env)
        if b_const is not None and a_const is None:
            return _Mask(a, b, cond, True)
        if a_const is not None and b_const is None:
            return _Mask(b, a, cond, False)
        return "neither branch of the where() is one constant value, so it is not a mask filling in a constant"
    if key in (torch.masked_fill, "masked_fill", "masked_fill_") and len(node.args) >= 2:
        value = _arg(node, 2, "value")
        if _constant(value, env) is None:
            return "masked_fill's value is not one constant"
        return _Mask(node.args[0], value, node.args[1], False)
    if key in _ADDS:
        if len(node.args) == 2 and not node.kwargs and all(isinstance(a, torch.fx.Node) for a in node.args):
            for scores, addend in (node.args, node.args[::-1]):
                leaky, _ = _through_movement(scores, env, modules)
                if isinstance(leaky, torch.fx.Node) and _leaky_slope(leaky, modules) is not None:
                    why = _additive_problem(addend, scores, env, modules)
                    return why if why is not None else _Mask(scores, 0.0, addend, True, additive=True)
        return (f"the scores are added to {op_name(node)} (node {node.name}) with no LeakyReLU(s_i + t_j) on "
                f"either side; the fused kernel adds a mask to GAT's scores only")
    return None


def _additive_problem(addend: torch.fx.Node, scores: torch.fx.Node, env: Mapping, modules: Mapping) -> str | None:
    """Why an addend of the scores cannot be the fused kernel's additive mask (0 / -inf, or a bias):
    it must hold the scores' dtype and get no gradient (the kernel does not compute one for it)."""
    a, e = env.get(addend), env.get(scores)
    if not isinstance(a, torch.Tensor) or not isinstance(e, torch.Tensor) or a.dtype != e.dtype:
        return (f"the scores are added to {addend.name}, which is not a tensor of the scores' dtype; the fused "
                f"kernel adds a mask of the scores' dtype")
    seen, stack = set(), [addend]
    root = modules.get("")
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        learnt = False
        if n.op == "get_attr" and root is not None:
            obj = root
            for part in str(n.target).split("."):
                obj = getattr(obj, part, None)
            learnt = isinstance(obj, torch.nn.Parameter) and obj.requires_grad
        elif n.op == "call_module":
            learnt = any(p.requires_grad for p in modules[str(n.target)].parameters())
        if learnt:
            return (f"the mask added to the scores ({addend.name}) is computed from parameters, so it needs a "
                    f"gradient, which the fused kernel does not compute")
        stack.extend(n.all_input_nodes)
    return None


def _constant(value: Any, env: Mapping) -> float | None:
    """The one value a number or a tensor node holds at every probe position, else None - as the
    code writes it where it can be read (``-9e15 * ones_like(e)``, ``full_like(e, -inf)``), since
    the probes hold it rounded to float32."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, torch.fx.Node):
        return None
    t = env.get(value)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return None
    first = t.reshape(-1)[0]
    same = torch.all((t == first) | (torch.isnan(t) & torch.isnan(first)))
    if not bool(same):
        return None
    written = _written_constant(value, env)
    if written is not None and (bool(torch.tensor(written, dtype=t.dtype) == first)
                                or (math.isnan(written) and bool(torch.isnan(first)))):
        return written
    return float(first)


def _written_constant(node: torch.fx.Node, env: Mapping) -> float | None:
    key = _target_key(node)
    numbers = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if key in (operator.mul, torch.mul, "mul") and len(node.args) == 2 and len(numbers) == 1:
        other = next(a for a in node.args if isinstance(a, torch.fx.Node))
        ones = env.get(other)
        if isinstance(ones, torch.Tensor) and bool(torch.all(ones == 1)):
            return float(numbers[0])
    if key in (torch.full_like, "new_full", torch.full) and numbers:
        return float(numbers[-1])
    if key in (torch.full_like, torch.full) and "fill_value" in node.kwargs:
        return float(node.kwargs["fill_value"])
    return None


def _comparison(cond: Any, env: Mapping, keep: bool) -> tuple[Any, str, float, bool] | str:
    """(mask source node, compare, threshold, keep) for ``cond``."""
    while isinstance(cond, torch.fx.Node) and _target_key(cond) in _NOTS and len(cond.args) == 1:
        cond, keep = cond.args[0], not keep
    if not isinstance(cond, torch.fx.Node):
        return "the mask is not a tensor"
    key = _target_key(cond)
    if key in _COMPARISONS and len(cond.args) == 2:
        a, b = cond.args
        if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
            return a, _COMPARISONS[key], float(b), keep
        if isinstance(b, torch.fx.Node) and isinstance(a, (int, float)) and not isinstance(a, bool):
            return b, _FLIPPED[_COMPARISONS[key]], float(a), keep
    value = env.get(cond)
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return cond, "true", 0.0, keep
    return (f"the mask is computed by {op_name(cond)} (node {cond.name}); the fused kernel reads masks that "
            f"compare one tensor with a number (adj > 0, adj == 0) or are a bool tensor")


def _bool_mask(source: torch.fx.Node, compare: str, threshold: float, keep: bool, env: Mapping) -> tuple:
    """A bool adjacency compared with a number is the adjacency or its negation (``adj > 0`` is
    ``adj``): read it as it is, so the kernel does not cast every block to float to compare it."""
    value = env.get(source)
    if compare == "true" or not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
        return source, compare, threshold, keep
    # whether True (1.0) and False (0.0) pass the comparison
    passes = [{"gt": x > threshold, "ge": x >= threshold, "lt": x < threshold, "le": x <= threshold,
               "eq": x == threshold, "ne": x != threshold}[compare] for x in (1.0, 0.0)]
    if passes == [True, False]:
        return source, "true", 0.0, keep
    if passes == [False, True]:
        return source, "true", 0.0, not keep
    return source, compare, threshold, keep  # every entry alike: compared as written


# --- the axes ---------------------------------------------------------------------------------------

def _varies(shape: Sequence[int], rank: int) -> list[bool]:
    """Per axis of a result of ``rank`` dims, whether a broadcast operand of ``shape`` varies along it."""
    padded = [1] * (rank - len(shape)) + list(shape)
    return [size != 1 for size in padded]


@dataclasses.dataclass
class _Axes:
    """The scores' axes at one probe: kind per non-1 axis ("g", "i", "j"), mask variation."""

    shape: tuple
    kinds: dict  # scores axis -> "g" | "i" | "j"
    mask: list  # scores axes (non-1) the mask varies along
    amap: dict = dataclasses.field(default_factory=dict)  # sum axis -> scores axis (non-1 axes)


def _axes(plan_nodes: dict, env: Mapping, modules: Mapping | None = None) -> _Axes | str:
    scores, add, u, v, source = (env[plan_nodes[k]] for k in ("scores", "add", "u", "v", "source"))
    shape = tuple(scores.shape)
    nonone = [a for a, size in enumerate(shape) if size != 1]
    amap = _sum_axes(plan_nodes, env, modules or {})
    if isinstance(amap, str):
        return amap
    su, sv = _varies(u.shape, add.dim()), _varies(v.shape, add.dim())
    kinds = {}
    for b, a in amap.items():
        kinds[a] = "g" if su[b] and sv[b] else "i" if su[b] else "j"
    for kind, name in (("i", plan_nodes["u"].name), ("j", plan_nodes["v"].name)):
        found = [a for a, k in kinds.items() if k == kind]
        if len(found) != 1:
            return (f"the sum is not s_i + t_j: {len(found)} axes vary with {name} alone "
                    f"(node {plan_nodes['add'].name}, shapes {tuple(u.shape)} + {tuple(v.shape)})")
    src_varies = _varies(source.shape, len(shape))
    if len(source.shape) > len(shape) or any(src_varies[a] and shape[a] == 1 for a in range(len(shape))):
        return "the mask has axes the scores do not have"
    mask = [a for a in nonone if src_varies[a]]
    i, j = (next(a for a, k in kinds.items() if k == kind) for kind in ("i", "j"))
    if i not in mask or j not in mask:
        return "the mask does not vary along both the rows and the columns of the scores"
    return _Axes(shape, kinds, mask, amap)


def _sum_axes(parts: dict, env: Mapping, modules: Mapping) -> dict | str:
    """Which axis of the scores each non-1 axis of the sum ``s_i + t_j`` becomes, in the sum's order:
    ``{sum axis: scores axis}``. The copying ops between them (and LeakyReLU, elementwise) must only
    add or drop size-1 dims, permute, or merge axes and split them again the same way - as
    ``(pairs @ a).view(B, N, N, H).permute(0, 3, 1, 2)`` does after the pair-linear rule flattened
    ``s_i + t_j`` into the model's ``[B, N*N, H]``; found by running those ops on element ids."""
    scores, add = env[parts["scores"]], env[parts["add"]]
    shape, added = tuple(scores.shape), tuple(add.shape)
    nonone = [a for a, size in enumerate(shape) if size != 1]
    added_nonone = [a for a, size in enumerate(added) if size != 1]
    if [shape[a] for a in nonone] == [added[a] for a in added_nonone] and not parts.get("chain"):
        return dict(zip(added_nonone, nonone))
    reshaped = "the sum is reshaped on its way to the softmax (not only size-1 dims added or dropped, or permuted)"
    ids = _ids_through(parts, env, modules)
    if ids is None or tuple(ids.shape) != shape or ids.numel() != add.numel():
        return reshaped
    own = {math.prod(added[b + 1:]): b for b in added_nonone}  # a contiguous sum's stride -> its axis
    found = half_strides(Provenance(torch.zeros_like(ids), ids, [added]), 0, shape[-1]) if ids.ndim else "no axes"
    if isinstance(found, str) or found[2] != 0:
        return reshaped
    amap = {}
    for a, stride in enumerate(found[1]):
        if shape[a] == 1:
            continue
        b = own.get(stride)
        if b is None or added[b] != shape[a]:
            return reshaped
        amap[b] = a
    if sorted(amap) != added_nonone:
        return reshaped
    return dict(sorted(amap.items()))


def _ids_through(parts: dict, env: Mapping, modules: Mapping) -> torch.Tensor | None:
    """The sum's flat element ids laid out as the scores: the copying ops from the sum to LeakyReLU
    and from LeakyReLU to the masked scores, each run on ids (:func:`.data_movement.provenance`),
    composed (LeakyReLU, elementwise, keeps every element in place)."""
    scores, leaky = parts["chain"]
    try:
        up, low = (trace_movement(t, env, modules) for t in (scores, leaky.args[0]))
        if up.sources != [leaky] or low.sources != [parts["add"]]:
            return None
        above, below = provenance(up, env, modules), provenance(low, env, modules)
    except (ValueError, TypeError, RuntimeError):  # an op that does not take ids: not a plain copy
        return None
    return below.flat.reshape(-1)[above.flat]


# --- the nearest attention, where a rule finds none --------------------------------------------------

def _site(node: torch.fx.Node) -> str:
    """``softmax_1 (gat.py:42)``: a node and the user's source line."""
    line = source_line(node)
    return f"{node.name} ({line})" if line else node.name


def _readers(node: torch.fx.Node, env: Mapping, modules: Mapping) -> list[torch.fx.Node]:
    """The first nodes reading ``node``'s values that do more than copy them (dropout passed too)."""
    out, todo, seen = [], list(node.users), set()
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if (is_movement(n, env, modules) and n.op != "call_module") or _dropout(n, modules) is not None:
            todo.extend(n.users)
        elif n.op != "output":
            out.append(n)
    return out


def _softmaxes(gm: torch.fx.GraphModule, probes: Sequence[Probe]):
    """Each softmax of ``gm`` with the nodes that read its weights (:func:`_readers`)."""
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if _softmax_dim(node, modules) is not None and node.args and isinstance(node.args[0], torch.fx.Node):
            yield node, _readers(node, probes[0].env, modules), modules


def _named(nodes: Sequence[torch.fx.Node], modules: Mapping) -> str:
    return ", ".join(f"{op_name(n, modules)} (node {n.name})" for n in nodes[:2]) or "nothing but the output"


def nearest_attention(gm: torch.fx.GraphModule, probes: Sequence[Probe]) -> str | None:
    """The fused-attention rule's nearest candidate where it finds none: a softmax whose weights are
    not multiplied into node features by a product it reads (matmul, @, bmm, einsum)."""
    for node, readers, modules in _softmaxes(gm, probes):
        return (f"{_site(node)}: its weights are read by {_named(readers, modules)}, not multiplied into the node "
                f"features by a product (matmul, @, bmm or einsum summing the softmax's axis against the rows "
                f"of the features)")
    return None


def nearest_dot_product(gm: torch.fx.GraphModule, probes: Sequence[Probe]) -> str | None:
    """The SDPA rule's nearest candidate where it finds none: a softmax not followed by a product
    with v, or one over something other than the scores q @ k^T."""
    env = probes[0].env
    for node, readers, modules in _softmaxes(gm, probes):
        scores, _ = _through_movement(node.args[0], env, modules)
        if not any(as_product(r, env) is not None for r in readers):
            return (f"{_site(node)}: not followed by a product with v (its weights are read by "
                    f"{_named(readers, modules)})")
        if not isinstance(scores, torch.fx.Node) or as_product(scores, env) is None:
            what = _named([scores], modules) if isinstance(scores, torch.fx.Node) else repr(scores)
            return (f"{_site(node)}: followed by a product with v, but it normalises {what}, not scores "
                    f"q @ k^T (a product of queries and keys, scaled or masked)")
        return f"{_site(node)}: its weights are not the left operand of a product weights @ v over the keys"
    return None
