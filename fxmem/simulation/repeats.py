"""Identical repeated blocks in a traced graph: find the chain, and cut it to four blocks.

A Llama-7B runs the same decoder layer 32 times on the same shapes; simulating every one of them
costs 32 times one. This module finds such a chain in an fx graph - a container whose numbered
children (``layers.0``, ``layers.1``, ...) each own one contiguous run of nodes, the runs
identical up to renaming (same ops, same arguments, each block fed only by the one before it and
by values computed before the first), with parameters, buffers and leaf modules of the same
shapes, dtypes and settings - and makes the same graph with only the first four blocks
(the fourth feeding what the last fed). :mod:`.unroll` turns the four-block recording back into
the whole model's.

>>> chain = find_chain(gm)                                      # doctest: +SKIP
>>> chain.prefix, chain.count, len(chain.segments[0])           # doctest: +SKIP
('layers', 32, 57)
>>> short = shorten(gm, chain)                                  # doctest: +SKIP

Eager mode has no graph to compare: :func:`find_module_chain` finds the container of a model's own
modules whose children are alike (same classes, tensors of the same shapes, the same settings but
for a layer index), and :func:`shorten_module` keeps its first three and its last child (the last
runs as the last, whatever its code does with its index); the simulation of those four says, event
by event, whether the second and third ran the same (:mod:`.unroll`).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable

import torch
import torch.fx

from .. import _torch_compat as tc
from ..capture import module_path, private_copy
from .sameness import hook_functions, same, tensor_key

# blocks simulated: the two middle ones each see a block on either side, as every inner block does,
# so the second checks the first event by event (see .unroll)
KEPT = 4
_MIN_BLOCKS = KEPT + 1  # fewer blocks than this: nothing to gain
# the longest pattern of layer kinds tried (Gemma-2 alternates 2, Gemma-3 repeats 6, Llama-4 4)
_MAX_PERIOD = 8


@dataclasses.dataclass(frozen=True)
class Chain:
    """``count`` blocks ``{prefix}.{indices[j]}``; ``segments[j]`` are block j's fx node names in
    graph order (with the glue code after it that the parent runs between blocks).

    ``period`` > 1: each block is ``period`` consecutive children (``children`` lists them all), as
    in models whose layers alternate kinds - Gemma-2's sliding and full attention layers, a hybrid
    model's pattern - where no two neighbours are alike but every group of ``period`` is. A path
    inside block ``j`` is then named relative to it as ``#k`` (its ``k``-th child) and the rest."""

    prefix: str
    indices: tuple
    segments: tuple  # tuple of tuples of node names
    period: int = 1
    children: tuple = ()  # period > 1: every child index, in order (block j: children[j*period:...])

    @property
    def count(self) -> int:
        return len(self.indices)

    def module(self, j: int) -> str:
        """The dotted path of block ``j`` (0-based position in the chain); with ``period`` > 1 a name
        for messages (``layers.2-3``), not a module."""
        first = f"{self.prefix}." if self.prefix else ""
        if self.period == 1:
            return f"{first}{self.indices[j]}"
        members = self.children[j * self.period:(j + 1) * self.period]
        return f"{first}{members[0]}-{members[-1]}"

    def block_of(self, path: str) -> int | None:
        """The position of the block whose module holds ``path`` (a module or tensor's dotted
        path), or None: read off the path, so that asking for every node or parameter of a deep
        chain stays linear in its depth (asking each block in turn was quadratic)."""
        at = self.relative(path)
        return None if at is None else at[0]

    def relative(self, path: str) -> tuple[int, str] | None:
        """``(j, rest)``: ``path`` is in block ``j``, and :meth:`path` ``(j, rest)`` gives it back;
        None outside the chain. Period 1: ``rest`` is what follows the block's path (``.attn.q``)."""
        if self.prefix:
            if not path.startswith(self.prefix + "."):
                return None
            path = path[len(self.prefix) + 1:]
        head, dot, tail = path.partition(".")
        if not head.isdigit():
            return None
        at = self._positions.get(int(head))
        if at is None:
            return None
        if self.period == 1:
            return at, dot + tail
        return at // self.period, f"#{at % self.period}{dot}{tail}"

    def path(self, j: int, rest: str) -> str:
        """The path ``rest`` (from :meth:`relative`) names in block ``j``."""
        if self.period == 1:
            return self.module(j) + rest
        k, _, tail = rest[1:].partition(".")
        first = f"{self.prefix}." if self.prefix else ""
        return f"{first}{self.children[j * self.period + int(k)]}" + (f".{tail}" if tail else "")

    @functools.cached_property
    def _positions(self) -> dict[int, int]:
        """Child index -> its position among the chain's children (blocks' children, period > 1)."""
        return {index: j for j, index in enumerate(self.children if self.period > 1 else self.indices)}


