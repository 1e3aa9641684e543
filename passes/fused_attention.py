"""The fused-attention rule: GAT's masked softmax attention over decomposed scores becomes one fused
kernel that never builds or keeps an N x M float tensor (:mod:`fxmem.ops.attention`).

    softmax_j(where(keep_ij, LeakyReLU(s_i + t_j), fill)) [dropout] @ h   ->   masked_attention(s, t, h, adj)

After the pair-linear rule (or in code written that way: pyGAT's fix, PyG's ``DenseGATConv``)
what is left of a GAT layer is this attention, whose scores, mask, masked scores and softmax are
N x M each and mostly kept for backward. The rule matches by meaning, not spelling: from a
product whose weights are (a permutation of) a softmax - ``matmul``, ``@``, ``bmm``, or ``einsum``
with any letters and axis order (labml.ai's ``einsum('ijh,jhf->ihf', a, g)``), read as an einsum
equation as the SDPA rule reads its products, the result given back in the product's own layout -
it walks back through dropout, a ``where``/``masked_fill`` with a constant, a LeakyReLU and a broadcast add ``u + v``, and reads
off, at the probe sizes, which axes of the scores each operand varies along: ``u`` alone (the
rows i), ``v`` alone (the columns j), both (batch, heads). The softmax must run over j, the
product must contract j with the values' rows, the mask must come from comparing one tensor with a number (or be a
bool tensor) and be shared by the heads or not, as it is. Then the fused kernel, run at each probe
on the operands so laid out, must reproduce the product's value. Look-alikes are declined with
the reason: scores that are not LeakyReLU(s_i + t_j) (GATv2's a·LeakyReLU(Wh_i + Wh_j), dot
products), masks added rather than filled in, a softmax over the wrong axis.

Dropout with p > 0 on the weights runs inside the kernel while it is on (train mode), with the
model's own random mask: on the CPU ``F.dropout`` draws one number per weight in memory order, and
the kernel, visiting the weights group by group and row by row (or, for weights laid out heads last,
``[B, N, N, H]``, a row block's heads together), draws the same numbers from the same stream where the
weights are laid out in that order (checked at every probe; its backward draws them again from the
generator's state). Over the edge list (``settings``) the kernel draws the dense weights' numbers the
same way, a row block at a time, and keeps those at the edges. Where they are laid out otherwise (or
where this machine's ``bernoulli_`` does not draw in order), the rewritten graph runs the fused
kernel while the dropout is off (eval mode) and the original nodes while it is on - same numbers as
the original in both. With ``training=True`` written into the code (dropout on in eval mode too)
the rule declines.

The parts the match walks back through (dropout, softmax, LeakyReLU, the mask, the scores' axes)
are read by :mod:`.attention_parts`; this module matches, lays out, checks and rewrites.

>>> [f.status for f in find(gm, probes)]                         # doctest: +SKIP
['match']
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxmem.ops import attention as _kernel
from fxmem.ops.attention import DEFAULT_BLOCK_BYTES, masked_attention
from fxmem.ops.edge_attention import edge_attention, kept_edges
from fxmem import data_paths
from fxmem.passes.attention_layout import Axes, gather_axes, recipe, scatter_axes
from fxmem.passes.attention_parts import (_ADDS, Product, _Axes, _axes, _bool_mask, _comparison, _constant, _dropout,
                                          _leaky_slope, _mask, _softmax_dim, _target_key, _through_movement,
                                          _unexpanded, products)
from fxmem.passes.base import Finding, Probe
from fxmem.passes.data_movement import op_name, provenance, trace_movement
from fxmem.passes.pair_layout import half_strides
from fxmem.passes.pair_reasons import variable_name

RULE = "fused-attention"



@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Where the parts of one attention are, and how to lay them out for the fused kernel."""

    output: torch.fx.Node  # the matmul
    u: torch.fx.Node  # s side of the add
    v: torch.fx.Node  # t side
    values: torch.fx.Node  # h
    mask_source: torch.fx.Node  # the tensor the mask compares (adj)
    u_axes: Axes
    v_axes: Axes
    values_axes: Axes
    mask_axes: Axes
    out_order: tuple
    out_unsqueeze: tuple
    options: tuple  # (compare, threshold, keep, fill, slope, block_bytes)
    dropout_p: float
    training: Any  # None (no dropout), a bool, or the node holding the flag
    dropout_module: str | None  # an nn.Dropout's path: it reads its own flag
    fallback: tuple  # (nodes of the original attention, in graph order; the nodes they read)
    edge_list: bool = False  # run over the adjacency's kept entries (fxmem.ops.edge_attention)
    # the dropout runs inside the kernel (the model's own mask: the weights are drawn in the order
    # the kernel visits them); otherwise the original attention runs while dropout is on
    dropout_in_kernel: bool = False
    # ... visiting the Gh heads of a row block at once: the model's weights have their heads last
    heads_last: bool = False




