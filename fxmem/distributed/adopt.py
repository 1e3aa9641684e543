"""A model the user wrapped already (``DistributedDataParallel``, or ``fully_shard`` per block and
on the root): analysed as the same wrapping of the unwrapped model, in fxmem's own fake group.

The user's wrapper belongs to their process group, which fxmem must not use: its collectives
would reach the other ranks. So fxmem reads what the wrapping was - the world size and rank of
its group, DDP's keyword arguments (buckets, ``gradient_as_bucket_view``, ...), which modules
``fully_shard`` was applied to and with what (``reshard_after_forward``, ``mp_policy``,
``offload_policy``, placements, prefetching, the setters' settings) - and returns the unwrapped
model (each sharded parameter at its full size, on the meta device: no memory) with a
``parallelize(model, mesh)`` that applies that wrapping again. What it cannot recreate is refused
by name.

>>> adopted = adopt(ddp_model)                                  # doctest: +SKIP
>>> adopted.world_size, adopted.rank, adopted.how               # doctest: +SKIP
(4, 1, 'DistributedDataParallel(forward_sync_buffers=True, bucket_cap_mb=1)')
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .. import _torch_compat as tc
from ..errors import ModelError


@dataclasses.dataclass(frozen=True)
class Adopted:
    """The unwrapped ``model``, the wrapping as ``fn(model, mesh)``, the user's group's
    ``world_size`` and this process's ``rank`` in it, ``how`` (what was read, for the report) and
    ``devices``: the device types the user's wrapping keeps its parameters on."""

    model: torch.nn.Module
    fn: Callable[[torch.nn.Module, Any], torch.nn.Module]
    world_size: int
    rank: int
    how: str
    devices: frozenset = frozenset()


def _refuse(where: str, unsupported: list[str]) -> None:
    if unsupported:
        raise ModelError(f"{where} uses {', '.join(unsupported)}, which fxmem cannot recreate on its own copy of the "
                         f"model; analyse the unwrapped model with parallelize=fn (fn(model, mesh) doing the same "
                         f"wrapping without it) and world_size=")


def _ddp(model: torch.nn.Module) -> Adopted:
    from torch.nn.parallel import DistributedDataParallel

    settings = tc.ddp_settings(model)
    _refuse("the model's DistributedDataParallel", settings["unsupported"])
    kwargs, ignore = settings["kwargs"], settings["ignore"]
    inner = model.module
    if any(isinstance(m, DistributedDataParallel) or tc.fsdp2_state(m) is not None for m in inner.modules()):
        raise ModelError("the model is DistributedDataParallel around a model that is wrapped again inside; fxmem "
                         "models one wrapping: analyse the unwrapped model with parallelize=")

    def fn(m: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        if ignore:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, sorted(ignore))
        return DistributedDataParallel(m, **kwargs)

    import inspect
    defaults = {k: p.default for k, p in inspect.signature(DistributedDataParallel.__init__).parameters.items()}
    shown = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v!r}" for k, v in kwargs.items()
                      if k not in defaults or defaults[k] != v)  # what differs from DDP's defaults
    devices = frozenset(p.device.type for p in inner.parameters() if p.device.type != "meta")
    return Adopted(inner, fn, settings["world_size"], settings["rank"], f"DistributedDataParallel({shown})", devices)


