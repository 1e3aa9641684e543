"""The SDPA rule: naive dot-product attention becomes ``F.scaled_dot_product_attention``.

    softmax(q @ kᵀ · scale [+ mask | masked_fill(mask, -inf)], dim=keys) [dropout] @ v
        ->   F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=..., scale=...)

On CPU the fused kernel (flash attention) works on blocks of queries and keys and keeps the row
logsumexp for backward, where the naive form builds and keeps B·H·L·S scores, weights (and a
mask): seed 002 measured them. The rule matches by meaning, not spelling (every spelling of
inductor's ``fuse_attention.py`` list, ``tests/zoo/sdpa_spellings.py``): the two products may be
``matmul``/``@``/``bmm`` or ``einsum`` with the axes in any order; ``k`` arrives transposed
(``transpose``, ``permute``, ``.mT``) or already laid out ``[.., D, S]``; the scale multiplies or
divides the scores, ``q`` or ``k`` (numbers, ``d ** -0.5`` from a size, a 0-dim constant tensor);
casts to another tensor's dtype (``type_as(q)``, ``.to(q.dtype)``) are passed. Which axis is which is read from the
products (:mod:`.sdpa_parts`); the masks from the scores' chain (:mod:`.sdpa_masks`). Then SDPA,
run at each probe on the parts so laid out, must reproduce the value of the product it replaces.

Declined, with the reason: a softmax over another axis than the keys the product sums; scores or
weights read by another node (the weights returned, the scores logged); a mask that broadcasts the
scores to a larger shape or promotes their dtype; two masks; a scale that is a tensor (a learned
temperature) or a negative number, or applied to the weights after the softmax; masks filled in
with a finite value other than on a causal triangle (a row with every key masked: the original
gives uniform weights, SDPA does not); dropout written with ``training=True``; casts to a dtype
written in the code (``.float()`` before the softmax: a no-op for float32, a rounding for
float64); q, k, v with different batch axes (k and v shared by the heads). Where CPU flash
attention does not apply (v's head size other than q's, not 4-d) SDPA runs its math path, which
builds the scores too: the optimizer then finds no memory saved and keeps the original.

Dropout: SDPA's dropout draws its own random mask, so with p > 0 it cannot give the numbers the
model's ``dropout`` gives. Where dropout follows the module's flag (``nn.Dropout``,
``F.dropout(training=self.training)``) the rewritten graph runs SDPA while it is off (eval mode)
and the original nodes while it is on (train mode); p == 0 (seed 002's default) is SDPA in both.
``settings={"sdpa": {"same_distribution": True}}`` opts in to SDPA's own ``dropout_p`` while it
is on: the same distribution, other random bits (:mod:`.sdpa_dropout`: how that is checked, and
where it is refused).

>>> [f.status for f in find(gm, probes)]                         # doctest: +SKIP
['match']
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxmem.passes import sdpa_dropout as own
from fxmem.passes.base import Finding, Probe
from fxmem.passes.data_movement import op_name
from fxmem.passes.attention_parts import _dropout, _dropout_p, _softmax_dim
from fxmem.passes.fused_attention import _fallback, _original, boxed
from fxmem.passes.sdpa_masks import MaskPlan, fold_chain
from fxmem.passes.sdpa_parts import Layout, as_product, attention_layout, cast, fixed_cast, peel_scale

RULE = "sdpa"
SETTINGS = {own.SETTING: own.DESCRIPTION}
FLAGS = frozenset({own.SETTING})  # the settings that are True/False


@dataclasses.dataclass(frozen=True)
class SdpaPlan:
    """Where the parts of one attention are and how SDPA reads them (every field prints in the graph)."""

    output: torch.fx.Node  # the product weights @ v
    query: torch.fx.Node
    key: torch.fx.Node
    value: torch.fx.Node
    layout: Layout  # permutations to [batch.., L, D] and back
    scale: tuple  # (("mul" | "div", number or node), ...)
    mask: MaskPlan
    dropout_p: float
    training: Any  # None (no dropout), False, or the node holding the flag
    dropout_module: str | None  # an nn.Dropout's path: it reads its own flag
    fallback: tuple  # (nodes of the original attention, in graph order; the nodes they read)
    flash: bool  # CPU flash attention applies (4-d, one head size); else SDPA's math path
    own_dropout: bool = False  # SDPA's own dropout_p while dropout is on (same_distribution=True)


def find(gm: torch.fx.GraphModule, probes: Sequence[Probe], settings: Mapping[str, Any] | None = None) -> list[Finding]:
    """Every softmax dot-product attention (a match), and every look-alike (declined, with the reason);
    ``settings``: :data:`SETTINGS` (``same_distribution``: see :mod:`.sdpa_dropout`)."""
    modules = dict(gm.named_modules())
    same = bool((settings or {}).get(own.SETTING, False))
    findings = []
    for node in gm.graph.nodes:
        if as_product(node, probes[0].env) is None:
            continue
        found = _match(node, probes, modules, same)
        if found is None:
            continue
        if isinstance(found, str):
            findings.append(Finding(RULE, node, "declined", found))
        else:
            findings.append(Finding(RULE, node, "match", _describe(found), found, frozenset(found.fallback[0])))
    return findings


def _passed_cast(node: Any, env: Mapping) -> Any:
    """Below the casts to another tensor's dtype that change nothing (``.type_as(q)``)."""
    while isinstance(node, torch.fx.Node) and cast(node, env) == "follows":
        node = node.args[0]
    return node


