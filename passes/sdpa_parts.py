"""The SDPA rule's products: which operand is q, k and v, and how each is laid out.

Both products of an attention - the scores ``q · k`` and the output ``weights · v`` - are read as
einsum equations, whatever their spelling: ``a @ b`` and ``bmm`` are ``"..xy,..yz->..xz"``,
``einsum`` gives its own. From the output product the axes get their meaning: *i* (queries: in
the weights and the output), *j* (keys: summed), *d* (features of v) and the batch axes (in all
three); the scores product names the same axes by position and contracts *e* (features of q and
k). SDPA wants ``[batch.., L, E]``: a :class:`Layout` holds the permutation that takes each
operand there (None: already there) and the one that puts SDPA's result back. Scale factors on
the operands (``q * scale``) and views that only permute (``k.transpose(-2, -1)``,
``.permute(0, 1, 3, 2)``, a permuting ``rearrange``) are looked through: SDPA reads the tensor
below them, so nothing is built for it.

>>> as_product(node, env)[2]                                      # doctest: +SKIP
('abxy', 'abyz', 'abxz')
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxmem.passes.base import Probe
from fxmem.passes.data_movement import data_inputs, is_movement, method_name, run_node

_MATMULS = frozenset({torch.matmul, operator.matmul, torch.bmm})
_MULS = frozenset({operator.mul, torch.mul, "mul"})
_DIVS = frozenset({operator.truediv, torch.div, torch.true_divide, "div", "true_divide"})
SCALES = _MULS | _DIVS
_METADATA = frozenset({"size", "dim", "shape", "dtype", "device", "ndim"})
_LIKE = frozenset({"new_ones", "new_zeros", "new_full", "new_empty"})  # a new tensor with x's dtype and device
_LETTERS = "abcdefghklmnopqrstuvw"


@dataclasses.dataclass(frozen=True)
class Layout:
    """q, k (below scale factors and permuting views) and how SDPA reads q, k, v and writes back."""

    query: torch.fx.Node
    key: torch.fx.Node
    query_order: tuple | None
    key_order: tuple | None
    value_order: tuple | None
    output_order: tuple | None  # SDPA's [batch.., L, Dv] -> the product's layout
    lift: int  # leading size-1 axes added so that SDPA sees 4 dims (flash attention on CPU)
    keys_axis: int  # the scores' axis of the keys (the softmax must run over it)
    scores_canonical: bool  # the scores are laid out [batch.., L, S], as SDPA's mask is
    scale: tuple  # (("mul" | "div", number or node), ...) from q and k

    @property
    def orders(self) -> tuple:
        """The layout as a plain tuple (it is written into the rewritten graph's code)."""
        return (self.query_order, self.key_order, self.value_order, self.output_order, self.lift)


def as_product(node: Any, env: Mapping) -> tuple[torch.fx.Node, torch.fx.Node, tuple[str, str, str]] | None:
    """(left operand, right operand, (left, right, result) einsum letters) if ``node`` is a product
    of two tensors with no broadcast of one over the other's batch axes; None otherwise."""
    if not isinstance(node, torch.fx.Node):
        return None
    if (node.op == "call_function" and node.target in _MATMULS) or method_name(node) in ("matmul", "bmm"):
        if len(node.args) != 2 or node.kwargs or not all(isinstance(a, torch.fx.Node) for a in node.args):
            return None
        a, b = (env.get(x) for x in node.args)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != b.dim() or a.dim() < 2:
            return None
        batch = _LETTERS[:a.dim() - 2]
        return node.args[0], node.args[1], (batch + "xy", batch + "yz", batch + "xz")
    if node.op == "call_function" and node.target is torch.einsum and node.args and isinstance(node.args[0], str):
        operands = node.args[1:] if len(node.args) != 2 else node.args[1]
        if not isinstance(operands, (tuple, list)) or len(operands) != 2 \
                or not all(isinstance(a, torch.fx.Node) for a in operands):
            return None
        equation = node.args[0].replace(" ", "")
        if "->" not in equation or "." in equation:
            return None
        left, out = equation.split("->")
        parts = left.split(",")
        if len(parts) != 2 or any(len(set(s)) != len(s) for s in (*parts, out)):
            return None
        return operands[0], operands[1], (parts[0], parts[1], out)
    return None


def _number(value: Any, probes: Sequence[Probe]) -> Any:
    """A positive scale factor: a number as written, a node holding a number (``d ** -0.5`` from a
    size), or a 0-dim float tensor built from constants (``torch.full([], 8.0)``); else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if value > 0 else None
    if not isinstance(value, torch.fx.Node):
        return None
    seen = [p.env.get(value) for p in probes]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in seen):
        return value
    if all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() and not v.requires_grad
           for v in seen) and len({float(v) for v in seen}) == 1 and float(seen[0]) > 0 and constant_built(value):
        return float(seen[0])
    return None


def attribute(node: torch.fx.Node) -> Any:
    """The object a ``get_attr`` node reads from the graph's module."""
    value = node.graph.owning_module
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


def constant_built(node: torch.fx.Node, buffers: bool = False) -> bool:
    """Whether ``node`` is computed from no input and no parameter: sizes, numbers and the tensor
    constants fx makes of literals (``torch.full([], 8.0)``), and with ``buffers`` the module's buffers."""
    stack, seen = [node], set()
    owner = node.graph.owning_module
    registered = {name for name, _ in owner.named_buffers()} if owner is not None else set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return False
        name = method_name(n) or (n.args[1] if n.op == "call_function" and n.target is getattr else None)
        if name in _METADATA:
            continue  # reads a tensor's size, dtype or device, never its values
        if name in _LIKE:
            stack.extend(a for a in [*n.args[1:], *n.kwargs.values()] if isinstance(a, torch.fx.Node))
            continue
        literal = str(n.target).startswith("_tensor_constant")  # fx's name for a tensor made from literals
        if n.op == "get_attr" and (isinstance(attribute(n), torch.nn.Parameter)
                                   or (str(n.target) in registered and not buffers and not literal)):
            return False
        stack.extend(n.all_input_nodes)
    return True


def cast(node: torch.fx.Node, env: Mapping) -> str | None:
    """``"follows"`` for a cast to another tensor's dtype that changes nothing (``type_as(q)``,
    ``.to(q.dtype)``), ``"fixed"`` for one to a dtype written in the code (``.float()``), else None."""
    name = method_name(node)
    if name not in ("float", "double", "half", "bfloat16", "to", "type", "type_as") or not node.args \
            or not isinstance(node.args[0], torch.fx.Node):
        return None
    a, b = env.get(node.args[0]), env.get(node)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
        return None
    target = [*node.args[1:], *node.kwargs.values()]
    return "follows" if len(target) == 1 and isinstance(target[0], torch.fx.Node) else "fixed"


def fixed_cast(node: torch.fx.Node, env: Mapping) -> str:
    """Why a cast to a dtype written in the code is declined."""
    return (f"the attention is cast to a dtype written in the code ({node.name}: .{method_name(node)}(), a no-op "
            f"for {env[node].dtype} but not for other dtypes): SDPA computes in q's dtype, so the rewrite would "
            f"not compute the same in every dtype")


def peel_scale(node: torch.fx.Node, probes: Sequence[Probe]) -> tuple[torch.fx.Node, tuple] | None:
    """(the tensor, ("mul" | "div", factor)) if ``node`` multiplies or divides one tensor by a scale factor."""
    key = node.target if node.op == "call_function" else method_name(node)
    if node.kwargs or len(node.args) != 2 or key not in _MULS | _DIVS:
        return None
    a, b = node.args
    env = probes[0].env
    for tensor, factor, how in ((a, b, "mul" if key in _MULS else "div"), (b, a, "mul")):
        if how == "mul" and key not in _MULS and tensor is b:
            continue  # c / x is no scale
        if isinstance(tensor, torch.fx.Node) and isinstance(env.get(tensor), torch.Tensor) \
                and env[tensor].dim() > 0:
            f = _number(factor, probes)
            if f is not None:
                return tensor, (how, f)
    return None


def _permuting_view(node: torch.fx.Node, env: Mapping) -> tuple[torch.fx.Node, tuple] | None:
    """(x, pi) if ``node`` is ``x.permute(pi)`` as a view (transpose, permute, .mT, a permuting rearrange)."""
    if not is_movement(node, env) or node.op == "call_module":
        return None
    inputs = data_inputs(node, env)
    if len(inputs) != 1 or not isinstance(env.get(inputs[0]), torch.Tensor):
        return None
    x = env[inputs[0]]
    ids = torch.arange(x.numel(), dtype=torch.int64).reshape(x.shape)
    lookup = {**env, inputs[0]: ids}
    args = torch.fx.node.map_arg(node.args, lambda n: lookup[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: lookup[n])
    try:
        out = run_node(node, args, kwargs, None)
    except Exception:  # an op that cannot run on int64 ids: not looked through
        return None
    if not isinstance(out, torch.Tensor) or out.dim() != ids.dim() or out.untyped_storage().data_ptr() != \
            ids.untyped_storage().data_ptr() or out.storage_offset() != 0:
        return None
    pi = []
    for size, stride in zip(out.shape, out.stride()):
        dims = [d for d in range(ids.dim()) if ids.stride(d) == stride and ids.shape[d] == size and d not in pi]
        if len(dims) != 1 or size == 1:
            return None  # size-1 axes make the permutation ambiguous: not looked through
        pi.append(dims[0])
    return inputs[0], tuple(pi)


def _settle(node: torch.fx.Node, order: list, probes: Sequence[Probe]) -> tuple[torch.fx.Node, list, list]:
    """Look through scale factors and permuting views below an operand read in ``order``."""
    factors: list = []
    while True:
        peeled = peel_scale(node, probes)
        if peeled is not None:
            node, f = peeled
            factors.append(f)
            continue
        view = _permuting_view(node, probes[0].env)
        if view is not None:
            node, pi = view
            order = [pi[o] for o in order]
            continue
        return node, order, factors


def attention_layout(scores: torch.fx.Node, output: torch.fx.Node, weights: torch.fx.Node,
                     probes: Sequence[Probe]) -> Layout | str:
    """How SDPA reads the attention whose scores product is ``scores`` and output product ``output``."""
    env = probes[0].env
    _, value, (w, y, z) = as_product(output, env)
    j = [c for c in w if c in y and c not in z]
    i = [c for c in w if c in z and c not in y]
    d = [c for c in y if c in z and c not in w]
    batch = [c for c in w if c in y and c in z]
    if not (len(j) == len(i) == len(d) == 1 and len(w) == len(y) == len(z) == len(batch) + 2):
        return "the product with the weights is not weights[.., i, j] · v[.., j, d] (no per-query sum over the keys)"
    i, j, d = i[0], j[0], d[0]
    left, right, (p, q, x) = as_product(scores, env)
    if len(x) != len(w):
        return "the scores are reshaped between the two products"
    rename = dict(zip(x, w))
    contracted = [c for c in p if c in q and c not in x]
    if len(contracted) != 1 or len(p) != len(q) or len(p) != len(x):
        return "the scores are not q[.., i, e] · k[.., j, e] summed over one feature axis e"
    rename[contracted[0]] = "#"
    p, q = "".join(rename.get(c, "?") for c in p), "".join(rename.get(c, "?") for c in q)
    if i in q and j in p:  # k · q: the left operand holds the keys
        left, right, p, q = right, left, q, p
    want_q, want_k = [*batch, i, "#"], [*batch, j, "#"]
    if sorted(p) != sorted(want_q) or sorted(q) != sorted(want_k):
        return "the scores are not q[.., i, e] · k[.., j, e] over the axes the output product uses"
    query, q_order, q_scale = _settle(left, [p.index(c) for c in want_q], probes)
    key, k_order, k_scale = _settle(right, [q.index(c) for c in want_k], probes)
    v_order = [y.index(c) for c in [*batch, j, d]]
    out_canon = [*batch, i, d]
    for pr in probes:
        qs, ks, vs = (pr.env[n].permute(o).shape for n, o in ((query, q_order), (key, k_order), (value, v_order)))
        if qs[:-2] != ks[:-2] or qs[:-2] != vs[:-2]:
            return (f"q, k and v have different batch axes ({tuple(qs)}, {tuple(ks)}, {tuple(vs)}): one is broadcast "
                    f"over the others (shared keys), which SDPA does not take as is")
    ident = (lambda o: None if list(o) == list(range(len(o))) else tuple(o))
    rank = len(batch) + 2
    return Layout(query, key, ident(q_order), ident(k_order), ident(v_order),
                  ident([out_canon.index(c) for c in z]), max(0, 4 - rank),
                  w.index(j), list(w) == [*batch, i, j], tuple(q_scale + k_scale))
