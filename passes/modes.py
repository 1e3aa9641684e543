"""Train and eval: a traced graph that follows the module's ``training`` flag as the original does.

``torch.fx`` reads ``self.training`` while it traces, so ``F.dropout(x, p, training=self.training)``
becomes ``training=True`` (or ``False``) frozen into the graph: after ``.eval()`` a traced module
would still drop out. :func:`trace_modes` traces the model in both modes (on structural copies,
so the user's flags are never touched) and compares the two graphs:

* the same graph: the model does not read the flag (modules such as ``nn.Dropout`` and
  ``nn.BatchNorm`` read their own flag when called, which a traced graph keeps);
* the same graph up to constants that are ``True`` in one and ``False`` in the other: those
  constants become ``self.training`` (or ``not self.training``) read when the graph runs;
* anything else (``if self.training:`` choosing other ops, ``p = 0.5 if self.training else 0``):
  the result dispatches on ``self.training`` between the two traced graphs, and nothing is
  rewritten (:attr:`Traced.reason` says why).

>>> traced = trace_modes(layer)                     # doctest: +SKIP
>>> "training = self.training" in traced.graph_module.code, traced.reason   # doctest: +SKIP
(True, None)
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
from typing import Any, Sequence

import torch
import torch.fx

from .. import _torch_compat as tc
from ..capture import trace

FLAG = "training"  # the attribute every nn.Module has, read by the merged graph at run time


def structural_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` and its submodules (new module objects) sharing every tensor with it,
    so flags can be set on the copy without touching the user's modules."""
    return tc.fake_module_copy(module, lambda t, trainable: t)


def in_mode(module: torch.nn.Module, training: bool) -> torch.nn.Module:
    """``module`` in train (``True``) or eval mode, as a structural copy; ``module`` is untouched."""
    copy = structural_copy(module)
    copy.train(training)
    return copy


@dataclasses.dataclass
class Traced:
    """The model traced for both modes: ``graph_module`` runs as the model would in either mode.

    ``reason`` is None when ``graph_module`` is one graph (rewritable); otherwise it says why the
    two modes need two graphs (``graph_module`` then dispatches between them).
    """

    graph_module: torch.fx.GraphModule
    reason: str | None = None


def trace_modes(model: torch.nn.Module, leaf_modules: Sequence[type] = ()) -> Traced:
    """Trace ``model`` in train and in eval mode; one graph that follows the flag, when it can be."""
    if isinstance(model, torch.fx.GraphModule):  # already a graph: it reads the flag or it does not
        return Traced(model)
    train = trace(in_mode(model, True), leaf_modules)
    evals = trace(in_mode(model, False), leaf_modules)
    merged = _merge(train, evals)
    if merged is not None:
        merged.train(model.training)
        return Traced(merged)
    where = _first_difference(train, evals)
    return Traced(_dispatch(model, train, evals),
                  f"the model computes other things in train and in eval mode ({where}), not just other "
                  f"values of self.training; such graphs are left as they are (the result runs the train-mode "
                  f"or the eval-mode trace, as the module's flag says)")


# --- one graph with a symbolic flag ----------------------------------------------------------------

