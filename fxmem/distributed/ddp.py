"""DDP in torch's fake process group: the all-reduce whose result DDP waits for.

DDP's built-in all-reduce hook divides each gradient bucket by the world size in place and
all-reduces it, then reads the reduced bucket from the collective's future. The fake process
group's futures carry no value (DDP would stop with an internal assertion), so the simulation
registers the hook's equivalent in Python: the same in-place division, the bucket itself as the
result - the same storages, allocated and freed at the same moments (no collective allocates).

>>> ddp = install_allreduce(DistributedDataParallel(model))    # doctest: +SKIP
"""
from __future__ import annotations

import torch

from .. import _torch_compat as tc
from ..errors import ModelError


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
        if getattr(model, "static_graph", False):
            raise ModelError("DistributedDataParallel(static_graph=True) is not modelled: its first step reads "
                             "which gradients were used from tensors' values, which fxmem's fake tensors do not "
                             "have. static_graph=False gives the same step above resident memory on the CPU runs "
                             "fxmem was checked against, but DDP's static-graph bookkeeping adds to the resident "
                             "bytes (296 on a 4,386-parameter model), which fxmem cannot count")
        tc.ddp_keep_buckets(model)
        try:
            model.register_comm_hook(None, _allreduce)
        except RuntimeError as exc:  # a hook is registered already (only one is allowed)
            if "only be called once" not in str(exc) and "once" not in str(exc):
                raise
    return model
