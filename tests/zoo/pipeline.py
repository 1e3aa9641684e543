"""Models, pipeline splits and steps for tests/distributed/test_pipeline.py, at module level so that the
gloo processes (spawned) can import them."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                         ScheduleZBVZeroBubble)

from .distributed import Block, D, TPBlock, V, _block_plan

MICROBATCHES = 4


class PipeDecoder(nn.Module):
    """Blocks, a norm and a head in one ``nn.Sequential`` (split into stages by slicing it); the
    second argument is the target the last stage's loss reads (the whole model ignores it)."""

    def __init__(self, n: int = 3):
        super().__init__()
        self.layers = nn.Sequential(*[Block() for _ in range(n)], nn.LayerNorm(D), nn.Linear(D, V))

    def forward(self, x, target=None):
        return self.layers(x)


class PipeTPDecoder(nn.Module):
    """:class:`PipeDecoder` of blocks tensor parallelism splits into 2 (whole heads and MLP features a
    rank), width ``TP_D``."""

    def __init__(self, n: int = 3):
        super().__init__()
        self.layers = nn.Sequential(*[TPBlock(TP_D, 2 * TP_D) for _ in range(n)], nn.LayerNorm(TP_D),
                                    nn.Linear(TP_D, V))

    def forward(self, x, target=None):
        return self.layers(x)


TP_D = 24


def mse(out, target):
    return ((out - target) ** 2).mean()


def _stage(model, mesh):
    """Stage ``rank`` of ``world_size``: the model's layers split as evenly as they go."""
    rank, stages = mesh.get_local_rank(), mesh.size()
    cuts = [round(i * len(model.layers) / stages) for i in range(stages + 1)]
    return PipelineStage(model.layers[cuts[rank]:cuts[rank + 1]], rank, stages, torch.device("cpu"))


def gpipe(model, mesh):
    return ScheduleGPipe(_stage(model, mesh), n_microbatches=MICROBATCHES, loss_fn=mse)


def one_f_one_b(model, mesh):
    return Schedule1F1B(_stage(model, mesh), n_microbatches=MICROBATCHES, loss_fn=mse)


def _two_stages(model, mesh, shape="loop"):
    """Two stages per rank of ``2 x ranks``: looped (rank r runs stages r and r + ranks) or in a V
    (stages r and 2 x ranks - 1 - r: rank 0 holds the first and the last)."""
    rank, ranks = mesh.get_local_rank(), mesh.size()
    stages = 2 * ranks
    cuts = [round(i * len(model.layers) / stages) for i in range(stages + 1)]
    own = (rank, rank + ranks) if shape == "loop" else (rank, stages - 1 - rank)
    return [PipelineStage(model.layers[cuts[s]:cuts[s + 1]], s, stages, torch.device("cpu")) for s in own]


def interleaved(model, mesh):
    return ScheduleInterleaved1F1B(_two_stages(model, mesh), n_microbatches=MICROBATCHES, loss_fn=mse)


def looped_bfs(model, mesh):
    return ScheduleLoopedBFS(_two_stages(model, mesh), n_microbatches=MICROBATCHES, loss_fn=mse)


def interleaved_zero_bubble(model, mesh):
    return ScheduleInterleavedZeroBubble(_two_stages(model, mesh), n_microbatches=MICROBATCHES, loss_fn=mse)


def zbv(model, mesh):
    return ScheduleZBVZeroBubble(_two_stages(model, mesh, "v"), n_microbatches=MICROBATCHES, loss_fn=mse)


def dualpipe_v(model, mesh):
    return ScheduleDualPipeV(_two_stages(model, mesh, "v"), n_microbatches=MICROBATCHES, loss_fn=mse)


def train(schedule, opt, x, target):
    """A pipeline's training step as scripts write it: inputs to the first stage, the target to the last."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    if rank == 0:
        schedule.step(x)
    elif rank == last:
        losses = []
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    opt.step()
    opt.zero_grad()


def train_held(schedule, opt, x, target):
    """The step torchtitan writes: the stages a rank holds say what it hands ``schedule.step`` (in a V,
    rank 0 holds the first and the last stage: the inputs and the target)."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    if first and last:
        schedule.step(x, target=target, losses=[])
    elif first:
        schedule.step(x)
    elif last:
        schedule.step(target=target, losses=[])
    else:
        schedule.step()
    opt.step()
    opt.zero_grad()


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def _mesh_stage(model, mesh, schedule, ddp=False):
    """Stage ``mesh["pp"]``'s local rank of its size, over the mesh's ``"pp"`` dim: its blocks tensor
    parallel over ``"tp"`` and sharded by FSDP2 over ``"dp"`` where the mesh has those dims (torchtitan's
    order: tensor parallelism, then fully_shard of each block and of the stage)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    names = mesh.mesh_dim_names
    pp = mesh["pp"]
    rank, stages = pp.get_local_rank(), pp.size()
    cuts = [round(i * len(model.layers) / stages) for i in range(stages + 1)]
    part = model.layers[cuts[rank]:cuts[rank + 1]]
    blocks = [m for m in part if type(m).__name__ in ("Block", "TPBlock")]
    if "tp" in names:
        for block in blocks:
            parallelize_module(block, mesh["tp"], _block_plan())
    # FSDP2 over "dp", or HSDP over ("replicate", "shard"): replicated over the first, sharded over the second
    dp = mesh["dp"] if "dp" in names else mesh["replicate", "shard"] if "replicate" in names else None
    if dp is not None and ddp:  # DDP over "dp": the stage's gradients all-reduced in its buckets
        from torch.nn.parallel import DistributedDataParallel
        part = DistributedDataParallel(part, process_group=dp.get_group())
    elif dp is not None:
        for block in blocks:
            fully_shard(block, mesh=dp)
        fully_shard(part, mesh=dp)
    return schedule(PipelineStage(part, rank, stages, torch.device("cpu"), group=pp.get_group()),
                    n_microbatches=MICROBATCHES, loss_fn=mse)


def pp_fsdp(model, mesh):
    """Pipeline stages over ``"pp"``, each sharded by FSDP2 over ``"dp"`` (1F1B)."""
    return _mesh_stage(model, mesh, Schedule1F1B)


def pp_ddp(model, mesh):
    """Pipeline stages over ``"pp"``, each wrapped by DDP over ``"dp"`` (1F1B)."""
    return _mesh_stage(model, mesh, Schedule1F1B, ddp=True)


def pp_hsdp(model, mesh):
    """Pipeline stages over ``"pp"``, each sharded by HSDP over ``("replicate", "shard")`` (1F1B)."""
    return _mesh_stage(model, mesh, Schedule1F1B)


def pp_fsdp_gpipe(model, mesh):
    return _mesh_stage(model, mesh, ScheduleGPipe)


def pp_tp(model, mesh):
    """Pipeline stages over ``"pp"``, their blocks tensor parallel over ``"tp"`` (1F1B)."""
    return _mesh_stage(model, mesh, Schedule1F1B)


def pp_fsdp_tp(model, mesh):
    """torchtitan's 3-D layout: pipeline over ``"pp"``, FSDP2 over ``"dp"``, tensor parallel over ``"tp"``."""
    return _mesh_stage(model, mesh, Schedule1F1B)


def train_staged(schedule, opt, x, target):
    """:func:`train` for a rank of a mesh of several dims: the stage, not the global rank, says what it is handed."""
    stage = schedule._stage
    if stage.is_first:
        schedule.step(x)
    elif stage.is_last:
        schedule.step(target=target, losses=[])
    else:
        schedule.step()
    opt.step()
    opt.zero_grad()
