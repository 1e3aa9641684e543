"""The storage table: every storage a simulated run touches, its symbolic size, and when it dies.

A storage is known by a weak reference to it (views share it), so its death - the moment the real
allocator would free it - is seen exactly: :meth:`StorageTable.dead` lists the storages whose
last reference went away since it was last asked.

>>> table = StorageTable(env, "cpu")                                    # doctest: +SKIP
>>> i = table.add(x, Role.INPUT, "x"); table.lookup(x) == i             # doctest: +SKIP
True
"""
from __future__ import annotations

import weakref
from typing import Any

import sympy
import torch

from .. import _torch_compat as tc
from ..records import Phase, Role, Storage
from .failures import NotModelled


class StorageTable:
    """Storages of one run, in the order they were first seen (sizes over ShapeEnv symbols)."""

    def __init__(self, env: Any, device: str):
        self.env = env
        self.device = device
        self.storages: list[Storage] = []
        self._live: dict[int, tuple[Any, int]] = {}  # allocated by the run: key -> (weakref, index)
        self._resident: dict[int, tuple[Any, int]] = {}  # there before the run: never polled
        # deaths are heard, not searched for: each run storage has a weakref whose callback files
        # its index in _died (O(deaths) per poll, not O(live): a 1000-layer optimizer step has
        # thousands of live gradients and states and polls after every op)
        self._watch: dict[int, Any] = {}  # index -> the weakref watching its current storage
        self._died: list[int] = []
        self._key_of: dict[int, int] = {}  # index -> its key in _live
        # storages whose record a later output took over (take_over): key -> (weakref, index); seen
        # again alive, fxmem's bookkeeping and the real run parted (see moved_from)
        self._moved: dict[int, tuple[Any, int]] = {}
        self.rename: Any = lambda text: text  # torch's size symbols -> the user's dims, in messages
        self.data_dims: Any = None  # the run's sizes that depend on values, named (a DataDims)
        self.module_now: Any = lambda: ""  # eager mode: the module running (see module_stack)

    def counts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in the memory being predicted (the analysed device)."""
        return t.device.type == self.device

    def lookup(self, t: torch.Tensor) -> int | None:
        ref = tc.storage_key(t)
        hit = self._live.get(ref.cdata) or self._resident.get(ref.cdata)
        if hit is None or hit[0].expired():
            return None
        return hit[1]

    def add(self, t: torch.Tensor, role: Role, name: str, *, node: str | None = None, step: int | None = None,
            op: str | None = None, phase: Phase = Phase.FORWARD) -> int | None:
        """The index of ``t``'s storage, recording it first if it is new (None if not on the device).

        A storage with a ``step`` was allocated by the run and dies when its last reference does.
        """
        if not self.counts(t):
            return None
        known = self.lookup(t)
        if known is not None:
            return known
        nbytes = tc.size_expr(self.env, tc.storage_nbytes(t))
        shape = tuple(tc.size_expr(self.env, d) for d in t.shape)
        for e in (nbytes, *shape):
            unbacked = tc.unbacked_symbols(e)
            if unbacked and not (self.data_dims is not None and self.data_dims.knows(unbacked)):
                raise NotModelled(
                    f"{op or role.value} makes a tensor whose size depends on the data "
                    f"(shape {self.rename(str(tuple(t.shape)))}); fxmem gives formulas in input sizes only. Give that size "
                    f"as an input (e.g. an index tensor of shape ('E',)) instead of computing it from values."
                )
        record = Storage(len(self.storages), nbytes, t.dtype, shape, role, name, node=node if step is not None else None,
                         op=op, step=step, phase=phase, module=self.module_now() if step is not None else "")
        self.storages.append(record)
        ref = tc.storage_key(t)
        (self._live if step is not None else self._resident)[ref.cdata] = (ref, record.index)
        if step is not None:
            self._hear(t.untyped_storage(), record.index)
        return record.index

    def _hear(self, storage: Any, index: int) -> None:
        """File ``index`` in ``_died`` when ``storage`` is freed (unless ``index`` moved on first)."""
        table = weakref.ref(self)  # no cycle: the callback holds the table weakly

        def died(ref: Any) -> None:
            me = table()
            if me is not None and me._watch.get(index) is ref:
                del me._watch[index]
                me._died.append(index)

        self._watch[index] = tc.watch_storage(storage, died)
        self._key_of[index] = tc.storage_weakref(storage).cdata

    def resized(self, storage: Any, old: int, new: int, role: Role, name: str, *, node: str, step: int, op: str,
                phase: Phase) -> tuple[int | None, int | None]:
        """A storage resized in place (``untyped_storage().resize_``): its old bytes are freed and
        its new bytes allocated, as the real allocator does. Returns (freed index, new index)."""
        ref = tc.storage_weakref(storage)
        freed = None
        for table in (self._live, self._resident):
            hit = table.pop(ref.cdata, None)
            if hit is not None:
                self._watch.pop(hit[1], None)  # its end is this free, not the storage object's death
                if old > 0:
                    freed = hit[1]
        index = None
        if new > 0:
            record = Storage(len(self.storages), sympy.Integer(new), torch.uint8, (sympy.Integer(new),), role, name, node=node,
                             op=op, step=step, phase=phase, module=self.module_now())
            self.storages.append(record)
            self._live[ref.cdata] = (ref, record.index)
            self._hear(storage, record.index)
            index = record.index
        return freed, index

    def forget(self, t: torch.Tensor) -> None:
        """Drop the record just added for ``t`` (an empty storage: nothing to count)."""
        ref = tc.storage_key(t)
        _, index = self._live.pop(ref.cdata)
        assert index == len(self.storages) - 1
        self._watch.pop(index, None)
        self.storages.pop()

    def take_over(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new``'s storage continues ``old``'s record: the real kernel wrote in place into ``old``'s
        buffer where the fake one made a new one (no allocation, and ``old``'s death is no free)."""
        old_ref = tc.storage_key(old)
        _, index = self._live.pop(old_ref.cdata)
        self._moved[old_ref.cdata] = (old_ref, index)
        ref = tc.storage_key(new)
        self._live[ref.cdata] = (ref, index)
        self._hear(new.untyped_storage(), index)  # replaces old's watch: its death is no free

    def moved_from(self, t: torch.Tensor) -> int | None:
        """The record ``t``'s storage had before another tensor took it over (:meth:`take_over`),
        when that storage is still alive and unrecorded; else None. The real run reused the buffer
        only because nothing else held it: a live one means the simulation took a wrong path."""
        hit = self._moved.get(tc.storage_key(t).cdata)
        if hit is None or hit[0].expired():
            return None
        return hit[1]

    def is_whole(self, t: torch.Tensor, index: int) -> bool:
        """Whether ``t`` spans the whole of storage ``index`` (not a slice of a larger one)."""
        return sympy.expand(tc.size_expr(self.env, t.numel() * t.element_size()) - self.storages[index].bytes) == 0

    def dead(self) -> list[int]:
        """Indices of the run's storages that died since the last call, in index order."""
        if not self._died:
            return []
        gone, self._died = sorted(self._died), []
        for index in gone:  # drop their _live entries (unless a newer storage took the key meanwhile)
            key = self._key_of.pop(index, None)
            hit = self._live.get(key)
            if hit is not None and hit[1] == index:
                del self._live[key]
        return gone
