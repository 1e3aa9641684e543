"""Reorder for a lower peak: another valid topological order of the graph, kept only where fxmem's
exact analysis finds it lowers the peak.

A traced graph runs its nodes in the order the Python code called them, and frees each value
after its last use; two branches that each build a large temporary and reduce it are both alive
at once if the code builds both temporaries first. Another order of the same nodes can free one
before building the other (inductor's ``reorder_for_peak_memory`` does this for its kernels).

    the graph's data dependencies, plus an order the rewrite must keep (random draws, in-place
    changes, calls of one module, anything with side effects) -> a networkx DAG -> list
    scheduling: of the ready nodes, run the one that leaves the fewest bytes live (two greedy
    rules; the lower model peak wins) -> a lower modelled peak? -> fxmem's exact analysis of the
    reordered graph (forward and training-step peaks in train mode, inference peak in eval mode,
    at the example sizes and at twice them: none higher, one lower) -> same outputs and gradients
    -> kept

The model of live bytes is the graph's own liveness: the bytes of each storage a node creates
(a meta-device run at the example sizes), which values share a storage (a run at small sizes,
where views show as shared storages), and each value freed after its last user. It only chooses
which order to try; whether the order is kept is decided by fxmem's analysis, which sees every
temporary, every tensor autograd keeps, and every kernel's workspace.

>>> new, entry = reorder(gm, probes[0], sizes, memory, check)                  # doctest: +SKIP
>>> entry["reason"]                                                           # doctest: +SKIP
'peak 3.00 MiB -> 2.00 MiB at B=97, ...'
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Sequence

import networkx as nx
import torch
import torch.fx

from fxmem import _torch_compat as tc
from fxmem.errors import FxMemError
from fxmem.inputs import input_shape
from fxmem.units import format_bytes
from fxmem.passes.segments import same_attributes

RULE = "reorder"
LOOKS_FOR = "another order of the nodes with a lower modelled peak at the example sizes"

# call_function targets from these modules compute a value from their inputs and nothing else
# (unless they draw random numbers or work in place, which are told apart below)
_PURE_MODULES = ("torch", "_operator", "operator", "math", "einops", "fxmem", "builtins")
_RANDOM = ("dropout", "rand", "bernoulli", "normal", "multinomial", "poisson", "shuffle")


def _is_random(n: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    if n.op == "call_module":
        name = type(gm.get_submodule(str(n.target))).__name__.lower()
    else:
        name = str(n.target if n.op == "call_method" else getattr(n.target, "__name__", n.target)).lower()
    return any(r in name for r in _RANDOM)


def _barrier(n: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """A node every other node must stay on its side of: side effects, in-place changes, unknown calls."""
    if n.op == "call_method":
        name = str(n.target)
        return name.endswith("_") and not name.endswith("__")
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        module = getattr(n.target, "__module__", None) or ""
        if n.kwargs.get("inplace") is True or n.kwargs.get("out") is not None:
            return True
        if name.endswith("_") and not name.endswith("__") or name.startswith("i") and module == "_operator":
            return True  # torch.relu_, operator.iadd
        return module.split(".")[0] not in _PURE_MODULES or n.is_impure()
    if n.op == "call_module":
        return getattr(gm.get_submodule(str(n.target)), "inplace", False) is True
    return False


def dependencies(gm: torch.fx.GraphModule) -> nx.DiGraph:
    """The compute nodes of ``gm`` and the order any reordering must keep (a DAG, original order as ``index``)."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    g = nx.DiGraph()
    for k, n in enumerate(nodes):
        g.add_node(n, index=k)
    for n in nodes:
        for a in n.all_input_nodes:
            if a in g:
                g.add_edge(a, n)
    chains: dict = {}  # random draws keep their order; so do the calls of one module
    last_barrier, since = None, []
    for n in nodes:
        keys = ["random"] if _is_random(n, gm) else []
        if n.op == "call_module":
            keys.append(("module", n.target))
        for key in keys:
            if key in chains:
                g.add_edge(chains[key], n)
            chains[key] = n
        if _barrier(n, gm):
            for m in since:
                g.add_edge(m, n)
            if last_barrier is not None:
                g.add_edge(last_barrier, n)
            last_barrier, since = n, []
        else:
            if last_barrier is not None:
                g.add_edge(last_barrier, n)
            since.append(n)
    return g