def _fsdp2(model: torch.nn.Module) -> Adopted:
    from torch.distributed.fsdp import fully_shard

    groups = tc.fsdp2_groups(model)
    paths = {id(m): (p or "the model") for p, m in model.named_modules(remove_duplicate=False)}
    for g in groups:
        _refuse(f"fully_shard on {', '.join(paths.get(id(m), '?') for m in g['modules'])}", g["unsupported"])
    meshes = {id(g["mesh"]) for g in groups if g["mesh"] is not None}
    mesh = next(g["mesh"] for g in groups if g["mesh"] is not None)
    if len(meshes) > 1 or mesh.ndim != 1:
        raise ModelError("the model was sharded with fully_shard over several meshes, or a mesh of more than one "
                         "dimension (HSDP), which fxmem does not model; analyse the unwrapped model with "
                         "parallelize= over the 1-D mesh fxmem passes")
    world_size, rank = mesh.size(), mesh.get_local_rank()
    unwrapped = tc.fsdp2_unsharded_copy(model)
    # the same modules of the copy, by their place in the tree (the copy keeps every attribute name)
    copy_of = dict(zip([id(m) for _, m in model.named_modules(remove_duplicate=False)],
                       [m for _, m in unwrapped.named_modules(remove_duplicate=False)]))
    managed = tc.fsdp2_managed(model)
    ignored_names = [(id(m), n) for m in model.modules() for n, p in m.named_parameters(recurse=False)
                     if tc.fsdp2_state(m) is not None and id(p) not in managed
                     and not any((id(m), n) in g["placements"] for g in groups)]

    def fn(m: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        ours = dict(zip([id(x) for _, x in unwrapped.named_modules(remove_duplicate=False)],
                        [x for _, x in m.named_modules(remove_duplicate=False)]))
        mine = {k: ours[id(v)] for k, v in copy_of.items()}  # the user's module -> the module fn gets
        ignored = {getattr(mine[mid], n) for mid, n in ignored_names}
        for g in groups:
            targets = [mine[id(x)] for x in g["modules"]]
            by_param = {id(getattr(mine[mid], n)): placement for (mid, n), placement in g["placements"].items()}
            kwargs = dict(g["kwargs"])
            if any(getattr(pl, "dim", 0) != 0 for pl in by_param.values()):
                kwargs["shard_placement_fn"] = lambda p, by_param=by_param: by_param.get(id(p))
            if ignored:
                kwargs["ignored_params"] = ignored
            fully_shard(targets if len(targets) > 1 else targets[0], mesh=mesh, **kwargs)
            tc.fsdp2_set_knobs(targets[0], g["knobs"])
        for g in groups:
            first = mine[id(g["modules"][0])]
            if g["forward"]:
                first.set_modules_to_forward_prefetch([mine[id(x)] for x in g["forward"]])
            if g["backward"]:
                first.set_modules_to_backward_prefetch([mine[id(x)] for x in g["backward"]])
        return m

    shown = "; ".join(_fsdp2_shown(g, paths) for g in groups)
    # the copy's sharded parameters are on the meta device; the user's shards are on the mesh's device
    return Adopted(unwrapped, fn, world_size, rank, f"fully_shard on {shown}", frozenset({mesh.device_type}))


def _fsdp2_shown(group: dict, paths: dict) -> str:
    """One ``fully_shard`` call as the report shows it: its modules and what differs from the defaults."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    kw = group["kwargs"]
    said = [f"reshard_after_forward={kw['reshard_after_forward']!r}"] if kw["reshard_after_forward"] is not None else []
    if kw.get("mp_policy") is not None and kw["mp_policy"] != MixedPrecisionPolicy():
        said.append(f"mp_policy={kw['mp_policy']}")
    if kw.get("offload_policy") is not None and type(kw["offload_policy"]) is not OffloadPolicy:
        said.append(f"offload_policy={type(kw['offload_policy']).__name__}()")
    names = ", ".join(paths.get(id(x), "?") for x in group["modules"])
    return names + (f" ({', '.join(said)})" if said else "")


def adopt(model: torch.nn.Module) -> Adopted | None:
    """The wrapping of ``model`` as an unwrapped model and a ``parallelize`` function, or None if
    ``model`` is not wrapped by DistributedDataParallel at its root or by ``fully_shard``."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return _ddp(model)
    if any(tc.fsdp2_state(m) is not None for m in model.modules()):
        return _fsdp2(model)
    return None


def adopted_parallel(adopted: Adopted, options: Any) -> Any:
    """The :class:`~fxmem.distributed.Parallel` option for ``adopted``: the user's group's size and
    this process's rank, unless ``options`` names others (``world_size=`` asks about another
    number of ranks: rank 0 of them unless ``rank=`` says which)."""
    from ..errors import SpecError
    from .parallel import Parallel

    devices = adopted.devices
    if devices and options.device not in devices:
        raise SpecError(f"device={options.device!r}, but the model you wrapped keeps its parameters on "
                        f"{', '.join(sorted(devices))}: pass device={sorted(devices)[0]!r} (fxmem analyses "
                        f"the memory of the device you name)")
    world_size = options.world_size if options.world_size is not None else adopted.world_size
    rank = options.rank if options.rank is not None else adopted.rank if world_size == adopted.world_size else 0
    parallel = Parallel(world_size, rank, adopted.fn, how=f"your {adopted.how}")
    parallel.check()
    return parallel
