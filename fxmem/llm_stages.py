"""Pipeline stages of a Hugging Face causal LM: its decoder layers split evenly over the ``"pp"`` dim of
a mesh, as :func:`fxmem.llm` analyses ``pp=P`` (``fxmem llm --pp P``).

The split follows the model's own pipeline plan (its config's ``base_model_pp_plan``: the embedding
makes ``inputs_embeds`` from ``input_ids``, the layers map hidden states to hidden states, the final
norm): stage 0 holds the embedding and the first layers, the last stage the last layers, the norm and
the head, and computes the loss with the model's own ``loss_function`` (the logits upcast, labels
shifted, cross entropy). Each stage runs the base model's own ``forward`` over its layers (stage
``s > 0`` with ``inputs_embeds=`` the hidden states received), so the causal mask and the rotary
positions are made as in the whole model. The schedule is one of :data:`SCHEDULES` (torchtitan's
names; ``1F1B`` unless asked) over ``microbatches`` micro-batches (default one per stage): those of
two stages a rank split the layers into ``2P`` stages, rank ``r`` running ``r`` and ``r + P``
(looped) or ``r`` and ``2P - 1 - r`` (in a V: rank 0 holds the first and the last). Within a
stage, tensor parallelism (``"tp"``, the model's own plan) and FSDP2 on every decoder layer and the
stage (``"dp"``) as :func:`fxmem.llm.fsdp_tp_per_block`.

>>> answer = fxmem.llm(model, batch=8, seq=1024, pp=2)            # doctest: +SKIP
>>> [s.stage for s in answer.stages]                               # doctest: +SKIP
[0, 1]
"""
from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from .errors import SpecError

