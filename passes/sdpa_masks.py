"""The SDPA rule's scores: what happens to ``q · k`` between the product and the softmax.

Walking back from the softmax's input to the scores product, each step is one of: a scale
(``* c``, ``/ c``: :func:`.sdpa_parts.peel_scale`), an additive mask (``+ mask``, either operand),
a mask filled in (``masked_fill(cond, v)``, ``where(cond, s, v)``, ``where(cond, v, s)``), or a
cast that keeps the dtype. Folded from the product outwards, they become SDPA's arguments
(:class:`MaskPlan`): ``scale``, and one of

* nothing;
* ``is_causal=True``: a mask - added (0 / -inf) or filled in - that is the causal triangle at
  every probe size and is built from sizes and constants alone (``triu(ones(L, L), 1)``, a
  ``tril`` buffer sliced ``[:L, :L]``), never from an input: provably causal, so the L x L mask
  is not built at all. A finite fill value counts as -inf when it is <= -1e4 (exp underflows to
  exactly 0 next to a row's unmasked maximum whenever the scores stay above it by more than 104 in
  float32, 745 in float64; every causal row keeps its diagonal);
* a bool ``attn_mask`` for a mask filled in with -inf (True: kept). The same numbers except for a
  query whose keys are all masked: the original's softmax gives NaN there, SDPA zeros. A finite
  fill elsewhere is declined: there such a query gets uniform weights from the original;
* a float ``attn_mask``: the added masks, times the scale factors that come after them.

Declined: masks that broadcast the scores to a larger shape or promote their dtype, bool tensors
added (``+ True`` is 1), scales that are not positive numbers, a mask both filled in and added.

>>> fold_chain(softmax_input, probes).mask.describe()             # doctest: +SKIP
'is_causal'
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx

from fxmem.passes.base import Probe
from fxmem.passes.data_movement import method_name
from fxmem.passes.attention_parts import _constant
from fxmem.passes.sdpa_parts import SCALES, as_product, cast, constant_built, fixed_cast, peel_scale

_ADDS = frozenset({operator.add, torch.add, "add"})
FILL_AS_MINUS_INF = -1e4  # finite fill values at or below this are taken as -inf on a causal mask


@dataclasses.dataclass(frozen=True)
class MaskPlan:
    """SDPA's mask: ``causal``; or ``keep`` (a bool node) with ``negate``; or ``added`` float masks,
    each with the scale factors applied after it; ``cast``: the dtype the added masks are cast to."""

    causal: bool = False
    keep: torch.fx.Node | None = None
    negate: bool = False
    added: tuple = ()  # ((node, (("mul" | "div", factor), ...)), ...)
    cast: torch.dtype | None = None

    def nodes(self) -> list:
        """The nodes SDPA's mask is computed from."""
        found = [self.keep] if self.keep is not None else []
        for node, factors in self.added:
            found += [node] + [f for _, f in factors if isinstance(f, torch.fx.Node)]
        return found

    def build(self, lookup: Callable[[torch.fx.Node], Any]) -> Any:
        """The mask, from values or fx proxies (``lookup`` gives each node's), or None."""
        if self.keep is not None:
            m = lookup(self.keep)
            return m.logical_not() if self.negate else m
        total = None
        for node, factors in self.added:
            m = lookup(node)
            for how, f in factors:
                f = lookup(f) if isinstance(f, torch.fx.Node) else f
                m = m * f if how == "mul" else m / f
            total = m if total is None else total + m
        if total is not None and self.cast is not None:
            total = total.to(self.cast)
        return total

    def describe(self) -> str:
        """The mask in words: ``"causal"``, ``"masked_fill(pad, -inf)"``, ``"+ bias + mask"``."""
        if self.causal:
            return "causal"
        if self.keep is not None:
            return f"masked_fill({'' if self.negate else '~'}{self.keep.name}, -inf)"
        return " ".join(f"+ {n.name}" for n, _ in self.added)


@dataclasses.dataclass
class Chain:
    """The scores product, the nodes from it to the softmax (product first), SDPA's scale and mask."""

    product: torch.fx.Node
    nodes: list
    scale: tuple
    mask: MaskPlan


