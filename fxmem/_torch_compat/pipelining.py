"""``torch.distributed.pipelining``: a schedule's stages, and the start-up messages its stages
exchange, answered in one process.

A ``PipelineStage`` learns its neighbours' shapes at the schedule's first ``step()``
(``_PipelineSchedule._initialize_pp_stages``): a vote on the inference mode
(``_warmup_p2p``: an int32 passed from stage 0 to the last and back, read with ``.item()``),
then, unless every stage was built with ``input_args`` and ``output_args`` (STATIC), its
output metadata sent forward and its input-gradient metadata sent back as pickled objects
(``PipelineStage._send_meta`` / ``_recv_meta``: ``dist.send_object_list``). torch's fake process
group carries none of them (a receive leaves its buffer as it was: the object's size is garbage).
:func:`messages` routes those three calls to an exchange in Python; everything after the start-up
(the micro-batches' activation and gradient sends, the schedule itself) is torch's own code.

On a torch upgrade, what breaks here: ``_PipelineSchedule._warmup_p2p`` (its signature, and that
it sets ``stage._inference_mode``), ``PipelineStage._send_meta`` / ``_recv_meta`` /
``_post_metadata_inference_cleanup`` / ``_user_meta``, ``InferenceMode.needs_dynamic``, the
schedules' ``_stage`` / ``_stages``, the stages' ``args_recv_info`` / ``grad_recv_info`` /
``output_chunks``; torch older than 2.13 has none of the vote and sends its metadata otherwise
(refused by :func:`messages`).

Imports nothing of fxmem's.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Protocol


def pipeline_schedule_type() -> type | None:
    """``torch.distributed.pipelining``'s schedule base class, where that package is imported
    already (a schedule exists only then); else None."""
    module = sys.modules.get("torch.distributed.pipelining.schedules")
    return getattr(module, "_PipelineSchedule", None) if module is not None else None


def is_pipeline_schedule(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.pipelining`` schedule (``ScheduleGPipe``, ...)."""
    base = pipeline_schedule_type()
    return base is not None and isinstance(obj, base)


def is_pipelining_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is a schedule or stage of ``torch.distributed.pipelining`` refusing how it is
    set up or called (``PipeliningMetadataError``: the last stage called without ``target=``,
    neighbouring stages that disagree on what they send): not a check of the input's shapes."""
    module = sys.modules.get("torch.distributed.pipelining._utils")
    refusal = getattr(module, "PipeliningMetadataError", None) if module is not None else None
    return refusal is not None and isinstance(exc, refusal)


def schedule_stages(schedule: Any) -> list:
    """The stages ``schedule`` runs on this rank (one, or several for the looped/interleaved ones)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def schedule_microbatches(schedule: Any) -> int:
    """The micro-batches ``schedule.step`` splits its inputs into (``n_microbatches``)."""
    return int(schedule._n_microbatches)


def stage_index(stage: Any) -> int:
    return int(stage.stage_index)


def stage_static_vote(stage: Any, has_backward: bool) -> bool:
    """The stage's vote: True where it was built with enough metadata to skip inference (STATIC)."""
    from torch.distributed.pipelining._utils import InferenceMode
    return not InferenceMode.needs_dynamic(stage._user_meta, has_backward)


class Exchange(Protocol):
    """What :func:`messages` asks: the pipeline's vote, and the metadata objects stages send."""

    def vote(self, stages: list, votes: list[bool]) -> bool:
        """True (STATIC) or False (DYNAMIC), given this rank's ``stages`` and their ``votes``."""

    def recv(self, stage: Any, src_stage: int) -> Any:
        """The object stage ``src_stage`` sends ``stage``."""

    def send(self, stage: Any, meta: Any, dst_stage: int) -> None:
        """``stage`` sends ``meta`` to stage ``dst_stage``."""

    def initialized(self, stage: Any) -> None:
        """``stage`` has finished its start-up (its metadata inference, if any)."""

    def uneven(self, n_microbatches: int, shapes: list) -> None:
        """A step's inputs split into micro-batches of unequal ``shapes`` (raises: a stage sizes
        its receive buffers from the first micro-batch, so a real run fails there)."""