def find_chain(gm: torch.fx.GraphModule) -> Chain | None:
    """The chain of identical blocks that saves the most simulation, or None."""
    nodes = list(gm.graph.nodes)
    best: tuple[int, Chain] | None = None
    for prefix, starts in _candidates(nodes).items():
        for chain in _container_chains(gm, nodes, prefix, starts):
            saved = (chain.count - KEPT) * len(chain.segments[0])
            if best is None or saved > best[0]:
                best = (saved, chain)
    return best[1] if best else None


def _container_chains(gm: torch.fx.GraphModule, nodes: list, prefix: str, starts: dict[int, int]) -> list[Chain]:
    """The chain one container gives: its children all alike, else its longest run of alike
    children; else groups of ``period`` children alike (layers that alternate kinds), the
    smallest period first, the children after the last whole group outside the chain."""
    for run in [starts, *_runs(nodes, starts)]:
        chain = _chain(gm, nodes, prefix, run)
        if chain is not None:
            return [chain]
    indices = sorted(starts, key=starts.get)
    for period in range(2, _MAX_PERIOD + 1):
        groups = len(indices) // period
        if groups < _MIN_BLOCKS:
            break
        children = indices[:groups * period]
        chain = _chain(gm, nodes, prefix, {i: starts[i] for i in children[::period]}, period, tuple(children))
        if chain is not None:
            return [chain]
    return []


def _runs(nodes: list, starts: dict[int, int]) -> list[dict[int, int]]:
    """Runs of consecutive children whose nodes look alike (the same ops on the same kinds of
    targets), longest first: where a container's children are not all alike - a recomputation
    plan that treats one layer of 32 otherwise - the others are still a chain."""
    indices = sorted(starts, key=starts.get)
    if len(indices) < _MIN_BLOCKS or indices != sorted(indices):
        return []

    def look(j: int) -> tuple:
        return tuple((n.op, n.target if n.op not in ("call_module", "get_attr") else None)
                     for n in nodes[starts[indices[j]]:starts[indices[j + 1]]])

    looks = [look(j) for j in range(len(indices) - 1)]
    runs, first = [], 0
    for j in range(1, len(looks) + 1):
        if j == len(looks) or looks[j] != looks[first]:
            # blocks first..j-1 alike, and block j perhaps (its nodes are cut off by the next
            # block's, or not at all): _chain checks each on its own nodes
            for end in (j + 1, j):
                if _MIN_BLOCKS <= end - first < len(indices):
                    runs.append({i: starts[i] for i in indices[first:end]})
            first = j
    return sorted(runs, key=len, reverse=True)


def shorten(gm: torch.fx.GraphModule, chain: Chain) -> torch.fx.GraphModule:
    """``gm`` with blocks ``KEPT..count-1`` left out; what used the last block's values uses the
    fourth's. Node names (and their module stacks and source lines) are those of ``gm``."""
    seg = {name: (j, k) for j, names in enumerate(chain.segments) for k, name in enumerate(names)}
    last = chain.count - 1
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        j, k = seg.get(n.name, (None, None))
        if j is not None and KEPT <= j:
            if j == last:  # the last block's values are the fourth block's
                env[n] = env[by_name[chain.segments[KEPT - 1][k]]]
            continue
        copy = graph.node_copy(n, lambda a: env[a])
        copy.name = n.name
        env[n] = copy
    out = torch.fx.GraphModule(gm, graph, type(gm).__name__)
    _order_like(out, gm)
    return out


def _order_like(out: torch.nn.Module, gm: torch.nn.Module) -> None:
    """The containers fx makes for ``out`` list modules in the order the graph uses them; ``gm``'s may
    list them in the model's (a rewritten model shares the model's ModuleList): an optimizer then
    steps the parameters in another order. Put each container's in ``gm``'s order."""
    tc.order_like(out, gm)
    for name, child in out.named_children():
        twin = getattr(gm, name, None)
        if isinstance(twin, torch.nn.Module) and child is not twin:
            _order_like(child, twin)