# --- the rule ---------------------------------------------------------------------------------------

SETTINGS = {"block_bytes": "scratch (bytes) one row block of the fused kernel may use (default 4 MiB)",
            "edge_list": "True: for sparse graphs, run the attention over the adjacency's kept entries (listed once "
                         "per adjacency and call, shared by every head and layer) instead of every pair: time and "
                         "memory in the number of edges, a dim K of the formulas; with dropout on, its numbers are "
                         "still drawn for every pair, the model's own mask (default False: row blocks of every pair, "
                         "memory in N only)"}
FLAGS = frozenset({"edge_list"})


def find(gm: torch.fx.GraphModule, probes: Sequence[Probe], settings: Mapping[str, Any] | None = None) -> list[Finding]:
    """Every masked softmax attention over decomposed scores (a match), and every look-alike (declined).

    ``settings``: ``{"block_bytes": n, "edge_list": bool}`` (see :data:`SETTINGS`).
    """
    modules = dict(gm.named_modules())
    block_bytes = int((settings or {}).get("block_bytes", DEFAULT_BLOCK_BYTES))
    edge_list = bool((settings or {}).get("edge_list", False))
    findings = []
    for node in gm.graph.nodes:
        found = None
        for product in products(node, probes[0].env):  # the first reading whose weights are a softmax
            found = _match(node, product, probes, modules, block_bytes, edge_list)
            if found is not None:
                break
        if found is None:
            continue
        if isinstance(found, str):
            findings.append(Finding(RULE, node, "declined", found))
        else:
            findings.append(Finding(RULE, node, "match", _describe(found, probes[0].env), found,
                                    frozenset(found.fallback[0])))
    return findings


