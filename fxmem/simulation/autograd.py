"""What autograd keeps, as a simulated run sees it: saved tensors, hidden storages kept until a
node's backward, and where the engine is during ``backward()``.

* Saved tensors: autograd's saved-tensor hook reports each tensor as it is packed; a pack is
  attributed to the op that saved it (:meth:`Autograd.attribute`): an op saves its inputs just
  before it dispatches and its outputs right after.
* Kept hidden storages (a wrapped Python number ``MulBackward0`` saves without a hook) live until
  the backward of the node that made them has run: a hook on that node's ``grad_fn`` releases them
  - unless that backward keeps the graph (``retain_graph=True``, as the zero-bubble pipeline
  schedules' input-gradient pass does): then they live until the node itself dies.
* During ``backward()`` the engine is either inside a node's backward or between two (where it
  accumulates gradients); hooks on every ``grad_fn`` tell which, and name each backward after its
  fx node.

>>> autograd = Autograd(table, log)                     # doctest: +SKIP
>>> with tc.saved_tensor_hooks(recorder.saved): ...    # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch

from .. import _torch_compat as tc
from ..records import SavedBy
from .events import EventLog
from .storages import StorageTable


class Autograd:
    def __init__(self, table: StorageTable, log: EventLog):
        self.table = table
        self.log = log
        self.between_nodes = False  # during backward(): the engine is between two nodes
        self.keeping: list[bool] = []  # per backward() running now, innermost last: keeps its graph
        self._pending: list[int] = []  # storages packed since the last op
        self._keeps: dict[str, list[int]] = {}  # fx node -> hidden storages kept, not yet bound
        self._unbound: list[tuple[Any, str, list[int]]] = []  # (weakref to op output, node, kept)
        # reading a view's grad_fn after an in-place write through it makes autograd replay the view
        # (an aten call the recorder sees) while it holds that tensor's autograd mutex: a second
        # read of the same grad_fn from inside that call would wait on the mutex for ever
        self._reading_grad_fn = False
        self._released: set[int] = set()
        self._closed = False

    # --- saved tensors --------------------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def saved(self, t: torch.Tensor) -> None:
        """Autograd packed ``t`` for backward (the saved-tensor hook)."""
        if isinstance(t, torch.Tensor) and self.table.counts(t):
            index = self.table.lookup(t)
            if index is not None:
                self._pending.append(index)

    def attribute(self, op_inputs: set, op: str | None, last_op: str | None) -> None:
        """Give pending packs to their op: one of this op's inputs was saved by it, the rest by the last op."""
        for index in self._pending:
            by = SavedBy(self.log.node, (op if (op is not None and index in op_inputs) else last_op) or "?")
            saved_by = self.table.storages[index].saved_by
            if by not in saved_by:
                saved_by.append(by)
        self._pending.clear()

    # --- hidden storages kept until backward ----------------------------------------------------
    def keep(self, indices: list[int], output: torch.Tensor | None) -> None:
        """Storages ``indices`` (no tensor of their own) live until the backward of the current node;
        ``output`` is the op's output, whose ``grad_fn`` autograd attaches after the op returns."""
        if not indices:
            return
        node = self.log.node
        self._keeps.setdefault(node, []).extend(indices)
        if output is not None:
            self._unbound.append((weakref.ref(output), node, list(indices)))

    def bind(self) -> None:
        """Hook each kept storage to its op's ``grad_fn`` (runs at the next op, once autograd attached it)."""
        if self._reading_grad_fn or not self._unbound:
            return  # inside autograd's replay of a view whose grad_fn is being read: at the next op
        pending, self._unbound = self._unbound, []
        with self.reading_grad_fn():
            for ref, node, indices in pending:
                t = ref()
                fn = getattr(t, "grad_fn", None) if t is not None else None
                base = tc.view_base(t) if t is not None else None
                held = getattr(base, "grad_fn", None) if base is not None else None
                if type(held).__name__ == "CopySlices":
                    # an in-place op on a view: its backward node lives in the base's CopySlices,
                    # as long as the base's graph - not in the view's grad_fn, which dies with the view
                    fn = held
                if fn is None:
                    continue
                fn.register_hook(_Release(self._release, indices, self.keeping))
                left = [i for i in self._keeps.get(node, []) if i not in indices]
                if left:
                    self._keeps[node] = left
                else:
                    self._keeps.pop(node, None)

    @contextlib.contextmanager
    def reading_grad_fn(self) -> Iterator[None]:
        """While fxmem reads ``grad_fn`` s: no nested read from the aten calls that may run meanwhile."""
        was, self._reading_grad_fn = self._reading_grad_fn, True
        try:
            yield
        finally:
            self._reading_grad_fn = was

    def release_keeps(self, node: str) -> None:
        """The backward of ``node`` ran: release what was kept for it (when no grad_fn was bound)."""
        self._release(self._keeps.pop(node, []))

    def close(self) -> None:
        """The run is over: releases after this (graphs collected later) are not part of it."""
        self._closed = True

    def _release(self, indices: list[int]) -> None:
        if self._closed:
            return
        fresh = [i for i in indices if i not in self._released]
        self._released.update(fresh)
        self.log.freed(fresh)

    # --- the engine -----------------------------------------------------------------------------
    def watch_engine(self, loss: torch.Tensor) -> None:
        """Know when the engine is between nodes during ``loss.backward()`` (where it accumulates).

        A post-hook on every node (but AccumulateGrad, whose refcount-based choice to steal the
        gradient a hook would change) sets the flag; a pre-hook on every node clears it.
        """
        with self.reading_grad_fn():
            nodes = _autograd_nodes(loss)
        for fn in nodes:
            if type(fn).__name__ == "AccumulateGrad":
                continue
            fn.register_prehook(self._enter)
            fn.register_hook(self._leave)

    def _enter(self, *_: Any) -> None:
        self.between_nodes = False

    def _leave(self, *_: Any) -> None:
        self.between_nodes = True

    def name_backward(self, node_name: str, value: Any, release: bool = True) -> None:
        """Attribute the backward of the autograd nodes fx node ``node_name`` created to it, and
        (``release``) release what was kept for it once that backward ran.

        An autograd node is named by the first fx node that returns it (a getitem of a tuple
        returns its producer's). The mark lives in the node's own ``metadata``: a set of ``id``s
        would skip a new node that got a dead one's id, leaving its backward unnamed."""
        for t in tc.tree_leaves(value):
            with self.reading_grad_fn():
                fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is None or _NAMED in fn.metadata:
                continue
            fn.metadata[_NAMED] = node_name
            name = f"{node_name} (backward)"
            fn.register_prehook(lambda *_, name=name: setattr(self.log, "node", name))
            if release:
                fn.register_hook(lambda *_: self.release_keeps(node_name))


_NAMED = "fxmem.fx_node"  # key in an autograd node's metadata: the fx node its backward is attributed to


def _autograd_nodes(t: torch.Tensor) -> list:
    """Every autograd node ``t``'s backward will run (its graph, depth first)."""
    seen: set = set()
    found, stack = [], [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        found.append(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found


class _Release:
    """A ``grad_fn`` hook that releases kept storages when the node's backward runs (in a backward
    that does not keep the graph), or when the node itself is destroyed: a graph nothing can reach
    any more (its output was detached, or only ``argmax`` of it was kept) frees what it saved, as
    the real run does. Only the node holds the hook, so the hook dies with it."""

    def __init__(self, release: Any, indices: list[int], keeping: list[bool]):
        self.release, self.indices, self.keeping = release, indices, keeping

    def __call__(self, *_: Any) -> None:
        if not (self.keeping and self.keeping[-1]):  # a kept graph keeps what its nodes saved
            self.release(self.indices)

    def __del__(self) -> None:
        self.release(self.indices)
