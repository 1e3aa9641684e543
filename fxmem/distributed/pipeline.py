"""Pipeline parallelism: one rank's stage of a ``torch.distributed.pipelining`` schedule, its step
simulated by torch's own schedule code.

The user's ``parallelize=fn(model, mesh)`` splits the model as their script does, builds this
rank's ``PipelineStage`` and returns the **schedule**; ``step=fn(schedule, optimizer, *inputs)``
is their training step, which calls ``schedule.step(...)`` (inputs on the first stage, the target
on the last) and the optimizer. The optimizer is built over the stage's parameters. fxmem runs the
schedule's own code on fake tensors, so the micro-batches in flight are the schedule's: GPipe keeps
every micro-batch's saved tensors until its backward pass, 1F1B at most ``stages - stage_index``;
ScheduleInterleaved1F1B, ScheduleLoopedBFS and the zero-bubble schedules run several stages a rank
(built as a list, each its own PipelineStage; ScheduleZBVZeroBubble and ScheduleDualPipeV in a V:
rank ``r`` of ``R`` holds stages ``r`` and ``2R - 1 - r``, so rank 0 holds the first and the last).
The zero-bubble schedules split each backward in two - the input gradients first (keeping the
graph), the weights' later - and keep the gradients of the activations they received until the
next step starts.
On a mesh of several dims (``mesh={"pp": 2, "dp": 2, "tp": 2}``) the stage is its ``mesh["pp"]``
coordinate's, FSDP2 (over ``"dp"``, or HSDP over two dims) or DDP (over ``"dp"``) and tensor
parallelism (over ``"tp"``) inside it: the schedule runs their collectives in each micro-batch's
forward and backward.

>>> def parallelize(model, mesh):                                      # doctest: +SKIP
...     rank, stages = mesh.get_local_rank(), mesh.size()
...     part = model.layers[:2] if rank == 0 else model.layers[2:]
...     stage = PipelineStage(part, rank, stages, torch.device("cpu"))
...     return Schedule1F1B(stage, n_microbatches=4, loss_fn=mse)
>>> def step(schedule, opt, x, y):                                     # doctest: +SKIP
...     rank, last = dist.get_rank(), dist.get_world_size() - 1
...     if rank == 0: schedule.step(x)
...     elif rank == last: schedule.step(target=y)
...     else: schedule.step()
...     opt.step(); opt.zero_grad()
>>> fxmem.analyze(model, ("B", 16), ("B", 16), world_size=2, rank=1, parallelize=parallelize,
...               step=step, optimizer=lambda p: torch.optim.Adam(p))  # doctest: +SKIP

A stage learns its neighbours' shapes in the schedule's first ``step()``, from messages the fake
process group does not carry (see :mod:`fxmem._torch_compat.pipelining`). :func:`start_up` gets
them as the real ranks would: it builds every rank's stage (the user's ``fn`` with that rank's
mesh, on a copy of the model) and runs each rank's step until its start-up is done, in turn,
passing on what each sends - the vote on the inference mode, the forward metadata stage ``s``
sends ``s + 1`` and the gradient metadata ``s + 1`` sends back. The analysed rank's step then
runs with those answers; its micro-batches' sends and receives do nothing (the values received
are garbage, the buffers real).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from .. import _torch_compat as tc
from ..errors import InternalError, ModelError, ShapeError, SpecError

# the schedules checked against real runs, in one process and on gloo (tests/distributed/test_pipeline.py)
MODELLED = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
            "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")

STEP_NEEDED = ("a pipeline schedule runs from your own step: pass step=fn, fn(schedule, optimizer, *inputs) calling "
               "schedule.step(x) on the first stage, schedule.step(target=y) on the last, schedule.step() between "
               "(the rank is dist.get_rank()), then optimizer.step() and optimizer.zero_grad()")


class _Blocked(BaseException):
    """A rank's start-up waits for a message not sent yet (a BaseException: it passes through the
    user's ``except Exception`` and fxmem's error naming, as a real rank's wait would)."""

    def __init__(self, key: tuple) -> None:
        super().__init__(key)
        self.key = key


class _Done(BaseException):
    """A rank's start-up is over: what it sends is sent."""