def _match(node: torch.fx.Node, product: Product, probes: Sequence[Probe], modules: Mapping,
           block_bytes: int, edge_list: bool = False) -> AttentionPlan | str | None:
    env = probes[0].env
    weights_in, values = product.weights, product.values
    top, permutes = _through_movement(weights_in, env, modules)
    drop = _dropout(top, modules) if isinstance(top, torch.fx.Node) else None
    softmax = top.args[0] if drop is not None else top
    if not isinstance(softmax, torch.fx.Node):
        return None
    dim = _softmax_dim(softmax, modules)
    if dim is None:
        return None  # not attention weights
    if product.problem is not None:
        return product.problem  # softmax weights in a product of another shape
    x = softmax.args[0]
    if not isinstance(x, torch.fx.Node):
        return None
    mask = _mask(x, env, modules)
    if mask is None:
        return (f"the softmax's input is {op_name(x, modules)} (node {x.name}), not scores with a mask filled in "
                f"(where/masked_fill); only masked attention is fused")
    if isinstance(mask, str):
        return mask
    if not isinstance(mask.scores, torch.fx.Node):
        return "the masked scores are not a tensor"
    leaky, upper = _through_movement(mask.scores, env, modules)
    slope = _leaky_slope(leaky, modules) if isinstance(leaky, torch.fx.Node) else None
    if slope is None:
        what = f"{op_name(leaky, modules)} (node {leaky.name})" if isinstance(leaky, torch.fx.Node) else repr(leaky)
        return (f"the scores are {what}, not LeakyReLU(s_i + t_j): only GAT's decomposed scores are fused "
                f"(a nonlinearity before the attention vector, as in GATv2's a·LeakyReLU(Wh_i + Wh_j), or dot "
                f"products have no s_i + t_j form)")
    add, lower = _through_movement(leaky.args[0], env, modules)
    if not (isinstance(add, torch.fx.Node) and _target_key(add) in _ADDS
            and len(add.args) == 2 and not add.kwargs
            and all(isinstance(a, torch.fx.Node) for a in add.args)):
        what = f"{op_name(add, modules)} (node {add.name})" if isinstance(add, torch.fx.Node) else repr(add)
        return (f"LeakyReLU's input is {what}, not a broadcast sum s_i + t_j: only GAT's decomposed scores "
                f"are fused")
    if mask.additive:
        source, compare, threshold, keep = mask.cond, "add", 0.0, True
    else:
        compared = _comparison(mask.cond, env, mask.keep)
        if isinstance(compared, str):
            return compared
        source, compare, threshold, keep = _bool_mask(*compared, env)
    u, v = _unexpanded(add, probes)
    chain = (mask.scores, leaky) if upper or lower else None  # copying ops around LeakyReLU
    parts = {"scores": x, "add": add, "u": u, "v": v, "source": source, "chain": chain}
    per_probe = [_axes(parts, p.env, modules) for p in probes]
    bad = next((a for a in per_probe if isinstance(a, str)), None)
    if bad is not None:
        return bad
    if any((a.kinds, a.mask) != (per_probe[0].kinds, per_probe[0].mask) for a in per_probe):
        return "the scores' axes play different roles at different sizes"
    axes = per_probe[0]
    rank = len(axes.shape)
    ends = {k: a for a, k in axes.kinds.items() if k != "g"}  # the axis u alone varies along ("i"), v's ("j")
    if not isinstance(dim, int) or dim % rank not in ends.values():
        return (f"the softmax runs over dim {dim}, not over an axis that one side of the sum alone varies along: "
                f"it does not normalise the scores of one row over its columns")
    if dim % rank == ends["i"]:  # PyG writes s_j + t_i: the columns are u's
        u, v = v, u
        axes.kinds = {a: {"i": "j", "j": "i"}.get(k, k) for a, k in axes.kinds.items()}
        parts.update(u=u, v=v)
    i, j = (next(a for a, k in axes.kinds.items() if k == kind) for kind in ("i", "j"))
    if tuple(env[x].shape) != tuple(env[mask.scores].shape) or tuple(env[softmax].shape) != tuple(env[x].shape):
        return "the mask broadcasts the scores to a larger shape"
    groups_mask = [a for a in sorted(axes.kinds) if axes.kinds[a] == "g" and a in axes.mask]
    groups_heads = [a for a in sorted(axes.kinds) if axes.kinds[a] == "g" and a not in axes.mask]
    layout = _layouts(node, top if drop is not None else softmax, product, axes, i, j,
                      groups_mask, groups_heads, parts, probes, modules)
    if isinstance(layout, str):
        return layout
    p, training, module = drop if drop is not None else (0.0, None, None)
    in_kernel = drop is not None and p > 0 and training is not False and _kernel.DRAWS_IN_PIECES
    heads_last = False
    if in_kernel and not all(_draws_in_order(pr.env[softmax], groups_mask + groups_heads + [i, j]) for pr in probes):
        # [B, N, M, H] (PyG's DenseGATConv): the kernel visits a row block's heads together
        heads_last = in_kernel = bool(groups_heads) and all(
            _draws_in_order(pr.env[softmax], groups_mask + [i, j] + groups_heads) for pr in probes)
    if drop is not None and p > 0 and module is None and training is True:
        return (f"dropout (p={p}) is always on here (training=True written in the code, eval mode too): the rule "
                f"checks the kernel against the attention's values at its probes, which always-on dropout leaves "
                f"random in every mode; fused where dropout follows the mode (training=self.training, nn.Dropout)")
    if drop is not None and (p == 0 or training is False):
        training = False
        in_kernel = False
    options = (compare, threshold, keep, _constant(mask.fill, env), slope, block_bytes)
    plan = AttentionPlan(node, u, v, values, source, *layout, options, p, training, module,
                         _original(node, [u, v, values, source]), edge_list, in_kernel, heads_last)
    mismatch = _check(plan, probes)
    return mismatch if mismatch is not None else plan