class Liveness:
    """Bytes each node's value keeps, which values share storages, and when values die, for one order."""

    def __init__(self, gm: torch.fx.GraphModule, env: Mapping[torch.fx.Node, Any], sizes: Mapping[torch.fx.Node, list],
                 kept: frozenset = frozenset()):
        self.kept = kept  # storages autograd keeps for backward: never freed in the forward
        self.outputs = {a for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}
        self.owned: dict = {}  # node -> [(storage key, bytes)] it allocates
        self.holds: dict = {}  # node -> storage keys its value refers to
        seen: set = set()
        for n in gm.graph.nodes:
            keys = []
            for k, t in enumerate(_tensors(env.get(n))):
                key = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if key[0] == 0:
                    continue
                keys.append(key)
                if key not in seen and n.op in ("call_function", "call_method", "call_module"):
                    seen.add(key)
                    big = sizes.get(n, [])
                    self.owned.setdefault(n, []).append((key, big[k] if k < len(big) else 0))
            self.holds[n] = set(keys)

    def peak(self, order: Sequence[torch.fx.Node]) -> int:
        """The most bytes live at once (above resident) when ``order`` runs, each value freed after its last use."""
        live, peak, size = 0, 0, {}
        refs: dict = {}  # storage -> values holding it that are still alive
        pending = {n: len(n.users) for n in order}
        for n in order:
            for key, b in self.owned.get(n, []):
                size[key] = b
                live += b
            peak = max(peak, live)
            for key in self.holds.get(n, ()):
                refs.setdefault(key, set()).add(n)
            dying = [a for a in n.all_input_nodes if a in pending and _last_use(pending, a)]
            if not n.users:
                dying.append(n)
            for a in dying:
                if a in self.outputs:
                    continue
                for key in self.holds.get(a, ()):
                    holders = refs.get(key, set())
                    holders.discard(a)
                    if not holders and key in size and key not in self.kept:
                        live -= size.pop(key)
        return peak


def _last_use(pending: dict, a: torch.fx.Node) -> bool:
    pending[a] -= 1
    return pending[a] == 0


def _tensors(value: Any) -> list:
    return [t for t in tc.tree_leaves(value) if isinstance(t, torch.Tensor)]


def probe_run(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> tuple[dict, frozenset]:
    """Each node's value on small real inputs (train mode, autograd recording, on a copy) and the
    storages autograd packs for backward (``saved_tensors_hooks``), keyed as :class:`Liveness` keys them."""
    twin = copy.deepcopy(gm).train()
    kept: set = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    interp = torch.fx.Interpreter(twin, garbage_collect_values=False)
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
          for x in inputs]
    with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.manual_seed(0)
        interp.run(*xs)
    by_name = {n.name: v for n, v in interp.env.items()}
    return {n: by_name.get(n.name) for n in gm.graph.nodes}, frozenset(kept)


def meta_sizes(gm: torch.fx.GraphModule, specs: Sequence[Any], sizes: Mapping[str, int]) -> dict:
    """Bytes of each tensor each node outputs, at ``sizes``, from a meta-device run (no memory used)."""
    # a structural copy on the meta device: no copy of the weights' memory
    twin = tc.fake_module_copy(gm, lambda t, trainable: torch.empty_like(t, device="meta"))
    inputs = [torch.empty(input_shape(s, sizes), dtype=s.dtype, device="meta") for s in specs]
    interp = torch.fx.Interpreter(twin, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*inputs)
    by_name = {n.name: v for n, v in interp.env.items()}
    return {n: [t.untyped_storage().nbytes() for t in _tensors(by_name.get(n.name))] for n in gm.graph.nodes}


