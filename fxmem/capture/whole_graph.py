"""One graph of a model, captured by TorchDynamo where ``torch.fx`` cannot trace it, as a
GraphModule with the model's call signature, its outputs and its parameters: what
``fxmem.optimize`` rewrites (``torch.zeros(x.size(0), F)`` in GNN code, wrapped ``forward``s).

The capture asks for what a rewrite needs: one graph (``fullgraph=True``), valid at every size
(every size dynamic, no size guards), computing what ``forward`` returns. Anything less is a
:class:`TraceError` with Dynamo's reason.

>>> gm = capture(layer, specs, ["x", "edge_index"])            # doctest: +SKIP
>>> torch.equal(gm(x, edge_index), layer(x, edge_index))       # doctest: +SKIP
True
"""
from __future__ import annotations

import types
from typing import Any, Sequence

import sympy
import torch
import torch.fx

from .. import _torch_compat as tc
from ..errors import TraceError
from ..inputs import random_inputs
from .dynamo import from_dynamo
from .trace import private_copy


def capture(model: torch.nn.Module, specs: Sequence[Any], order: Sequence[str]) -> torch.fx.GraphModule:
    """The one graph TorchDynamo captures from ``model`` (``fullgraph=True``, every size dynamic),
    as a GraphModule taking the forward's arguments ``order``, returning what ``forward`` returns,
    and sharing ``model``'s parameters and buffers.

    The capture runs a private copy of the model once, for real, on small random inputs on the
    model's device (the meta device for a model built there): each dim gets its own size, none 0
    or 1, so Dynamo neither merges dims nor fixes them. The graph's flat outputs are then put back
    in the structure ``forward`` returned. Raises :class:`TraceError` with Dynamo's reason when it
    cannot capture one graph (a graph break, Python that decides on tensor values), fixes one of
    the user's dims to a number, the forward stores a tensor on a module (the graph would not), or
    the model returns what a graph cannot (a class).

    >>> gm = capture(layer, specs, ["x", "edge_index"])      # doctest: +SKIP
    """
    names = {s.arg: tuple(int(d) if d.is_number else str(d) for d in s.dims) for s in specs}
    constants = {int(d) for s in specs for d in s.dims if d.is_number}
    dims = sorted({str(x) for s in specs for d in s.dims for x in d.free_symbols})
    sizes, k = {}, 7
    for name in dims:  # distinct, and none equal to a fixed size: Dynamo would take them for one
        while k in constants or k in sizes.values():
            k += 1
        sizes[name] = k
        k += 1
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    inputs = random_inputs(specs, sizes, device=str(device))
    twin = private_copy(model)  # its Python state is its own; its tensors are the model's
    before = {name: _memory_of(v) for name, v in tc.module_attribute_values(twin)}
    graph, out, flat, copies = _compiled(twin, inputs, names, order, type(model).__name__)
    # a tensor in other memory than before; not the copy of a parameter or buffer the graph ran on,
    # which Dynamo sets back after an in-place update (``self.count += 1``: the graph does that update)
    stored = [name for name, v in tc.module_attribute_values(twin)
              if isinstance(v, torch.Tensor) and before.get(name) != _memory_of(v) and id(v) not in copies]
    if stored:  # Dynamo replays such a store itself; the graph it hands a backend does not hold it
        raise TraceError(f"{type(model).__name__}'s forward stores a tensor on a module "
                         f"({', '.join('self.' + n for n in stored)}), which the graph TorchDynamo captures does "
                         f"not record (it computes the outputs only), so a rewrite of it would not store it. What "
                         f"to do: store it in a submodule's forward that torch.fx can trace (the rewrite then "
                         f"stores it too), or analyse with fxmem.analyze (the original forward)")
    if graph.specialised:
        raise TraceError(f"TorchDynamo fixed {', '.join(graph.specialised)} in the graph it captured of "
                         f"{type(model).__name__}, so it holds at that size only")
    if graph.guards:  # a branch on sizes, or an assert: the graph holds where they do
        if not all(isinstance(g, sympy.Rel) and {str(x) for x in g.free_symbols} <= set(dims)
                   for g in graph.guard_exprs):
            raise TraceError(f"the graph TorchDynamo captured of {type(model).__name__} holds only where "
                             f"{', '.join(graph.guards)} (Python decides on sizes there), not at every size")
        # the graph holds there; who uses it runs the model's own forward elsewhere (passes.switch.Guards)
        graph.module.meta["fxmem_guards"] = tuple(graph.guard_exprs)
    _follow_the_models_dtype(graph.module, model, inputs, names, order)
    _restore_output(graph.module, out, flat, type(model).__name__)
    _share_tensors(graph.module, model)
    return graph.module


