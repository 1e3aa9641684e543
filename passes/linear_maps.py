"""Linear maps: fx nodes that apply a map linear in the last dim of their input, with weights
that do not depend on the inputs - and how to split such a map where that dim is a concatenation.

    [x1 || x2] @ W          = x1 @ W[:F] + x2 @ W[F:]
    linear([x1 || x2], W, b) = linear(x1, W[:, :F], b) + linear(x2, W[:, F:])
    ([x1 || x2] * a).sum(-1) = (x1 * a[..., :F]).sum(-1) + (x2 * a[..., F:]).sum(-1)

``LINEAR_MAPS`` lists the recognisers (matmul with a parameter, ``nn.Linear``, ``F.linear``,
``(x * a).sum(-1)``, ``x @ a.expand(B, 2F, k)`` (a batched copy of one weight, as
``torch.bmm`` needs it), and ``W @ xᵀ`` - a map of x's rows written from the left, "left"); ``SPLITS``
the rewriters, by kind (a "left" split gives its halves as ``xᵢ Wᵢᵀ``: the caller transposes).

>>> linear_map(node, env, modules, Weights())                          # doctest: +SKIP
LinearMap(kind='matmul', node=matmul_1, x=view_1, weight=a, features=256, ...)
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Mapping

import torch
import torch.fx
import torch.nn.functional as F

from fxmem.passes.data_movement import method_name


@dataclasses.dataclass(frozen=True)
class LinearMap:
    """``node`` computes a map linear in the last dim (``features`` = 2F) of its input ``x``."""

    kind: str  # key of SPLITS
    node: torch.fx.Node
    x: torch.fx.Node
    weight: Any  # a node, or the module path of an nn.Linear
    bias: Any = None  # a node, a module path, or None
    features: int = 0
    options: tuple = ()  # ("ndim", n) for matmul weights; sum's keyword arguments for mul-sum


class Weights:
    """Whether a node is computed from parameters, buffers and constants only (never from inputs)."""

    def __init__(self) -> None:
        self._memo: dict[torch.fx.Node, bool] = {}

    def __call__(self, node: Any) -> bool:
        if not isinstance(node, torch.fx.Node):
            return False
        if node not in self._memo:
            if node.op == "placeholder":
                self._memo[node] = False
            elif node.op == "get_attr":
                self._memo[node] = True
            else:
                inputs: list[torch.fx.Node] = []
                torch.fx.node.map_arg((node.args, node.kwargs), lambda n: inputs.append(n) or n)
                self._memo[node] = all(self(n) for n in inputs)
        return self._memo[node]


def _fits(x: Any, features: int) -> bool:
    return (isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[-1] == features
            and features >= 2 and features % 2 == 0)


def _matmul(node: torch.fx.Node, env: Mapping, modules: Mapping, is_weight: Weights) -> LinearMap | None:
    if not ((node.op == "call_function" and node.target in (torch.matmul, operator.matmul))
            or method_name(node) == "matmul") or len(node.args) != 2 or node.kwargs:
        return None
    x, w = node.args
    wv = env.get(w) if isinstance(w, torch.fx.Node) else None
    if not isinstance(x, torch.fx.Node) or not is_weight(w) or not isinstance(wv, torch.Tensor) or wv.ndim < 1:
        return None
    features = wv.shape[0] if wv.ndim == 1 else wv.shape[-2]
    return LinearMap("matmul", node, x, w, None, features, ("ndim", wv.ndim)) if _fits(env.get(x), features) else None


_EXPANDS = frozenset({"expand", "expand_as", "broadcast_to"})


def _batched_weight(node: torch.fx.Node, env: Mapping, modules: Mapping, is_weight: Weights) -> LinearMap | None:
    # x @ a.expand(B, 2F, k) / torch.bmm(x, a.expand(B, -1, -1)): a per-batch copy of one weight
    # [2F, k] is the weight itself (the batch size is the input's, so the expanded node is no weight)
    if not ((node.op == "call_function" and node.target in (torch.matmul, operator.matmul, torch.bmm))
            or method_name(node) in ("matmul", "bmm")) or len(node.args) != 2 or node.kwargs:
        return None
    x, w = node.args
    if not isinstance(w, torch.fx.Node) or not w.args or not isinstance(w.args[0], torch.fx.Node):
        return None
    name = method_name(w) or (w.target.__name__ if w.op == "call_function" and hasattr(w.target, "__name__") else None)
    a = w.args[0]
    av, wv, xv = env.get(a), env.get(w), env.get(x)
    if name not in _EXPANDS or not is_weight(a) or not isinstance(av, torch.Tensor) or av.ndim != 2 \
            or not isinstance(wv, torch.Tensor) or wv.ndim != 3 or tuple(wv.shape[1:]) != tuple(av.shape) \
            or not isinstance(xv, torch.Tensor) or xv.ndim != 3 or not isinstance(x, torch.fx.Node):
        return None
    features = av.shape[0]
    return LinearMap("matmul", node, x, a, None, features, ("ndim", 2)) if _fits(xv, features) else None


def _linear_module(node: torch.fx.Node, env: Mapping, modules: Mapping, is_weight: Weights) -> LinearMap | None:
    mod = modules.get(str(node.target)) if node.op == "call_module" else None
    if not isinstance(mod, torch.nn.Linear) or len(node.args) != 1 or node.kwargs:
        return None
    bias = f"{node.target}.bias" if mod.bias is not None else None
    x = node.args[0]
    return LinearMap("linear", node, x, f"{node.target}.weight", bias, mod.in_features) \
        if isinstance(x, torch.fx.Node) and _fits(env.get(x), mod.in_features) else None


def _functional_linear(node: torch.fx.Node, env: Mapping, modules: Mapping, is_weight: Weights) -> LinearMap | None:
    if node.op != "call_function" or node.target is not F.linear:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, w = args[0], node.kwargs.get("weight", args[1])
    b = node.kwargs.get("bias", args[2])
    if not isinstance(x, torch.fx.Node) or not is_weight(w) or not (b is None or is_weight(b)):
        return None
    wv = env.get(w)
    if not isinstance(wv, torch.Tensor) or wv.ndim != 2:
        return None
    return LinearMap("linear", node, x, w, b, wv.shape[1]) if _fits(env.get(x), wv.shape[1]) else None


def _mul_sum(node: torch.fx.Node, env: Mapping, modules: Mapping, is_weight: Weights) -> LinearMap | None:
    # (x * a).sum(-1), torch.sum(a * x, dim=-1, keepdim=...)
    if not ((node.op == "call_function" and node.target is torch.sum) or method_name(node) == "sum"):
        return None
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    product, dim = node.args[0], node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    pv = env.get(product)
    if not isinstance(pv, torch.Tensor) or len(node.args) > 3:
        return None
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or dim not in (-1, pv.ndim - 1):
        return None
    if not ((product.op == "call_function" and product.target in (operator.mul, torch.mul))
            or method_name(product) == "mul") or len(product.args) != 2:
        return None
    u, v = product.args
    x, a = (u, v) if is_weight(v) else (v, u) if is_weight(u) else (None, None)
    av = env.get(a) if isinstance(a, torch.fx.Node) else None
    if not isinstance(x, torch.fx.Node) or not isinstance(av, torch.Tensor) or av.ndim < 1:
        return None
    options = (("keepdim", keepdim),) + ((("dtype", node.kwargs["dtype"]),) if "dtype" in node.kwargs else ())
    return LinearMap("mul-sum", node, x, a, None, av.shape[-1], options) if _fits(env.get(x), av.shape[-1]) else None


_TRANSPOSES = frozenset({"t", "T", "mT"})


def _transposed(node: Any, env: Mapping) -> Any:
    """``x`` when ``node`` is ``x.t()``, ``x.T``, ``torch.t(x)`` or ``x.transpose(0, 1)`` of a 2-D ``x``."""
    if not isinstance(node, torch.fx.Node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    x = node.args[0]
    if not (isinstance(env.get(x), torch.Tensor) and env[x].dim() == 2):
        return None
    name = method_name(node) or (node.target.__name__ if node.op == "call_function" and node.target is torch.t
                                 else None)
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        name = node.args[1]
    if name in _TRANSPOSES or (name == "transpose" and sorted(a % 2 for a in node.args[1:3]) == [0, 1]):
        return x
    return None


def _left_matmul(node: torch.fx.Node, env: Mapping, modules: Mapping, is_weight: Weights) -> LinearMap | None:
    # W @ xᵀ with W [k, 2F] a weight (pyGAT's sparse layer: self.a.mm(edge_h) with edge_h = cat(...).t())
    if not ((node.op == "call_function" and node.target in (torch.matmul, operator.matmul, torch.mm))
            or method_name(node) in ("matmul", "mm")) or len(node.args) != 2 or node.kwargs:
        return None
    w, y = node.args
    wv = env.get(w) if isinstance(w, torch.fx.Node) else None
    x = _transposed(y, env)
    if x is None or not is_weight(w) or not isinstance(wv, torch.Tensor) or wv.dim() != 2:
        return None
    return LinearMap("left", node, x, w, None, wv.shape[1]) if _fits(env.get(x), wv.shape[1]) else None


# Every way a node can apply a map linear in its input's last dim, tried in order.
LINEAR_MAPS: tuple[Callable[..., LinearMap | None], ...] = (_matmul, _batched_weight, _linear_module,
                                                            _functional_linear, _mul_sum, _left_matmul)


def linear_map(node: torch.fx.Node, env: Mapping, modules: Mapping, is_weight: Weights) -> LinearMap | None:
    """The linear map ``node`` applies to its input's last dim, or None."""
    for match in LINEAR_MAPS:
        found = match(node, env, modules, is_weight)
        if found is not None:
            return found
    return None


