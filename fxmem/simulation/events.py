"""The event log of a simulated run: what happened, in order, and to whom it is attributed.

Three kinds of event (see :class:`fxmem.records.Recording`): a storage died (``FREE``), an aten
call allocated (``STEP``), an fx node / source line / training phase ended (``NODE``). The log
also knows *where* the run is - the fx node or line being executed and the phase of the training
step - so every allocation is attributed without the runners reaching into it.

>>> log = EventLog()
>>> with log.at("linear"):
...     log.node, log.phase.value
('linear', 'forward')
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

from ..records import FREE, NODE, STEP, Node, Phase, Step


class EventLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.steps: list[Step] = []
        self.nodes: list[Node] = []
        self.notes: list[str] = []
        self._places: dict[str, tuple[int, list[str]]] = {}  # note_at: text -> (its index in notes, places)
        self.node = "<input>"  # the fx node, source line or phase being executed
        self.phase = Phase.FORWARD

    def enter(self, node: str) -> None:
        """The runner starts executing ``node`` (an fx node or a source line)."""
        self.node = node

    @contextlib.contextmanager
    def at(self, node: str, phase: Phase | None = None) -> Iterator[None]:
        """Attribute what happens inside to ``node`` (and ``phase``); restores the previous place."""
        saved = self.node, self.phase
        self.node = node
        if phase is not None:
            self.phase = phase
        try:
            yield
        finally:
            self.node, self.phase = saved

    def freed(self, indices: list[int]) -> None:
        self.events.extend((FREE, i) for i in indices)

    def step(self, op: str, allocs: list[int], program: list, reads: tuple = ()) -> Step:
        step = Step(len(self.steps), self.node, op, allocs, program, self.phase, reads)
        self.steps.append(step)
        self.events.append((STEP, step.index))
        return step

    @property
    def next_step(self) -> int:
        return len(self.steps)

    def ended(self, node: Node) -> None:
        """``node`` finished (its steps are ``[node.first_step, node.end_step)``)."""
        self.nodes.append(node)
        self.events.append((NODE, len(self.nodes) - 1))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def note_at(self, place: str, text: str) -> None:
        """One note ``text`` for every ``place`` it is true of (a model's 32 layers make one line
        naming the first places and how many more, not 160 lines that differ in the node)."""
        if text not in self._places:
            self._places[text] = (len(self.notes), [])
            self.notes.append("")
        index, where = self._places[text]
        if place not in where:
            where.append(place)
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        self.notes[index] = f"{'node' if len(where) == 1 else 'nodes'} {shown}: {text}"

    def mark(self) -> int:
        """The current length of the log (``Recording.forward_end``)."""
        return len(self.events)

    def __repr__(self) -> str:
        return f"<EventLog {len(self.events)} events, {len(self.steps)} steps, {len(self.nodes)} nodes>"


_PLACES = re.compile(r"^nodes? ((?:'[^']*'(?:, )?)+)(?: and (\d+) more)?: ")


def places(note: str) -> int:
    """How many places a note of :meth:`EventLog.note_at` names (1 for any other note)."""
    m = _PLACES.match(note)
    if m is None:
        return 1
    return m.group(1).count("'") // 2 + int(m.group(2) or 0)