# --- eager mode: a chain of the model's own modules ----------------------------------------------
def find_module_chain(model: torch.nn.Module) -> Chain | None:
    """The container (``nn.ModuleList`` or ``nn.Sequential``) of five or more alike children that
    holds the most parameters, as a chain without segments (eager mode names its lines as they
    run), or None."""
    best: tuple[int, Chain] | None = None
    for prefix, container in model.named_modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(container.named_children())
        if len(children) < _MIN_BLOCKS or not all(name.isdigit() for name, _ in children):
            continue
        if _shares_tensors(model, prefix):
            continue
        chain = _module_groups([m for _, m in children], prefix, [int(name) for name, _ in children])
        if chain is None:
            continue
        size = sum(p.numel() for p in container.parameters()) + len(children)
        if best is None or size > best[0]:
            best = (size, chain)
    return best[1] if best else None


def _module_groups(blocks: list, prefix: str, indices: list) -> Chain | None:
    """The children ``blocks`` (at ``indices``) as a chain: all alike, else groups of ``period``
    consecutive children alike position by position (layers that alternate kinds: Gemma-2's
    sliding and full attention), the smallest period first, the children after the last whole
    group outside the chain (they run after it, simulated as they are)."""
    if _alike(blocks, indices):
        return Chain(prefix, tuple(indices), ())
    for period in range(2, _MAX_PERIOD + 1):
        groups = len(blocks) // period
        if groups < _MIN_BLOCKS:
            break
        if all(_alike(blocks[k:groups * period:period], indices[k:groups * period:period]) for k in range(period)):
            return Chain(prefix, tuple(indices[:groups * period:period]), (), period,
                         tuple(indices[:groups * period]))
    return None


def simulated_positions(chain: Chain) -> tuple[int, ...]:
    """The chain positions :func:`shorten_module` keeps: the first three and the last."""
    return tuple(range(KEPT - 1)) + (chain.count - 1,)


def shorten_module(model: torch.nn.Module, chain: Chain) -> torch.nn.Module:
    """A private copy of ``model`` (tensors shared) whose container holds only the blocks at
    :func:`simulated_positions`, under their own names (the last keeps its index)."""
    short = private_copy(model)
    container = short.get_submodule(chain.prefix) if chain.prefix else short
    kept = simulated_positions(chain)
    held = container.__dict__["_modules"]
    for name in list(held):
        at = chain.block_of(f"{chain.prefix}.{name}" if chain.prefix else name)
        if at is not None and at not in kept:  # children after the chain's last group stay
            del held[name]
    return short


def _alike(blocks: list, indices: list) -> bool:
    """Blocks of the same classes, all the way down, holding tensors of the same shapes, strides,
    dtypes and trainability, with hooks calling the same functions and the same other attributes
    (objects that carry behaviour - a kernel bound per layer, a closure - compared by what they run:
    :mod:`.sameness`) - but for integers equal to each block's own index (a ``layer_idx``)."""
    walks = [list(b.named_modules(remove_duplicate=False)) for b in blocks]
    if any(len(w) != len(walks[0]) for w in walks):
        return False
    for row in zip(*walks):
        names, modules = [n for n, _ in row], [m for _, m in row]
        if any(n != names[0] or type(m) is not type(modules[0]) for n, m in zip(names, modules)):
            return False
        states = [_state(m) for m in modules]
        if any(set(st) != set(states[0]) for st in states):
            return False
        for key in states[0]:
            values = [st[key] for st in states]
            if all(same(v, values[0]) for v in values):
                continue
            if all(type(v) is int and v == i for v, i in zip(values, indices)):  # a layer index
                continue
            first = _unindexed(values[0], indices[0])
            if not all(same(_unindexed(v, i), first) for v, i in zip(values, indices)):
                return False
    return True


def _unindexed(value: Any, index: int) -> Any:
    """``value`` with the block's own index taken out of the dotted paths it holds: peft keeps each
    adapter's ``target_name`` (``model.layers.7.self_attn.q_proj``) in a dict, names that say
    where a layer sits, not what it runs."""
    if isinstance(value, str):
        return re.sub(rf"(?:(?<=\.)|^){index}(?=\.|$)", "#", value)
    if isinstance(value, dict):
        return {k: _unindexed(v, index) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unindexed(v, index) for v in value) if type(value) in (list, tuple) else value
    return value


