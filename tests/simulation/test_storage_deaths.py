"""The storage table hears each storage's death (a weakref callback) instead of scanning every
live storage at each poll: checked against torch's own StorageWeakRef.expired() on the same
tensors - views keep a storage alive, autograd's saved tensors keep it alive without any Python
reference, take_over and forget move or drop a record, resident storages are never reported."""
from __future__ import annotations

import torch

from fxmem import _torch_compat as tc
from fxmem.records import Role
from fxmem.simulation.storages import StorageTable


def _expired(refs: dict) -> set:
    return {i for i, r in refs.items() if r.expired()}


def test_deaths_match_expired_weakrefs():
    table = StorageTable(None, "cpu")
    weight = torch.randn(4, requires_grad=True)
    table.add(weight, Role.PARAMETER, "w")  # resident: no step, never reported
    a = torch.randn(8)
    b = torch.randn(8)
    view = b[2:]
    c = (weight * 2).exp()  # exp saves its output for backward
    loss = c.sum()
    refs = {}
    for name, t in (("a", a), ("b", b), ("c", c)):
        refs[table.add(t, Role.ACTIVATION, name, step=1)] = tc.storage_key(t)
    del t  # the loop's last reference
    assert table.dead() == []
    del a, b
    assert table.dead() == sorted(_expired(refs)) == [1]  # b lives on through its view
    del view, c  # c's storage: still saved by autograd
    assert table.dead() == [2] and _expired(refs) == {1, 2}
    loss.backward()
    del loss
    assert table.dead() == [3] and _expired(refs) == {1, 2, 3}
    assert table.dead() == []
    del weight
    assert table.dead() == []  # a resident storage's end is not the run's


def test_take_over_and_forget():
    table = StorageTable(None, "cpu")
    old, new, empty = torch.randn(4), torch.randn(4), torch.randn(0)
    i = table.add(old, Role.ACTIVATION, "old", step=1)
    table.take_over(old, new)  # new's storage continues old's record
    del old
    assert table.dead() == []  # old's death is no free
    j = table.add(empty, Role.ACTIVATION, "empty", step=2)
    table.forget(empty)
    del empty
    assert table.dead() == [] and j == i + 1
    del new
    assert table.dead() == [i]
    assert table.lookup(torch.randn(4)) is None