# the architectures whose base model's forward is Llama's (embedding, then the layers, then the norm,
# nothing between them that a stage given inputs_embeds would run again): a split of theirs computes
# what the whole model does
SPLITTABLE = ("llama", "mistral", "qwen2", "qwen3")
_PLAN = ("embed_tokens", "layers", "norm")
# the schedules (torchtitan's names): torch.distributed.pipelining's class, the stages a rank runs and
# their order ("loop": r, r + P; "v": r, 2P - 1 - r); each checked against real runs (tests/llm/test_llm.py)
SCHEDULES = {"1F1B": ("Schedule1F1B", 1, "loop"), "GPipe": ("ScheduleGPipe", 1, "loop"),
             "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2, "loop"), "LoopedBFS": ("ScheduleLoopedBFS", 2, "loop"),
             "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
             "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2, "v"), "DualPipeV": ("ScheduleDualPipeV", 2, "v")}


def schedule_named(name: str) -> str:
    """The key of :data:`SCHEDULES` ``name`` means (any case); a SpecError listing them otherwise."""
    found = {k.lower(): k for k in SCHEDULES}.get(str(name).lower())
    if found is None:
        raise SpecError(f"schedule={name!r}: use one of {', '.join(SCHEDULES)} (torchtitan's names)")
    return found


def own_stages(rank: int, ranks: int, schedule: str) -> list[int]:
    """The stages (of ``ranks`` x its stages a rank) that pipeline rank ``rank`` runs under ``schedule``."""
    _, per_rank, order = SCHEDULES[schedule]
    if per_rank == 1:
        return [rank]
    return [rank, rank + ranks] if order == "loop" else [rank, 2 * ranks - 1 - rank]


def stage_layers(layers: int, stage: int, stages: int) -> range:
    """Which of ``layers`` decoder layers stage ``stage`` of ``stages`` holds (as even as they go)."""
    return range(round(stage * layers / stages), round((stage + 1) * layers / stages))


def check(model: torch.nn.Module, pp: int, schedule: str = "1F1B") -> None:
    """Refuse a model whose split fxmem does not make (a SpecError naming why)."""
    hf = model.model if hasattr(model, "model") and hasattr(model.model, "base_model") else model
    config = getattr(hf, "config", None)
    kind = getattr(config, "model_type", type(hf).__name__)
    plan = tuple(getattr(config, "base_model_pp_plan", None) or ())
    if kind not in SPLITTABLE or plan != _PLAN:
        raise SpecError(f"pp=: fxmem splits {', '.join(SPLITTABLE)} models into pipeline stages (their base model "
                        f"runs embed_tokens, layers, norm and nothing between); a {kind} model is not split yet: "
                        f"use fxmem.analyze with your own PipelineStage split (see fxmem.distributed.pipeline)")
    layers = len(hf.base_model.layers)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise SpecError(f"pp={pp!r}: the number of pipeline stages, an int >= 2")
    stages = pp * SCHEDULES[schedule][1]
    if stages > layers:
        raise SpecError(f"pp={pp}: the model has {layers} decoder layers, fewer than the {stages} stages"
                        f"{f' ({schedule} runs {stages // pp} a rank)' if stages > pp else ''}; use pp <= "
                        f"{layers // (stages // pp)}")


class CausalLMStage(torch.nn.Module):
    """Stage ``stage`` of ``stages`` of the causal LM ``hf``: its slice of the decoder layers; the
    embedding on the first stage, the norm and the head on the last. The stage runs a copy of the
    base model object of its own (its own table of submodules, the layers shared); :func:`drop_split`
    then takes them all out of ``hf`` (fxmem's copy), so that a rank holds its stages' parameters only.
    ``forward(x)``: token ids (first stage) or hidden states in, hidden states or logits out."""

    def __init__(self, hf: torch.nn.Module, stage: int, stages: int):
        super().__init__()
        source = hf.base_model
        base = copy.copy(source)  # (the base model's forward, config and rotary embedding; tables of its own)
        for name, table in vars(source).items():
            if name.startswith("_") and isinstance(table, dict):
                object.__setattr__(base, name, type(table)(table))
        held = stage_layers(len(source.layers), stage, stages)
        base.layers = torch.nn.ModuleList(list(source.layers)[held.start:held.stop])
        self.first, self.last = stage == 0, stage == stages - 1
        if not self.first:
            base.embed_tokens = None
        if not self.last:
            base.norm = torch.nn.Identity()
        self.base = base
        self.head = hf.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = dict(input_ids=x) if self.first else dict(inputs_embeds=x)
        hidden = self.base(**given, use_cache=False).last_hidden_state
        return self.head(hidden) if self.last else hidden


def causal_lm_loss(hf: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own training loss of one micro-batch (``labels``: its input ids)."""
    return hf.loss_function(logits=logits, labels=labels, vocab_size=hf.config.vocab_size)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers (what FSDP2 shards one by one): the model's ``_no_split_modules`` classes."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in model.modules() if type(m).__name__ in names]


def drop_split(hf: torch.nn.Module) -> None:
    """Take the decoder layers, the embedding, the norm and the head out of ``hf`` (fxmem's copy)
    once its stages hold theirs: what no stage of this rank runs is freed, as a real rank's split frees it."""
    base = hf.base_model
    base.layers = torch.nn.ModuleList()
    base.embed_tokens, base.norm, hf.lm_head = None, torch.nn.Identity(), None


def pipeline_per_stage(model: torch.nn.Module, mesh: Any, microbatches: int, plan: dict | None = None,
                       schedule: str = "1F1B") -> Any:
    """``parallelize=`` of a training step module (:class:`fxmem.llm.CausalLMStep`) over ``mesh``:
    this rank's stages (of the ``"pp"`` dim's local rank; a 1-D mesh is the pipeline alone), tensor
    parallel over ``"tp"`` by ``plan`` (the model's own, :func:`fxmem.llm.tensor_parallel_plan`) and
    sharded by FSDP2 over ``"dp"`` where the mesh has them, in ``schedule`` (a :data:`SCHEDULES` key)
    of ``microbatches``."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    names = mesh.mesh_dim_names or ()
    pp = mesh["pp"] if "pp" in names else mesh
    hf = model.model
    kind, per_rank, _ = SCHEDULES[schedule]
    rank, ranks = pp.get_local_rank(), pp.size()
    own = own_stages(rank, ranks, schedule)
    parts = [CausalLMStage(hf, s, ranks * per_rank) for s in own]
    drop_split(hf)
    for part in parts:
        if "tp" in names:
            if plan is None:
                raise SpecError("pipeline_per_stage: a mesh with a 'tp' dim needs plan= (the tensor-parallel plan)")
            parallelize_module(part.base, mesh["tp"], plan)
        if "dp" in names:
            for block in decoder_layers(part):
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
    # every rank's schedule gets the loss: without one torch's schedules run no backward on that rank
    loss = functools.partial(causal_lm_loss, hf)
    device = next(iter(parts[0].parameters())).device
    stages = [pipelining.PipelineStage(part, s, ranks * per_rank, device, group=pp.get_group())
              for part, s in zip(parts, own)]
    return getattr(pipelining, kind)(stages[0] if per_rank == 1 else stages, n_microbatches=microbatches,
                                     loss_fn=loss)


def train_stage(schedule: Any, optimizer: Any, input_ids: torch.Tensor, attention_mask: Any = None) -> None:
    """``step=`` of a stage: the token ids into the first stage, the same ids as the labels of the last
    (``labels=input_ids``, as :class:`fxmem.llm.CausalLMStep`), then the optimizer. The attention mask
    of unpadded sequences (all ones) is not sent: each stage makes the causal mask."""
    from . import _torch_compat as tc

    stages = tc.schedule_stages(schedule)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    if first and last:  # a V-shaped schedule's rank 0
        schedule.step(input_ids, target=input_ids, losses=[])
    elif first:
        schedule.step(input_ids)
    elif last:
        schedule.step(target=input_ids, losses=[])
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad()


def mesh(pp: int, fsdp: int | None, tp: int | None) -> dict:
    """The mesh of a layout, torchtitan's order: ``{"pp": P, "dp": W, "tp": T}`` (the dims given)."""
    return {k: v for k, v in (("pp", pp), ("dp", fsdp), ("tp", tp)) if v is not None}


def check_microbatches(batch: int, microbatches: int) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise SpecError(f"microbatches={microbatches!r}: a positive int")
    if batch % microbatches:
        raise SpecError(f"batch={batch} does not split into {microbatches} equal micro-batches (torch's stages size "
                        f"their receive buffers from the first); use a batch that microbatches={microbatches} divides")

