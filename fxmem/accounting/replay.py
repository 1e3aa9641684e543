"""The one replay: walk a recording's events and add up live bytes, with any number system.

The events (:class:`fxmem.records.Recording`) say, in order, which storage died, which aten call
allocated what (with its hidden program, see :mod:`fxmem.kernels`) and where each node ended.
Walking them with symbolic sizes gives each moment's live bytes as a polynomial (the formulas);
walking them with integers gives exact numbers at given dims, including the CUDA allocator's
512-byte rounding. Only what the run allocates counts: parameters, buffers, inputs, constants and
optimizer state are resident throughout.

>>> w = walk(rec, size=lambda i: sizes[i], delta=int, zero=0, add=operator.add, neg=operator.neg,
...          positive=lambda d: d > 0, mark=rec.forward_end)           # doctest: +SKIP
>>> w.at_mark == retained                                               # doctest: +SKIP
True
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..kernels import OUT
from ..records import FREE, STEP, Placed, Recording


@dataclasses.dataclass
class Walk:
    """What one walk over the events found (symbolic ``Terms`` or ints)."""

    candidates: list  # [(step index, live bytes)] at every moment something was allocated
    after_node: list  # live bytes when each node ended
    final: Any  # live bytes at the end of the events
    at_mark: Any  # live bytes at the mark (the forward's return)
    forward_candidates: int  # how many candidates come before the mark


def walk(rec: Recording, size: Callable[[int], Any], delta: Callable[[Any], Any], zero: Any,
         add: Callable[[Any, Any], Any], neg: Callable[[Any], Any], positive: Callable[[Any], bool],
         mark: int | None = None, trace: Callable[[str, Any, Any, int | None], None] | None = None) -> Walk:
    """Walk every event of ``rec``; ``mark`` is an event index whose live bytes are kept (``at_mark``).

    ``trace(action, what, bytes, step)``, if given, hears every allocation and free in order:
    ``action`` is ``"alloc"`` or ``"free"``, ``what`` a storage index or ``("scratch", step, k)``
    for a kernel's hidden buffer (freed last-in first-out, the rest when its call returns); and
    ``"mark"`` when the walk reaches ``mark``.
    """
    allocated = [s.step is not None for s in rec.storages]
    hear = trace or (lambda *_: None)
    live = zero
    candidates, after_node = [], []
    at_mark, before_mark = None, None
    for k, (kind, i) in enumerate(rec.events):
        if k == mark:
            at_mark, before_mark = live, len(candidates)
            hear("mark", None, zero, None)
        if kind == FREE:
            if allocated[i]:
                live = add(live, neg(size(i)))
                hear("free", i, size(i), None)
        elif kind == STEP:
            step = rec.steps[i]
            placed = {p.storage for p in step.program if isinstance(p, Placed)}
            out = total = zero
            for s in step.allocs:
                total = add(total, size(s))
                if s not in placed:
                    out = add(out, size(s))
            cur = live
            scratch: list = []  # (key, bytes) of the hidden buffers alive inside this call
            made = 0
            for p in step.program or [OUT]:
                if p is OUT:
                    cur = add(cur, out)
                    candidates.append((i, cur))
                    for s in step.allocs:
                        if s not in placed:
                            hear("alloc", s, size(s), i)
                elif isinstance(p, Placed):
                    cur = add(cur, size(p.storage))
                    candidates.append((i, cur))
                    hear("alloc", p.storage, size(p.storage), i)
                else:
                    d = delta(p)
                    if not d:  # a regime's buffer this piece does not have (fxmem.kernels.regimes)
                        continue
                    cur = add(cur, d)
                    if positive(d):
                        candidates.append((i, cur))
                        scratch.append((("scratch", i, made), d))
                        made += 1
                        hear("alloc", scratch[-1][0], d, i)
                    elif trace is not None:
                        # the buffer of exactly that size, else the newest ones; a measured stretch
                        # gives back part of what it held (kernels.measured: up, then down), so the
                        # rest of a buffer freed in part is heard as a buffer of its own
                        remaining = neg(d)
                        while remaining > 0 and scratch:
                            same = [n for n, (_, b) in enumerate(scratch) if b == remaining]
                            key, b = scratch.pop(same[-1] if same else -1)
                            hear("free", key, b, i)
                            if b > remaining:
                                scratch.append((("scratch", i, made), b - remaining))
                                made += 1
                                hear("alloc", scratch[-1][0], b - remaining, i)
                            remaining -= min(b, remaining)
            for key, b in reversed(scratch):  # what the call did not free itself is gone when it returns
                hear("free", key, b, i)
            live = add(live, total)
        else:
            after_node.append(live)
    if at_mark is None:  # the mark is the end
        at_mark, before_mark = live, len(candidates)
    return Walk(candidates, after_node, live, at_mark, before_mark)


@dataclasses.dataclass
class Liveness:
    """Live bytes at concrete ``dims``, node by node; ``high``/``after`` align with the report's
    nodes, ``sizes`` with its storages. Live bytes are above resident (parameters, buffers, inputs).
    """

    dims: dict  # user dim name -> int
    resident: int  # bytes of parameters, buffers, inputs
    peak: int  # absolute peak bytes of the forward (resident + peak_above_resident)
    peak_above_resident: int
    peak_node: str | None  # the node during which the forward's peak happens
    high: list  # per node: most activation bytes live at any moment while it runs
    after: list  # per node: activation bytes live when it ends
    sizes: list  # per storage: bytes (rounded to allocator blocks on CUDA)


def liveness(nodes: list, steps: list, w: Walk, dims: dict, resident: int, sizes: list) -> Liveness:
    """Attribute a numeric walk to nodes: each node's high-water mark and its live bytes at its end."""
    index = {n.name: k for k, n in enumerate(nodes)}
    after = list(w.after_node) + [w.final] * (len(nodes) - len(w.after_node))
    high = [max(after[k], after[k - 1] if k else 0) for k in range(len(after))]
    for step, value in w.candidates:
        k = index.get(steps[step].node)
        if k is not None:
            high[k] = max(high[k], value)
    forward = w.candidates[:w.forward_candidates]
    peak_step, peak_live = max(forward, key=lambda c: c[1], default=(None, 0))
    peak_live = max(peak_live, 0)
    return Liveness(dict(dims), resident, resident + peak_live, peak_live,
                    None if peak_step is None else steps[peak_step].node, high, after, list(sizes))


