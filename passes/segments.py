"""Blocks of a traced graph that can be recomputed in backward: where they are, and how a graph
runs one of them under ``torch.utils.checkpoint``.

A block is the run of nodes a submodule's ``forward`` made (fx records each node's module stack),
contiguous in graph order: a transformer's ``layers.0``, ``layers.1``, ... The blocks offered are
those of the shallowest module depth with two or more of them, so a model wrapped in one module
(``HiddenStates(model)``) offers its layers, not itself.

:func:`extract` moves a block's nodes into a GraphModule of their own (sharing the model's
submodules) and replaces them with one ``call_function`` node that calls a :class:`Recomputed`:
``torch.utils.checkpoint.checkpoint(body, *inputs, use_reentrant=False)``, whole (nothing inside
the block is kept for backward but its inputs) or selective (matrix products' outputs kept,
everything else recomputed; ``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
No submodule is added to the result, so its ``state_dict`` keys stay the model's.

>>> [b.name for b in blocks(gm)]                                 # doctest: +SKIP
['layers.0', 'layers.1', 'layers.2', 'layers.3']
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Sequence

import torch
import torch.fx
import torch.utils.checkpoint as checkpointing

from fxmem.capture import source_line
from fxmem.capture.source import stack_path
from fxmem.simulation.repeats import code_key
from fxmem.passes.base import REPLACES


# Ops whose outputs selective recomputation keeps: the products that cost FLOPs. Everything else
# in a block (pointwise ops, norms, softmax, copies) is recomputed in backward.
KEPT_BY_SELECTIVE = ("mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "linear",
                     "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention")



@dataclasses.dataclass(frozen=True)
class Block:
    """A run of graph nodes made by one submodule: ``name`` (its path), ``nodes`` (in graph order)."""

    name: str
    nodes: tuple
    refusal: str | None = None  # why it cannot be recomputed (None: it can)


def _stack(node: torch.fx.Node) -> list[str]:
    if node.op == "call_module":
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        paths = [stack_path(v) for v in stack]
        return paths if paths and paths[-1] == node.target else paths + [str(node.target)]
    return [stack_path(v) for v in (node.meta.get("nn_module_stack") or {}).values()]


def blocks(gm: torch.fx.GraphModule) -> list[Block]:
    """The recomputable blocks of ``gm``: the shallowest module depth with two or more blocks, where
    a block that holds a stack of alike layers (an ``nn.Sequential``/``nn.ModuleList`` of
    transformer blocks, a decoder's ``layers.0``, ``layers.1``, ..., at any depth) offers those
    layers instead of itself, as does a container of layers (``nn.Sequential``/``nn.ModuleList``)
    whatever its layers compute: recomputing the layers one by one is what a library's own
    checkpointing does (timm's ``set_grad_checkpointing``, Hugging Face's
    ``gradient_checkpointing_enable``), and one block of them all would bring all their
    activations back at once."""
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    stacks = {n: [p for p in _stack(n) if p] for n in compute}
    depth = 0
    while True:
        named = _runs(compute, stacks, depth)
        if not named:
            return []
        found = _whole_runs(named)
        if len(found) >= 2:
            return [piece for name, ns in found for piece in _layers(gm, name, ns, stacks, depth + 1)]
        if len(named) != 1 and not found:
            return []
        depth += 1  # one block (a wrapper module): look inside it


def _runs(nodes: Sequence[torch.fx.Node], stacks: dict, depth: int) -> list[tuple[str, list]]:
    """``nodes`` in runs of one module at ``depth`` of their module stacks (those of no module there
    left out). Nodes of no module there between two nodes of one module belong to its run:
    TorchDynamo records no module for some ops inside a module's code (``x.dtype``, a constant)."""
    runs: list[tuple[Any, list]] = []
    for n in nodes:
        s = stacks[n]
        key = s[depth] if len(s) > depth else None
        if runs and runs[-1][0] == key:
            runs[-1][1].append(n)
        elif key is not None and len(runs) >= 2 and runs[-1][0] is None and runs[-2][0] == key:
            gap = runs.pop()[1]
            runs[-1][1].extend(gap + [n])
        else:
            runs.append((key, [n]))
    return [(k, ns) for k, ns in runs if k is not None]


def _whole_runs(named: Sequence[tuple[str, list]]) -> list[tuple[str, list]]:
    """The runs that are a module's only run with two nodes or more: a module whose nodes are
    interleaved with others' is no block (it is called twice, or in pieces)."""
    counts: dict = {}
    for k, _ in named:
        counts[k] = counts.get(k, 0) + 1
    return [(k, ns) for k, ns in named if counts[k] == 1 and len(ns) >= 2]


def _layers(gm: torch.fx.GraphModule, name: str, nodes: list, stacks: dict, depth: int) -> list[Block]:
    """The block ``name`` made of ``nodes``, or, where it holds a stack of alike layers, the blocks
    inside it (each again split where it holds such a stack: a Swin stage's blocks). A stack of
    layers: two or more runs of submodules that compute alike (the same ops in the same order, the
    same module types) and together make at least half of the block's nodes - a transformer block's
    two LayerNorms are no stack."""
    inner = _whole_runs(_runs(nodes, stacks, depth))
    if len(inner) == 1 and len(inner[0][1]) == len(nodes):  # a wrapper inside the block: look inside it
        return _layers(gm, inner[0][0], nodes, stacks, depth + 1)
    alike: dict = {}
    for k, ns in inner:
        alike.setdefault(_signature(gm, k, ns), []).append(ns)
    stacked = sum(len(ns) for runs in alike.values() if len(runs) >= 2 for ns in runs)
    deeper = [_layers(gm, k, ns, stacks, depth + 1) for k, ns in inner]
    split = sum(len(b.nodes) for d in deeper if len(d) > 1 for b in d)  # in children that hold stacks
    if (len(inner) >= 2 and _container(gm, name)) or 2 * max(stacked, split) >= len(nodes):
        return [b for d in deeper for b in d]
    return [Block(name, tuple(nodes), _refusal(gm, nodes))]


def _container(gm: torch.fx.GraphModule, path: str) -> bool:
    """Whether the module at ``path`` is an ``nn.Sequential``/``nn.ModuleList``/``nn.ModuleDict``: its
    children are the layers (a Swin stage's two blocks, shifted and not, compute unlike each other)."""
    try:
        return isinstance(gm.get_submodule(path), (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict))
    except AttributeError:
        return False


def _signature(gm: torch.fx.GraphModule, path: str, nodes: Sequence[torch.fx.Node]) -> tuple:
    """What a run of nodes computes, up to the module it runs in: per node its op and its target,
    modules and attributes named relative to ``path`` (``layers.3.mlp.fc1`` is ``mlp.fc1``)."""
    prefix = path.replace(".", "_") + "_"
    out = []
    for n in nodes:
        target = n.target
        if n.op == "call_module":
            target = type(gm.get_submodule(str(target))).__name__
        elif not isinstance(target, str):
            target = getattr(target, "__name__", repr(target))
        elif n.op != "call_method":
            target = str(target).removeprefix(path + ".").removeprefix(prefix)
        out.append((n.op, target, len(n.args)))
    return tuple(out)


# ops whose output may share its input's memory: an in-place change of their output changes the input
# (``getattr``: ``x.T``, ``x.mT``); an op missing here is taken for new memory, and a rewrite that then
# changes an input twice fails its verification (outputs and buffers after the call)
_ALIASING = frozenset({"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "getitem", "select",
                       "narrow", "expand", "expand_as", "broadcast_to", "squeeze", "unsqueeze", "flatten", "unflatten",
                       "split", "split_with_sizes", "tensor_split", "chunk", "unbind", "unfold", "detach", "contiguous",
                       "to", "type_as", "as_strided", "movedim", "swapaxes", "swapdims", "diagonal", "real", "imag",
                       "view_as_real", "view_as_complex", "getattr", "alias"})


def _op_name(n: torch.fx.Node) -> str:
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", "")


def _made_inside(x: Any, inside: set) -> bool:
    """Whether the tensor ``x`` (a node) is memory the block itself made: below the views of it, a
    node of the block - not its input, a parameter or buffer, or another block's value."""
    while isinstance(x, torch.fx.Node) and x in inside and x.op in ("call_function", "call_method") \
            and _op_name(x) in _ALIASING and x.args:
        x = x.args[0]
    return isinstance(x, torch.fx.Node) and x in inside


def _refusal(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]) -> str | None:
    """Why a block cannot be recomputed, or None. In-place changes are refused only where they
    change memory from outside the block (its inputs, the model's parameters and buffers): on a
    tensor the block made (timm's drop path: ``x.new_empty(...).bernoulli_(p)``) a recomputation
    makes it again and changes that copy, with the random state the checkpoint restores."""
    inside = set(nodes)
    for n in nodes:
        module = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        if getattr(module, "track_running_stats", False):
            return (f"{n.name} ({source_line(n) or n.target}) updates running statistics, which a recomputation in "
                    f"backward would update a second time")
        name = _op_name(n)
        changed = n.args[0] if n.args else None
        if isinstance(name, str) and name.endswith("_") and not name.endswith("__") \
                and not _made_inside(changed, inside):
            return (f"{n.name} ({source_line(n) or name}) changes in place a tensor from outside the block; "
                    f"recomputing it would do so twice")
        if (n.kwargs.get("inplace") is True or getattr(module, "inplace", False) is True) \
                and not _made_inside(changed, inside):
            return (f"{n.name} ({source_line(n) or name or n.target}) works in place on a tensor from outside the "
                    f"block; recomputing it would do so twice")
    return None