@contextlib.contextmanager
def messages(exchange: Exchange) -> Iterator[None]:
    """While the block runs, every ``PipelineStage``'s start-up vote and metadata messages go to
    ``exchange`` instead of the process group; set back on exit."""
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.stage import PipelineStage

    needed = [(schedules._PipelineSchedule, "_warmup_p2p"), (PipelineStage, "_send_meta"),
              (PipelineStage, "_recv_meta"), (PipelineStage, "_post_metadata_inference_cleanup")]
    missing = [f"{owner.__name__}.{name}" for owner, name in needed if name not in vars(owner)]
    if missing:
        raise NotImplementedError(f"this torch's pipelining has no {', '.join(missing)} (torch 2.13's start-up "
                                  f"protocol is the one fxmem answers)")
    original_warmup = schedules._PipelineSchedule._warmup_p2p
    original_cleanup = PipelineStage._post_metadata_inference_cleanup
    original_split = schedules.split_args_kwargs_into_chunks

    def split(args: Any, kwargs: Any, chunks: int, *more: Any, **options: Any) -> Any:
        args_split, kwargs_split = original_split(args, kwargs, chunks, *more, **options)
        shapes = [[tuple(t.shape) for t in _tensors((a, k))] for a, k in zip(args_split, kwargs_split)]
        if any(s != shapes[0] for s in shapes[1:]):  # (on symbolic sizes: a guard, B divisible by chunks)
            exchange.uneven(chunks, shapes)
        return args_split, kwargs_split

    def warmup_p2p(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        if not all(isinstance(s, PipelineStage) for s in stages):
            return original_warmup(self, stages, has_backward, p2p_done)
        static = exchange.vote(stages, [stage_static_vote(s, has_backward) for s in stages])
        for s in stages:
            s._inference_mode = InferenceMode.STATIC if static else InferenceMode.DYNAMIC

    def cleanup(self: Any) -> None:
        original_cleanup(self)
        exchange.initialized(self)

    replaced = [(schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p),
                (PipelineStage, "_send_meta", lambda self, meta, dst: exchange.send(self, meta, dst)),
                (PipelineStage, "_recv_meta", lambda self, src: exchange.recv(self, src)),
                (PipelineStage, "_post_metadata_inference_cleanup", cleanup),
                (schedules, "split_args_kwargs_into_chunks", split)]
    originals = [(owner, name, vars(owner)[name]) for owner, name, _ in replaced]
    try:
        for owner, name, value in replaced:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(originals):
            setattr(owner, name, value)


def _tensors(tree: Any) -> list:
    from torch.utils._pytree import tree_leaves
    import torch
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def stage_buffers(schedule: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of what the schedule's stages keep between steps: the receive buffers made
    at start-up - per micro-batch, one per input activation (not on the first stage) and one per
    output gradient (not on the last) - the gradients a backward left on the activation buffers,
    and the last stage's outputs of the step before (each ``step()`` clears them as it starts)."""
    import torch

    out = []
    for stage in schedule_stages(schedule):
        s = stage_index(stage)
        for kind, infos in (("activation", stage.args_recv_info), ("gradient", stage.grad_recv_info)):
            for chunk, recv in sorted(infos.items()):
                for i, info in enumerate(recv):
                    buffer = getattr(info, "buffer", None)
                    if buffer is None:
                        continue
                    out.append((f"stage {s} {kind} receive buffer {i}, micro-batch {chunk}", buffer))
                    if isinstance(buffer, torch.Tensor) and buffer.grad is not None:
                        # a backward that accumulates into the received activation (the zero-bubble
                        # schedules' input-gradient pass) leaves its .grad on the buffer until the
                        # next step()'s clear_runtime_states sets it to None
                        out.append((f"stage {s} {kind} receive buffer {i}'s gradient, micro-batch {chunk} (kept "
                                    f"until the next step)", buffer.grad))
        for chunk, output in enumerate(getattr(stage, "output_chunks", ())):  # the last stage's, for step()'s return
            for i, t in enumerate(output if isinstance(output, (tuple, list)) else [output]):
                out.append((f"stage {s} output {i} of micro-batch {chunk} (kept until the next step)", t))
    return out


@contextlib.contextmanager
def sends(record: Any) -> Iterator[None]:
    """While the block runs, ``record(tensor)`` is called with every tensor a schedule sends to
    another stage (the ``isend`` ops its ``_batch_p2p`` posts: activations forward, gradients
    back); the sends themselves go on as before. Set back on exit."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules

    original = vars(schedules).get("_batch_p2p")
    if original is None:
        raise NotImplementedError("this torch's pipelining schedules have no _batch_p2p (torch 2.13's is the one "
                                  "fxmem reads the sends from)")

    def batch_p2p(p2p_ops: list, *args: Any, **kwargs: Any) -> Any:
        for op in p2p_ops:
            if op.op is dist.isend:
                record(op.tensor)
        return original(p2p_ops, *args, **kwargs)

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original
