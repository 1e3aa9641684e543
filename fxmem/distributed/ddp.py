"""DDP in torch's fake process group: the all-reduce whose result DDP waits for, and what its
reducer keeps.

DDP's built-in all-reduce hook divides each gradient bucket by the world size in place and
all-reduces it, then reads the reduced bucket from the collective's future. The fake process
group's futures carry no value (DDP would stop with an internal assertion), so the simulation
registers the hook's equivalent in Python: the same in-place division, the bucket itself as the
result - the same storages, allocated and freed at the same moments (no collective allocates).

DDP's C++ reducer allocates its gradient buckets (and, with ``static_graph=True`` or
``find_unused_parameters=True``, two int32 maps of which parameters got a gradient: one on the
host, one on the parameters' device) in its constructor and keeps them for the model's life:
:func:`reducer_state` finds them among the tensors the constructor made, named for the report -
resident bytes, also for a forward-only analysis, where no step touches them.

>>> ddp = install_allreduce(DistributedDataParallel(model))    # doctest: +SKIP
"""
from __future__ import annotations

import gc
from typing import Any

import torch

from .. import _torch_compat as tc


def _allreduce(state, bucket):  # noqa: ANN001 - DDP checks the annotations: none, or dist.GradBucket
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def install_allreduce(model: torch.nn.Module) -> torch.nn.Module:
    """Give a DDP ``model`` (fxmem's fake copy) the fake-world all-reduce, unless the user's
    ``parallelize`` registered a comm hook of their own (theirs then runs, on fake collectives)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        tc.ddp_keep_buckets(model)
        try:
            model.register_comm_hook(None, _allreduce)
        except RuntimeError as exc:  # a hook is registered already (only one is allowed)
            if "only be called once" not in str(exc) and "once" not in str(exc):
                raise
    return model


_HOST_MAP = "DDP used-parameter map (host)"


def used_map_reads(model: torch.nn.Module, held: list[tuple[str, torch.Tensor]]) -> Any:
    """:func:`fxmem._torch_compat.ddp_used_map_reads` for ``model``, with the host-side map
    :func:`reducer_state` found among ``held`` (the reducer reads it before any copy shows it)."""
    return tc.ddp_used_map_reads(model, next((t for name, t in held if name == _HOST_MAP), None))


def reducer_state(model: torch.nn.Module, made: list) -> list[tuple[str, torch.Tensor]]:
    """The tensors a DDP ``model``'s reducer keeps, as ``(name, tensor)``: those of ``made`` (weak
    references to the tensors made while it was built, :func:`fxmem._torch_compat.tensors_made`)
    still alive that are none of the model's parameters or buffers. [] for any other model."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return []
    gc.collect()  # a temporary of the constructor in a reference cycle is not kept
    own = {tc.storage_key(tc.local_tensor(t)).cdata for t in [*model.parameters(), *model.buffers()]}
    device_map = tc.ddp_used_map(model)
    device_key = tc.storage_key(device_map).cdata if device_map is not None else None
    out, seen, buckets = [], set(own), 0
    for ref in made:
        t = ref()
        if t is None or t.layout != torch.strided:
            continue
        key = tc.storage_key(t).cdata
        if key in seen:
            continue
        seen.add(key)
        if t.is_floating_point():
            out.append((f"DDP gradient bucket {buckets}", t))
            buckets += 1
        elif t.dtype == torch.int32 and device_map is not None and t.numel() == device_map.numel():
            out.append(("DDP used-parameter map (device)" if key == device_key else _HOST_MAP, t))
        else:
            out.append(("DistributedDataParallel state", t))
    return out