# --- splitting the map at F -----------------------------------------------------------------------

def _weight_node(graph: torch.fx.Graph, nodes: Mapping, ref: Any) -> Any:
    if ref is None or isinstance(ref, torch.fx.Node):
        return nodes[ref] if ref is not None else None
    return graph.get_attr(ref)  # a parameter of an nn.Linear, by its path


def _split_matmul(graph: torch.fx.Graph, nodes: Mapping, m: LinearMap, left: Any, right: Any, f: int) -> tuple:
    # [x1 || x2] @ W = x1 @ W[..., :F, :] + x2 @ W[..., F:, :]   (W of shape [.., 2F, k], or [2F])
    w = nodes[m.weight]
    plain = dict([m.options])["ndim"] <= 2  # W[:F] slices the 2F axis
    first = slice(None, f) if plain else (Ellipsis, slice(None, f), slice(None))
    second = slice(f, None) if plain else (Ellipsis, slice(f, None), slice(None))
    e1 = graph.call_function(torch.matmul, (left, graph.call_function(operator.getitem, (w, first))))
    e2 = graph.call_function(torch.matmul, (right, graph.call_function(operator.getitem, (w, second))))
    return e1, e2


def _split_linear(graph: torch.fx.Graph, nodes: Mapping, m: LinearMap, left: Any, right: Any, f: int) -> tuple:
    # W [x1 || x2] + b = (W[:, :F] x1 + b) + W[:, F:] x2: the bias is added once
    w = _weight_node(graph, nodes, m.weight)
    b = _weight_node(graph, nodes, m.bias)
    w1 = graph.call_function(operator.getitem, (w, (slice(None), slice(None, f))))
    w2 = graph.call_function(operator.getitem, (w, (slice(None), slice(f, None))))
    return graph.call_function(F.linear, (left, w1, b)), graph.call_function(F.linear, (right, w2))