def _draws_in_order(weights: Any, order: list) -> bool:
    """Whether ``F.dropout(weights)`` draws its noise in the order the fused kernel visits the
    weights: the axes ``order`` (the groups, the rows i, the columns j), row-major, size-1 axes
    aside. On the CPU dropout draws into ``empty_like(weights)`` element by element in memory
    order (the strides of dense weights, else contiguous ones): the order the kernel's blocks draw
    in when the two agree, and then the kernel draws the model's own mask."""
    if not isinstance(weights, torch.Tensor) or weights.device.type != "cpu":
        return False
    noise = torch.empty_like(weights, device="meta")
    rest = [a for a in range(weights.dim()) if a not in order]
    if any(weights.shape[a] != 1 for a in rest):
        return False
    return noise.permute(*order, *rest).is_contiguous()


def _layouts(node, weights, product: Product, axes: _Axes, i, j, groups_mask, groups_heads, parts, probes,
             modules) -> tuple | str:
    """The recipes for u, v, values and the mask source, and how to put the result back in place
    (the product read as a matmul, ``product``'s permutations composed into the recipes)."""
    env = probes[0].env
    weights_in, values = product.weights, product.values
    gm_n, gh_n = len(groups_mask), len(groups_heads)
    g_order = groups_mask + groups_heads
    nonone = sorted(axes.kinds)

    def varying(kind_ok) -> list:
        return [a for a in nonone if kind_ok(a)]

    u_vals, v_vals = env[parts["u"]], env[parts["v"]]
    # u's and v's own non-1 dims, in their order, are the sum's: the scores' axes they become
    in_sum = [axes.amap[b] for b in sorted(axes.amap)] if axes.amap else nonone
    u_axes = recipe(u_vals.shape, [a for a in in_sum if axes.kinds[a] in ("g", "i")], g_order + [i], (gm_n, gh_n))
    v_axes = recipe(v_vals.shape, [a for a in in_sum if axes.kinds[a] in ("g", "j")], g_order + [j], (gm_n, gh_n))
    mask_axes = recipe(env[parts["source"]].shape, varying(lambda a: a in axes.mask), groups_mask + [i, j], (gm_n,))
    # the matmul's left operand: a permutation of the attention weights (which axis is which)
    lhs = env[weights_in]
    if weights_in is weights:
        strides = [s for s in _contiguous_strides(lhs.shape)]
    else:
        movement = trace_movement(weights_in, env, modules)
        if movement.sources != [weights]:
            return "the attention weights are combined with something else before the matmul"
        found = half_strides(provenance(movement, env, modules), 0, lhs.shape[-1])
        if isinstance(found, str) or found[2] != 0 or lhs.numel() != env[weights].numel():
            return "the attention weights are rearranged before the matmul, not only permuted"
        strides = found[1]
    if product.weights_order is not None:  # an einsum's weights, laid out [batch.., i, j] as a matmul reads them
        lhs, strides = lhs.permute(product.weights_order), [strides[d] for d in product.weights_order]
    own = dict(zip(_contiguous_strides(axes.shape), range(len(axes.shape))))
    lhs_axes = []
    for d, (size, stride) in enumerate(zip(lhs.shape, strides)):
        if size == 1:
            lhs_axes.append(None)
            continue
        a = own.get(stride)
        if a is None or axes.shape[a] != size:
            return "the attention weights are rearranged before the matmul, not only permuted"
        lhs_axes.append(a)
    if lhs.dim() < 2 or lhs_axes[-1] != j or lhs_axes[-2] != i:
        return (f"the product does not sum over the axis the softmax normalises (dim {j} of the scores): the "
                f"weights it sums for one output row do not add up to 1, so this is no row-normalised attention")
    batch = lhs_axes[:-2]
    vals = env[values] if product.values_order is None else env[values].permute(product.values_order)
    if vals.dim() < 2 or vals.shape[-2] != lhs.shape[-1]:
        return "the values do not have one row per column j"
    padded = [1] * (len(batch) - (vals.dim() - 2)) + list(vals.shape[:-2])
    if len(padded) != len(batch) or any(b is None and size != 1 for b, size in zip(batch, padded)):
        return "the values have axes the attention weights do not"
    # values shared by every head (att @ h[:, None]): the kernel takes them expanded over the heads
    shared = [b for b, size in zip(batch, padded) if b is not None and size == 1]
    if shared and sorted(shared) != sorted(groups_heads):
        return ("the values are broadcast over the batch or over some of the heads; only values with their own "
                "rows, or shared by every head, are fused")
    batch_axes = [b for b in batch if b is not None]
    if sorted(batch_axes) != sorted(g_order):
        return "the matmul's batch axes are not the attention's batch and head axes"
    value_squeeze = tuple(d for d, size in enumerate(vals.shape[:-2]) if size == 1)
    own = [b for b, size in zip(batch, padded) if b is not None and size != 1]  # the values' non-1 axes, in order
    wanted = groups_mask + ([] if shared else groups_heads)
    values_axes = (value_squeeze, tuple(own.index(a) for a in wanted) + (len(own), len(own) + 1),
                   (gm_n, 0 if shared else gh_n))
    # the fused result is [Gm.., Gh.., N, F]: back to the matmul's order, size-1 dims put back
    out_order = tuple(g_order.index(a) for a in batch_axes) + (len(g_order), len(g_order) + 1)
    out_unsqueeze = tuple(d for d, b in enumerate(batch) if b is None)
    if product.values_order is not None:
        values_axes = _permuted_recipe(product.values_order, values_axes)
    if product.output_order is not None:  # an einsum's own result layout ([N, H, F] for 'ijh,jhf->ihf')
        out_order, out_unsqueeze = _permuted_result(out_order, out_unsqueeze, product.output_order)
    return u_axes, v_axes, values_axes, mask_axes, out_order, out_unsqueeze