def _merge(train: torch.fx.GraphModule, evals: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """``train``'s graph with the constants that differ as the flag does read from ``self.training``;
    None when the graphs differ in anything else."""
    a, b = list(train.graph.nodes), list(evals.graph.nodes)
    if len(a) != len(b):
        return None
    index_a, index_b = {n: k for k, n in enumerate(a)}, {n: k for k, n in enumerate(b)}
    flags: list[tuple[int, tuple, bool]] = []  # (node, path into (args, kwargs), True: flag / False: not flag)
    for k, (x, y) in enumerate(zip(a, b)):
        if x.op != y.op or x.name != y.name or not _same_target(x.target, y.target):
            return None
        found = _differences((x.args, x.kwargs), (y.args, y.kwargs), index_a, index_b, ())
        if found is None:
            return None
        flags += [(k, path, polarity) for path, polarity in found]
    if not flags:
        return train
    graph = train.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    with (graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(a[0])):
        # create_node: get_attr() warns for attributes that are neither tensors nor modules
        flag = graph.create_node("get_attr", FLAG)
    with graph.inserting_after(flag):
        negated = graph.call_function(operator.not_, (flag,)) if any(not p for _, _, p in flags) else None
    for k, path, polarity in flags:
        node = a[k]
        value = flag if polarity else negated
        node.args, node.kwargs = _replace((node.args, node.kwargs), path, value)
    graph.lint()
    train.recompile()
    return train


def _same_target(x: Any, y: Any) -> bool:
    return x is y or x == y


def _differences(x: Any, y: Any, ia: dict, ib: dict, path: tuple) -> list[tuple[tuple, bool]] | None:
    """Paths where ``x`` holds True/False and ``y`` the opposite; None if they differ otherwise."""
    if isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node):
        ok = isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node) and ia[x] == ib[y]
        return [] if ok else None
    if isinstance(x, bool) and isinstance(y, bool):
        return [] if x == y else [(path, x)]
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        if type(x) is not type(y) or len(x) != len(y):
            return None
        out: list = []
        for k, (u, v) in enumerate(zip(x, y)):
            found = _differences(u, v, ia, ib, path + (k,))
            if found is None:
                return None
            out += found
        return out
    if isinstance(x, dict) and isinstance(y, dict):
        if list(x) != list(y):
            return None
        out = []
        for key in x:
            found = _differences(x[key], y[key], ia, ib, path + (key,))
            if found is None:
                return None
            out += found
        return out
    try:
        same = type(x) is type(y) and bool(x == y)
    except Exception:  # constants that do not compare (tensors): the graphs are not the same
        return None
    return [] if same else None


def _replace(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: (_replace(v, rest, new) if k == head else v) for k, v in value.items()}
    items = [(_replace(v, rest, new) if k == head else v) for k, v in enumerate(value)]
    return type(value)(items) if not isinstance(value, torch.fx.immutable_collections.immutable_list) \
        else torch.fx.immutable_collections.immutable_list(items)


def _first_difference(train: torch.fx.GraphModule, evals: torch.fx.GraphModule) -> str:
    for x, y in zip(train.graph.nodes, evals.graph.nodes):
        if x.format_node() != y.format_node():
            return f"train: {x.format_node()}; eval: {y.format_node()}"
    return "the graphs have different lengths"


# --- two graphs, chosen by the flag ------------------------------------------------------------------

def run_in_mode(training: bool, graphs: tuple, *args: Any) -> Any:
    """Run the train-mode trace (``graphs[0]``) or the eval-mode one (``graphs[1]``)."""
    return graphs[0 if training else 1](*args)


BRANCHES = "_fxmem_mode_graphs"  # attribute holding the two traces: a tuple, so not a submodule


def _dispatch(model: torch.nn.Module, train: torch.fx.GraphModule,
              evals: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with the model's signature that runs the train or the eval trace, as
    ``self.training`` says.

    Both traces are re-rooted on the model's own modules (which the result shares), so a leaf
    module such as ``nn.Dropout`` follows the result's flag, and they are held in a tuple attribute
    (not submodules), so the result's ``state_dict`` keys are the model's; ``copy.deepcopy`` and
    ``.to()`` reach them through the shared modules.
    """
    name = type(model).__name__
    branches = (torch.fx.GraphModule(model, copy.deepcopy(train.graph), name),
                torch.fx.GraphModule(model, copy.deepcopy(evals.graph), name))
    graph = torch.fx.Graph()
    inputs = []
    for n in train.graph.nodes:
        if n.op == "placeholder":
            inputs.append(graph.placeholder(n.name, default_value=n.args[0] if n.args else inspect.Signature.empty))
    flag = graph.create_node("get_attr", FLAG)
    graphs = graph.create_node("get_attr", BRANCHES)
    graph.output(graph.call_function(run_in_mode, (flag, graphs, *inputs)))
    root = torch.nn.Module()
    setattr(root, BRANCHES, branches)
    gm = torch.fx.GraphModule(root, graph, name)
    gm.train(model.training)
    return gm