def _split_mul_sum(graph: torch.fx.Graph, nodes: Mapping, m: LinearMap, left: Any, right: Any, f: int) -> tuple:
    # sum_c [x1 || x2]_c a_c = sum_c<F x1_c a_c + sum_c<F x2_c a_(F+c)   (a broadcasts as before)
    a = nodes[m.weight]
    out = []
    for operand, part in ((left, slice(None, f)), (right, slice(f, None))):
        half = graph.call_function(operator.getitem, (a, (Ellipsis, part)))
        out.append(graph.call_function(torch.sum, (graph.call_function(operator.mul, (operand, half)),),
                                       {"dim": -1, **dict(m.options)}))
    return tuple(out)


def _split_left(graph: torch.fx.Graph, nodes: Mapping, m: LinearMap, left: Any, right: Any, f: int) -> tuple:
    # W [x1 || x2]ᵀ = (x1 W[:, :F]ᵀ + x2 W[:, F:]ᵀ)ᵀ: the halves in linear's orientation (the caller transposes)
    w = nodes[m.weight]
    w1 = graph.call_function(operator.getitem, (w, (slice(None), slice(None, f))))
    w2 = graph.call_function(operator.getitem, (w, (slice(None), slice(f, None))))
    return graph.call_function(F.linear, (left, w1)), graph.call_function(F.linear, (right, w2))


