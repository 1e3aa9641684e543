"""From the recording of four blocks to the recording of all of them.

:mod:`.repeats` finds a chain of identical blocks and cuts the graph to its first four: A, B, B2
and C. Their simulation records, in order, what each block's forward, backward and optimizer step
allocated and freed. B and B2 are what every inner block of the whole chain is: fed by a block,
feeding a block. So the whole model's recording is the short one with B's runs of events repeated
once per inner block - each copy's storages its own, its references to the block before and after
pointing at that copy's neighbours - B2's dropped, and C's renamed to the last block's.

Nothing is assumed: every run of B's events is compared, event by event, with B2's (same ops,
sizes, programs, nodes; each reference to A's, B's or B2's storage matched by a reference to B's,
B2's or C's one block on; the same shared storages). If they differ - a block that reads two
blocks back, an optimizer step over several blocks' tensors at once (``foreach``), a size the
data decides - :func:`unroll` says why and the caller simulates the whole model instead.

Frees noticed at one poll happen at one moment (no allocation between them), so their order among
themselves is free: each is put with the block whose storage it frees where the poll falls
between two blocks' runs.

>>> whole = unroll(short_recording, chain, gm)           # doctest: +SKIP
>>> whole if isinstance(whole, str) else len(whole.nodes) # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

import torch.fx

from ..records import FREE, NODE, STEP, Phase, Placed, Recording, Role, SavedBy, Step, Storage
from .repeats import KEPT, Chain, simulated_positions

_BACKWARD = " (backward)"
_LAST_INNER = "last inner"  # names as B2 sees them, B2 standing for the block before the last
_AT = "@"  # eager mode: a node of an inner block not simulated, before its lines are numbered
_LABEL = re.compile(r"^(.*?)(?:#\d+)?(?:@\d+)?$", re.S)  # a line label's base: file.py:12 of file.py:12#3
A, B, B2, C = range(KEPT)  # the simulated blocks: first, the template, its check, the last
# whose storages a run of each owner may touch (None: code outside the chain)
_NEIGHBOURS = {A: {None, A, B}, B: {None, A, B, B2}, B2: {None, B, B2, C}, C: {None, B2, C}, None: {None, A, C}}


class _Mismatch(Exception):
    """The simulated blocks do not repeat: why, in words."""


def unroll(rec: Recording, chain: Chain, gm: torch.fx.GraphModule | None) -> Recording | str:
    """``rec`` (of ``chain``'s first four blocks) as the recording of ``gm`` with all of them, or
    the reason it cannot be (a string).

    ``gm=None``: eager mode (:func:`.repeats.shorten_module`): ``rec`` ran the first three blocks
    and the last, its nodes are source lines, and a block's lines are those its modules ran (with
    the lines of the loop that calls it); the whole recording's lines are numbered as a run of
    every block would number them (``model.py:12#7``)."""
    try:
        if gm is None:
            return _Unroller(rec, chain, None).run_eager()
        return _Unroller(rec, chain, gm).run()
    except _Mismatch as exc:
        return str(exc)


class _Unroller:
    def __init__(self, rec: Recording, chain: Chain, gm: torch.fx.GraphModule | None):
        if rec.data_dims:
            raise _Mismatch("sizes that depend on the data differ from block to block")
        self.rec, self.chain, self.gm, self.n = rec, chain, gm, chain.count
        # the simulated blocks' positions in the chain, their modules and their nodes' names
        self.sim = tuple(range(KEPT)) if gm is not None else simulated_positions(chain)
        self.seg = chain.segments[:KEPT] if gm is not None else _line_segments(rec, chain, self.sim)
        self.block_of_node = {name: j for j in range(KEPT) for name in self.seg[j]}
        self.position = {name: k for j in range(KEPT) for k, name in enumerate(self.seg[j])}
        self.owner: list = [None] * len(rec.storages)
        self.step_owner: list = [None] * len(rec.steps)
        self._storage_and_step_owners()
        self.events, self.event_owner, self.forward_end = self._ordered_events()

    # --- who each storage, step and event belongs to ---------------------------------------------
    def block_of(self, text: str | None) -> int | None:
        """The simulated block a name (node, ``node (backward)``, ``node:op``, qualified name) is in."""
        if not text:
            return None
        base = text[:-len(_BACKWARD)] if text.endswith(_BACKWARD) else text
        j = self.block_of_node.get(base)
        if j is None:
            j = self.block_of_node.get(self.split(base)[0])
        if j is None:
            position = self.chain.block_of(base)
            j = self.sim.index(position) if position in self.sim else None
        return j

    def _storage_and_step_owners(self) -> None:
        rec = self.rec
        for s in rec.storages:
            if s.step is None and s.role != Role.INPUT:
                self.owner[s.index] = self.block_of(s.name)
        for kind, i in rec.events:  # in order: what a step reads was made before it
            if kind != STEP:
                continue
            step = rec.steps[i]
            base = step.node[:-len(_BACKWARD)] if step.node.endswith(_BACKWARD) else step.node
            if base in self.block_of_node:
                owner = self.block_of_node[base]
            elif step.phase != Phase.STEP:
                owner = None  # a node before or after the chain, the loss, the start of backward()
            else:  # the optimizer's step: it works for the block whose tensors it reads
                owners = {self.owner[r] for r in step.reads} - {None}
                if len(owners) > 1:
                    raise _Mismatch(f"{step.op} in {step.phase.value} works on several blocks' tensors at once "
                                    f"(a foreach or fused optimizer, say)")
                owner = owners.pop() if owners else None
            self.step_owner[i] = owner
            for s in step.allocs:
                self.owner[s] = owner

    def _ordered_events(self) -> tuple[list, list, int]:
        """The events with each poll's frees put with the block whose storage they free, and every
        event's owner."""
        rec = self.rec
        events, owners = [], []
        forward_end = -1

        def owner_of(event: tuple) -> int | None:
            kind, i = event
            return self.step_owner[i] if kind == STEP else self.block_of_node.get(rec.nodes[i].name)

        k, total = 0, len(rec.events)
        before = None  # owner of the last step or node end
        while k < total:
            if k == rec.forward_end:
                forward_end = len(events)
            if rec.events[k][0] != FREE:
                before = owner_of(rec.events[k])
                events.append(rec.events[k])
                owners.append(before)
                k += 1
                continue
            end = k
            while end < total and rec.events[end][0] == FREE and (end == k or end != rec.forward_end):
                end += 1
            after = owner_of(rec.events[end]) if end < total else None
            targets: dict = {}  # owner -> its frees, in order of first appearance
            for _, i in rec.events[k:end]:
                o = self.owner[i]
                if before == after:
                    t = before if before is not None else o  # inside a run, or among code outside the chain
                elif o in (before, after):
                    t = o
                else:
                    t = after if after is not None else before
                targets.setdefault(t, []).append(i)
            # the run before's frees first, the run after's last: runs stay whole
            for t in sorted(targets, key=lambda t: 0 if t == before and t is not None else
                            2 if t == after and t is not None else 1):
                for i in targets[t]:
                    events.append((FREE, i))
                    owners.append(t)
            k = end
        if rec.forward_end == total:
            forward_end = len(events)
        if rec.forward_end >= 0 and forward_end < 0:
            raise _Mismatch("the forward's end was not found")
        return events, owners, forward_end

    def _runs(self) -> list[tuple]:
        """Maximal runs of events with one owner: (owner, start, end)."""
        runs: list = []
        for k, owner in enumerate(self.event_owner):
            if runs and runs[-1][0] == owner:
                runs[-1][2] = k + 1
            else:
                runs.append([owner, k, k + 1])
        return [tuple(r) for r in runs]

    # --- checking that the blocks repeat ---------------------------------------------------------
    def _check(self, runs: list) -> list[tuple]:
        """Pairs of B's and B2's runs, checked; the maps from neighbours' storages."""
        self.bij: dict = {}  # B's storage -> B2's
        self.prev: dict = {}  # A's storage B uses -> B's storage B2 uses in its place
        self.next: dict = {}  # B2's storage B uses -> C's storage B2 uses in its place
        names: dict[str, list[int]] = {}  # a name may be several storages' (one line's two cats): in order
        for s in self.rec.storages:
            if s.step is None and self.owner[s.index] == B2:
                names.setdefault(s.name, []).append(s.index)
        seen: dict[str, int] = {}
        for s in self.rec.storages:
            if s.step is None and self.owner[s.index] == B:
                key = self.rename(s.name, B, B2)
                k = seen[key] = seen.get(key, -1) + 1
                others = names.get(key, [])
                other = others[k] if k < len(others) else None
                if other is None or not self._same_meta(s.index, other):
                    raise _Mismatch(f"{s.name} has no counterpart in {self.chain.module(B2)}")
                self.bij[s.index] = other
        for owner, start, end in runs:
            for k in range(start, end):
                far = [s for s in self._refs(self.events[k]) if self.owner[s] not in _NEIGHBOURS[owner]]
                if far:
                    raise _Mismatch(f"a block uses the tensors of a block that is not its neighbour, or code outside "
                                    f"the chain uses an inner block's tensors ({self.rec.storages[far[0]].name} at "
                                    f"{self._event_text(self.events[k])})")
        ours = [r for r in runs if r[0] == B]
        checks = [r for r in runs if r[0] == B2]
        if len(ours) != len(checks) or not ours:
            raise _Mismatch("the blocks' events do not come in matching runs (a block's work is interleaved "
                            "with another's)")
        pairs = []
        for rb, rc in zip(ours, checks):
            if rb[2] != rc[1] and rc[2] != rb[1]:
                raise _Mismatch("something happens between two blocks' runs of events")
            self._compare(rb, rc)
            pairs.append((rb, rc))
        return pairs

    def _event_text(self, event: tuple) -> str:
        kind, i = event
        if kind == STEP:
            return f"{self.rec.steps[i].op} at {self.rec.steps[i].node}"
        return "a free" if kind == FREE else self.rec.nodes[i].name

    def _refs(self, event: tuple) -> list[int]:
        kind, i = event
        if kind == FREE:
            return [i]
        if kind == STEP:
            step = self.rec.steps[i]
            return [*step.reads, *[c for s in step.allocs if (c := self.rec.storages[s].copy_of) is not None]]
        return [o for o in self.rec.nodes[i].outputs if o is not None]

    def _same_meta(self, i: int, j: int) -> bool:
        a, b = self.rec.storages[i], self.rec.storages[j]
        return a.bytes == b.bytes and a.dtype == b.dtype and a.shape == b.shape and a.role == b.role

    def _correspond(self, sx: int, sy: int) -> None:
        """Storage ``sx`` seen by B plays the part ``sy`` plays for B2."""
        ox, oy = self.owner[sx], self.owner[sy]
        if ox is None:
            ok = oy is None and sx == sy
        elif ox == B:
            ok = oy == B2 and self.bij.get(sx) == sy
        elif ox == A:
            ok = oy == B and self.prev.setdefault(sx, sy) == sy
        elif ox == B2:
            ok = oy == C and self.next.setdefault(sx, sy) == sy
        else:
            ok = False
        if not ok:
            x, y = self.rec.storages[sx], self.rec.storages[sy]
            raise _Mismatch(f"blocks {self.chain.module(B)} and {self.chain.module(B2)} use different tensors in "
                            f"the same place ({x.name}, {y.name})")

    def _compare(self, rb: tuple, rc: tuple) -> None:
        rec = self.rec
        eb, ec = self.events[rb[1]:rb[2]], self.events[rc[1]:rc[2]]
        if len(eb) != len(ec):
            raise _Mismatch(f"blocks {self.chain.module(B)} and {self.chain.module(B2)} record different numbers "
                            f"of memory events")
        k = 0
        while k < len(eb):
            (kx, ix), (ky, iy) = eb[k], ec[k]
            if kx != ky:
                raise _Mismatch(f"blocks {self.chain.module(B)} and {self.chain.module(B2)} record different events")
            if kx == FREE:  # frees noticed at one poll: one moment, in no particular order
                end = k
                while end < len(eb) and eb[end][0] == FREE:
                    end += 1
                if any(kind != FREE for kind, _ in ec[k:end]) or end < len(ec) and ec[end][0] == FREE:
                    raise _Mismatch(f"blocks {self.chain.module(B)} and {self.chain.module(B2)} free different "
                                    f"numbers of tensors at once")
                self._correspond_frees([i for _, i in eb[k:end]], [i for _, i in ec[k:end]])
                k = end
                continue
            k += 1
            if kx == STEP:
                self._compare_steps(rec.steps[ix], rec.steps[iy])
            else:
                nx, ny = rec.nodes[ix], rec.nodes[iy]
                if self.rename(nx.name, B, B2) != ny.name or nx.shapes != ny.shapes or nx.dtypes != ny.dtypes \
                        or [o is None for o in nx.outputs] != [o is None for o in ny.outputs] \
                        or nx.end_step - nx.first_step != ny.end_step - ny.first_step:
                    raise _Mismatch(f"fx nodes {nx.name} and {ny.name} differ")
                for a, b in zip(nx.outputs, ny.outputs):
                    if a is not None:
                        self._correspond(a, b)

    def _correspond_frees(self, xs: list[int], ys: list[int]) -> None:
        """Storages ``xs`` B frees at one moment are ``ys`` B2 frees, in any order."""
        if all(self._expected(x) in (y, None) for x, y in zip(xs, ys)):
            pairs = list(zip(xs, ys))
        else:
            left, pairs, unknown = list(ys), [], []
            for x in xs:
                y = self._expected(x)
                if y is None:
                    unknown.append(x)
                elif y in left:
                    left.remove(y)
                    pairs.append((x, y))
                else:
                    pairs.append((x, left.pop(0) if left else -1))
            pairs += list(zip(unknown, left))
        for x, y in pairs:
            if y < 0:
                raise _Mismatch(f"blocks {self.chain.module(B)} and {self.chain.module(B2)} free different tensors")
            self._correspond(x, y)

    def _expected(self, sx: int) -> int | None:
        """The storage B2 uses where B uses ``sx``, if known yet."""
        o = self.owner[sx]
        if o is None:
            return sx
        return {B: self.bij, A: self.prev, B2: self.next}.get(o, {}).get(sx)

    def _compare_steps(self, sx: Step, sy: Step) -> None:
        storages = self.rec.storages
        same = (sx.op == sy.op and sx.phase == sy.phase and len(sx.allocs) == len(sy.allocs)
                and len(sx.reads) == len(sy.reads) and len(sx.program) == len(sy.program)
                and self.rename(sx.node, B, B2) == sy.node)
        if same:
            for a, b in zip(sx.allocs, sy.allocs):
                x, y = storages[a], storages[b]
                if not self._same_meta(a, b) or x.op != y.op or x.is_output or y.is_output or \
                        [v.op for v in x.saved_by] != [v.op for v in y.saved_by] or (x.copy_of is None) != (y.copy_of is None):
                    same = False
                    break
                self.bij[a] = b
            where = {s: k for k, s in enumerate(sx.allocs)}
            for p, q in zip(sx.program, sy.program):
                if isinstance(p, Placed) != isinstance(q, Placed) or \
                        (sy.allocs[where[p.storage]] != q.storage if isinstance(p, Placed) else p != q):
                    same = False
        if not same:
            raise _Mismatch(f"{sx.op} at {sx.node} and {sy.op} at {sy.node} allocate differently")
        for a, b in zip(sx.reads, sy.reads):
            self._correspond(a, b)
        for a, b in zip(sx.allocs, sy.allocs):
            if storages[a].copy_of is not None:
                self._correspond(storages[a].copy_of, storages[b].copy_of)

    # --- names -----------------------------------------------------------------------------------
    def rename(self, text: str | None, src: int, dst: int) -> str | None:
        """``text`` (a node name, ``node (backward)``, ``node:op``, a qualified name) of simulated block
        ``src`` as block ``dst`` (a position in the whole chain) names it."""
        if not text or src == dst:
            return text
        if text.endswith(_BACKWARD):
            return self.rename(text[:-len(_BACKWARD)], src, dst) + _BACKWARD
        if self.block_of_node.get(text) == src:
            return self.segment_name(dst, self.position[text])
        head, tail = self.split(text)
        if tail and self.block_of_node.get(head) == src:
            return self.segment_name(dst, self.position[head]) + ":" + tail
        at = self.chain.relative(text)
        if at is not None and at[0] == self.sim[src]:
            return self.chain.path(dst, at[1])
        return text

    def split(self, text: str) -> tuple[str, str]:
        """``node:op`` (a storage's name) as (node, op); ``(text, "")`` when no node of the blocks
        starts it."""
        return _split_node(text, self.block_of_node)

    def segment_name(self, position: int, k: int) -> str:
        """The name of the ``k``-th node of the block at ``position`` of the whole chain. Eager mode
        knows only the simulated blocks' names: the others' are placeholders :meth:`run_eager`
        numbers as the whole run would."""
        if self.gm is not None:
            return self.chain.segments[position][k]
        if position in self.sim and k < len(self.seg[self.sim.index(position)]):
            return self.seg[self.sim.index(position)][k]
        return f"{self.seg[B][k]}{_AT}{position}"

    def _name(self, text: Any, where: Any) -> Any:
        """A name from the short run as the whole model has it, seen from ``where``: ``A``, ``C``, a
        position ``p`` of a copy of B, or None (outside the chain). A neighbour's name is that of the
        neighbour of ``where``'s position."""
        if not isinstance(text, str):
            return text
        j = self.block_of(text)
        if j is None:
            return text
        if where is None:
            target = {A: 0, B: 1, B2: 2, C: self.n - 1}[j]
        else:
            base_j, base_t = (A, 0) if where == "A" else (C, self.n - 1) if where == "C" else \
                (B2, self.n - 2) if where == _LAST_INNER else (B, where)
            target = base_t + j - base_j
        return self.rename(text, j, target)

    # --- building the whole recording ------------------------------------------------------------
    def run(self) -> Recording:
        rec, n = self.rec, self.n
        runs = self._runs()
        pairs = self._check(runs)
        descending = {rb[1]: rc[1] < rb[1] for rb, rc in pairs}  # B2's run first: a backward, copies in reverse
        inner = list(range(1, n - 1))  # positions of B's copies (1 is B itself)
        back = {v: k for k, v in self.bij.items()}  # B2's storage -> B's

        def at(p: int, s: int) -> Any:  # B's storage s in the copy at position p
            return s if p == 1 else (p, s)

        def key(s: int, where: Any) -> Any:
            """The whole model's storage that ``s`` is, seen from ``where`` (see :meth:`_name`)."""
            o = self.owner[s]
            if o is None or o == A and where in ("A", 1) or o == C:
                return s
            if where == "A" or where is None:
                return s  # B seen from A (checked: nothing outside the chain touches B)
            if where == "C":
                return at(n - 2, back[s])  # C's block before is the last copy
            if o == B:
                return at(where, s)
            if o == A:
                return at(where - 1, self.prev[s])
            return self.next[s] if where + 1 == n - 1 else at(where + 1, back[s])  # B2: the block after

        order: list = []  # storages: B's copies follow B's, group by group; B2's are dropped
        group: list = []
        for s in rec.storages:
            if self.owner[s.index] == B:
                group.append(s.index)
                continue
            order.extend([*group, *[(p, g) for p in inner[1:] for g in group]])
            group = []
            if self.owner[s.index] != B2:
                order.append(s.index)
        order.extend([*group, *[(p, g) for p in inner[1:] for g in group]])
        new_index = {k: i for i, k in enumerate(order)}

        events, steps, nodes = [], [], []
        step_index: dict = {}  # (position or None, short step) -> new step
        first_copy: dict = {}  # short step -> its first new index
        forward_end = -1
        for owner, start, end in runs:
            if owner == B2:
                continue
            if start < self.forward_end < end and owner == B:
                raise _Mismatch("the forward ends inside a block")
            places: list = (inner[::-1] if descending[start] else inner) if owner == B else \
                ["A" if owner == A else "C" if owner == C else None]
            for where in places:
                ctx = where if isinstance(where, int) else None
                for k in range(start, end):
                    if k == self.forward_end and (ctx is None or where == places[0]):
                        forward_end = len(events)
                    kind, i = self.events[k]
                    if kind == FREE:
                        events.append((FREE, new_index[key(i, where)]))
                    elif kind == STEP:
                        s = rec.steps[i]
                        step_index[(ctx, i)] = len(steps)
                        first_copy.setdefault(i, len(steps))
                        steps.append(Step(len(steps), self._name(s.node, where), s.op,
                                          [new_index[key(a, where)] for a in s.allocs],
                                          [Placed(new_index[key(p.storage, where)]) if isinstance(p, Placed) else p
                                           for p in s.program], s.phase,
                                          tuple(new_index[key(r, where)] for r in s.reads)))
                        events.append((STEP, steps[-1].index))
                    else:
                        node = rec.nodes[i]
                        span = range(node.first_step, node.end_step)
                        firsts = [step_index[(ctx, j)] for j in span] if ctx is not None else \
                            [first_copy[j] for j in span if j in first_copy]
                        nodes.append(dataclasses.replace(
                            node, name=self._name(node.name, where), module=self._name(node.module, where),
                            target=self._name(node.target, where) if node.op in ("call_module", "get_attr")
                            else node.target, outputs=[None if o is None else new_index[key(o, where)]
                                                       for o in node.outputs],
                            first_step=min(firsts, default=len(steps)), end_step=len(steps)))
                        events.append((NODE, len(nodes) - 1))
        if self.forward_end == len(self.events):
            forward_end = len(events)
        storages = [self._storage(k, new_index, step_index, key) for k in order]
        first, last = self.chain.module(0), self.chain.module(n - 1)
        notes = [*rec.notes, f"the {n} blocks {first} ... {last} run the same code on tensors of the same sizes: "
                             f"fxmem simulated four and repeated the memory events of the second for the inner "
                             f"{n - 2} (the second and third were checked to match, event by event)"]
        return dataclasses.replace(rec, storages=storages, steps=steps, nodes=nodes, events=events, notes=notes,
                                   forward_end=forward_end, graph_module=self.gm or rec.graph_module)

    def run_eager(self) -> Recording:
        """:meth:`run`, then eager mode's line labels numbered as one run of every block numbers
        them, and the module calls of the blocks not simulated added."""
        whole = self.run()
        runs: dict[str, list] = {}  # a line's nodes in the order they ended
        for node in whole.nodes:
            runs.setdefault(_LABEL.match(node.name).group(1), []).append(node.name)
        label: dict[str, str] = {}
        for base, names in runs.items():
            # numbered in the order they started: as they ended, but for a line's nodes nested in
            # one block's run (a comprehension inside its line) whose short-run numbers say
            ordered = [name for _, run in itertools.groupby(names, key=self._instance)
                       for name in sorted(run, key=_number)]
            for k, name in enumerate(ordered, 1):
                label[name] = base if k == 1 else f"{base}#{k}"

        def named(text: Any) -> Any:
            if not isinstance(text, str):
                return text
            if text.endswith(_BACKWARD):
                return named(text[:-len(_BACKWARD)]) + _BACKWARD
            if text in label:
                return label[text]
            node, op = _split_node(text, label)  # a storage's node:op
            return f"{label[node]}:{op}" if op else text

        nodes = [dataclasses.replace(n, name=named(n.name)) for n in whole.nodes]
        steps = [dataclasses.replace(s, node=named(s.node)) for s in whole.steps]
        storages = [dataclasses.replace(s, name=named(s.name), node=named(s.node),
                                        saved_by=[SavedBy(named(v.node), v.op) for v in s.saved_by])
                    for s in whole.storages]
        notes = [*whole.notes, f"eager mode ran {self.chain.module(B2 + 1)} ... {self.chain.module(self.n - 2)} as "
                               f"{self.chain.module(B)} ran; their code was not run: a layer that branches on its own "
                               f"index by arithmetic alone (no attribute differs) is not seen - repeats=False "
                               f"simulates every layer"]
        return dataclasses.replace(whole, nodes=nodes, steps=steps, storages=storages, notes=notes,
                                   module_calls=self._module_calls(whole.module_calls))

    def _instance(self, name: str) -> Any:
        """Which run of a block a node of the whole recording comes from (a copy of B by position, a
        simulated block, or None: outside the chain)."""
        at = name.rpartition(_AT)
        return ("copy", at[2]) if at[1] and at[2].isdigit() else ("simulated", self.block_of(name))

    def _module_calls(self, calls: dict | None) -> dict | None:
        """Eager mode's module calls with those of the inner blocks not simulated (as B's)."""
        if not calls:
            return calls
        items = list(calls.items())
        ours = [(self.chain.relative(k)[1], v) for k, v in items if self.chain.block_of(k) == self.sim[B]]
        after = max((i for i, (k, _) in enumerate(items) if self.chain.block_of(k) == self.sim[B2]), default=None)
        if after is None:
            raise _Mismatch(f"{self.chain.module(B2)} was not called")
        out: dict = {}
        for i, (k, v) in enumerate(items):
            out[k] = v
            if i == after:
                for p in range(B2 + 1, self.n - 1):
                    for rest, call in ours:
                        out[self.chain.path(p, rest)] = dataclasses.replace(call)
        return out

    def _storage(self, k: Any, new_index: dict, step_index: dict, key: Any) -> Storage:
        ctx, s = k if isinstance(k, tuple) else (None, k)
        record = self.rec.storages[s]
        o = self.owner[s]
        where: Any = {A: "A", C: "C"}.get(o)
        if o == B:
            where = ctx = ctx or 1
        step = None if record.step is None else step_index[(ctx if o == B else None, record.step)]
        saved_by, inner = [], []  # a value from outside, saved by every inner block: block by block
        savers, seen_from = record.saved_by, where
        if o == B and where == self.n - 2 > 1:
            # the last inner block's tensors are saved by the last block's code: as B2's were (the
            # last block's code may differ from the others': eager mode runs the real one)
            savers, seen_from = self.rec.storages[self.bij[s]].saved_by, _LAST_INNER
        for v in [*savers, None]:
            if v is not None and o is None and self.block_of(v.node) == B:
                inner.append(v)
                continue
            if inner:  # (an empty one still walks every block: quadratic in the depth, storage by storage)
                saved_by.extend(SavedBy(self._name(u.node, p), u.op) for p in range(1, self.n - 1) for u in inner)
                inner = []
            if v is not None and not (o is None and self.block_of(v.node) == B2):
                saved_by.append(SavedBy(self._name(v.node, seen_from), v.op))
        copy_of = None if record.copy_of is None else new_index[key(record.copy_of, where)]
        return dataclasses.replace(record, index=new_index[k], name=self._name(record.name, where),
                                   node=self._name(record.node, where), module=self._name(record.module, where),
                                   step=step, saved_by=saved_by, copy_of=copy_of)


def _number(name: str) -> int:
    """A line label's number in the run that named it: 3 for ``file.py:12#3``, 1 for ``file.py:12``."""
    m = re.match(r"^.*?#(\d+)(?:@\d+)?$", name, re.S)
    return int(m.group(1)) if m else 1


def _split_node(text: str, nodes: Any) -> tuple[str, str]:
    """``node:op`` as (node, op), ``node`` the first prefix of ``text`` before a ``:`` that is in
    ``nodes`` (eager mode's nodes have a ``:`` of their own: ``model.py:12:aten.mm``); else
    ``(text, "")``."""
    at = text.find(":")
    while at >= 0:
        if text[:at] in nodes:
            return text[:at], text[at + 1:]
        at = text.find(":", at + 1)
    return text, ""


def _line_segments(rec: Recording, chain: Chain, sim: tuple) -> tuple:
    """Eager mode: each simulated block's source-line nodes in order - those its modules ran, and
    the calling code's lines between it and the next block (the loop's own lines) or inside its
    run; a forward run several times (``generate``) adds each run's. The first three blocks must
    run the same lines (the last is simulated itself)."""
    nodes = [rec.nodes[i] for kind, i in rec.events if kind == NODE]
    block = [sim.index(p) if (p := chain.block_of(n.module or "")) in sim else None for n in nodes]
    firsts = []
    for j in range(KEPT):
        at = [k for k, b in enumerate(block) if b == j]
        if not at:
            raise _Mismatch(f"{chain.module(sim[j])} ran no line of its own")
        firsts.append(at[0])
    if firsts != sorted(firsts):
        raise _Mismatch("the blocks did not run in order")
    before, after = [None] * len(nodes), [None] * len(nodes)  # the nearest block's node on each side
    last = None
    for k, b in enumerate(block):
        before[k], last = last, b if b is not None else last
    last = None
    for k in range(len(nodes) - 1, -1, -1):
        after[k], last = last, block[k] if block[k] is not None else last
    segments: list = [[] for _ in range(KEPT)]
    for k, (node, b) in enumerate(zip(nodes, block)):
        if b is None and before[k] is not None and after[k] in (before[k], before[k] + 1):
            b = before[k]  # inside a block's run, or the caller's lines between it and the next
        if b is not None:
            segments[b].append(node.name)
    bases = [[_LABEL.match(name).group(1) for name in seg] for seg in segments]
    if not bases[A] == bases[B] == bases[B2]:  # the last is simulated itself: its lines may differ
        raise _Mismatch("the blocks ran different source lines")
    return tuple(tuple(seg) for seg in segments)