def _state(module: torch.nn.Module) -> dict:
    """A module's own attributes, its hooks as the functions they call; its submodules are walked
    on their own (:func:`_alike`)."""
    own = {k: v for k, v in module.__dict__.items() if k != "_modules" and not (k.endswith("hooks") or "hooks_" in k)}
    return {**own, **hook_functions(module)}


def _shares_tensors(model: torch.nn.Module, prefix: str) -> bool:
    """Does a block hold a tensor another block or the rest of the model also holds (tied weights)?"""
    owner: dict[int, str] = {}
    inside = prefix + "." if prefix else ""
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        holder = name[len(inside):].split(".", 1)[0] if name.startswith(inside) else ""
        if not holder.isdigit():
            holder = ""
        if owner.setdefault(id(t), holder) != holder:
            return True
    return False


# --- finding the chain ---------------------------------------------------------------------------
def _candidates(nodes: list) -> dict[str, dict[int, int]]:
    """Container path -> {child index: position of the first node inside that child}."""
    found: dict[str, dict[int, int]] = {}
    for pos, n in enumerate(nodes):
        parts = module_path(n).split(".")
        for i in range(len(parts)):  # i == 0: the model itself is the container (an nn.Sequential)
            if parts[i].isdigit():
                found.setdefault(".".join(parts[:i]), {}).setdefault(int(parts[i]), pos)
    return found


def _chain(gm: torch.fx.GraphModule, nodes: list, prefix: str, starts: dict[int, int], period: int = 1,
           children: tuple = ()) -> Chain | None:
    """``starts`` (each block's first child -> its first node) as a chain, or None where they are not
    one (see :func:`_same_code`, :func:`_same_modules`)."""
    indices = sorted(starts, key=starts.get)
    if len(indices) < _MIN_BLOCKS or indices != sorted(indices):
        return None
    first = [starts[i] for i in indices]
    length = first[1] - first[0]
    if length <= 0 or any(b - a != length for a, b in zip(first, first[1:])) or first[-1] + length > len(nodes):
        return None
    segments = [nodes[p:p + length] for p in first]
    chain = Chain(prefix, tuple(indices), tuple(tuple(n.name for n in seg) for seg in segments), period, children)
    for j, seg in enumerate(segments):  # each block's own nodes come first in its segment
        at = chain.relative(module_path(seg[0]))  # (in the group's first child)
        if at is None or at[0] != j or period > 1 and not at[1].partition(".")[0] == "#0":
            return None
        for n in seg:
            if chain.block_of(module_path(n)) not in (j, None):
                return None
    if not _same_code(gm, chain, segments, first[0]) or not _same_modules(gm, chain, segments):
        return None
    return chain


