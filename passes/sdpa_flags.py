"""The sdpa-flags rule: an SDPA call given what SDPA can take as a flag is given the flag.

    sdpa(q, repeat(k), repeat(v), attn_mask=<the causal triangle>)   ->   sdpa(q, k, v, is_causal=True, enable_gqa=True)

Code that builds the causal mask as a tensor and repeats the key/value heads of grouped-query
attention pays for both: an L x S mask (a bool or float tensor, built each call), key and value
copied ``H / H_kv`` times and kept for backward, and SDPA's CPU flash kernel given a mask. Hugging
Face's decoders do this whenever they run under ``torch.compile`` (TorchDynamo, the graph fxmem
captures them with): eagerly they call SDPA with ``is_causal`` and ``enable_gqa``, under tracing
they build the mask and repeat the heads - on a tiny Llama the captured training step is
``256*B*L + 4*B*L**2`` bytes per layer above the eager one. Hand-written models that slice a
``tril`` buffer into ``attn_mask`` are the same case.

The rule matches by meaning, at every probe size:

* **causal**: the mask is built from sizes and constants alone (never from an input: a padding
  mask the caller passes is data) and what it masks is exactly the entries above the diagonal of
  the ``[.., L, S]`` scores (SDPA's ``is_causal`` is aligned top-left) - a bool mask (True: kept)
  or a float one adding 0 where kept and -inf, or a fill <= -1e4, where masked (exp underflows to
  exactly 0 there, as :mod:`.sdpa_masks` explains);
* **grouped heads**: key and value are copies of tensors with ``H_kv`` heads, each head repeated
  ``H / H_kv`` times in place (``x[:, :, None].expand(..).reshape(..)``, ``repeat_interleave``:
  what SDPA's ``enable_gqa=True`` does, torch >= 2.5); both or neither.

Look-alikes are declined with the reason: a mask that is not the triangle, or reads an input; heads
repeated as a whole (``repeat``, ``[k, k]``), which is another pairing of query and key heads.

>>> [f.status for f in find(gm, probes)]                         # doctest: +SKIP
['match']
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from fxmem.capture import source_line
from fxmem.passes.base import Finding, Probe
from fxmem.passes.data_movement import method_name
from fxmem.passes.sdpa_masks import FILL_AS_MINUS_INF
from fxmem.passes.sdpa_parts import constant_built

RULE = "sdpa-flags"
LOOKS_FOR = ("scaled_dot_product_attention given the causal triangle as attn_mask or key/value heads repeated "
             "for grouped-query attention")
SETTINGS: dict = {}
# the ops a repetition of heads passes through, from the repeated tensor down to the one with H_kv heads
_REPEAT_STEPS = frozenset({"expand", "reshape", "view", "unsqueeze", "repeat_interleave", "contiguous", "flatten"})


@dataclasses.dataclass(frozen=True)
class FlagsPlan:
    """What the call becomes: ``key``/``value`` (the tensors with H_kv heads, or the call's own),
    ``causal`` (the mask dropped for ``is_causal=True``), ``gqa`` (``enable_gqa=True``)."""

    call: torch.fx.Node
    key: torch.fx.Node
    value: torch.fx.Node
    causal: bool
    gqa: bool
    dropped: tuple  # the nodes the call no longer reads (the mask, the repeated heads)


def _is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention


def _arguments(node: torch.fx.Node) -> dict:
    """The call's arguments by name (SDPA's signature)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    out = dict(zip(names, node.args))
    out.update(node.kwargs)
    return out


def find(gm: torch.fx.GraphModule, probes: Sequence[Probe], settings: Mapping[str, Any] | None = None) -> list[Finding]:
    """Every SDPA call that a flag would spare a mask or repeated heads (a match), and the calls given
    a mask or more key heads that are not such (declined, with the reason)."""
    findings = []
    for node in gm.graph.nodes:
        if not _is_sdpa(node):
            continue
        found = _match(node, probes)
        if isinstance(found, str):
            findings.append(Finding(RULE, node, "declined", found))
        elif found is not None:
            findings.append(Finding(RULE, node, "match", _describe(found), found, frozenset(found.dropped)))
    return findings


def nearest(gm: torch.fx.GraphModule, probes: Sequence[Probe]) -> str | None:
    """Where no call is found: the first SDPA call, which takes no mask and no repeated heads."""
    for node in gm.graph.nodes:
        if _is_sdpa(node):
            return f"{node.name} ({source_line(node) or 'scaled_dot_product_attention'}): given no mask and its own heads"
    return None