@dataclasses.dataclass
class StepColumn:
    """One stretch of a training step: consecutive aten calls of one recorded node in one phase.

    ``node`` is an fx node or source line (forward), ``"<node> (backward)"`` (its backward), or a
    phase's own name (``loss``, ``optimizer.step``, ``zero_grad``); ``phase`` a
    :class:`~fxmem.records.Phase` value. ``high``/``after``: activation bytes live (above the
    step's resident bytes) at most while it runs and when it ends.
    """

    node: str
    phase: str
    high: int
    after: int

    @property
    def forward_node(self) -> str:
        """The forward node this stretch belongs to: ``conv (backward)`` -> ``conv``."""
        return forward_node_of(self.node)


BACKWARD_SUFFIX = " (backward)"  # how the simulation names the backward of fx node X: "X (backward)"


def forward_node_of(name: str) -> str:
    """The node whose backward a recorded node name is (``conv (backward)`` -> ``conv``), else the name.

    >>> forward_node_of("conv (backward)"), forward_node_of("relu")
    ('conv', 'relu')
    """
    return name[:-len(BACKWARD_SUFFIX)] if name.endswith(BACKWARD_SUFFIX) else name


@dataclasses.dataclass
class StepLiveness:
    """Live bytes over a whole training step (forward, loss, backward, optimizer step, zero_grad)
    at concrete ``dims``: the training-step counterpart of :class:`Liveness`.

    ``resident`` is the step's resident bytes (parameters, buffers, inputs and optimizer state:
    ``train_resident``); ``peak`` the absolute peak (``train_peak``), reached while
    ``columns[peak_column]`` runs. ``born``/``died`` map a storage to the column that allocates it
    and the column by whose end it is freed (absent: alive when the step ends). Bytes throughout.

    >>> step = plan.step_liveness({B: 4})             # doctest: +SKIP
    >>> step.peak_phase, step.peak_node                # doctest: +SKIP
    ('backward', 'conv1 (backward)')
    """

    dims: dict
    resident: int
    peak: int
    peak_above_resident: int
    peak_column: int | None
    columns: list  # [StepColumn], in execution order
    born: dict
    died: dict
    sizes: list  # per storage: bytes (rounded to allocator blocks on CUDA)
    final: int  # activation bytes live when the step ends

    @property
    def peak_node(self) -> str | None:
        """The recorded node during which the step's peak happens (``X (backward)`` in a backward)."""
        return None if self.peak_column is None else self.columns[self.peak_column].node

    @property
    def peak_phase(self) -> str | None:
        """The phase of the step's peak: ``forward``, ``loss``, ``backward``, ``optimizer.step`` ..."""
        return None if self.peak_column is None else self.columns[self.peak_column].phase


def step_liveness(events: list, steps: list, dims: dict, resident: int, sizes: list) -> StepLiveness:
    """Attribute a training step's allocations and frees (``MemoryPlan.trace``'s ``events``, in
    bytes) to columns of consecutive calls of one node and phase. A free between two calls counts
    for the column before it (the node by whose end the storage was gone). The peak is the first
    moment the running sum is largest, as ``max`` over the walk's candidates finds it."""
    columns: list[StepColumn] = []
    born: dict[int, int] = {}
    died: dict[int, int] = {}
    live = peak = 0
    peak_column = None
    for action, what, nbytes, step in events:
        if step is not None:
            node, phase = steps[step].node, str(steps[step].phase)
            if not columns or (columns[-1].node, columns[-1].phase) != (node, phase):
                columns.append(StepColumn(node, phase, live, live))
        live += nbytes if action == "alloc" else -nbytes
        if not columns:  # nothing allocated yet: a free of what the step did not make changes no column
            continue
        here = len(columns) - 1
        if isinstance(what, int):
            (born if action == "alloc" else died)[what] = here
        if action == "alloc" and live > peak:
            peak, peak_column = live, here
        columns[-1].high = max(columns[-1].high, live)
        columns[-1].after = live
    return StepLiveness(dict(dims), resident, resident + peak, peak, peak_column, columns, born, died,
                        list(sizes), live)