def _same_code(gm: torch.fx.GraphModule, chain: Chain, segments: list, start: int) -> bool:
    """Every block runs the same nodes on the same kinds of arguments: its own values, the block
    before's (the first block: values computed before the chain, consistently), or values computed
    before the chain; its values are used only by itself, the next block, or (the last) after it."""
    where: dict[torch.fx.Node, tuple[int, int]] = {n: (j, k) for j, seg in enumerate(segments) for k, n in enumerate(seg)}
    order = {n: p for p, n in enumerate(segments[0][0].graph.nodes)}
    last = len(segments) - 1

    def norm(a: Any, j: int) -> Any:
        if isinstance(a, torch.fx.Node):
            at = where.get(a)
            if at is None and order[a] < start:
                return ("outer", a)
            if at is not None and at[0] == j:
                return ("own", at[1])
            if at is not None and at[0] == j - 1:
                return ("prev", at[1])
            raise _NotChain  # a block reading a block further back, or a value made after the chain
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(norm(x, j) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, norm(v, j)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", norm(a.start, j), norm(a.stop, j), norm(a.step, j))
        return ("const", type(a).__name__, repr(a))

    def target(n: torch.fx.Node, j: int) -> Any:
        if n.op in ("call_module", "get_attr"):
            t = str(n.target)
            at = chain.relative(t)
            if at is not None and at[0] == j:
                return ("own", at[1])
            held = _held_graphs(gm, t, chain, j) if n.op == "get_attr" else None
            return ("held", held) if held is not None else ("outer", t)
        return n.target

    for j, seg in enumerate(segments):
        for n in seg:
            for user in n.users:
                at = where.get(user)
                if at is None and j != last or at is not None and at[0] not in (j, j + 1):
                    return False
    try:
        sigs = [[(n.op, target(n, j), norm(n.args, j), norm(n.kwargs, j)) for n in seg]
                for j, seg in enumerate(segments)]
    except _NotChain:
        return False
    if any(sig != sigs[1] for sig in sigs[2:]):
        return False
    # the first block reads values from before the chain where the others read the block before's:
    # one value for each, and a different one for each
    inputs: dict = {}

    def first_matches(a: Any, b: Any) -> bool:
        if a == b:
            return True
        if isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == ("outer",) and b[:1] == ("prev",):
            return inputs.setdefault(b[1], a[1]) is a[1]
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
            return all(first_matches(x, y) for x, y in zip(a, b))
        return False

    if not all(first_matches(a, b) for a, b in zip(sigs[0], sigs[1])):
        return False
    return len({id(v) for v in inputs.values()}) == len(inputs)


class _NotChain(Exception):
    pass


def _child_index(chain: Chain, path: str) -> int | None:
    """The index of the chain's child (a layer) that holds ``path``, or None."""
    rest = path[len(chain.prefix) + 1:] if chain.prefix else path
    head = rest.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def code_key(graph: torch.fx.Graph, where: Callable[[torch.fx.Node], Any] = lambda n: n.target) -> tuple:
    """What ``graph`` computes, up to node names, as a hashable tuple: per node its op, its target as
    ``where`` names it (placeholders: none), its arguments with nodes by position. Two graphs with
    equal keys run the same code."""
    pos = {n: k for k, n in enumerate(graph.nodes)}

    def norm(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", pos[a])
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, norm(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", norm(a.start), norm(a.stop), norm(a.step))
        return ("const", type(a).__name__, repr(a))

    return tuple((n.op, where(n) if n.op != "placeholder" else None, norm(n.args), norm(n.kwargs))
                 for n in graph.nodes)


def _held_graphs(gm: torch.fx.GraphModule, name: str, chain: Chain, j: int) -> tuple | None:
    """What a rewrite's graphs held by ``gm`` compute (a tuple of GraphModules under a name of
    their own per site: the original attention a fallback runs, a mask built on demand), up to
    node names, with block ``j``'s own modules named relative to it; None when ``name`` holds
    something else. Two blocks whose held graphs compute the same are the same code."""
    held = getattr(gm, name, None)
    if not isinstance(held, tuple) or not held or not all(isinstance(h, torch.fx.GraphModule) for h in held):
        return None

    def where(n: torch.fx.Node) -> Any:
        if n.op in ("call_module", "get_attr"):
            t = str(n.target)
            at = chain.relative(t)
            return ("own", at[1]) if at is not None and at[0] == j else ("outer", t)
        return n.target

    return tuple(code_key(sub.graph, where) + tuple(n.name for n in sub.graph.nodes if n.op == "placeholder")
                 for sub in held)


def _same_modules(gm: torch.fx.GraphModule, chain: Chain, segments: list) -> bool:
    """Blocks hold parameters, buffers and tensor attributes of the same shapes, strides, dtypes
    and trainability, none shared with another block or the rest of the model, and call leaf
    modules alike as :func:`_alike` says (classes, settings, hooks)."""
    def tensors(j: int) -> list:  # block j's tensors, named relative to it
        out = []
        for rest in members(j):
            module = gm.get_submodule(chain.path(j, rest))
            named = [*module.named_parameters(), *module.named_buffers(), *tc.tensor_attributes(module)]
            out += [(rest, name, tensor_key(t)) for name, t in named]
        return out

    def members(j: int) -> list[str]:  # the block's children, as chain.relative names them
        return [""] if chain.period == 1 else [f"#{k}" for k in range(chain.period)]

    def leaves(j: int) -> list:
        return [(gm.get_submodule(str(n.target)), _child_index(chain, str(n.target)))
                for n in segments[j] if n.op == "call_module"]

    try:
        reference = tensors(1)
        if any(tensors(j) != reference for j in range(chain.count)):
            return False
    except AttributeError:
        return False
    calls = [leaves(j) for j in range(chain.count)]  # the same number: _same_code compared the nodes
    # a leaf may hold its layer's own index (a layer_idx): the index of the child holding it
    if not all(_alike([m for m, _ in row], [i for _, i in row]) for row in zip(*calls)):
        return False
    owner: dict[int, str] = {}  # tensor id -> the block (or "") holding it
    for name, t in gm.named_parameters(remove_duplicate=False):
        block = chain.block_of(name)
        holder = chain.module(block) if block is not None else ""
        if owner.setdefault(id(t), holder) != holder:
            return False
    return True
