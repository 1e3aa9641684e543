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
  the result is a :class:`ModeGraphModule`, whose ``train()``/``eval()`` switch between the two
  traced graphs, and nothing is rewritten (:attr:`Traced.reason` says why).

>>> traced = trace_modes(layer)                     # doctest: +SKIP
>>> "training = self.training" in traced.graph_module.code, traced.reason   # doctest: +SKIP
(True, None)
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx

from fxmem.capture import private_copy, trace
from fxmem.errors import TraceError

FLAG = "training"  # the attribute every nn.Module has, read by the merged graph at run time


def in_mode(module: torch.nn.Module, training: bool) -> torch.nn.Module:
    """``module`` in train (``True``) or eval mode, as a copy sharing its tensors; ``module`` is untouched."""
    copy = private_copy(module)
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
    capture: str | None = None  # None: torch.fx traced it; else what captured it and why
    # with a reason: the (train-mode, eval-mode) traces ``graph_module`` dispatches between (a budget
    # is fitted on the train-mode one: a training step runs it)
    modes: tuple | None = None


def trace_modes(model: torch.nn.Module, leaf_modules: Sequence[type] = (),
                concrete_args: dict | None = None,
                fallback: Callable[[torch.nn.Module], torch.fx.GraphModule] | None = None) -> Traced:
    """Trace ``model`` in train and in eval mode; one graph that follows the flag, when it can be.
    ``concrete_args``: arguments without an input, traced with their defaults. ``fallback``: how
    to capture a mode's copy where torch.fx cannot (TorchDynamo); ``Traced.capture`` says which ran."""
    if isinstance(model, torch.fx.GraphModule):  # already a graph: it reads the flag or it does not
        return Traced(model)
    capture = None
    try:
        # what the forward stores on its submodules (self.attn = p_attn) the result stores too
        train = trace(in_mode(model, True), leaf_modules, concrete_args, keep_stores=True)
        evals = trace(in_mode(model, False), leaf_modules, concrete_args, keep_stores=True)
    except TraceError as exc:
        if fallback is None:
            raise
        try:
            train, evals = fallback(in_mode(model, True)), fallback(in_mode(model, False))
        except TraceError as second:
            head = str(exc).partition("\n  what to do")[0]  # fx's advice is not the whole story now
            raise TraceError(f"{head}\n  {second}") from second
        capture = f"the graph TorchDynamo (torch.compile) captures, because {str(exc).splitlines()[0]}"
    merged = _merge(train, evals)
    if merged is not None:
        merged.train(model.training)
        return Traced(merged, capture=capture)
    where = _first_difference(train, evals)
    return Traced(per_mode(model, train, evals),
                  f"the model computes other things in train and in eval mode ({where}), not just other "
                  f"values of self.training; such graphs are left as they are (the result runs the train-mode "
                  f"or the eval-mode trace, as the module's flag says)", capture, (train, evals))


# --- one graph with a symbolic flag ----------------------------------------------------------------