def _permuted_recipe(perm: Sequence[int], axes: Axes) -> Axes:
    """The recipe ``axes`` of ``x.permute(perm)`` as a recipe of ``x`` itself (:func:`gather_axes`).

    >>> _permuted_recipe((1, 0, 2), ((), (0, 1, 2), (1,)))
    ((), (1, 0, 2), (1,))
    """
    squeeze, order, groups = axes
    kept = [d for d in range(len(perm)) if d not in squeeze]  # dims of the permuted tensor left
    below = sorted(perm[d] for d in kept)  # the same dims of x, in x's order
    return (tuple(sorted(perm[d] for d in squeeze)), tuple(below.index(perm[kept[o]]) for o in order), groups)


def _permuted_result(order: Sequence[int], unsqueeze: Sequence[int], perm: Sequence[int]) -> tuple:
    """``(order, unsqueeze)`` for :func:`scatter_axes` that give ``result.permute(perm)`` where
    ``(order, unsqueeze)`` give ``result`` (size-1 dims inserted where ``perm`` puts them).

    >>> _permuted_result((1, 0, 2), (), (1, 0, 2))
    ((0, 1, 2), ())
    """
    n = len(perm)
    real = [d for d in range(n) if d not in unsqueeze]  # the result's dims the kernel's output fills
    return (tuple(order[real.index(perm[e])] for e in range(n) if perm[e] not in unsqueeze),
            tuple(e for e in range(n) if perm[e] in unsqueeze))


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return out[::-1]


