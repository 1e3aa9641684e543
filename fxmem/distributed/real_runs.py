"""Real distributed training steps on CPU (``gloo``, one process per rank), each rank's memory measured.

The independent evidence for :mod:`fxmem.distributed`: ``world_size`` processes train the same
model with the same ``parallelize(model, mesh)``; after a warm-up step each rank measures one
steady-state step with :func:`fxmem.measure.measure` (its own allocator, through the profiler).

>>> ranks = measure_ranks(make_model, inputs, fsdp, 2, lambda p: torch.optim.AdamW(p))   # doctest: +SKIP
>>> ranks[0].peak_above_start, ranks[0].retained, ranks[0].resident                      # doctest: +SKIP
(5412, 0, 3208)

``make_model``, ``parallelize``, ``optimizer`` and ``loss`` are sent to new processes: define them
at module level (not lambdas) so they pickle.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import tempfile
from typing import Any, Callable

import torch

from ..measure import measure
from ..training import default_loss, train_step


@dataclasses.dataclass
class RankMeasurement:
    """One rank's steady-state training step (bytes): above the memory at its start, what it kept;
    ``resident``: what set-up and two steps left allocated (the allocator's count: parameter shards,
    buffers, DDP's buckets, optimizer state, and anything an asynchronous collective has not freed
    yet) plus the inputs; ``extra["state_storages"]``: the storages of the local parameters,
    buffers, optimizer state and inputs, counted one by one."""

    rank: int
    peak_above_start: int
    retained: int
    resident: int
    optimizer_state: int
    extra: dict


def measure_ranks(make_model: Callable[[], torch.nn.Module], inputs: tuple, parallelize: Callable,
                  world_size: int, optimizer: Callable, loss: Callable = default_loss, threads: int = 1,
                  probe: Callable | None = None, mesh: dict | None = None,
                  step: Callable | None = None) -> list[RankMeasurement]:
    """Train ``make_model()`` parallelised on ``world_size`` gloo processes; each rank's step measured.

    ``probe(model, inputs, optimizer, loss) -> dict``: optional, run on every rank after the measured
    step (e.g. another tool's own figures), its result in ``RankMeasurement.extra``. ``mesh``: the
    DeviceMesh ``parallelize`` is given, ``{dim name: size}`` as fxmem's ``mesh=`` (default 1-D).
    ``step``: the training step, ``step(model, optimizer, *inputs)`` as fxmem's ``step=`` (default:
    forward, ``loss``, backward, ``optimizer.step()``, ``zero_grad``).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        mp.start_processes(_rank_main, args=(world_size, port, out, make_model, inputs, parallelize, optimizer,
                                             loss, threads, probe, _dims(mesh), step),
                           nprocs=world_size, start_method="spawn", join=True)
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dims(mesh: dict | None) -> tuple | None:
    return tuple(mesh.items()) if mesh is not None else None