def _dropout_of(node: torch.fx.Node, modules: Mapping) -> tuple[float, Any, str | None] | None:
    """(p, training, module path) for nn.Dropout, F.dropout, Tensor.dropout and torch.dropout(x, p, train)."""
    if node.op == "call_function" and node.target is torch.dropout:
        args = list(node.args) + [None] * 3
        return _dropout_p(node.kwargs.get("p", args[1]), node.kwargs.get("train", args[2]))
    return _dropout(node, modules)


def _opaque(scores: torch.fx.Node, modules: Mapping) -> str | None:
    """Why the scores cannot be read, when they come from code fx did not trace into (a function
    under ``@torch.fx.wrap``, a leaf module) that is given a matrix product; None otherwise."""
    seen, todo = set(), [scores]
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or len(seen) > 8:
            continue
        seen.add(n)
        target = n.target
        if n.op == "call_module":
            owner = type(modules.get(n.target)).__module__ if n.target in modules else ""
            hidden = not owner.startswith("torch.")
        elif n.op == "call_function":
            owner = getattr(target, "__module__", "") or ""
            hidden = not owner.startswith(("torch", "_operator", "operator", "builtins", "math", "fxmem"))
        else:
            hidden = False
        if hidden and any(isinstance(a, torch.fx.Node) for a in n.args):
            what = getattr(target, "__name__", str(target))
            return (f"the scores pass through {what} (node {n.name}), code torch.fx does not trace into (a function "
                    f"under @torch.fx.wrap or a leaf module): what it does to them cannot be seen, so softmax(q @ k^T "
                    f"[+ mask]) @ v is not matched; make it traceable to let the rewrite see it")
        todo += [a for a in n.args if isinstance(a, torch.fx.Node)]
    return None


def _metadata(node: torch.fx.Node) -> bool:
    """``getattr(x, "dtype")`` (or device): a read of what a tensor is, not of its values."""
    return (node.op == "call_function" and node.target is getattr and len(node.args) == 2
            and node.args[1] in ("dtype", "device"))


def _single_user(chain: Sequence[torch.fx.Node], softmax: torch.fx.Node, end: torch.fx.Node) -> str | None:
    """A reason if a node of the attention (scores to weights) is read by anything outside it."""
    inside = set(chain) | {end}
    for n in chain:  # x.dtype read only to cast x inside the attention (a TorchDynamo graph's .type(v.dtype))
        inside |= {u for u in n.users if _metadata(u) and u.users and all(v in inside for v in u.users)}
    weights = False
    for n in chain:
        weights = weights or n is softmax
        others = [u for u in n.users if u not in inside]
        if others:
            return (f"the {'attention weights' if weights else 'scores'} (node {n.name}) are also read by "
                    f"{others[0].name} ({op_name(others[0])}): SDPA neither builds nor returns them")
    return None


