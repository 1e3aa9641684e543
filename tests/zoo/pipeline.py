"""Models, pipeline splits and steps for tests/distributed/test_pipeline.py, at module level so that the
gloo processes (spawned) can import them."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                         ScheduleLoopedBFS)

from .distributed import Block, D, V

MICROBATCHES = 4


class PipeDecoder(nn.Module):
    """Blocks, a norm and a head in one ``nn.Sequential`` (split into stages by slicing it); the
    second argument is the target the last stage's loss reads (the whole model ignores it)."""

    def __init__(self, n: int = 3):
        super().__init__()
        self.layers = nn.Sequential(*[Block() for _ in range(n)], nn.LayerNorm(D), nn.Linear(D, V))

    def forward(self, x, target=None):
        return self.layers(x)


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


def interleaved(model, mesh):
    """Two stages per rank, looped: rank r runs stages r and r + ranks of 2 x ranks."""
    rank, ranks = mesh.get_local_rank(), mesh.size()
    stages = 2 * ranks
    cuts = [round(i * len(model.layers) / stages) for i in range(stages + 1)]
    own = [PipelineStage(model.layers[cuts[s]:cuts[s + 1]], s, stages, torch.device("cpu"))
           for s in (rank, rank + ranks)]
    return ScheduleInterleaved1F1B(own, n_microbatches=MICROBATCHES, loss_fn=mse)


def looped_bfs(model, mesh):
    return ScheduleLoopedBFS([_stage(model, mesh)], n_microbatches=MICROBATCHES, loss_fn=mse)


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


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)