def _rank_main(rank: int, world_size: int, port: int, out: str, make_model: Callable, inputs: tuple,
               parallelize: Callable, optimizer: Callable, loss: Callable, threads: int, probe: Any,
               dims: tuple | None, step: Callable | None = None) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,)) if dims is None else init_device_mesh(
            "cpu", tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims))
        result = measure_rank(rank, mesh, make_model, inputs, parallelize, optimizer, loss, probe, step)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measure_synchronous(make_model: Callable[[], torch.nn.Module], inputs: tuple, parallelize: Callable,
                        world_size: int, rank: int, optimizer: Callable,
                        loss: Callable = default_loss, mesh: dict | None = None,
                        step: Callable | None = None) -> RankMeasurement:
    """Rank ``rank``'s real step in this process, in torch's fake process group: real tensors and
    allocator, FSDP2's and DDP's own code, collectives that do nothing - the synchronous schedule
    (each buffer freed as soon as the code lets go of it). DDP gets the Python form of its
    built-in all-reduce (the fake group's futures carry no value). ``mesh``, ``step``: as for
    :func:`measure_ranks`."""
    from .. import _torch_compat as tc
    from .ddp import _allreduce

    def wrapped(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        out = parallelize(model, mesh) or model
        wrappers = [s.submod for s in tc.schedule_stages(out)] if is_pipeline(out) else [out]
        for wrapper in wrappers:  # (a pipeline's stages each)
            if isinstance(wrapper, DistributedDataParallel):
                wrapper.register_comm_hook(None, _allreduce)
        return out

    from .pipeline import is_pipeline, real_start_up

    dims = _dims(mesh)
    pipelined = _returns_pipeline(make_model, parallelize, world_size, rank, dims)
    with contextlib.ExitStack() as pipeline:
        if pipelined:
            # the start-up messages the other ranks would send this rank's stage, from their own steps:
            # gathered before this rank's measurement starts (their fake groups leave small buffers behind)
            mailbox = real_start_up(world_size, make_model, wrapped, optimizer, inputs, step, dims)
            mailbox.rank = rank
            pipeline.enter_context(tc.pipeline_messages(mailbox))
        with tc.fake_process_group(world_size, rank, dims=dims) as device_mesh:
            return measure_rank(rank, device_mesh, make_model, inputs, wrapped, optimizer, loss, step=step)


def _returns_pipeline(make_model: Callable, parallelize: Callable, world_size: int, rank: int,
                      dims: tuple | None) -> bool:
    """Whether ``parallelize`` returns a pipeline schedule: tried on a model made on the meta device
    (nothing allocated), or, where the wrapping refuses meta tensors, on a real one."""
    from .. import _torch_compat as tc
    from .pipeline import is_pipeline

    for device in ("meta", "cpu"):
        with tc.fake_process_group(world_size, rank, dims=dims) as device_mesh:
            try:
                with torch.device(device):
                    return is_pipeline(parallelize(make_model(), device_mesh))
            except Exception:
                if device == "cpu":
                    raise
    return False


def measure_rank(rank: int, mesh: Any, make_model: Callable, inputs: tuple, parallelize: Callable,
                 optimizer: Callable, loss: Callable = default_loss, probe: Any = None,
                 step: Callable | None = None) -> RankMeasurement:
    """This process's rank: resident bytes after set-up and three steps, then one step measured.

    On gloo the allocator's resident count can include a late free (800 B once, with DDP, on a loaded
    machine): ``extra["state_storages"]`` (+ ``extra["ddp_bucket_bytes"]``) count storages instead."""
    from .. import _torch_compat as tc
    from .pipeline import is_pipeline, stage_model

    def one_step(model: torch.nn.Module, opt: Any) -> Any:
        if step is not None:
            return step(model, opt, *inputs)
        return train_step(model, inputs, opt, loss)

    def setup() -> tuple:
        # built, parallelised, and three steps taken (DDP rebuilds its buckets in the second, or
        # with static_graph=True in the third): what this leaves allocated is the rank's resident
        # memory, buckets included
        torch.manual_seed(0)
        model = make_model()
        handed = parallelize(model, mesh) or model
        # a pipeline schedule (fxmem.distributed.pipeline): the step gets it, the optimizer its stage's parameters
        model = stage_model(handed) if is_pipeline(handed) else handed
        opt = optimizer(list(model.parameters()))
        for _ in range(3):
            one_step(handed, opt)
        return handed, model, opt

    made = measure(setup, warmup=0, keep_result=True)
    handed, model, opt = made.result
    m = measure(lambda: one_step(handed, opt), warmup=0)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    extra = probe(model, inputs, opt, loss) if probe is not None else {}
    extra["state_storages"] = _storages([*model.parameters(), *model.buffers(), *opt_state_tensors(opt), *tensors])
    extra["ddp_bucket_bytes"] = tc.ddp_bucket_bytes(model)  # DDP's own count (0 for other models)
    used_map = tc.ddp_used_map(model) if extra["ddp_bucket_bytes"] else None
    # its used-parameter map, host and device side of the same size (static_graph, find_unused_parameters)
    extra["ddp_used_map_bytes"] = 2 * used_map.nbytes if used_map is not None else 0
    return RankMeasurement(rank, m.peak_above_start, m.retained, made.retained + _storages(tensors),
                           _storages(opt_state_tensors(opt)), extra)


def opt_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storages(tensors: list) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's: its local shard's)."""
    seen, total = set(), 0
    for t in tensors:
        s = _local(t).untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total