def _match(node: torch.fx.Node, probes: Sequence[Probe], modules: Mapping,
           same: bool = False) -> SdpaPlan | str | None:
    env = probes[0].env
    weights_in, values, letters = as_product(node, env)
    top = _passed_cast(weights_in, env)
    drop = _dropout_of(top, modules) if isinstance(top, torch.fx.Node) else None
    softmax = _passed_cast(top.args[0], env) if drop is not None else top
    if not isinstance(softmax, torch.fx.Node):
        return None
    if same and drop is None:  # the opt-in asked for, and a dropout elsewhere in the attention: say why not
        why = own.misplaced(weights_in, lambda n: _dropout_of(n, modules) is not None,
                            lambda n: _softmax_dim(n, modules) is not None, lambda n: cast(n, env) == "follows",
                            lambda n: as_product(n, env) is not None)
        if why is not None:
            return why
    for n in (top, softmax):
        if cast(n, env) == "fixed" and _softmax_dim(_passed_cast(n.args[0], env), modules) is not None:
            return fixed_cast(n, env)
    dim = _softmax_dim(softmax, modules)
    if dim is None and drop is None and peel_scale(softmax, probes) is not None \
            and _softmax_dim(_passed_cast(peel_scale(softmax, probes)[0], env), modules) is not None:
        return (f"the attention weights are scaled after the softmax (node {softmax.name}), so they do not add up "
                f"to 1: SDPA's scale multiplies the scores, before the softmax")
    if dim is None or not isinstance(softmax.args[0], torch.fx.Node):
        return None  # not attention weights
    chain = fold_chain(softmax.args[0], probes)
    if chain is None:  # softmax of something that is no product: not dot-product attention, unless hidden
        return _opaque(softmax.args[0], modules)
    if isinstance(chain, str):
        return chain
    layout = attention_layout(chain.product, node, weights_in, probes)
    if isinstance(layout, str):
        return layout
    if not isinstance(dim, int) or dim % env[softmax].dim() != layout.keys_axis:
        return (f"the softmax runs over dim {dim}, not over the keys the product with v sums (dim "
                f"{layout.keys_axis} of the scores): the weights of one query do not add up to 1")
    if (chain.mask.keep is not None or chain.mask.added or chain.mask.causal) and not layout.scores_canonical:
        return ("the scores are laid out with the keys or queries before the batch axes, and masked: SDPA's mask "
                "is read as [.., L, S]")
    weights = [weights_in]
    while weights[-1] is not softmax:
        weights.append(weights[-1].args[0])
    used = _single_user(chain.nodes + weights[::-1], softmax, node)
    if used is not None:
        return used
    p, training, module = drop if drop is not None else (0.0, None, None)
    if drop is not None and p > 0 and module is None and training is True:
        if same:
            return own.always_on(p)
        return (f"dropout (p={p}) is always on here (training=True written in the code): SDPA's dropout draws "
                f"another random mask, so the rewrite could not give the same numbers")
    if drop is None or p == 0 or training is False:
        training = None if drop is None or p == 0 else False
    heads = {env[n].shape[order[-1] if order is not None else -1]
             for n, order in ((layout.query, layout.query_order), (values, layout.value_order))}
    flash = len(heads) == 1 and env[softmax].dim() + layout.lift == 4  # CPU flash attention's conditions
    plan = SdpaPlan(node, layout.query, layout.key, values, layout, chain.scale + layout.scale, chain.mask,
                    p, training, module, _original(node, _reads(layout, values, chain.mask)), flash,
                    same and drop is not None and p > 0 and training is not False)
    bad = _check(plan, probes)
    if bad is None and plan.own_dropout:  # SDPA's dropout, drawn at the probes, against the model's
        reads = _reads(layout, values, chain.mask) + [f for _, f in plan.scale if isinstance(f, torch.fx.Node)]
        bad = own.check_distribution(lambda look, dropout_p: _value(plan, look, dropout_p), reads, weights_in,
                                     values, letters, p, probes)
    return bad if bad is not None else plan


def _reads(layout: Layout, values: torch.fx.Node, mask: MaskPlan) -> list:
    return [layout.query, layout.key, values] + [n for n in mask.nodes() if isinstance(n, torch.fx.Node)]


# --- the replacement, written once: run on values (the check) or on fx proxies (the rewrite) ---------