def _memory_of(value: Any) -> Any:
    """Where a tensor attribute's elements live (its storage's address), else the object itself."""
    if isinstance(value, torch.Tensor):
        try:
            return ("storage", value.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage of its own (a subclass): by identity
            return ("object", id(value))
    return ("object", id(value))


def _compiled(twin: torch.nn.Module, inputs: list, names: dict, order: Sequence[str], name: str) -> tuple:
    """Compile ``twin`` once on ``inputs``: the one graph Dynamo hands the backend, the call's result,
    the graph's flat outputs, and the ids of the copies of ``twin``'s tensors the graph ran on."""
    found: list = []
    returned: list = []
    held = {id(t) for t in [*twin.parameters(), *twin.buffers()]}
    copies: dict[int, torch.Tensor] = {}  # id -> the copy (kept alive, so that no id is reused)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        found.append(from_dynamo(gm, example_inputs, names, twin, order, inline_numbers=True))

        def run(*original: Any) -> Any:
            # the graph runs for real once (its outputs' structure); on copies of the model's
            # tensors, which a forward may write in place (a counter, running statistics, clipping)
            args = tuple(a.clone() if id(a) in held else a for a in original)
            copies.update((id(a), a) for a, b in zip(args, original) if a is not b)
            returned.append(gm.forward(*args))
            return returned[-1]
        return run

    entry = _fresh_entry(twin)
    try:
        with torch.no_grad():
            out = torch.compile(entry, backend=backend, dynamic=True, fullgraph=True)(*inputs)
    except Exception as exc:  # Dynamo's refusal: no graph to rewrite
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TraceError(f"TorchDynamo cannot capture {name} as one graph: {type(exc).__name__}: {text}") from exc
    finally:  # the entry is never called again: Dynamo's state for it goes now, not at interpreter exit
        tc.forget_compiled(entry.__code__)
    if len(found) != 1 or not returned:
        raise TraceError(f"TorchDynamo captured {len(found)} graphs of {name}, not one")
    return found[0], out, returned[0], copies


def _fresh_entry(module: torch.nn.Module) -> Any:
    """A function calling ``module`` whose code object is new at each capture. TorchDynamo keeps its
    compiled frames per code object: compiling ``module`` itself would add an entry to the cache of
    its class's ``forward`` at each capture (each copy fails the last one's guards), until the
    recompile limit fails a ``fullgraph`` capture (the 9th model of one class in a process) - and
    those entries would count against the user's own ``torch.compile`` of that class. Everything the
    call runs is inlined into this one frame, so the entries stay with this code object."""
    def entry(*args: Any) -> Any:
        return module(*args)
    return types.FunctionType(entry.__code__.replace(), entry.__globals__, "entry", None, entry.__closure__)


def _follow_the_models_dtype(gm: torch.fx.GraphModule, model: torch.nn.Module, inputs: list, names: dict,
                             order: Sequence[str]) -> None:
    """Dynamo writes a dtype the code reads from a tensor (``torch.zeros(n, dtype=x.dtype)``) into
    its graph as a constant, so the graph would keep float32 after ``.double()`` or under autocast.
    The model is captured once more in float64: a dtype constant that differs between the two
    graphs follows the model's dtype, and becomes ``.dtype`` of the nearest floating-point tensor
    computed before it (or of the first floating-point input). Graphs that do not align node for
    node are left as they are (optimize's verification in float64 then declines their rewrites)."""
    import copy

    floating = [t for t in [*model.parameters(), *model.buffers(), *inputs] if t.is_floating_point()]
    if not floating or any(t.dtype != torch.float32 for t in floating) or any(t.is_meta for t in floating):
        return
    try:
        twin = copy.deepcopy(model).double()
        doubled = [t.double() if t.is_floating_point() else t for t in inputs]
        other, _, _, _ = _compiled(twin, doubled, names, order, type(model).__name__)
    except (TraceError, RuntimeError, TypeError):
        return
    mine, theirs = list(gm.graph.nodes), list(other.module.graph.nodes)
    if len(mine) != len(theirs) or any((a.op, a.target) != (b.op, b.target) for a, b in zip(mine, theirs)):
        return
    changed = False
    source = None
    for node, twin_node in zip(mine, theirs):
        if any(a != b and isinstance(a, torch.dtype) and isinstance(b, torch.dtype)
               for a, b in zip(tc.tree_leaves((node.args, node.kwargs)), tc.tree_leaves((twin_node.args, twin_node.kwargs)))):
            ref = source or next((n for n in mine if n.op == "placeholder" and _floating(n)), None)
            if ref is not None:
                with gm.graph.inserting_before(node):
                    dtype = gm.graph.call_function(getattr, (ref, "dtype"))
                node.args, node.kwargs = _swap_dtypes((node.args, node.kwargs), (twin_node.args, twin_node.kwargs), dtype)
                changed = True
        if node.op != "placeholder" and _floating(node):
            source = node
    if changed:
        gm.graph.lint()
        gm.recompile()


def _floating(node: torch.fx.Node) -> bool:
    value = tc.dynamo_example_value(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _swap_dtypes(mine: Any, theirs: Any, replacement: torch.fx.Node) -> Any:
    """``mine`` with each dtype that differs from ``theirs`` at the same place replaced."""
    if isinstance(mine, (list, tuple)):
        return type(mine)(_swap_dtypes(a, b, replacement) for a, b in zip(mine, theirs))
    if isinstance(mine, dict):
        return {k: _swap_dtypes(v, theirs[k], replacement) for k, v in mine.items()}
    if isinstance(mine, torch.dtype) and isinstance(theirs, torch.dtype) and mine != theirs:
        return replacement
    return mine


def _restore_output(gm: torch.fx.GraphModule, out: Any, flat: Sequence[Any], name: str) -> None:
    """Make ``gm`` return ``out``'s structure (the compiled call's result) instead of Dynamo's flat
    tuple ``flat`` of graph outputs."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    nodes = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    leaves, spec = tc.tree_flatten(out)
    mapped = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            k = next((k for k, t in enumerate(flat) if t is leaf), None)
            if k is None:
                raise TraceError(f"the graph TorchDynamo captured of {name} does not compute one of its outputs "
                                 f"({type(leaf).__name__} {tuple(leaf.shape)}); fxmem cannot rebuild what it returns")
            mapped.append(nodes[k])
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            mapped.append(leaf)
        else:
            raise TraceError(f"{name} returns a {type(leaf).__name__}, which a graph cannot return")
    rebuilt = tc.tree_unflatten(mapped, spec)
    if _model_output(rebuilt):  # transformers' ModelOutput: a dict of its set fields, made into its class again
        fields = dict(rebuilt)
        if not _plain(fields):
            raise TraceError(f"{name} returns a {type(rebuilt).__name__} holding what a graph cannot return")
        with gm.graph.inserting_before(output):
            rebuilt = gm.graph.call_function(type(rebuilt), (), fields)  # the class itself, called with the fields
    elif not _plain(rebuilt):
        raise TraceError(f"{name} returns a {type(rebuilt).__name__}; fxmem rebuilds tensors, tuples, lists and "
                         f"dicts of them only")
    output.args = (rebuilt,)
    gm.graph.lint()
    gm.recompile()


def _model_output(value: Any) -> bool:
    """Whether ``value`` is a transformers ``ModelOutput`` (an ordered dict of its set fields; found
    by its class's bases, so transformers is never imported here)."""
    return isinstance(value, dict) and any(c.__name__ == "ModelOutput" and c.__module__.startswith("transformers")
                                           for c in type(value).__mro__)


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(_plain(v) for v in value.values())
    return isinstance(value, torch.fx.Node) or value is None or isinstance(value, (bool, int, float, str))


def _share_tensors(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Put ``model``'s own parameters and buffers where the meta copy's are (same qualified names)."""
    real = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    for qual, _ in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if qual not in real:
            raise TraceError(f"the captured graph reads '{qual}', which is not a parameter or buffer of the model")
        *path, leaf = qual.split(".")
        owner = gm.get_submodule(".".join(path)) if path else gm
        value = real[qual]
        if isinstance(value, torch.nn.Parameter):
            owner.register_parameter(leaf, value)
        else:
            owner.register_buffer(leaf, value)