def _fill(node: torch.fx.Node, env: dict) -> tuple[Any, Any, Any, bool] | str | None:
    """(scores operand, cond, fill value, cond says masked) for masked_fill / where with a constant."""
    key = node.target if node.op == "call_function" else method_name(node)
    if key in (torch.masked_fill, "masked_fill") and len(node.args) >= 2:
        value = node.kwargs.get("value", node.args[2] if len(node.args) > 2 else None)
        fill = _constant(value, env)
        if fill is None:
            return f"masked_fill's value (node {node.name}) is not one constant number"
        return node.args[0], node.args[1], fill, True
    if key in (torch.where, "where") and len(node.args) == 3 and not node.kwargs:
        cond, a, b = node.args
        if key == "where":  # x.where(cond, y): x where cond, else y
            cond, a, b = node.args[1], node.args[0], node.args[2]
        fa, fb = _constant(a, env), _constant(b, env)
        if fb is not None and fa is None:
            return a, cond, fb, False
        if fa is not None and fb is None:
            return b, cond, fa, True
        return f"neither branch of where (node {node.name}) is one constant value: not a mask filled in"
    return None


def _walk(node: Any, probes: Sequence[Probe], steps: list, nodes: list) -> torch.fx.Node | str | None:
    """Walk back to the scores product, recording ``steps`` (softmax side first); the product node."""
    env = probes[0].env
    while True:
        if not isinstance(node, torch.fx.Node):
            return None
        if as_product(node, env) is not None:
            nodes.append(node)
            return node
        nodes.append(node)
        how = cast(node, env)
        if how == "fixed":
            return fixed_cast(node, env)
        if how == "follows":
            node = node.args[0]
            continue
        peeled = peel_scale(node, probes)
        if peeled is not None:
            steps.append(("scale", peeled[1]))
            node = peeled[0]
            continue
        key = node.target if node.op == "call_function" else method_name(node)
        if key in _ADDS and len(node.args) == 2 and not node.kwargs \
                and all(isinstance(a, torch.fx.Node) for a in node.args):
            for k in (0, 1):  # the operand that leads to the product is the scores; the other the mask
                sub_steps, sub_nodes = [], []
                found = _walk(node.args[k], probes, sub_steps, sub_nodes)
                if isinstance(found, torch.fx.Node):
                    steps.append(("add", node.args[1 - k], node.args[k]))
                    steps += sub_steps
                    nodes += sub_nodes
                    return found
            return None
        if key in SCALES and len(node.args) == 2:
            for k in (0, 1):  # a product scaled by what is not a positive number
                if isinstance(_walk(node.args[k], probes, [], []), torch.fx.Node):
                    other = node.args[1 - k]
                    what = other.name if isinstance(other, torch.fx.Node) else repr(other)
                    return (f"the scores are scaled by {what} (node {node.name}), not by a positive number fixed "
                            f"when the model is traced: SDPA's scale is a float (a learned temperature would "
                            f"lose its gradient, a negative scale is no softmax temperature)")
            return None
        fill = _fill(node, env)
        if isinstance(fill, str):
            return fill
        if fill is not None:
            scores, cond, value, masked = fill
            steps.append(("fill", cond, value, masked, scores))
            node = scores
            continue
        return None  # no product q·k below: not dot-product attention


def _unexpanded(mask: torch.fx.Node, at: torch.fx.Node, nodes: list) -> torch.fx.Node:
    """The mask below an ``expand_as(scores)``: SDPA broadcasts it, and the scores are not built to
    lend their shape (the expand joins the attention's ``nodes``)."""
    if isinstance(mask, torch.fx.Node) and method_name(mask) == "expand_as" and len(mask.args) == 2 \
            and mask.args[1] in nodes and isinstance(mask.args[0], torch.fx.Node):
        nodes.append(mask)
        return mask.args[0]
    return mask


def _broadcasts(mask: torch.fx.Node, at: torch.fx.Node, probes: Sequence[Probe]) -> str | None:
    for p in probes:
        m, s = p.env.get(mask), p.env[at]
        if not isinstance(m, torch.Tensor):
            return f"the mask {mask.name} is not a tensor"
        try:
            ok = torch.broadcast_shapes(m.shape, s.shape) == s.shape
        except RuntimeError:
            ok = False
        if not ok:
            return (f"the mask {mask.name} {tuple(m.shape)} is not broadcastable to the scores {tuple(s.shape)}: "
                    f"it makes them larger, and SDPA's attn_mask must broadcast to [.., L, S]")
    return None