def _original(output: torch.fx.Node, inputs: Sequence[torch.fx.Node]) -> tuple:
    """The nodes that compute ``output`` from ``inputs`` (the attention itself), in graph order, and
    every other node they read. A node whose value is also read outside them is read, not copied."""
    outside: set = set()
    stack = list(inputs)
    while stack:  # what the inputs depend on stays outside
        n = stack.pop()
        if n not in outside:
            outside.add(n)
            stack.extend(n.all_input_nodes)
    inside, stack = set(), [output]
    while stack:
        n = stack.pop()
        # attributes (parameters, the training flag) are read where the graph runs, not copied
        if n in inside or n in outside or n.op in ("get_attr", "placeholder"):
            continue
        inside.add(n)
        stack.extend(n.all_input_nodes)
    # a value something else also reads (a causal mask built once and read by every layer's
    # attention) stays in the graph and is read: a copy would build it a second time, next to it
    shared = True
    while shared:
        shared = {n for n in inside if n is not output and any(u not in inside for u in n.users)}
        inside -= shared
    order = {n: k for k, n in enumerate(output.graph.nodes)}
    nodes = sorted(inside, key=order.__getitem__)
    reads = sorted({a for n in nodes for a in n.all_input_nodes if a not in inside}, key=order.__getitem__)
    return tuple(nodes), tuple(reads)


def _check(plan: AttentionPlan, probes: Sequence[Probe]) -> str | None:
    """Run the fused kernel on each probe's values laid out by the plan: it must give the matmul's value."""
    for p in probes:
        env = p.env
        with data_paths.forced(True):  # the edge list, whatever the probe's density (the row blocks: below)
            edges = edges_of(env[plan.mask_source], plan.mask_axes, *plan.options[:3]) if plan.edge_list else None
        want = env[plan.output]
        got = fused_value(env[plan.u], env[plan.v], env[plan.values], env[plan.mask_source], plan_data(plan), edges)
        if edges is not None and _same(got, want):
            got = fused_value(env[plan.u], env[plan.v], env[plan.values], env[plan.mask_source], plan_data(plan))
        if not _same(got, want):
            at = ", ".join(f"{k}={v}" for k, v in p.sizes.items())
            return (f"the parts recognised do not reproduce the attention at {at}: the fused kernel's result differs "
                    f"from the node's value; left as it is")
    return None


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def plan_data(plan: AttentionPlan) -> tuple:
    """The plan's recipes and options as plain tuples (they are written into the rewritten graph)."""
    return (plan.u_axes, plan.v_axes, plan.values_axes, plan.mask_axes, plan.out_order, plan.out_unsqueeze,
            plan.options)


def edges_of(source: torch.Tensor, mask_axes: Axes, compare: str, threshold: float,
             keep: bool) -> torch.Tensor | None:
    """The kept entries of the mask's source laid out as [Am, N, M]: what the rewritten graph computes
    once per adjacency for every attention that runs over its edge list (:func:`kept_edges`; None
    where the adjacency is too dense for one: the attentions then run in row blocks)."""
    return kept_edges(gather_axes(source, mask_axes), compare, threshold, keep)


def fused_value(u: torch.Tensor, v: torch.Tensor, values: torch.Tensor, source: torch.Tensor, data: tuple,
                edges: torch.Tensor | None = None, p: float = 0.0, heads_last: bool = False) -> torch.Tensor:
    """The attention computed by the fused kernel (over ``edges``, the mask's kept entries, when
    given; with dropout ``p`` on its weights, drawn as over weights laid out heads last when
    ``heads_last``), in the layout of the original matmul's result."""
    u_axes, v_axes, values_axes, mask_axes, out_order, out_unsqueeze, options = data
    compare, threshold, keep, fill, slope, block_bytes = options
    s, t = gather_axes(u, u_axes), gather_axes(v, v_axes)
    h, adj = gather_axes(values, values_axes), gather_axes(source, mask_axes)
    if h.shape[1] != s.shape[1]:  # values shared by the heads: a view over them (the kernel copies it once)
        h = h.expand(h.shape[0], s.shape[1], *h.shape[2:])
    if edges is not None:
        out = edge_attention(s, t, h, edges, mask_groups=adj.shape[0], fill=fill, slope=slope,
                             added=adj if compare == "add" else None, dropout=p, heads_last=heads_last,
                             block_bytes=block_bytes)
    else:
        out = masked_attention(s, t, h, adj, compare=compare, threshold=threshold, keep=keep, fill=fill, slope=slope,
                               block_bytes=block_bytes, dropout=p, heads_last=heads_last)
    return scatter_axes(out, u, u_axes, out_order, out_unsqueeze)  # u has every group axis of the result


