"""The storage table: every storage a simulated run touches, its symbolic size, and when it dies.

A storage is known by a weak reference to it (views share it), so its death - the moment the real
allocator would free it - is seen exactly: :meth:`StorageTable.dead` lists the storages whose
last reference went away since it was last asked.

>>> table = StorageTable(env, "cpu")                                    # doctest: +SKIP
>>> i = table.add(x, Role.INPUT, "x"); table.lookup(x) == i             # doctest: +SKIP
True
"""
from __future__ import annotations

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
        return record.index

    def resized(self, storage: Any, old: int, new: int, role: Role, name: str, *, node: str, step: int, op: str,
                phase: Phase) -> tuple[int | None, int | None]:
        """A storage resized in place (``untyped_storage().resize_``): its old bytes are freed and
        its new bytes allocated, as the real allocator does. Returns (freed index, new index)."""
        ref = tc.storage_weakref(storage)
        freed = None
        for table in (self._live, self._resident):
            hit = table.pop(ref.cdata, None)
            if hit is not None and old > 0:
                freed = hit[1]
        index = None
        if new > 0:
            record = Storage(len(self.storages), sympy.Integer(new), torch.uint8, (sympy.Integer(new),), role, name, node=node,
                             op=op, step=step, phase=phase, module=self.module_now())
            self.storages.append(record)
            self._live[ref.cdata] = (ref, record.index)
            index = record.index
        return freed, index

    def forget(self, t: torch.Tensor) -> None:
        """Drop the record just added for ``t`` (an empty storage: nothing to count)."""
        ref = tc.storage_key(t)
        _, index = self._live.pop(ref.cdata)
        assert index == len(self.storages) - 1
        self.storages.pop()

    def take_over(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new``'s storage continues ``old``'s record: the real kernel wrote in place into ``old``'s
        buffer where the fake one made a new one (no allocation, and ``old``'s death is no free)."""
        _, index = self._live.pop(tc.storage_key(old).cdata)
        ref = tc.storage_key(new)
        self._live[ref.cdata] = (ref, index)

    def is_whole(self, t: torch.Tensor, index: int) -> bool:
        """Whether ``t`` spans the whole of storage ``index`` (not a slice of a larger one)."""
        return sympy.expand(tc.size_expr(self.env, t.numel() * t.element_size()) - self.storages[index].bytes) == 0

    def dead(self) -> list[int]:
        """Indices of the run's storages that died since the last call, in index order."""
        gone = tc.expired_keys(self._live)  # every poll scans the live storages: keep it a tight loop
        return sorted(self._live.pop(k)[1] for k in gone)