def _causal(masked: Callable[[dict], torch.Tensor], node: torch.fx.Node, scores: torch.fx.Node,
            probes: Sequence[Probe]) -> bool:
    """Whether the entries ``masked`` says are out are exactly those above the diagonal at every probe,
    and the mask is built from sizes and constants (or the model's constant buffers) alone."""
    if not constant_built(node, buffers=True):
        return False
    for p in probes:
        out = masked(p.env)
        rows, cols = p.env[scores].shape[-2:]
        if out.dim() < 2 or tuple(out.shape[-2:]) != (rows, cols):
            return False
        above = torch.ones(rows, cols, dtype=torch.bool).triu(1)
        if not bool(torch.all(out == above)):
            return False
    return True


def fold_chain(x: torch.fx.Node, probes: Sequence[Probe]) -> Chain | str | None:
    """SDPA's scale and mask for the softmax input ``x``; None if ``x`` is no (scaled, masked) product."""
    env = probes[0].env
    steps: list = []
    nodes: list = []
    product = _walk(x, probes, steps, nodes)
    if not isinstance(product, torch.fx.Node):
        return product
    scores_dtype = env[product].dtype
    scale: list = []
    added: list = []  # [node, factors after it]
    fill: list | None = None  # [cond, value, cond says masked]
    for step in reversed(steps):  # from the product outwards
        if step[0] == "scale":
            how, f = step[1]
            if isinstance(f, torch.fx.Node) and (added or fill):
                return (f"the masked scores are scaled by {f.name}, a number computed when the model runs: SDPA "
                        f"scales before the mask, so the mask would have to be rescaled by it")
            scale.append((how, f))
            for entry in added:
                entry[1].append((how, f))
            if fill is not None:
                fill[1] = fill[1] * f if how == "mul" else fill[1] / f
        elif step[0] == "add":
            mask, at = _unexpanded(step[1], step[2], nodes), step[2]
            bad = _broadcasts(mask, at, probes)
            if bad:
                return bad
            m = env[mask]
            if m.dtype == torch.bool or not m.is_floating_point():
                return (f"a {m.dtype} tensor ({mask.name}) is added to the scores: that adds 1 or 0, it is not "
                        f"a mask SDPA reads the same way")
            if torch.promote_types(m.dtype, env[at].dtype) != scores_dtype:
                return f"adding the mask {mask.name} ({m.dtype}) changes the scores' dtype ({scores_dtype})"
            if fill is not None:
                return (f"the scores are masked twice (by {mask.name} after another mask is filled in): SDPA "
                        f"takes one mask")
            added.append([mask, []])
        else:
            _, cond, value, masked, at = step
            if fill is not None or added:
                return (f"the scores are masked twice (by {cond.name} after another mask): SDPA takes one "
                        f"mask, and a fill after an added mask is not an added mask")
            bad = _broadcasts(cond, at, probes)
            if bad:
                return bad
            cond = _unexpanded(cond, at, nodes)
            if not all(getattr(p.env.get(cond), "dtype", None) == torch.bool for p in probes):
                return f"the mask {cond.name} is not a bool tensor"
            fill = [cond, value, masked]
    return _plan(product, nodes[::-1], tuple(scale), added, fill, scores_dtype, probes)


def _plan(product, nodes, scale, added, fill, scores_dtype, probes) -> Chain | str:
    env = probes[0].env
    if fill is not None:
        cond, value, masked = fill
        holes = (lambda e: e[cond]) if masked else (lambda e: e[cond].logical_not())
        if _causal(holes, cond, product, probes) and value <= FILL_AS_MINUS_INF:
            return Chain(product, nodes, scale, MaskPlan(causal=True))
        if value != -math.inf:
            return (f"the mask {cond.name} is filled in with {value:g}, not -inf, and it is not the causal triangle: "
                    f"a row with every key masked gets uniform weights here, but none from SDPA")
        return Chain(product, nodes, scale, MaskPlan(keep=cond, negate=masked))
    if len(added) == 1 and not added[0][1]:
        mask = added[0][0]
        holes = (lambda e: e[mask] == -math.inf)
        if all(bool(torch.all((p.env[mask] == 0) | (p.env[mask] == -math.inf))) for p in probes) \
                and _causal(holes, mask, product, probes):
            return Chain(product, nodes, scale, MaskPlan(causal=True))
    cast = None
    if any(env[m].dtype != scores_dtype for m, _ in added):
        cast = scores_dtype
    return Chain(product, nodes, scale, MaskPlan(added=tuple((m, tuple(f)) for m, f in added), cast=cast))
