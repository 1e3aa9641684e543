"""What fxmem does not model in distributed training, refused by name with what to do instead.

A model the user wrapped already with ``DistributedDataParallel`` at its root or ``fully_shard``
is read and wrapped again in fxmem's own fake group (:mod:`fxmem.distributed.adopt`); what is left
here is what cannot be read back: DDP nested inside the model, ``DataParallel``, FSDP1, and a
wrapping with settings fxmem does not recreate, and a model whose parameters are DTensors already
or over a mesh of more than one dimension (fxmem applies the user's ``parallelize_module`` plan or
2-D wrapping itself, through ``parallelize=`` and ``mesh=``). FSDP1's ``FullyShardedDataParallel``,
the pipeline tracer front end (``pipeline()``'s ``Pipe``; stages built with ``PipelineStage`` in
``parallelize=`` are modelled, :mod:`.pipeline`) and DeepSpeed engines are not modelled.

>>> refuse_wrapped(torch.nn.Linear(2, 2))   # an ordinary model passes                # doctest: +SKIP
"""
from __future__ import annotations

import torch

from .. import _torch_compat as tc
from ..errors import ModelError

_UNWRAP = ("pass either the wrapped model without parallelize= (fxmem reads its wrapping), or the unwrapped model "
           "with the wrapping code as parallelize=fn, fn(model, mesh) returning the model to run, and world_size= "
           "(fxmem applies it to its own fake copy, in a fake process group)")


def _library(module: torch.nn.Module) -> str:
    return type(module).__module__.split(".")[0]


def refuse_wrapped(model: torch.nn.Module) -> None:
    """Refuse a model still wrapped for distributed training after :func:`~fxmem.distributed.adopt`
    (a wrapper inside the model, or one fxmem does not read back)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    for qual, module in model.named_modules():
        where = f"'{qual}'" if qual else "the model"
        if isinstance(module, DistributedDataParallel) and qual:
            raise ModelError(f"{where} is wrapped in DistributedDataParallel inside the model; fxmem reads a "
                             f"DistributedDataParallel only at the model's root: pass the unwrapped model with "
                             f"parallelize=lambda m, mesh: ... (wrapping {where} as your script does) and world_size=")
        if isinstance(module, DistributedDataParallel):
            raise ModelError(f"the model is wrapped in DistributedDataParallel; {_UNWRAP}, e.g. "
                             f"parallelize=lambda m, mesh: DistributedDataParallel(m) (with your bucket_cap_mb=...)")
        if isinstance(module, DataParallel):
            raise ModelError(f"{where} is wrapped in DataParallel (one process, several GPUs), which fxmem does not "
                             f"model; analyse the unwrapped model per GPU, or use DistributedDataParallel via "
                             f"parallelize=")
        if tc.fsdp2_state(module) is not None:
            raise ModelError(f"fully_shard (FSDP2) was applied to {where} already; {_UNWRAP}, e.g. a function "
                             f"that calls fully_shard(block, mesh=mesh) per block and fully_shard(model, mesh=mesh)")
        if _library(module) == "deepspeed":
            raise ModelError(f"{where} is a DeepSpeed {type(module).__name__}; fxmem does not model DeepSpeed "
                             f"(ZeRO). Analyse the bare model; FSDP2 (fully_shard) via parallelize= is modelled")
    refuse_unmodelled(model, "the model")


def refuse_unmodelled(model: torch.nn.Module, source: str, placed_here: bool = False) -> None:
    """Refuse what ``source`` produced that fxmem does not model: FSDP1, pipeline stages, and the
    DTensor parameters of a model given already placed - by tensor parallelism, or over a mesh of
    more than one dimension - whose plan fxmem cannot read back (``placed_here``: ``source`` is the
    ``parallelize=`` fxmem ran itself, whose placements it models)."""
    fsdp1 = tc.fsdp1_type()
    dtensor = tc.dtensor_type_if_loaded()
    managed = tc.fsdp2_managed(model)
    for qual, module in model.named_modules():
        where = f"'{qual}'" if qual else "the model"
        if fsdp1 is not None and isinstance(module, fsdp1):
            raise ModelError(f"{source}: {where} is FSDP1's FullyShardedDataParallel, which fxmem does not model; use "
                             f"FSDP2 (torch.distributed.fsdp.fully_shard, per block and on the root) in "
                             f"parallelize=, which fxmem models exactly")
        if "pipelining" in type(module).__module__:
            raise ModelError(f"{source}: {where} is a pipeline-parallel {type(module).__name__} (the tracer front end, "
                             f"pipeline()), which fxmem does not model; build this rank's PipelineStage(s) and its "
                             f"schedule (ScheduleGPipe, Schedule1F1B, ...) in parallelize=fn(model, mesh), "
                             f"return the schedule, and pass step=fn(schedule, optimizer, *inputs) (see "
                             f"fxmem.distributed.pipeline)")
    for qual, p in model.named_parameters():
        if dtensor is None or not isinstance(p, dtensor):
            continue
        if id(p) not in managed and not placed_here:
            raise ModelError(
                f"{source}: parameter '{qual}' is a DTensor already (tensor parallelism: parallelize_module or "
                f"distribute_tensor), and fxmem cannot read back the plan that placed it; pass the model before "
                f"parallelize_module, with your plan as parallelize=lambda m, mesh: parallelize_module(m, mesh, "
                f"{{...}}) and world_size=")
        if p.device_mesh.ndim != 1 and not placed_here:
            raise ModelError(f"{source}: parameter '{qual}' is sharded over a {p.device_mesh.ndim}-D mesh (HSDP or "
                             f"FSDP with tensor parallelism), a wrapping fxmem cannot read back; pass the unwrapped "
                             f"model with your wrapping code as parallelize=fn, world_size= and the mesh's dims as "
                             f"mesh={{'dp': ..., 'tp': ...}} (fxmem builds that mesh and hands it to fn)")