def attention(q: Any, k: Any, v: Any, mask: Any, scale: Any, orders: tuple, causal: bool,
              dropout_p: float = 0.0) -> Any:
    """SDPA on the model's q, k, v laid out by ``orders`` (:attr:`.sdpa_parts.Layout.orders`); the
    result in the layout of the product it replaces. ``dropout_p``: SDPA's own (:mod:`.sdpa_dropout`)."""
    query_order, key_order, value_order, output_order, lift = orders
    q, k, v = (x.permute(order) if order is not None else x
               for x, order in ((q, query_order), (k, key_order), (v, value_order)))
    for _ in range(lift):  # flash attention on CPU takes [B, H, L, D]: a 3-d bmm becomes [1, BH, L, D]
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    out = own.call(q, k, v, mask, scale, causal, dropout_p)
    for _ in range(lift):
        out = out.squeeze(0)
    return out.permute(output_order) if output_order is not None else out


def _scale(factors: Sequence[tuple[str, Any]], lookup: Any) -> Any:
    """SDPA's ``scale``: the product of the factors (numbers, or what ``lookup`` gives for nodes)."""
    scale: Any = None
    for how, f in factors:
        f = lookup(f) if isinstance(f, torch.fx.Node) else f
        if scale is None:
            scale = f if how == "mul" else 1.0 / f
        else:
            scale = scale * f if how == "mul" else scale / f
    return 1.0 if scale is None else scale


def _value(plan: SdpaPlan, env: Mapping, dropout_p: float = 0.0) -> torch.Tensor:
    look = env.__getitem__ if isinstance(env, Mapping) else env
    return attention(look(plan.query), look(plan.key), look(plan.value), plan.mask.build(look),
                     _scale(plan.scale, look), plan.layout.orders, plan.mask.causal, dropout_p)


def _check(plan: SdpaPlan, probes: Sequence[Probe]) -> str | None:
    """SDPA on each probe's values, laid out by the plan, must give the product's value."""
    for p in probes:
        want = p.env[plan.output]
        try:
            got = _value(plan, p.env)
        except RuntimeError as exc:  # SDPA refuses the operands (shapes, dtypes)
            first = (str(exc).strip().splitlines() or [""])[0]
            return f"F.scaled_dot_product_attention refuses the parts recognised: {first}"
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True):
            at = ", ".join(f"{k}={v}" for k, v in p.sizes.items())
            return (f"the parts recognised do not reproduce the attention at {at}: SDPA's result differs from the "
                    f"node's value; left as it is")
    return None


def sdpa_unless_dropout(dropout: bool, original: Any, box: list, q: Any, k: Any, v: Any, mask: Any,
                        mask_box: list, scale: Any, orders: tuple, causal: bool, own_p: Any = None) -> torch.Tensor:
    """What the rewritten graph calls where the attention has dropout with p > 0 that follows the
    module's flag: SDPA while it is off, the original nodes (``original[0]``, a GraphModule of them,
    on the values in the list ``box``) while it is on - they draw the same random mask as the model.
    With ``own_p`` (the dropout's p, ``same_distribution=True``) SDPA's own dropout_p while it is on,
    except within :func:`.sdpa_dropout.model_bits`. SDPA's mask is built (``mask[0]`` on the values
    in ``mask_box``) only when SDPA runs. Both lists are emptied here, so that nothing is held
    longer than the path taken needs it."""
    mask_reads = list(mask_box)
    mask_box.clear()
    drawn_by_sdpa = own_p is not None and own.own_dropout()
    if dropout and not drawn_by_sdpa:
        del mask_reads
        return original[0](box)
    box.clear()
    built = mask[0](*mask_reads) if mask is not None else None
    del mask_reads
    return attention(q, k, v, built, scale, orders, causal, float(own_p) if dropout else 0.0)


