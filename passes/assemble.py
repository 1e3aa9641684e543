"""Rewritten graphs as modules: the rules' sites applied to a copy of a graph (:func:`build`), and
the model's own submodules, parameters and buffers given to the result (:func:`share_modules`), so
that its ``state_dict`` keys are the model's and training it trains the model.

>>> out = build(gm, model, [(rule, finding)])                                   # doctest: +SKIP
>>> out.layers is model.layers
True
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.fx

from fxmem import _torch_compat as tc
from fxmem.passes.base import REPLACES, Finding, Pass



def site_groups(matches: list[tuple[Pass, Finding]]) -> list[list[tuple[Pass, Finding]]]:
    """Matches that free the same nodes (several heads reading one pair tensor) form one group:
    only all of them together free the pair tensor."""
    groups: list[list[tuple[Pass, Finding]]] = []
    for item in matches:
        joined = [g for g in groups if any(item[1].frees & f.frees for _, f in g)]
        merged = [item] + [x for g in joined for x in g]
        groups = [g for g in groups if g not in joined] + [merged]
    order = {id(f): k for k, (_, f) in enumerate(matches)}
    for g in groups:
        g.sort(key=lambda x: order[id(x[1])])
    return sorted(groups, key=lambda g: order[id(g[0][1])])


def build(gm: torch.fx.GraphModule, model: torch.nn.Module,
           rewrites: Sequence[tuple[Pass, Finding]]) -> torch.fx.GraphModule:
    """A new GraphModule: ``gm``'s graph (copied) with ``rewrites`` applied, sharing ``model``'s modules."""
    graph = copy.deepcopy(gm.graph)  # keeps node names, so nodes are matched by name
    by_name = {n.name: n for n in graph.nodes}
    nodes = {n: by_name[n.name] for n in gm.graph.nodes}
    # nodes kept although nothing reads them (in-place ops, side effects), unless a rewrite replaces them
    unused_before = {n for n in graph.nodes if not n.users} - {nodes[f.node] for _, f in rewrites}
    for rule, finding in rewrites:
        old = nodes[finding.node]
        before = set(graph.nodes)
        new = rule.rewrite(graph, nodes, finding, gm)
        for n in graph.nodes:
            if n not in before:  # tables and diagrams show the user's line for the new nodes
                n.meta["stack_trace"] = old.meta.get("stack_trace")
                n.meta["fxmem_rewrite"] = finding.rule
                if "nn_module_stack" in old.meta:  # the module that ran the replaced code runs the new
                    n.meta["nn_module_stack"] = dict(old.meta["nn_module_stack"])  # (recompute's blocks)
        old.replace_all_uses_with(new)
        # what the new node stands for in the graph as captured (regions are verified from there: .local_verify)
        new.meta[REPLACES] = old.meta.get(REPLACES, old.name)
        nodes[finding.node] = new
    out = torch.fx.GraphModule(gm, graph, type(model).__name__)
    share_modules(out, model)
    # drop what only fed the replaced nodes (the pair tensor and its copies), nothing else
    graph.eliminate_dead_code(is_impure_node=lambda n: n in unused_before or n.is_impure())
    graph.lint()
    out.recompile()
    out.training = model.training
    return out


def share_modules(out: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Give ``out`` the model's own submodules, parameters and buffers (same objects, same names),
    so its ``state_dict`` keys are the model's and training ``out`` trains the model."""
    for name, child in model.named_children():
        if not hasattr(torch.fx.GraphModule, name):
            setattr(out, name, child)
    for name, p in model.named_parameters(recurse=False):
        if getattr(out, name, None) is not p:
            out.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        if getattr(out, name, None) is not b:
            out.register_buffer(name, b, persistent=name not in tc.non_persistent_buffers(model))
    # in the model's order (a graph copies what it reads in the order it reads it): parameters() then
    # come as the model's do, so an optimizer state loaded by position matches; the graph's own last
    tc.order_like(out, model)
    for name, held in vars(out).items():  # the graphs a rewrite holds (the original attention a fallback runs)
        if name.startswith("_fxmem_") and isinstance(held, tuple):
            for sub in held:
                if isinstance(sub, torch.fx.GraphModule):
                    _share_held(sub, model)


def _share_held(sub: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Point what ``sub`` reads of the model (a dropout module, a mask buffer) at the model's own
    objects: they were copied from the traced graph's copy of the model when ``sub`` was built, and
    a copy's flag does not follow ``model.train()``/``eval()`` (a dropout that never turns on)."""
    for n in sub.graph.nodes:
        if n.op not in ("call_module", "get_attr"):
            continue
        parent_path, _, leaf = str(n.target).rpartition(".")
        try:
            owner = model.get_submodule(parent_path) if parent_path else model
            parent = sub.get_submodule(parent_path) if parent_path else sub
        except AttributeError:
            continue
        children = dict(owner.named_children())
        if n.op == "call_module" and leaf in children:
            setattr(parent, leaf, children[leaf])
        elif leaf in dict(owner.named_parameters(recurse=False)):
            parent.register_parameter(leaf, getattr(owner, leaf))
        elif leaf in dict(owner.named_buffers(recurse=False)):
            parent.register_buffer(leaf, getattr(owner, leaf))