def _match(node: torch.fx.Node, probes: Sequence[Probe]) -> FlagsPlan | str | None:
    args = _arguments(node)
    q, k, v, mask = args.get("query"), args.get("key"), args.get("value"), args.get("attn_mask")
    if not all(isinstance(t, torch.fx.Node) for t in (q, k, v)):
        return None
    causal_reason = None
    causal = False
    if isinstance(mask, torch.fx.Node) and not args.get("is_causal", False):
        causal_reason = _causal(mask, node, probes)
        causal = causal_reason is None
    gqa = False
    key, value = k, v
    if not args.get("enable_gqa", False):
        kb, vb = _grouped(k, q, probes), _grouped(v, q, probes)
        if isinstance(kb, torch.fx.Node) and isinstance(vb, torch.fx.Node) \
                and all(p.env[kb].shape[-3] == p.env[vb].shape[-3] for p in probes):
            key, value, gqa = kb, vb, True
    if not causal and not gqa:
        if causal_reason is not None:
            return f"its attn_mask {mask.name} is not taken as is_causal: {causal_reason}"
        return None
    dropped = tuple(n for n in ((mask,) if causal else ()) + ((k, v) if gqa else ()))
    return FlagsPlan(node, key, value, causal, gqa, dropped)


def _causal(mask: torch.fx.Node, call: torch.fx.Node, probes: Sequence[Probe]) -> str | None:
    """None where ``mask`` is the causal triangle at every probe and built from sizes and constants
    alone; else why not."""
    if not constant_built(mask, buffers=True):
        return "it is computed from an input (a padding mask is data, not the causal triangle)"
    for p in probes:
        m, q, k = p.env.get(mask), p.env[_arguments(call)["query"]], p.env[_arguments(call)["key"]]
        if not isinstance(m, torch.Tensor):
            return "it is not a tensor"
        rows, cols = q.shape[-2], k.shape[-2]
        above = torch.ones(rows, cols, dtype=torch.bool).triu(1)
        try:
            full = m.expand(*m.shape[:-2], rows, cols) if m.dim() >= 2 else None
        except RuntimeError:
            full = None
        if full is None:
            return f"it is {tuple(m.shape)}, not [.., {rows}, {cols}]"
        if m.dtype == torch.bool:
            out = ~full
        elif m.is_floating_point():
            if not bool(torch.all(full[..., ~above] == 0)) or not bool(torch.all(full[..., above] <= FILL_AS_MINUS_INF)):
                return "it adds other numbers than 0 where kept and -inf (or <= -1e4) where masked"
            out = full <= FILL_AS_MINUS_INF
        else:
            return f"it is of dtype {m.dtype}, neither bool nor float"
        if not bool(torch.all(out == above)):
            return f"at {dict(p.sizes)} it masks other entries than those above the diagonal"
    return None


def _grouped(x: torch.fx.Node, q: torch.fx.Node, probes: Sequence[Probe]) -> torch.fx.Node | None:
    """The tensor of H_kv heads whose heads, each repeated H / H_kv times in place, are ``x`` at every
    probe (``x`` has the query's H heads), found below ``x`` through the ops a repetition passes
    through; None where there is none."""
    node, seen = x, 0
    while isinstance(node, torch.fx.Node) and seen < 8:
        seen += 1
        name = method_name(node) or getattr(node.target, "__name__", "")
        is_index = node.op == "call_function" and node.target is operator.getitem
        if name not in _REPEAT_STEPS and not is_index:
            return None
        node = node.args[0] if node.args else None
        if isinstance(node, torch.fx.Node) and _repeats(node, x, q, probes):
            return node
    return None


def _repeats(base: torch.fx.Node, x: torch.fx.Node, q: torch.fx.Node, probes: Sequence[Probe]) -> bool:
    for p in probes:
        b, t, qt = p.env.get(base), p.env.get(x), p.env.get(q)
        if not all(isinstance(a, torch.Tensor) for a in (b, t, qt)) or b.dim() != t.dim() or t.dim() < 3:
            return False
        heads, groups = qt.shape[-3], b.shape[-3]
        if groups == 0 or groups >= heads or heads % groups or t.shape[:-2] != qt.shape[:-2] \
                or b.shape[:-3] != t.shape[:-3] or b.shape[-2:] != t.shape[-2:] or t.shape[-3] != heads:
            return False
        if not torch.equal(b.repeat_interleave(heads // groups, dim=-3), t):
            return False
    return True


def _describe(plan: FlagsPlan) -> str:
    flags = [f for f, on in (("is_causal=True for the mask", plan.causal),
                             ("enable_gqa=True for key/value heads repeated", plan.gqa)) if on]
    return (f"scaled_dot_product_attention ({plan.call.name}) given " + " and ".join(flags)
            + ": " + ", ".join(n.name for n in plan.dropped) + " no longer built for it")


def rewrite(graph: torch.fx.Graph, nodes: Mapping, finding: Finding, gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The call again, given the flags; returns its node."""
    plan: FlagsPlan = finding.plan
    args = _arguments(plan.call)
    kwargs = {name: (nodes[a] if isinstance(a, torch.fx.Node) else a) for name, a in args.items()
              if name not in ("query", "key", "value")}
    if plan.causal:
        kwargs.update(attn_mask=None, is_causal=True)
    if plan.gqa:
        kwargs["enable_gqa"] = True
    with graph.inserting_before(nodes[plan.call]):
        return graph.call_function(F.scaled_dot_product_attention,
                                   (nodes[args["query"]], nodes[plan.key], nodes[plan.value]), kwargs)