def _deferred_mask(plan: SdpaPlan, gm: torch.fx.GraphModule) -> str | None:
    """A GraphModule building SDPA's mask from ``plan.mask.nodes()``, held (in a tuple: not a
    submodule) by ``gm`` under the name returned; None when there is no mask to build."""
    reads = list(dict.fromkeys(plan.mask.nodes()))
    if not reads:
        return None
    sub = torch.fx.Graph()
    tracer = torch.fx.proxy.GraphAppendingTracer(sub)
    env = {n: torch.fx.Proxy(sub.placeholder(n.name), tracer) for n in reads}
    sub.output(plan.mask.build(env.__getitem__).node)
    name = f"_fxmem_sdpa_mask_{plan.output.name}"
    setattr(gm, name, (torch.fx.GraphModule(gm, sub, "attention_mask"),))
    return name


def _describe(plan: SdpaPlan) -> str:
    mask = plan.mask.describe()
    mask = f", {mask}" if mask == "causal" else f" {mask}" if mask else ""
    text = (f"softmax(q @ kᵀ · scale{mask}) @ v with q from {plan.query.name}, "
            f"k from {plan.key.name}, v from {plan.value.name}: F.scaled_dot_product_attention"
            f"{' (is_causal=True)' if plan.mask.causal else ''}, "
            + ("no L x S scores or weights kept" if plan.flash else
               "on CPU its math path (v's head size other than q's, or not 4-d), which builds the scores too"))
    if plan.mask.keep is not None:
        text += "; a query whose keys are all masked gets zeros from SDPA where the original gives NaN"
    if plan.own_dropout:
        text += (f"; while dropout (p={plan.dropout_p:g}) is on (train mode) SDPA's own dropout_p replaces it "
                 f"({own.NAMED}): the same distribution, NOT THE SAME RANDOM BITS - SDPA draws the mask, so "
                 f"train-mode outputs are not promised to be the model's bit for bit; checked exactly in eval mode "
                 f"and in train mode with the model's own bits, and as a distribution at the probes ({own.DRAWS} "
                 f"draws: the mean and spread of the model's dropout; backward with the forward's mask); on CPU "
                 f"SDPA's dropout runs its math path, recomputed in backward (torch.utils.checkpoint), so no L x S "
                 f"weights are kept from forward to backward")
    elif plan.dropout_p > 0 and plan.training is not False:
        text += (f"; while dropout (p={plan.dropout_p:g}) is on (train mode) the original attention runs: SDPA's "
                 f"dropout draws another random mask")
    return text


def rewrite(graph: torch.fx.Graph, nodes: Mapping, finding: Finding, gm: torch.fx.GraphModule) -> torch.fx.Node:
    """Insert SDPA (and what lays its operands out) before the product; returns the node of its result."""
    plan: SdpaPlan = finding.plan
    tracer = torch.fx.proxy.GraphAppendingTracer(graph)

    def proxy(n: torch.fx.Node) -> torch.fx.Proxy:
        return torch.fx.Proxy(nodes[n], tracer)

    with graph.inserting_before(nodes[plan.output]):
        q, k, v = proxy(plan.query), proxy(plan.key), proxy(plan.value)
        scale = _scale(plan.scale, proxy)
        if plan.dropout_p > 0 and plan.training is not False:
            holder, mask_holder = _fallback(plan, gm), _deferred_mask(plan, gm)
            if plan.dropout_module is not None:
                flag = graph.call_function(getattr, (graph.get_attr(plan.dropout_module), "training"))
            else:
                flag = nodes[plan.training] if isinstance(plan.training, torch.fx.Node) else plan.training
            original = graph.create_node("get_attr", holder)
            mask = graph.create_node("get_attr", mask_holder) if mask_holder is not None else None
            box = boxed(graph, [nodes[r] for r in plan.fallback[1]])
            mask_box = boxed(graph, [nodes[r] for r in dict.fromkeys(plan.mask.nodes())])
            scale = scale.node if isinstance(scale, torch.fx.Proxy) else scale
            own_p = None
            if plan.own_dropout:  # p as the model reads it: an nn.Dropout's p when the graph runs
                own_p = plan.dropout_p if plan.dropout_module is None else graph.call_function(
                    getattr, (graph.get_attr(plan.dropout_module), "p"))
            return graph.call_function(sdpa_unless_dropout, (flag, original, box, q.node, k.node, v.node, mask,
                                                             mask_box, scale, plan.layout.orders, plan.mask.causal,
                                                             own_p))
        mask = plan.mask.build(proxy)
        return attention(q, k, v, mask, scale, plan.layout.orders, plan.mask.causal).node