def _merge(train: torch.fx.GraphModule, evals: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """``train``'s graph with the constants that differ as the flag does read from ``self.training``;
    None when the graphs differ in anything else."""
    a, b = list(train.graph.nodes), list(evals.graph.nodes)
    if len(a) != len(b):
        return None
    index_a, index_b = {n: k for k, n in enumerate(a)}, {n: k for k, n in enumerate(b)}
    # (node, path into (args, kwargs), True: flag / False: not flag / (train value, eval value))
    flags: list[tuple[int, tuple, Any]] = []
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
        negated = graph.call_function(operator.not_, (flag,)) if any(p is False for _, _, p in flags) else None
    for k, path, polarity in flags:
        node = a[k]
        if isinstance(polarity, tuple):  # a number: (train value, eval value)
            with graph.inserting_before(node):
                value = graph.call_function(by_flag, (flag, *polarity))
        else:
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
    if isinstance(x, slice) and isinstance(y, slice):  # h[:, :n] with n a node
        found = _differences((x.start, x.stop, x.step), (y.start, y.stop, y.step), ia, ib, path)
        return None if found is None or found else []  # a flag inside a slice is not rewritten
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
    if not same and isinstance(x, (int, float)) and isinstance(y, (int, float)):
        # `p if self.training else 0` (0.1 / 0, or 0.0 / 0): the number the flag picks, read when the graph runs
        return [(path, (x, y))]
    return [] if same else None


def by_flag(training: bool, when_training: Any, otherwise: Any) -> Any:
    """The constant a forward wrote as ``a if self.training else b``, picked by the flag at run time."""
    return when_training if training else otherwise


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
    a, b = list(train.graph.nodes), list(evals.graph.nodes)
    for x, y in zip(a, b):
        if x.format_node() != y.format_node():
            return f"train: {x.format_node()}; eval: {y.format_node()}"
    return "the graphs have different lengths" if len(a) != len(b) else "constants differ"


# --- two graphs, chosen by the flag ------------------------------------------------------------------

class ModeGraphModule(torch.fx.GraphModule):
    """A GraphModule whose graph is the train-mode or the eval-mode trace, as its flag says:
    ``train()``/``eval()`` switch the graph (and recompile). Its code is always one plain graph, so
    it runs, analyses, copies and saves like any GraphModule; both traces read the same modules
    and parameters (the model's, by their names)."""

    def train(self, mode: bool = True) -> "ModeGraphModule":
        super().train(mode)
        graph = self.__dict__.get(TRACES, (None, None))[0 if mode else 1]
        if graph is not None and self.graph is not graph:
            self.graph = graph
            self.recompile()
        return self

    def __deepcopy__(self, memo: dict) -> "ModeGraphModule":
        # GraphModule copies what its current graph reads; the other trace, and what it reads, too
        res = super().__deepcopy__(memo)
        graphs = copy.deepcopy(self.__dict__[TRACES], memo)
        _install_reads(self, res, graphs, memo)
        res.__dict__[TRACES] = graphs
        res.graph = graphs[0 if res.training else 1]
        res.recompile()
        return res


TRACES = "_fxmem_mode_graphs"  # (train graph, eval graph): graphs hold no tensors, so not submodules


def per_mode(model: torch.nn.Module, train: torch.fx.GraphModule,
              evals: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A :class:`ModeGraphModule` over the two traces, in the model's mode."""
    graphs = (copy.deepcopy(train.graph), copy.deepcopy(evals.graph))
    gm = ModeGraphModule(train, graphs[0], type(model).__name__)
    _install_reads(evals, gm, graphs)  # attributes only the eval trace reads (its tensor constants)
    gm.__dict__[TRACES] = graphs
    gm.train(model.training)
    return gm


def _install_reads(source: torch.nn.Module, target: torch.nn.Module, graphs: tuple, memo: dict | None = None) -> None:
    """Give ``target`` every attribute the ``graphs`` read that it lacks, from ``source`` (deep
    copies with ``memo``)."""
    for graph in graphs:
        for n in graph.nodes:
            if n.op in ("get_attr", "call_module") and not _has_path(target, str(n.target)):
                _copy_path(source, target, str(n.target), memo)


def _copy_path(source: torch.nn.Module, target: torch.nn.Module, path: str, memo: dict | None = None) -> None:
    """Give ``target`` the attribute ``path`` of ``source`` (the same object, or a deep copy with
    ``memo``), making the modules on the way."""
    *parents, name = path.split(".")
    for part in parents:
        source = getattr(source, part)
        if not hasattr(target, part):
            target.add_module(part, torch.nn.Module())
        target = getattr(target, part)
    value = getattr(source, name)
    value = copy.deepcopy(value, memo) if memo is not None else value
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        target.register_buffer(name, value)
    else:
        setattr(target, name, value)


def _has_path(module: torch.nn.Module, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(module, part):
            return False
        module = getattr(module, part)
    return True