def _keep_products(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective recomputation's policy: keep the products' outputs, recompute the rest."""
    packet = getattr(func, "overloadpacket", func)
    name = getattr(packet, "__name__", str(packet))
    if name in KEPT_BY_SELECTIVE:
        return checkpointing.CheckpointPolicy.MUST_SAVE
    return checkpointing.CheckpointPolicy.PREFER_RECOMPUTE


class _Root:
    """What a block's code reads as ``self``: the model's top-level attributes it uses, as the caller has them."""

    def __init__(self, attributes: dict):
        self.__dict__.update(attributes)


class Recomputed:
    """Call a block under ``torch.utils.checkpoint`` (non-reentrant): its activations are not kept
    for backward but recomputed there; ``selective`` keeps the matrix products' outputs.

    The graph node passes the module the block's code runs on before the block's inputs: the
    block's own module where the block calls only its own submodules (``layers.3``; the code names
    them relative to it, so identical blocks have identical code and equal ``Recomputed``s - a
    chain fxmem's simulation shortens, :mod:`fxmem.simulation.repeats`), else the model's top-level
    attributes the block uses (``layers``, ...). Either way the block runs the submodules of the
    module that runs it (a copy, a fake copy during fxmem's analysis), never those of the model it
    was cut from."""

    __module__ = __name__

    def __init__(self, code: torch.fx.GraphModule, attributes: Sequence[str] | None, selective: bool, name: str):
        # attributes None: the first argument is the block's own module, the code's ``self``
        self.code, self.selective = code, selective
        self.attributes = None if attributes is None else tuple(attributes)
        # the same name for every block (fxmem's recording names the op by it; alike blocks' records
        # are alike); the graph's node is named after its block (see _replace)
        self.__name__ = f"recompute_{'selective' if selective else 'whole'}"
        self.__qualname__ = self.__name__
        self.block = name
        self._key = (selective, self.attributes, code_key(code.graph))

    def __call__(self, *args: Any) -> Any:
        if self.attributes is None:
            root, args = args[0], args[1:]
        else:
            k = len(self.attributes)
            root, args = _Root(dict(zip(self.attributes, args[:k]))), args[k:]
        run = functools.partial(type(self.code).forward, root)
        kw: dict = {}
        if self.selective:
            kw["context_fn"] = functools.partial(checkpointing.create_selective_checkpoint_contexts, _keep_products)
        return checkpointing.checkpoint(run, *args, use_reentrant=False, **kw)

    def __eq__(self, other: object) -> bool:  # the same code on the same kind of root: the same call
        return isinstance(other, Recomputed) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"{self.__name__}({self.block})"


def extract(gm: torch.fx.GraphModule, choices: Sequence[tuple[Block, str]]) -> torch.fx.GraphModule:
    """A copy of ``gm`` in which each ``(block, "whole" | "selective")`` runs as one recomputed call.

    The copy shares ``gm``'s submodules, parameters and buffers (same objects, same names)."""
    graph = _copy_graph(gm.graph)
    by_name = {n.name: n for n in graph.nodes}
    for block, how in choices:
        _replace(gm, graph, [by_name[n.name] for n in block.nodes], how == "selective", block.name)
    graph.lint()
    return same_attributes(torch.fx.GraphModule(gm, graph, gm.__class__.__name__), gm)


def same_attributes(out: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give ``out`` every submodule, parameter and buffer of ``gm`` (the same objects), not only
    those its graph uses: gradients and ``state_dict`` keys are the model's."""
    for name, child in gm.named_children():
        # gm's own child, also where the GraphModule made a partial copy of it (parents of the
        # attributes its graph reads, without those only a recomputed block reads now)
        if getattr(out, name, None) is not child:
            setattr(out, name, child)
    for name, p in gm.named_parameters(recurse=False):
        if not hasattr(out, name):
            out.register_parameter(name, p)
    for name, b in gm.named_buffers(recurse=False):
        if not hasattr(out, name):
            out.register_buffer(name, b)
    out.training = gm.training
    return out


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph(owning_module=graph.owning_module)
    env: dict = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    for old, copied in env.items():
        copied.meta = dict(old.meta)
    return new


def _replace(gm: torch.fx.GraphModule, graph: torch.fx.Graph, nodes: list, selective: bool, name: str) -> None:
    # a parameter or buffer the block reads (a causal mask buffer) stays an attribute of the module:
    # the block gets it as an input (the block's own code has no attributes but its submodules)
    nodes = [n for n in nodes if n.op != "get_attr"]
    inside = set(nodes)
    inputs: list = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    body_graph = torch.fx.Graph()
    env = {a: body_graph.placeholder(f"in_{a.name}") for a in inputs}
    for n in nodes:
        env[n] = body_graph.node_copy(n, lambda a: env[a])
    body_graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    # the block's code only: its submodules are stand-ins, the caller passes the real ones
    targets = sorted({str(n.target) for n in nodes if n.op == "call_module"})
    own = name + "."
    rooted = all(t.startswith(own) for t in targets)  # only its own submodules: they are named relative to it
    if rooted:
        for n in body_graph.nodes:
            if n.op == "call_module":
                n.target = str(n.target)[len(own):]
        targets = [t[len(own):] for t in targets]
    code = torch.fx.GraphModule({t: torch.nn.Module() for t in targets}, body_graph, "block")
    tops = [name] if rooted else sorted({t.split(".")[0] for t in targets})
    with graph.inserting_before(nodes[0]):
        attrs = [graph.get_attr(t) for t in tops]
    for a in attrs:  # the block's own module is read inside the block (a repeated block's, as its others)
        a.meta["nn_module_stack"] = nodes[0].meta.get("nn_module_stack", {}) if rooted else {}
    with graph.inserting_after(nodes[-1]):
        target = Recomputed(code, None if rooted else tops, selective, name)
        call = graph.create_node("call_function", target, tuple(attrs) + tuple(inputs),
                                 name=f"{target.__name__}_{name.replace('.', '_')}")
    call.meta["stack_trace"] = nodes[0].meta.get("stack_trace")
    call.meta["nn_module_stack"] = nodes[0].meta.get("nn_module_stack", {})
    if len(outputs) == 1:
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in inside)
        call.meta[REPLACES] = outputs[0].meta.get(REPLACES, outputs[0].name)
    else:
        anchor = call
        for k, o in enumerate(outputs):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (call, k))
            anchor.meta[REPLACES] = o.meta.get(REPLACES, o.name)  # the value it stands for (.local_verify)
            o.replace_all_uses_with(anchor, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        graph.erase_node(n)
