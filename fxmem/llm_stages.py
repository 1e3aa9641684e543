"""Pipeline stages of a Hugging Face causal LM: its decoder layers split evenly over the ``"pp"`` dim of
a mesh, as :func:`fxmem.llm` analyses ``pp=P`` (``fxmem llm --pp P``).

The split follows the model's own pipeline plan (its config's ``base_model_pp_plan``: the embedding
makes ``inputs_embeds`` from ``input_ids``, the layers map hidden states to hidden states, the final
norm): stage 0 holds the embedding and the first layers, the last stage the last layers, the norm and
the head, and computes the loss with the model's own ``loss_function`` (the logits upcast, labels
shifted, cross entropy). Each stage runs the base model's own ``forward`` over its layers (stage
``s > 0`` with ``inputs_embeds=`` the hidden states received), so the causal mask and the rotary
positions are made as in the whole model. The schedule is ``Schedule1F1B`` with ``microbatches``
micro-batches (default ``P``); within a stage, tensor parallelism (``"tp"``, the model's own plan)
and FSDP2 on every decoder layer and the stage (``"dp"``) as :func:`fxmem.llm.fsdp_tp_per_block`.

>>> answer = fxmem.llm(model, batch=8, seq=1024, pp=2)            # doctest: +SKIP
>>> [s.stage for s in answer.stages]                               # doctest: +SKIP
[0, 1]
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from .errors import SpecError

# the architectures whose base model's forward is Llama's (embedding, then the layers, then the norm,
# nothing between them that a stage given inputs_embeds would run again): a split of theirs computes
# what the whole model does
SPLITTABLE = ("llama", "mistral", "qwen2", "qwen3")
_PLAN = ("embed_tokens", "layers", "norm")


def check(model: torch.nn.Module, pp: int) -> None:
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
    if pp > layers:
        raise SpecError(f"pp={pp}: the model has {layers} decoder layers, fewer than the stages; use pp <= {layers}")


class CausalLMStage(torch.nn.Module):
    """Stage ``stage`` of ``stages`` of the causal LM ``hf`` (changed in place: fxmem's copy): its
    slice of the decoder layers; the embedding on the first stage, the norm and the head on the last
    (the others' are dropped from ``hf``: a rank holds its stage's parameters only).
    ``forward(x)``: token ids (first stage) or hidden states in, hidden states or logits out."""

    def __init__(self, hf: torch.nn.Module, stage: int, stages: int):
        super().__init__()
        base = hf.base_model
        n = len(base.layers)
        cuts = [round(i * n / stages) for i in range(stages + 1)]
        base.layers = torch.nn.ModuleList(list(base.layers)[cuts[stage]:cuts[stage + 1]])
        self.first, self.last = stage == 0, stage == stages - 1
        if not self.first:
            base.embed_tokens = None
        if not self.last:  # what the stage does not run is not held (as a real rank's split frees it)
            base.norm = torch.nn.Identity()
            hf.lm_head = None
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


def pipeline_per_stage(model: torch.nn.Module, mesh: Any, microbatches: int, plan: dict | None = None) -> Any:
    """``parallelize=`` of a training step module (:class:`fxmem.llm.CausalLMStep`) over ``mesh``:
    this rank's stage (the ``"pp"`` dim's local rank; a 1-D mesh is the pipeline alone), tensor
    parallel over ``"tp"`` by ``plan`` (the model's own, :func:`fxmem.llm.tensor_parallel_plan`) and
    sharded by FSDP2 over ``"dp"`` where the mesh has them, in a ``Schedule1F1B`` of ``microbatches``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import parallelize_module

    names = mesh.mesh_dim_names or ()
    pp = mesh["pp"] if "pp" in names else mesh
    hf = model.model
    stage, stages = pp.get_local_rank(), pp.size()
    part = CausalLMStage(hf, stage, stages)
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
    device = next(iter(part.parameters())).device
    return Schedule1F1B(PipelineStage(part, stage, stages, device, group=pp.get_group()),
                        n_microbatches=microbatches, loss_fn=loss)


def train_stage(schedule: Any, optimizer: Any, input_ids: torch.Tensor, attention_mask: Any = None) -> None:
    """``step=`` of a stage: the token ids into the first stage, the same ids as the labels of the last
    (``labels=input_ids``, as :class:`fxmem.llm.CausalLMStep`), then the optimizer. The attention mask
    of unpadded sequences (all ones) is not sent: each stage makes the causal mask."""
    from . import _torch_compat as tc

    stage = tc.schedule_stages(schedule)[0]
    if stage.is_first:
        schedule.step(input_ids)
    elif stage.is_last:
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