def fused_attention(u: torch.Tensor, v: torch.Tensor, values: torch.Tensor, source: torch.Tensor, data: tuple,
                    dropout: bool = False, original: Any = None, box: list | None = None,
                    edges: torch.Tensor | None = None, p: float = 0.0, heads_last: bool = False) -> torch.Tensor:
    """What the rewritten graph calls: the fused attention - with dropout ``p`` inside the kernel
    while ``dropout`` is true (train mode), on the CPU - or, where the kernel cannot draw the
    model's mask (``p`` is 0, the tensors are on another device, or this machine's ``bernoulli_``
    does not draw in order: :data:`fxmem.ops.attention.DRAWS_IN_PIECES`), while dropout is on the
    original nodes (``original[0]``, a GraphModule of them, on the values in the list ``box``,
    which it empties), which draw the same random mask as the model."""
    if dropout and original is not None and not (p and u.device.type == "cpu" and _kernel.DRAWS_IN_PIECES):
        return original[0](box)  # (a module optimized on another machine: this one's dropout draws otherwise)
    if box is not None:
        box.clear()
    return fused_value(u, v, values, source, data, edges, p if dropout else 0.0, heads_last)


def _name(node: torch.fx.Node, env: Mapping) -> str:
    """The user's name for the tensor a node copies (``adj`` for ``adj.unsqueeze(-1)``)."""
    below, _ = _through_movement(node, env, {})
    return variable_name(below if isinstance(below, torch.fx.Node) else node)


def _describe(plan: AttentionPlan, env: Mapping) -> str:
    compare, threshold, keep, fill, slope, block_bytes = plan.options
    source = _name(plan.mask_source, env)
    if compare == "add":
        scores = f"LeakyReLU(s_i + t_j, {slope:g}) + {source}"
    else:
        mask = (source if compare == "true" else
                f"{source} {dict(gt='>', ge='>=', lt='<', le='<=', eq='==', ne='!=')[compare]} {threshold:g}")
        scores = f"{'where' if keep else 'masked_fill'}({mask}, LeakyReLU(s_i + t_j, {slope:g}), {fill:g})"
    text = f"softmax_j({scores}) @ {_name(plan.values, env)} with s from {plan.u.name}, t from {plan.v.name}: "
    if plan.edge_list:
        text += (f"over the kept entries of {source} only (listed once per call by nonzero: their number is a dim "
                 f"K of the formulas), no N x N float tensor built or kept")
    else:
        text += (f"fused, in row blocks of at most {block_bytes} bytes of scratch, no N x N float tensor built or kept "
                 f"(work in N x N still: on a sparse graph, settings={{'fused-attention': {{'edge_list': True}}}} "
                 f"runs it over the edges)")
    order = 'mask groups, rows, columns, heads' if plan.heads_last else 'groups, rows, columns'
    if plan.dropout_p > 0 and plan.training is not False and plan.dropout_in_kernel:
        text += (f"; dropout (p={plan.dropout_p:g}) inside the kernel, with the model's own random mask: the kernel "
                 f"visits the weights in the order dropout draws them ({order}) and draws them from the same stream; "
                 f"its backward draws them again from the generator's state (checked at the probes and by "
                 f"verification; on CUDA, whose dropout draws by offsets, the original attention runs while dropout "
                 f"is on)")
        if plan.edge_list:
            text += ("; over the edge list it draws the dense weights' numbers block by block and keeps those at the "
                     "edges (N x M random numbers drawn, not kept), and draws again in backward only where a row's "
                     "masked entries have weight")
    elif plan.dropout_p > 0 and plan.training is not False:
        why = ("this machine's bernoulli_ draws each call from a stream of its own (PyTorch with MKL on an Intel "
               "CPU), so a kernel drawing block by block cannot draw dropout's mask" if not _kernel.DRAWS_IN_PIECES
               else "the weights are not laid out in the order the kernel visits them, so it cannot draw dropout's "
                    "random mask from the same stream")
        text += f"; while dropout (p={plan.dropout_p:g}) is on (train mode) the original attention runs: {why}"
    return text