def schedule(g: nx.DiGraph, live: Liveness, rule: str) -> list:
    """List scheduling over ``g``: among the ready nodes, the one that adds the fewest bytes
    (``"net"``: allocated minus freed) or frees the most (``"frees"``); ties in original order."""
    indeg = {n: g.in_degree(n) for n in g}
    ready = [n for n, d in indeg.items() if d == 0]
    users_left = {n: sum(1 for u in n.users if u in g) for n in g}
    order = []
    while ready:
        def score(n: torch.fx.Node) -> tuple:
            alloc = sum(b for _, b in live.owned.get(n, []))
            freed = sum(sum(b for _, b in live.owned.get(a, [])) for a in n.all_input_nodes
                        if a in users_left and users_left[a] == 1 and a not in live.outputs)
            key = alloc - freed if rule == "net" else -freed
            return key, g.nodes[n]["index"]
        n = min(ready, key=score)
        ready.remove(n)
        order.append(n)
        for a in n.all_input_nodes:
            if a in users_left:
                users_left[a] -= 1
        for s in g.successors(n):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return order


def _higher(old: Any, new: Any, sizes: Mapping[str, int]) -> str | None:
    """Which peak of ``new`` is higher than ``old``'s at ``sizes`` (None: none is)."""
    for name, a, b in (("the forward's peak", old.report, new.report), ("the inference peak", old.inference, new.inference)):
        try:
            before, after = a.evaluate(**sizes), b.evaluate(**sizes)
        except FxMemError as exc:  # the model cannot run there: nothing shows the order is no worse
            return f"{name} cannot be analysed ({str(exc).splitlines()[0][:80]})"
        for key in ("peak", "train_peak"):
            if before.get(key) is not None and after[key] > before[key]:
                return f"{'the training-step peak' if key == 'train_peak' else name} is higher ({before[key]:,} -> {after[key]:,} B)"
    return None


