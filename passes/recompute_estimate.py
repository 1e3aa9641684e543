"""A recomputation plan's training-step peak estimated from the analysis of the graph without it:
what :mod:`.recompute` chooses with, so that one exact analysis (of the plan it chooses) is made
instead of one per plan tried.

The base analysis' recording is replayed at the user's dims (bytes, integers) with each block of
the plan changed as ``torch.utils.checkpoint`` (non-reentrant) changes it:

    forward: what the block made and autograd kept for backward is freed after its last use
             inside the block instead (selective: except the matrix products' outputs)
    backward: just before the block's first backward op, the block's forward runs again: what was
             dropped is made again and held until backward frees it, as before; what the forward
             freed is made and freed again in the same order

What checkpoint itself holds - the CPU random generator's state (5,056 bytes) it keeps per block so
that dropout draws the same masks again, and 64 bytes more - is added once per block, as if all were held at the
peak (an upper bound); its early stop (a recomputation that ends at the last tensor backward
needs) is left out. The plan it chooses is then analysed exactly, and that analysis, never the
estimate, is what :func:`.recompute.plan_budget` reports and checks against the budget.

>>> est = Estimator(base_report, dims)                                  # doctest: +SKIP
>>> est.peak([(block, "whole")]) <= est.peak([])                        # doctest: +SKIP
True
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from fxmem.kernels import OUT
from fxmem.records import FREE, NODE, STEP, Phase, Placed
from fxmem.passes.segments import KEPT_BY_SELECTIVE

_BACKWARD = " (backward)"


def _product(op: str) -> bool:
    """Whether an aten op (``aten.addmm``, ``aten.mm.default``) is one of the products selective
    recomputation keeps."""
    parts = str(op).split(".")
    name = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]
    return name in KEPT_BY_SELECTIVE


class Estimator:
    """The base training step's events at ``dims``, ready to be replayed under any plan."""

    def __init__(self, report: Any, dims: Mapping[str, int]):
        report = report._at(dict(dims), check=True)[0]  # the analysis whose formulas hold at dims
        plan = report._plan
        rec = self.rec = plan.rec
        values = {report.symbols[k]: v for k, v in dims.items() if k in report.symbols}
        self.size = plan.bytes_at(values)
        delta = plan._delta(values)
        self.resident = sum(self.size[s.index] for s in rec.storages if s.step is None)
        self.allocated = [s.step is not None for s in rec.storages]
        # per step: (highest bytes above live while it runs, bytes its outputs add)
        self.step_cost = [self._cost(st, delta) for st in rec.steps]
        self.forward_end = rec.forward_end if rec.forward_end >= 0 else len(rec.events)
        self.free_at = {i: k for k, (kind, i) in enumerate(rec.events) if kind == FREE}
        self.node_end = {rec.nodes[i].name: k for k, (kind, i) in enumerate(rec.events[:self.forward_end])
                         if kind == NODE}
        self.step_at = {i: k for k, (kind, i) in enumerate(rec.events) if kind == STEP}
        self.made_by = {s.index: s for s in rec.storages if s.step is not None}
        # which fx nodes' outputs live in each storage (a view's is its base's)
        self.holders: dict = {}  # storage -> the fx nodes whose outputs live in it
        for n in rec.nodes:
            for o in n.outputs:
                if o is not None:
                    self.holders.setdefault(o, []).append(n.name)
        graph = getattr(rec.graph_module, "graph", None)
        self.users = {n.name: [u.name for u in n.users] for n in graph.nodes} if graph is not None else {}
        self._blocks: dict = {}
        # the random state checkpoint keeps per block (a CPU tensor: it counts where the CPU is analysed)
        # (and 64 bytes for the rest of its bookkeeping: 5,064 in all were measured for one block)
        self.rng_bytes = torch.get_rng_state().untyped_storage().nbytes() + 64 if rec.device == "cpu" else 0

    def _cost(self, step: Any, delta: Any) -> tuple[int, int]:
        placed = {p.storage for p in step.program if isinstance(p, Placed)}
        out = sum(self.size[s] for s in step.allocs if s not in placed)
        total = sum(self.size[s] for s in step.allocs)
        cur = best = 0
        for p in step.program or [OUT]:
            if p is OUT:
                cur += out
            elif isinstance(p, Placed):
                cur += self.size[p.storage]
            else:
                cur += delta(p)
            best = max(best, cur)
        return best, total

    def _block(self, names: frozenset, selective: bool) -> tuple:
        """(dropped storages with the event after which the forward frees each, the products' outputs
        selective recomputation holds until backward, the block's forward events, the event before
        which its backward starts) for a block of fx node names."""
        key = (names, selective)
        if key in self._blocks:
            return self._blocks[key]
        rec, steps = self.rec, self.rec.steps
        mine = [i for i, st in enumerate(steps) if st.phase == Phase.FORWARD and st.node in names]
        ends = [self.node_end[n] for n in names if n in self.node_end]
        if not mine or not ends:
            self._blocks[key] = ({}, set(), [], None)
            return self._blocks[key]
        first, last = self.step_at[mine[0]], max(ends)
        dropped: dict = {}
        cached: set = set()  # selective: products' outputs the forward freed, held for the recomputation
        for st in mine:
            for s in steps[st].allocs:
                freed = self.free_at.get(s)
                if selective and _product(steps[st].op):
                    if freed is not None and freed < self.forward_end:
                        cached.add(s)
                    continue  # selective recomputation keeps the products' outputs
                if freed is None or freed < self.forward_end or self.made_by[s].is_output:
                    continue  # freed by the forward (not kept for backward), or never: as before
                readers = self._readers(s)
                if any(r not in names for r in readers):
                    continue  # read after the block (its output): kept
                dropped[s] = max([self.node_end.get(r, first) for r in readers] + [self.step_at[st]])
        start = None
        for k, (kind, i) in enumerate(rec.events[self.forward_end:], self.forward_end):
            if kind == STEP and steps[i].node.endswith(_BACKWARD) and steps[i].node[:-len(_BACKWARD)] in names:
                start = k
                break
        self._blocks[key] = (dropped, cached, list(range(first, last + 1)), start)
        return self._blocks[key]

    def _readers(self, s: int) -> set:
        """The fx nodes that use storage ``s``: users of every node whose output lives in it."""
        holders = self.holders.get(s, [])
        return {u for n in holders for u in self.users.get(n, ())} | set(holders)

    def peak(self, plan: Sequence[tuple[Any, str]]) -> int:
        """Estimated training-step peak (bytes) with each ``(block, "whole" | "selective")`` recomputed."""
        rec, size = self.rec, self.size
        early: dict = {}  # event index -> storages the forward frees after it
        recompute: dict = {}  # event index -> (dropped, forward events, products kept) to replay before it
        dropped_all: set = set()
        held: set = set()  # products' outputs held from the forward until the recomputation uses them
        for block, how in plan:
            names = frozenset(n.name for n in block.nodes)
            dropped, cached, events, start = self._block(names, how == "selective")
            for s, k in dropped.items():
                early.setdefault(k, []).append(s)
            dropped_all |= set(dropped)
            held |= cached
            if start is not None:
                recompute.setdefault(start, []).append((dropped, cached, events, names, how == "selective"))
        live = peak = 0
        remade: set = set()  # dropped storages the recompute made again (backward frees them)
        for k, (kind, i) in enumerate(rec.events):
            for dropped, cached, events, names, selective in recompute.get(k, ()):
                live, peak = self._replay(events, dropped, cached, names, selective, live, peak, remade)
            if kind == FREE:
                if k < self.forward_end and i in held:
                    continue  # the forward's free of a held product: the recomputation frees it
                if self.allocated[i] and (i not in dropped_all or i in remade):
                    live -= size[i]
            elif kind == STEP:
                high, total = self.step_cost[i]
                peak = max(peak, live + high)
                live += total
            for s in early.get(k, ()):
                live -= size[s]
        return self.resident + peak + self.rng_bytes * len(plan)

    def _replay(self, events: list, dropped: dict, cached: set, names: frozenset, selective: bool, live: int,
                peak: int, remade: set) -> tuple[int, int]:
        """The block's forward run again in backward: dropped storages stay, the rest is freed as the
        forward freed it (or when the recomputation returns)."""
        rec, steps, size = self.rec, self.rec.steps, self.size
        transient: set = set()
        for k in events:
            kind, i = rec.events[k]
            if kind == STEP and steps[i].node in names:
                st = steps[i]
                if selective and _product(st.op):
                    # not run again: the held output is handed over, and freed as the forward freed it
                    transient |= cached & set(st.allocs)
                    continue
                high, _ = self.step_cost[i]
                peak = max(peak, live + high)
                for s in st.allocs:
                    live += size[s]
                    (remade if s in dropped else transient).add(s)
            elif kind == FREE and i in transient:
                live -= size[i]
                transient.discard(i)
        live -= sum(size[s] for s in transient)  # the recomputed outputs nothing in backward reads
        return live, peak
