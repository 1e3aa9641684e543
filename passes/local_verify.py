"""Verification region by region: each part of a graph a rewrite changed, run on its own against
the part it replaced, and alike parts once.

Comparing a rewritten model with the original on real runs (:mod:`.verify`) costs a forward and a
backward of the whole model per size and mode, which grows with depth, while a rewrite usually
changes a few nodes per layer, the same few in every layer. :func:`verify_regions` compares only
what changed:

    the graph before (the graph as captured) and after (the rewritten one) -> the nodes both have
    (same name, op, target and arguments) and, around them, the changed regions: connected sets
    of nodes on each side, read from the same nodes, feeding the same nodes -> each region as a
    module of its own, before and after -> regions that compute alike (same code up to node names,
    modules of the same kind and shapes, buffers equal, inputs of the same shapes) grouped, and the
    first of each group run -> its inputs, as the graph before computes them at each verification
    size (a run stopped once they exist) -> :func:`.verify.compare` of the two modules on them:
    outputs and gradients in float64, train and eval mode, with and without grad.

It is half of what :func:`fxmem.optimize` checks: the other half is the whole model against the
rewrite at the smallest size (every mode), which sees what a region alone cannot - a random draw
moved to another place in the stream, an alias between two inputs. Where the regions cannot be
told apart (the same nodes in another order, a module that is no single graph), this returns None
and the caller compares the whole model at every size, as it does when a region differs (so that a
region checked on inputs the model never gives it is not what declines a rewrite).

>>> diff = verify_regions(captured, rewritten, verify_inputs, compare_regions)   # doctest: +SKIP
>>> diff.ok, diff.where                                                           # doctest: +SKIP
(True, 'output 0 (train mode) of the region at sdpa_3 (model.py:41), 1 of 24 alike')
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx

from fxmem.capture import source_line
from fxmem.simulation.repeats import code_key
from fxmem.simulation.sameness import same
from fxmem.passes.base import REPLACES
from fxmem.passes.modes import ModeGraphModule
from fxmem.passes.verify import Difference


@dataclasses.dataclass
class Region:
    """One changed region: ``before``/``after`` run its nodes on ``inputs`` (names of nodes both
    graphs have) and return its outputs in the same order."""

    before: torch.fx.GraphModule
    after: torch.fx.GraphModule
    inputs: list[str]
    code: tuple  # what the two compute, up to node names and attribute paths
    attributes: list  # the objects their attributes name, in the order ``code`` numbers them
    where: str  # a node of the region and its source line, for the records

    def alike(self, other: "Region", shapes: dict) -> bool:
        """Whether ``other`` computes what this region computes (checked once for both)."""
        if self.code != other.code or len(self.attributes) != len(other.attributes):
            return False
        if [shapes.get(n) for n in self.inputs] != [shapes.get(n) for n in other.inputs]:
            return False
        return all(_alike(a, b) for a, b in zip(self.attributes, other.attributes))


def regions(before: torch.fx.GraphModule, after: torch.fx.GraphModule) -> list[Region] | None:
    """The regions ``after`` changed in ``before``, in ``before``'s order; None where they cannot be
    told apart (nodes both have in another order, a boundary that does not match)."""
    a_nodes = {n.name: n for n in before.graph.nodes}
    same = {n.name for n in after.graph.nodes
            if n.name in a_nodes and _same_call(a_nodes[n.name], n) and _same_object(before, after, n)}
    while True:  # a node both have is the same only if it reads the same (or the region's counterpart)
        pairs: dict[str, str] = {}
        moved = False
        for b in after.graph.nodes:
            if b.name not in same:
                continue
            got = _boundary(a_nodes[b.name], b, same)
            if got is None:
                same.discard(b.name)
                moved = True
                continue
            for x, y in got:
                if pairs.setdefault(x, y) != y:  # one replaced value read as two new ones
                    return None
        if not moved:
            break
    if "output" not in same:
        return None
    order_a = [n.name for n in before.graph.nodes if n.name in same]
    if order_a != [n.name for n in after.graph.nodes if n.name in same]:
        return None  # the same nodes in another order (reorder): the whole model says whether that is the same
    changed_a = [n for n in before.graph.nodes if n.name not in same]
    changed_b = [n for n in after.graph.nodes if n.name not in same]
    if not changed_a and not changed_b:
        return []
    # connected parts: nodes linked by an edge on either side, and each replaced value to its replacement
    parent: dict = {}

    def find(x: Any) -> Any:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in changed_b:  # what a rewrite's node stands for (base.REPLACES): regions end there too
        x = n.meta.get(REPLACES)
        if isinstance(x, str) and x in a_nodes and x not in same and pairs.setdefault(x, n.name) != n.name:
            return None
    replaced = {y: x for x, y in pairs.items()}
    if len(replaced) != len(pairs):  # one new value standing for two replaced ones
        return None
    # a replaced value and its replacement are what both sides have at that point: the regions that
    # read them start there (checked on it as the graph before computes it), so that a chain of
    # rewritten layers is as many regions, not one
    shared = {"a": set(pairs), "b": set(replaced)}
    for side, nodes in (("a", changed_a), ("b", changed_b)):
        for n in nodes:
            find((side, n.name))
            for i in n.all_input_nodes:
                if i.name not in same and i.name not in shared[side]:
                    parent[find((side, n.name))] = find((side, i.name))
    for x, y in pairs.items():
        parent[find(("a", x))] = find(("b", y))
    parts: dict = {}
    for side, nodes in (("a", changed_a), ("b", changed_b)):
        for n in nodes:
            parts.setdefault(find((side, n.name)), ([], []))[0 if side == "a" else 1].append(n)
    out = []
    for nodes_a, nodes_b in parts.values():
        outputs = [(x, y) for x, y in pairs.items() if any(n.name == x for n in nodes_a)]
        if not outputs or any(n.op in ("placeholder", "output") for n in nodes_a + nodes_b):
            return None  # a region that feeds nothing the two share, or that changes the inputs or outputs
        out.append(_region(before, after, nodes_a, nodes_b, outputs, same, pairs))
    position = {n.name: k for k, n in enumerate(before.graph.nodes)}
    out.sort(key=lambda r: position[r.inputs[-1]] if r.inputs else -1)
    return out


def _same_call(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    if a.op != b.op:
        return False
    if a.op in ("call_module", "get_attr", "call_method", "placeholder", "output"):
        return str(a.target) == str(b.target)
    return a.target is b.target or a.target == b.target


def _same_object(before: torch.fx.GraphModule, after: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    """An attribute node reads the very object in both graphs (not another under the same name)."""
    if n.op not in ("call_module", "get_attr"):
        return True
    try:
        get = operator.attrgetter(str(n.target))
        return get(before) is get(after)
    except AttributeError:
        return False


def _boundary(a: torch.fx.Node, b: torch.fx.Node, same: set) -> list[tuple[str, str]] | None:
    """The (replaced, replacement) names where ``b`` reads a changed node where ``a`` reads one, or
    None where ``a`` and ``b`` read differently (so they are not the same node)."""
    found: list = []

    def walk(x: Any, y: Any) -> bool:
        if isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node):
            if not (isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node)):
                return False
            if x.name in same or y.name in same:
                return x.name == y.name and x.name in same
            found.append((x.name, y.name))
            return True
        if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
            return type(x) is type(y) and len(x) == len(y) and all(walk(p, q) for p, q in zip(x, y))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(walk(x[k], y[k]) for k in x)
        if isinstance(x, slice) and isinstance(y, slice):
            return walk((x.start, x.stop, x.step), (y.start, y.stop, y.step))
        return type(x) is type(y) and repr(x) == repr(y)

    return found if walk((a.args, a.kwargs), (b.args, b.kwargs)) else None


def _region(before: torch.fx.GraphModule, after: torch.fx.GraphModule, nodes_a: list, nodes_b: list,
            outputs: list[tuple[str, str]], same: set, pairs: dict) -> Region:
    """The two sides of one region as modules with the same inputs, outputs and parameters; an
    input is a node both graphs have, or a replaced value (read as its replacement after)."""
    inside = {("a", n.name) for n in nodes_a} | {("b", n.name) for n in nodes_b}
    replaced = {y: x for x, y in pairs.items()}
    reads: list[str] = []  # by their names in the graph before
    for side, nodes in (("a", nodes_a), ("b", nodes_b)):
        for n in nodes:
            for i in n.all_input_nodes:
                if (side, i.name) in inside or (i.op == "get_attr" and i.name in same):
                    continue
                name = i.name if i.name in same or side == "a" else replaced[i.name]
                if name not in reads:
                    reads.append(name)
    position = {n.name: k for k, n in enumerate(before.graph.nodes)}
    reads.sort(key=position.__getitem__)
    graphs = []
    targets: list[str] = []
    for side, source, nodes, names in (("a", before, nodes_a, [x for x, _ in outputs]),
                                       ("b", after, nodes_b, [y for _, y in outputs])):
        graph = torch.fx.Graph()
        env: dict = {}
        by_name = {n.name: n for n in source.graph.nodes}
        for r in reads:
            env[by_name[r if side == "a" or r in same else pairs[r]]] = graph.placeholder(f"in_{r}")
        for n in nodes:
            for i in n.all_input_nodes:
                if i not in env and i.op == "get_attr":  # a parameter or buffer: read as the model holds it
                    env[i] = graph.get_attr(str(i.target))
            env[n] = graph.node_copy(n, lambda x: env[x])
        graph.output(tuple(env[by_name[k]] for k in names))
        graphs.append((source, graph))
        targets += [str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")]
    targets = list(dict.fromkeys(targets))
    number = {t: k for k, t in enumerate(targets)}
    # each side holds its own graph module's objects (a path the other lacks: the other's, so that
    # both have the same parameters to compare gradients of)
    objects = [[_either(first, second, t) for t in targets] for first, second in ((before, after), (after, before))]
    modules = [_module(graph, targets, held) for (_, graph), held in zip(graphs, objects)]

    def where(n: torch.fx.Node) -> Any:
        return ("attribute", number[str(n.target)]) if n.op in ("call_module", "get_attr") else n.target

    code = code_key(graphs[0][1], where) + (("after",),) + code_key(graphs[1][1], where)
    first = (nodes_b or nodes_a)[0]
    line = source_line(first)
    return Region(modules[0], modules[1], reads, code, objects[0] + objects[1],
                  f"{first.name} ({line})" if line else first.name)


def _either(first: torch.nn.Module, second: torch.nn.Module, target: str) -> Any:
    """The attribute ``target`` (a dotted path) of ``first``, else of ``second``."""
    get = operator.attrgetter(target)
    try:
        return get(first)
    except AttributeError:
        return get(second)


def _module(graph: torch.fx.Graph, targets: list[str], objects: list) -> torch.fx.GraphModule:
    """A module running ``graph`` that holds every attribute of ``targets`` (both sides of the
    region hold the same ones: the same parameters, so the same gradients to compare)."""
    root = torch.nn.Module()
    made = {id(root)}  # the stand-in modules made here: only these are filled in, never the model's
    for target, obj in sorted(zip(targets, objects), key=lambda x: x[0].count(".")):
        owner = root
        *path, leaf = target.split(".")
        for part in path:
            nxt = dict(owner.named_children()).get(part)
            if nxt is None:
                nxt = torch.nn.Module()
                made.add(id(nxt))
                owner.add_module(part, nxt)
            owner = nxt
            if id(owner) not in made:  # a module of the model holds this attribute already
                break
        else:
            if isinstance(obj, torch.nn.Module):
                owner.add_module(leaf, obj)
            elif isinstance(obj, torch.nn.Parameter):
                owner.register_parameter(leaf, obj)
            elif isinstance(obj, torch.Tensor):
                owner.register_buffer(leaf, obj)
            else:
                setattr(owner, leaf, obj)
    out = torch.fx.GraphModule(root, graph, "region")
    # GraphModule copies only what its own graph reads: the rest of the attributes as well
    for name, child in root.named_children():
        setattr(out, name, child)
    for name, p in root.named_parameters(recurse=False):
        out.register_parameter(name, p)
    for name, b in root.named_buffers(recurse=False):
        out.register_buffer(name, b)
    for target, obj in zip(targets, objects):
        if "." not in target and not isinstance(obj, (torch.nn.Module, torch.Tensor)):
            setattr(out, target, obj)
    return out


def _alike(a: Any, b: Any) -> bool:
    """Interchangeable for what a region computes: parameters by shape (the code is what is
    verified, not the weights), buffers by value (a mask's values decide what a rewrite may do)."""
    if a is b:
        return True
    if isinstance(a, torch.nn.Parameter) or isinstance(b, torch.nn.Parameter):
        return same(a, b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, torch.fx.GraphModule) and isinstance(b, torch.fx.GraphModule):
        return _same_graph(a, b)  # a rewrite's own graph (the original attention a fallback runs)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(_alike(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
        if not same(a, b):
            return False
        bufs_a, bufs_b = list(a.named_buffers()), list(b.named_buffers())
        return len(bufs_a) == len(bufs_b) and all(
            na == nb and x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
            for (na, x), (nb, y) in zip(bufs_a, bufs_b))
    return same(a, b)


def _same_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    """The same code on alike attributes (each graph's own, numbered in the order the code reads them)."""
    keys, objects = [], []
    for gm in (a, b):
        targets = list(dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")))
        number = {t: k for k, t in enumerate(targets)}
        keys.append(code_key(gm.graph, lambda n: ("attribute", number[str(n.target)])
                             if n.op in ("call_module", "get_attr") else n.target))
        objects.append([operator.attrgetter(t)(gm) for t in targets])
    return keys[0] == keys[1] and len(objects[0]) == len(objects[1]) and all(
        _alike(x, y) for x, y in zip(*objects))


class _Gather(torch.fx.Interpreter):
    """Run a graph until the values of ``wanted`` (node names) exist; keep those."""

    class Done(Exception):
        pass

    def __init__(self, module: torch.fx.GraphModule, wanted: set):
        super().__init__(module)
        self.wanted, self.values = set(wanted), {}

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        if n.name in self.wanted:
            self.values[n.name] = value
            if len(self.values) == len(self.wanted):
                raise _Gather.Done
        return value


def _gather(twin: torch.fx.GraphModule, inputs: Sequence[Any], wanted: set) -> dict:
    """The values of ``wanted`` as ``twin`` (a copy of the graph before, in eval mode) computes them
    on ``inputs``, without grad; the caller's random state is left as it is."""
    if not wanted:
        return {}
    run = _Gather(twin, wanted)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            run.run(*inputs)
        except _Gather.Done:
            pass
    return run.values


def verify_regions(before: torch.fx.GraphModule, after: torch.fx.GraphModule, inputs: Sequence[Sequence[Any]],
                   compare: Callable[[torch.nn.Module, torch.nn.Module, list], Difference]) -> Difference | None:
    """Compare each changed region of ``after`` with what it replaced in ``before`` on the inputs
    ``before`` gives it at each of ``inputs`` (the model's inputs at the verification sizes), alike
    regions once; ``compare(reference, candidate, inputs)`` as :func:`.verify.compare`. Returns the
    first failing difference (its ``where`` names the region), else the largest; None where the
    regions cannot be told apart (see :func:`regions`: compare the whole model instead)."""
    if not all(isinstance(m, torch.fx.GraphModule) and not isinstance(m, ModeGraphModule) for m in (before, after)):
        return None  # two graphs switched by the flag (modes.per_mode): each mode's changes are not in .graph
    try:
        found = regions(before, after)
    except Exception:  # noqa: BLE001 - a graph this cannot cut (the whole model is compared instead)
        return None
    if found is None:
        return None
    if not found:
        return Difference(True, 0.0, "", torch.float64)
    twin = copy.deepcopy(before).eval()  # a copy: the model's flags and buffers stay as they are
    try:
        first = _gather(twin, inputs[0], {n for r in found for n in r.inputs})
        shapes = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (type(v).__name__, repr(v))
                  for k, v in first.items()}
        kinds: list[tuple[Region, int]] = []
        for r in found:
            for k, (rep, count) in enumerate(kinds):
                if rep.alike(r, shapes):
                    kinds[k] = (rep, count + 1)
                    break
            else:
                kinds.append((r, 1))
        wanted = {n for rep, _ in kinds for n in rep.inputs}
        at = [first] + [_gather(twin, xs, wanted) for xs in inputs[1:]]
        runs_of = [[tuple(values[n] for n in rep.inputs) for values in at] for rep, _ in kinds]
    except Exception:  # noqa: BLE001 - inputs this cannot gather (the whole model is compared instead)
        return None
    worst: Difference | None = None
    for (rep, count), runs in zip(kinds, runs_of):
        try:
            diff = compare(rep.before, rep.after, runs)
        except Exception:  # noqa: BLE001 - the region as it was cannot run alone: the whole model decides
            return None
        alike = f", 1 of {count} alike" if count > 1 else ""
        diff = dataclasses.replace(diff, where=f"{diff.where or 'outputs'} of the region at {rep.where}{alike}")
        if not diff.ok:
            return diff
        if worst is None or diff.max_abs >= worst.max_abs:
            worst = diff
    return worst