SPLITS: dict[str, Callable[..., tuple]] = {"matmul": _split_matmul, "linear": _split_linear, "mul-sum": _split_mul_sum,
                                           "left": _split_left}


# --- one term of a split map: c * L_h(x), L_h the map's half h --------------------------------------

def _part(half: int, f: int) -> slice:
    return slice(half * f, (half + 1) * f)


def _scaled(graph: torch.fx.Graph, weight: Any, coefficient: float) -> Any:
    # c L(x) = (c W) x: the coefficient scales the weight's half, never the (larger) operand
    return weight if coefficient == 1 else graph.call_function(operator.mul, (weight, coefficient))


def _term_matmul(graph: torch.fx.Graph, nodes: Mapping, m: LinearMap, x: Any, half: int, f: int, coefficient: float,
                 bias: bool) -> Any:
    # c * (x @ W[hF:(h+1)F])   (W of shape [.., 2F, k], or [2F])
    plain = dict([m.options])["ndim"] <= 2
    part = _part(half, f) if plain else (Ellipsis, _part(half, f), slice(None))
    w = graph.call_function(operator.getitem, (nodes[m.weight], part))
    return graph.call_function(torch.matmul, (x, _scaled(graph, w, coefficient)))


def _term_linear(graph: torch.fx.Graph, nodes: Mapping, m: LinearMap, x: Any, half: int, f: int, coefficient: float,
                 bias: bool) -> Any:
    # c * W[:, hF:(h+1)F] x (+ b in one term only)
    w = graph.call_function(operator.getitem, (_weight_node(graph, nodes, m.weight), (slice(None), _part(half, f))))
    b = _weight_node(graph, nodes, m.bias) if bias else None
    return graph.call_function(F.linear, (x, _scaled(graph, w, coefficient), b))


def _term_mul_sum(graph: torch.fx.Graph, nodes: Mapping, m: LinearMap, x: Any, half: int, f: int, coefficient: float,
                  bias: bool) -> Any:
    # c * sum_c x_c a_(hF + c)   (a broadcasts as before)
    a = graph.call_function(operator.getitem, (nodes[m.weight], (Ellipsis, _part(half, f))))
    product = graph.call_function(operator.mul, (x, _scaled(graph, a, coefficient)))
    return graph.call_function(torch.sum, (product,), {"dim": -1, **dict(m.options)})


# the rewriters of one term ``c * L_h(x)`` (``bias``: the term that adds the map's bias), by kind
TERMS: dict[str, Callable[..., Any]] = {"matmul": _term_matmul, "linear": _term_linear, "mul-sum": _term_mul_sum}