def rewrite(graph: torch.fx.Graph, nodes: Mapping, finding: Finding, gm: torch.fx.GraphModule) -> torch.fx.Node:
    """Insert the call of :func:`fused_attention` before the matmul; returns it."""
    plan: AttentionPlan = finding.plan
    args = [nodes[plan.u], nodes[plan.v], nodes[plan.values], nodes[plan.mask_source], plan_data(plan)]
    kwargs = {"edges": _edges_node(graph, nodes[plan.mask_source], plan)} if plan.edge_list else {}
    with graph.inserting_before(nodes[plan.output]):
        if plan.dropout_p > 0 and plan.training is not False:
            if plan.dropout_module is not None:
                module = graph.get_attr(plan.dropout_module)
                flag = graph.call_function(getattr, (module, "training"))
            else:
                flag = nodes[plan.training] if isinstance(plan.training, torch.fx.Node) else plan.training
            # the original nodes are held also where the kernel draws the mask: on another device than
            # the CPU they run while dropout is on (CUDA's dropout draws by offsets, not in order)
            original = graph.create_node("get_attr", _fallback(plan, gm))
            args += [flag, original, boxed(graph, [nodes[r] for r in plan.fallback[1]])]
            if plan.dropout_in_kernel:
                kwargs["p"] = plan.dropout_p
                if plan.heads_last:
                    kwargs["heads_last"] = True
        return graph.call_function(fused_attention, tuple(args), kwargs)


def _edges_node(graph: torch.fx.Graph, source: torch.fx.Node, plan: AttentionPlan) -> torch.fx.Node:
    """The node listing the kept entries of ``source`` read as ``plan`` reads it: one per adjacency
    and mask, shared by every attention over it (the heads of a layer, the layers of a model)."""
    key = (source, plan.mask_axes, *plan.options[:3])
    for n in graph.nodes:
        if n.op == "call_function" and n.target is edges_of and n.args == key:
            return n
    after = source
    if source.op == "placeholder":  # after the last placeholder: they stay the graph's first nodes
        after = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(after):
        return graph.call_function(edges_of, key)


def boxed(graph: torch.fx.Graph, values: Sequence[torch.fx.Node]) -> torch.fx.Node:
    """A list node of ``values``: what the rewritten graph hands a fallback (see :func:`_fallback`)."""
    return graph.call_function(list, (tuple(values),))


def _fallback(plan: AttentionPlan, gm: torch.fx.GraphModule) -> str:
    """A GraphModule of the original attention nodes, held (in a tuple: not a submodule, so
    ``state_dict`` keys stay the model's) by ``gm`` under a name the rewritten graph reads.

    It takes what it reads as one list (:func:`boxed`), takes the values out and empties it before
    it runs: each is then freed after its last use inside, as in the original graph (a causal mask
    added to the scores is freed once added). Passed as arguments, they would be held by the call
    until it returns - through the whole attention."""
    inside, reads = plan.fallback
    sub = torch.fx.Graph()
    env: dict = {}
    box = sub.placeholder("box")
    for k, r in enumerate(reads):
        env[r] = sub.call_function(operator.getitem, (box, k))
    sub.call_method("clear", (box,))
    for n in inside:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[plan.output])
    name = f"_fxmem_original_{plan.output.name}"
    setattr(gm, name, (torch.fx.GraphModule(gm, sub, "original_attention"),))
    return name