def rebuild(gm: torch.fx.GraphModule, order: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
    """``gm``'s nodes in ``order`` (placeholders and attributes first, the output last); shares its modules."""
    graph = torch.fx.Graph()
    env: dict = {}
    head = [n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")]
    tail = [n for n in gm.graph.nodes if n.op == "output"]
    for n in head + list(order) + tail:
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    graph.lint()
    return same_attributes(torch.fx.GraphModule(gm, graph, gm.__class__.__name__), gm)


def reorder(gm: torch.fx.GraphModule, inputs: Sequence[Any], specs: Sequence[Any],
            sizes: Mapping[str, int], memory: Callable[[torch.fx.GraphModule], Any],
            check: Callable[[torch.fx.GraphModule], Any] | None,
            also_at: Sequence[Mapping[str, int]] = ()) -> tuple[torch.fx.GraphModule, dict | None]:
    """``gm`` in another order when fxmem's analysis finds a lower peak (and nothing higher), else ``gm``.

    ``inputs``: small real inputs (which values share storages, which autograd keeps); ``sizes``:
    the example sizes the bytes are modelled at; ``memory(gm)`` fxmem's analysis (an object with
    ``lower_than`` and ``report``/``inference``); ``check(gm)`` the verification (``.ok``; None:
    the caller verifies the order returned, as optimize's driver does every pass's proposal);
    ``also_at``: more sizes (small ones) at which no peak may be higher - a peak is a ``Max`` of
    candidates that cross, so an order lower at the example sizes can be higher at others.
    Returns the module and its ``meta["fxmem"]`` entry (None when no order is modelled lower).
    """
    g = dependencies(gm)
    if not nx.is_directed_acyclic_graph(g):  # cannot happen for a valid graph; leave it alone
        return gm, None
    try:
        env, kept = probe_run(gm, inputs)
        bytes_at = meta_sizes(gm, specs, sizes)
    except Exception:  # noqa: BLE001 - an op without a meta kernel, a size read from values: no model, no reorder
        return gm, None
    live, train = Liveness(gm, env, bytes_at), Liveness(gm, env, bytes_at, kept)
    original = sorted(g, key=lambda n: g.nodes[n]["index"])
    before, train_before = live.peak(original), train.peak(original)
    # an order must not raise the modelled peak with autograd keeping what it keeps (training),
    # and must lower it without (inference) or with
    orders = [o for o in (schedule(g, m, rule) for m in (live, train) for rule in ("net", "frees"))
              if train.peak(o) <= train_before and o != original]
    if not orders:
        return gm, None
    best = min(orders, key=lambda o: (live.peak(o) + train.peak(o), live.peak(o)))
    modelled = live.peak(best)
    if modelled >= before and train.peak(best) >= train_before:
        return gm, None
    at = ", ".join(f"{k}={v}" for k, v in sizes.items())
    moved = sum(1 for a, b in zip(original, best) if a is not b)
    new = rebuild(gm, best)
    old_mem, new_mem = memory(gm), memory(new)
    entry = {"rule": RULE, "status": "declined", "where": f"{moved} of {len(original)} nodes moved",
             "modelled_peak_before": before, "modelled_peak_after": modelled,
             "peak_before": str(old_mem.report.peak), "peak_after": str(new_mem.report.peak),
             "train_peak_before": str(old_mem.report.train_peak), "train_peak_after": str(new_mem.report.train_peak),
             "inference_peak_before": str(old_mem.inference.peak), "inference_peak_after": str(new_mem.inference.peak)}
    keys = ("peak", "train_peak", "inference_peak")
    if hasattr(old_mem, "at_hints"):  # the peaks at the example sizes (bytes)
        entry.update(sizes=dict(sizes), bytes_before=dict(zip(keys, old_mem.at_hints)),
                     bytes_after=dict(zip(keys, new_mem.at_hints)))
    found = (f"an order with modelled live bytes {format_bytes(modelled)} instead of {format_bytes(before)} at "
             f"{at} ({moved} of {len(original)} nodes moved)")
    if not new_mem.lower_than(old_mem):
        entry.update(reason="declined: fxmem's analysis of the new order finds no lower peak (or a higher one); the "
                            "original order is kept",
                     details=f"{found} was found, but fxmem's analysis of it finds no lower peak (or a higher one), "
                             f"so the original order is kept",
                     decision=new_mem.decision(old_mem) if hasattr(new_mem, "decision") else None)
        return gm, entry
    for at_sizes in also_at:
        higher = _higher(old_mem, new_mem, at_sizes)
        if higher:
            there = ", ".join(f"{k}={v}" for k, v in at_sizes.items())
            entry.update(reason=f"declined: lower at {at}, higher at {there}: which order is lower depends on the "
                                f"sizes, so the original order is kept",
                         details=f"{found}: lower at {at}, but {higher} at {there}: which order is lower depends on "
                                 f"the sizes, so the original order is kept")
            return gm, entry
    diff = check(new) if check is not None else None  # None: the caller verifies (optimize's driver)
    if diff is not None and not diff.ok:
        entry.update(reason=f"declined: verification failed (max diff {diff.max_abs:.3g}); original order kept",
                     verification=f"failed: max diff {diff.max_abs:.3g} in {diff.where}", details=found)
        return gm, entry
    pairs = list(zip(old_mem.at_hints, new_mem.at_hints))
    names = ("peak", "training-step peak", "inference peak")
    gains = [(k, a, b) for k, (a, b) in zip(names, pairs) if a and a != b]
    if gains:  # the largest relative gain at the example sizes
        k, a, b = min(gains, key=lambda g: (g[2] - g[1]) / g[1])
        reason = f"applied: {k} {format_bytes(a)} -> {format_bytes(b)} ({100 * (b - a) / a:+.1f}%) at {at}"
    else:  # lower elsewhere (another size, the other path the data chooses), the same here
        reason = f"applied: no peak higher, one lower by fxmem's analysis (the same peaks at {at})"
    entry.update(status="applied", verification="passed" if diff is not None else None, details=found, reason=reason)
    return new, entry



def propose(gm: torch.fx.GraphModule, line: Any) -> tuple[torch.fx.GraphModule, dict]:
    """The registry's entry (:class:`~.base.GraphPass`): :func:`reorder` with ``line``'s inputs,
    sizes and analysis, proposed to the driver (which verifies it); its record, or what it looked for."""
    from fxmem.passes.base import log_entry

    best, entry = reorder(gm, line.verify_inputs[-1], line.specs, line.hints, line.memory, None, line.verify_at)
    if entry is None:
        entry = log_entry(RULE, "no match", type(line.model).__name__, f"looked for {LOOKS_FOR}; none")
    return best, entry
