"""Capture by TorchDynamo: turn a graph ``torch.compile`` hands to a backend into a plain
GraphModule fxmem analyses like a traced one, with the user's dim names.

A Dynamo graph takes the model's parameters and buffers as inputs (``L_self_modules_lin_parameters_
weight_``) and the sizes it treats as dynamic as SymInt inputs (``s77``). Here parameters and
buffers become attributes of a small root module (``lin.weight``), each SymInt input becomes
``x.size(d)`` of the first tensor input that has that size, and the tensor inputs keep their
argument names (``x``, or ``h`` after a graph break). The graph's nodes are left as Dynamo made
them, so the analysis runs the same torch calls in the same order, freeing each value where the
compiled code does.

Dims: a size Dynamo kept symbolic gets the user's name for it (``names={"x": ("B", "N", 6)}``, by
``forward`` argument name, in the order of the arguments: a call through ``*args`` reaches Dynamo
as ``args_0``, matched by position), else ``<input>_<dim>`` (``h_0``); a size Dynamo specialised stays the number it was compiled for
(the graph only runs at that size: Dynamo's guards recompile otherwise).

>>> graph = from_dynamo(gm, example_inputs, {"x": ("B", "N", 6)})    # doctest: +SKIP
>>> graph.specs                                                        # doctest: +SKIP
[TensorSpec(shape=('B', 'N', 6), dtype=torch.float32, requires_grad=False, fill=None)]
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import sympy
import torch
import torch.fx

from .. import _torch_compat as tc
from ..errors import SpecError, TraceError
from ..specs import TensorSpec


@dataclasses.dataclass
class DynamoGraph:
    """One graph as fxmem analyses it: ``module`` (tensor inputs only), one spec per input, example
    sizes (those of the call that compiled it), and what to tell the user."""

    module: torch.fx.GraphModule
    specs: list
    hints: dict
    notes: list
    specialised: list = dataclasses.field(default_factory=list)  # the user's dims Dynamo fixed to a number
    guards: list = dataclasses.field(default_factory=list)  # where the graph holds (Dynamo's size guards)
    guard_exprs: list = dataclasses.field(default_factory=list)  # the same, as sympy relations in the dims


# higher-order operators whose graphs fxmem runs as Dynamo made them, checked against real runs
# (tests/capture/test_backend.py: torch.utils.checkpoint, forward and a training step)
CHECKED_HOPS = ("tag_activation_checkpoint",)
_PART = re.compile(r"_(modules|parameters|buffers)_")


def _input_name(placeholder: str) -> str:
    """``L_x_`` -> ``x``; ``L_self_modules_lin_parameters_weight_`` -> ``lin.weight``."""
    name = re.sub(r"^[LG]_", "", placeholder).rstrip("_") or placeholder
    parts = _PART.split(name)
    if len(parts) > 1:  # self, kind, name, kind, name, ...: the attribute path below self
        return ".".join(parts[2::2]) or name
    return name


def _identifier(name: str, taken: set) -> str:
    base = re.sub(r"\W", "_", name) or "input"
    base = base if not base[0].isdigit() else f"_{base}"
    out, k = base, 1
    while out in taken:
        k += 1
        out = f"{base}_{k}"
    taken.add(out)
    return out


def _install(root: torch.nn.Module, path: str, value: torch.Tensor) -> str:
    """Put ``value`` at dotted ``path`` under ``root`` (a parameter, else a buffer); the path used."""
    *mods, leaf = path.split(".")  # "h.0.ln_1.weight": numbered children as nn.Sequential has them
    module = root
    for name in mods:
        if not isinstance(getattr(module, name, None), torch.nn.Module):
            module.add_module(name, torch.nn.Module())
        module = getattr(module, name)
    while hasattr(module, leaf):
        leaf += "_"
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)
    return ".".join([*mods, leaf])


def from_dynamo(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                names: Mapping[str, Sequence[Any]] | None = None, model: torch.nn.Module | None = None,
                order: Sequence[str] | None = None, inline_numbers: bool = False) -> DynamoGraph:
    """The Dynamo graph ``gm`` (with the inputs it was compiled for) as a GraphModule of tensor
    inputs only; ``names``: input name -> dims (names or ints), e.g. ``{"x": ("B", "N", 6)}``.
    ``model``: the module compiled, whose parameters and buffers keep their own names (else they
    are read off Dynamo's input names); ``order``: the forward's arguments, the new graph's inputs
    in that order (one the graph does not use is an input nobody reads); ``inline_numbers``: the
    Python numbers Dynamo passes as tensors become constants (for a rewrite of the model, not for
    the memory of the compiled call, which makes those tensors)."""
    names = dict(names or {})
    for n in gm.graph.nodes:  # subgraphs run by an operator: checked against real runs for checkpoint only
        if n.op == "call_function" and tc.is_higher_order_op(n.target) and str(n.target) not in CHECKED_HOPS:
            raise TraceError(f"the graph TorchDynamo captured calls {n.target}, whose subgraph fxmem has not been "
                             f"checked to analyse inside a graph; fxmem.analyze(model, ...) analyses the model's "
                             f"own forward")
    qualified = {} if model is None else {id(t): q for q, t in [*model.named_parameters(remove_duplicate=False),
                                                                *model.named_buffers(remove_duplicate=False)]}
    in_order = list(names.values())  # forward(*args) reaches Dynamo as args_0, args_1, ...: by position
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise TraceError(f"a graph from TorchDynamo has {len(placeholders)} inputs but was given "
                         f"{len(example_inputs)} example inputs; fxmem cannot tell which is which")
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env: dict = {}
    taken: set = set()
    specs, hints, notes, specialised = [], {}, [], []
    name_of: dict = {}  # Dynamo's symbol -> the user's dim name
    tensors: list[tuple[torch.fx.Node, list]] = []  # tensor inputs of the new graph, Dynamo's sizes
    symint_inputs, own, numbers = [], [], []
    inputs: dict = {}  # forward argument -> (Dynamo's placeholder, its sizes, its spec)
    for n, real in zip(placeholders, example_inputs):
        value = tc.dynamo_example_value(n)
        label = _input_name(str(n.target))
        if tc.dynamo_wrapped_number(n, real):
            numbers.append((n, real))
            continue
        if isinstance(real, torch.Tensor) and (id(real) in qualified or isinstance(real, torch.nn.Parameter)
                                               or "." in label or "_buffers_" in str(n.target)):
            own.append((n, qualified.get(id(real), label), real))  # the model's own: an attribute of the root
            continue
        if not isinstance(real, torch.Tensor):
            symint_inputs.append((n, value, real))
            continue
        exprs = tc.dynamo_input_sizes(value) or [sympy.Integer(d) for d in real.shape]
        by_position = re.fullmatch(r"args_(\d+)", label)
        if by_position and order is not None and label not in order and int(by_position.group(1)) < len(order):
            # a forward wrapped in ``def wrapper(*args, **kwargs)`` (transformers' decorators): the
            # call passed the forward's arguments in ``order``, so args_K is the K-th of them
            label = order[int(by_position.group(1))]
        given = list(names.get(label) or (in_order[int(by_position.group(1))] if by_position and
                                          int(by_position.group(1)) < len(in_order) else ()))
        if given and len(given) != len(exprs):
            raise SpecError(f"fxmem.backend: input '{label}' has {len(exprs)} dims {tuple(real.shape)}, but its "
                            f"names give {len(given)}: {tuple(given)}")
        dims = []
        for d, (expr, size) in enumerate(zip(exprs, real.shape)):
            if expr.is_number:
                if given and isinstance(given[d], str):
                    specialised.append(f"{given[d]} (= {int(expr)})")
                    notes.append(f"TorchDynamo compiled this graph for {label}.size({d}) == {int(expr)} only (static "
                                 f"shapes; its guards recompile at other sizes): {given[d]} is that number here. "
                                 f"torch.compile(..., dynamic=True) keeps it a dim")
                dims.append(int(expr))
                continue
            for sym in sorted(expr.free_symbols, key=str):
                if sym not in name_of:
                    # the user's name, or the user's number (the graph holds for every size, so also there)
                    wanted = given[d] if given and expr == sym else f"{label}_{d}"
                    clash = isinstance(wanted, str) and wanted in name_of.values()
                    name_of[sym] = f"{label}_{d}" if clash else wanted
            value = expr.xreplace({s: sympy.Integer(v) if isinstance(v, int) else sympy.Symbol(v)
                                   for s, v in name_of.items() if s in expr.free_symbols})
            dims.append(int(value) if value.is_number else str(value))
            if expr.is_Symbol and isinstance(name_of[expr], str):
                hints[name_of[expr]] = int(size)
        inputs[label] = (n, exprs, TensorSpec(tuple(dims), dtype=real.dtype, requires_grad=real.requires_grad))
    if order is not None and set(inputs) - set(order):
        raise TraceError(f"TorchDynamo's graph takes {sorted(set(inputs) - set(order))} as input(s), which are not "
                         f"arguments of forward ({', '.join(order)}); fxmem cannot tell what they are")
    for label in (order if order is not None else list(inputs)):
        node = graph.placeholder(_identifier(label, taken))
        if label in inputs:
            n, exprs, spec = inputs[label]
            env[n] = node
            tensors.append((node, exprs))
            specs.append(spec)
    for n, label, real in own:
        env[n] = graph.get_attr(_install(root, label, real))
    for n, value, real in symint_inputs:  # a size: read it off a tensor input that has it
        expr = tc.raw_expr(value) if isinstance(value, torch.SymInt) else None
        found = next(((t, d) for t, exprs in tensors for d, e in enumerate(exprs) if expr is not None and e == expr),
                     None)
        if found is None:
            raise TraceError(f"TorchDynamo passes the size {n.target} (= {real}) to this graph, and no tensor input "
                             f"has it as a dim, so fxmem cannot name it; compile with dynamic=False or analyse "
                             f"the model with fxmem.analyze")
        env[n] = graph.call_method("size", found)
    kept, constant = [], {}
    for n, real in numbers:
        if inline_numbers:  # a rewrite of the model: the number, as fx tracing would bake it in
            constant.update({u: real.item() for u in n.users if u.op == "call_method" and u.target == "item"})
            if all(u in constant for u in n.users):
                continue
        # made by the compiled call from a Python number, alive until the graph returns
        env[n] = graph.call_function(torch.tensor, (real.item(),), {"dtype": real.dtype})
        kept.append(env[n])
    if numbers and not inline_numbers:
        shown = ", ".join(f"{_input_name(str(n.target))} = {real.item()!r}" for n, real in numbers[:4])
        notes.append(f"TorchDynamo passes {len(numbers)} Python number(s) ({shown}{', ...' if len(numbers) > 4 else ''}) "
                     f"to the graph as 0-d float64 tensors it makes at each call (counted: 8 bytes each while the "
                     f"graph runs); the analysis uses their values at the call that compiled the graph")
    for n in gm.graph.nodes:
        if n.op == "output" and kept and not inline_numbers:  # held by the caller until the graph returns
            graph.call_function(len, (kept,))
        if n in constant:
            env[n] = constant[n]
        elif n.op != "placeholder":
            env[n] = graph.node_copy(n, lambda a: env[a])
    for name, sub in gm.named_children():  # submodules Dynamo kept as calls (rare with inlining)
        root.add_module(name, sub)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not _has(root, str(node.target)) and _has(gm, str(node.target)):
            _install(root, str(node.target), _get(gm, str(node.target)))
    module = torch.fx.GraphModule(root, graph, "CompiledGraph")
    dims_of = {s: sympy.Symbol(v) if isinstance(v, str) else sympy.Integer(v) for s, v in name_of.items()}
    guard_exprs = [g.xreplace(dims_of) for g in tc.dynamo_shape_guards([tc.dynamo_example_value(n)
                                                                          for n in placeholders])]
    guards = [str(g) for g in guard_exprs]
    if guards:
        notes.append(f"TorchDynamo compiled this graph where {', '.join(guards)} (its guards; at other sizes the "
                     f"compiled model runs another graph)")
    return DynamoGraph(module, specs, hints, notes, specialised, guards, guard_exprs)


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        _get(module, path)
        return True
    except AttributeError:
        return False


def _get(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module