class Mailbox:
    """The start-up messages of one pipeline (``tc.pipeline_messages``'s exchange): each rank's
    vote, and each metadata object by ``(from stage, to stage)``. ``rank``: the rank whose step runs
    now; ``peer``: True while :func:`start_up` runs it (a missing message blocks it, the end of its
    start-up stops it), False for the analysed step (a missing message is fxmem's failure)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.votes: dict[int, bool] = {}
        self.sent: dict[tuple[int, int], Any] = {}
        self.rank = 0
        self.peer = False

    def has(self, key: tuple) -> bool:
        if key == ("vote",):
            return len(self.votes) == self.world_size
        return key in self.sent

    def _wait(self, key: tuple) -> None:
        if self.peer:
            raise _Blocked(key)
        raise InternalError(f"rank {self.rank}'s pipeline start-up waits for {_said(key)}, which no rank sent when "
                            f"fxmem ran their steps in turn (do all ranks build their stages and call schedule.step() "
                            f"alike?)")

    def vote(self, stages: list, votes: list[bool]) -> bool:
        self.votes[self.rank] = all(votes)
        if not self.has(("vote",)):
            self._wait(("vote",))
        return all(self.votes.values())

    def recv(self, stage: Any, src_stage: int) -> Any:
        key = (src_stage, tc.stage_index(stage))
        if key not in self.sent:
            self._wait(key)
        return self.sent[key]

    def send(self, stage: Any, meta: Any, dst_stage: int) -> None:
        self.sent[(tc.stage_index(stage), dst_stage)] = meta

    def initialized(self, stage: Any) -> None:
        if self.peer:
            raise _Done()

    def uneven(self, n_microbatches: int, shapes: list) -> None:
        raise ShapeError(f"the pipeline's inputs do not split into {n_microbatches} equal micro-batches at these "
                         f"sizes: torch's stages size their receive buffers from the first micro-batch, so a real run "
                         f"fails at a later one; use a batch size that {n_microbatches} (n_microbatches) divides")


def _said(key: tuple) -> str:
    if key == ("vote",):
        return "every rank's vote on the inference mode"
    src, dst = key
    return f"the {'activation' if src < dst else 'gradient'} metadata stage {src} sends stage {dst}"


def start_up(mailbox: Mailbox, run_rank: Callable[[int, Mailbox], None]) -> Mailbox:
    """Fill ``mailbox`` with the messages of the pipeline's start-up: ``run_rank(j, mailbox)`` runs
    rank ``j``'s step (its own stage built afresh) while ``tc.pipeline_messages(mailbox)`` answers;
    each rank is run again when the message it waited for has been sent, until no rank can go
    further."""
    world_size = mailbox.world_size
    waiting: dict[int, tuple | None] = {j: None for j in range(world_size)}
    done: set[int] = set()
    progress = True
    while progress and len(done) < world_size:
        progress = False
        for j in range(world_size):
            if j in done or (waiting[j] is not None and not mailbox.has(waiting[j])):
                continue
            mailbox.rank, mailbox.peer = j, True
            try:
                run_rank(j, mailbox)
                done.add(j)  # a step that never starts a stage up (the user's step skipped it)
            except _Blocked as blocked:
                waiting[j] = blocked.key
            except _Done:
                done.add(j)
            finally:
                mailbox.peer = False
            progress = True
    return mailbox


def stage_ranks(layout: dict) -> list[int]:
    """The first rank of each stage of mesh ``layout`` (``{dim name: size}``, row-major as a
    DeviceMesh numbers its ranks): the ranks whose other coordinates are all 0."""
    names = list(layout)
    stride = math.prod(layout[n] for n in names[names.index("pp") + 1:])
    return [s * stride for s in range(layout["pp"])]


def is_pipeline(obj: Any) -> bool:
    """Whether ``obj`` (what ``parallelize=`` returned) is a pipeline schedule."""
    return tc.is_pipeline_schedule(obj)


def stage_model(schedule: Any) -> torch.nn.Module:
    """The module whose parameters this rank trains: the stage's submodule, or for a schedule of
    several stages per rank (interleaved) a ``ModuleList`` of theirs. Refuses what is not modelled."""
    name = type(schedule).__name__
    if name not in MODELLED:
        raise ModelError(f"parallelize= returned a {name}, a pipeline schedule fxmem does not model yet (it models "
                         f"{', '.join(MODELLED)}); analyse with one of those, whose micro-batches in flight are "
                         f"checked against real runs")
    stages = tc.schedule_stages(schedule)
    kinds = {type(s).__name__ for s in stages}
    if kinds != {"PipelineStage"}:
        raise ModelError(f"parallelize=: the schedule's stages are {', '.join(sorted(kinds))}; fxmem models the manual "
                         f"front end, torch.distributed.pipelining.PipelineStage(submodule, stage_index, num_stages, "
                         f"device) (not pipeline() / build_stage)")
    modules = [s.submod for s in stages]
    return modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)


def check(training: Any) -> None:
    """Refuse the analyses of a pipeline that are not modelled: a forward alone, the default step."""
    if training is None or training.step is None:
        raise SpecError(f"parallelize= returned a pipeline schedule; {STEP_NEEDED} (and optimizer=)")


def handed(schedule: Any, step: Callable) -> Callable:
    """``step`` as the simulation calls it, ``step(model, optimizer, *inputs)``: the user's
    ``step(schedule, optimizer, *inputs)`` (the model handed, the stage's module, is the one the
    schedule calls)."""
    @functools.wraps(step)
    def run(model: Any, optimizer: Any, *inputs: Any) -> Any:
        return step(schedule, optimizer, *inputs)
    return run


def real_start_up(world_size: int, make_model: Callable[[], torch.nn.Module], parallelize: Callable,
                  optimizer: Callable, inputs: tuple, step: Callable, dims: tuple | None = None) -> Mailbox:
    """:func:`start_up` of real ranks' steps, each in torch's fake process group of its rank, for a
    real run of one rank in one process (:func:`fxmem.distributed.real_runs.measure_synchronous`)."""
    import gc

    def run_rank(rank: int, mailbox: Mailbox) -> None:
        with tc.fake_process_group(world_size, rank, dims=dims) as mesh:
            torch.manual_seed(0)
            schedule = parallelize(make_model(), mesh)
            step(schedule, optimizer(list(stage_model(schedule).parameters())), *inputs)

    mailbox = Mailbox(world_size)
    with tc.pipeline_messages(mailbox):
        start_up(mailbox, run_rank)
    gc.collect()  # the other ranks' stages and models: gone before the measured rank starts
    return mailbox


def name_buffers(table: Any, schedule: Any) -> None:
    """Name in ``table`` the receive buffers ``schedule``'s stages keep from their start-up on
    (found among what the warm-up step left alive): resident, as a wrapper's state is."""
    from ..records import Role

    for name, t in tc.stage_buffers(schedule):
        if not table.counts(t):
            continue
        index = table.lookup(t)
        if index is None:
            table.add(t, Role.CONSTANT, name)
        else:
            table.storages[index].role, table.storages[index].name = Role.CONSTANT, name
