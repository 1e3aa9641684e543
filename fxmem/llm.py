"""Language models from a Hugging Face config: the model on the meta device (no weights, nothing
downloaded) and the first questions of an LLM user - how many parameters, how much the model
states take, the training step's peak at a batch and sequence length, and the largest batch and
sequence length that fit a GPU. ``fxmem llm config.json ...`` prints the same.

The training step is the one a Hugging Face user runs: ``model(input_ids=x, labels=x).loss``,
``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()`` (the loss computed inside the
model, as ``Trainer`` does), optionally with LoRA adapters (peft: the base frozen, so it has no
gradient and no optimizer state), gradient checkpointing, FSDP2 over ``fsdp`` ranks and tensor
parallelism over ``tp`` (per-rank numbers), in a named precision recipe (``recipe="amp-bf16"``: float32 master weights, the forward
under bfloat16 autocast; see :mod:`fxmem.recipes`; the default trains the model in its own dtype).
All byte counts are bytes.

>>> model = from_config({"model_type": "llama", "vocab_size": 128, "hidden_size": 32,
...                      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})
>>> answer = llm_answer(model, batch=2, seq=64, gpu="1GiB")   # doctest: +SKIP
>>> answer.parameters                                            # doctest: +SKIP
26784
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any, Callable

import sympy
import torch

from .accounting.symbolic import evaluate
from .errors import ModelError, SpecError
from .llm_stages import decoder_layers
from .units import format_bytes

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}


def _config(config: Any) -> Any:
    """A transformers config object from an object, a dict (with ``model_type``) or a path to a
    ``config.json`` (or the folder holding one)."""
    try:
        import transformers
    except ImportError as exc:
        raise ModelError("from_config needs the transformers package: pip install transformers") from exc
    if isinstance(config, transformers.PretrainedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise SpecError(f"from_config({os.fspath(config)!r}): no such file; give a config.json (the file "
                            f"Hugging Face models ship), its folder, a dict or a transformers config")
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise SpecError(f"from_config: {path} is not a JSON config ({exc})") from exc
    if not isinstance(config, dict):
        raise SpecError(f"from_config takes a transformers config, a dict or a config.json path, got "
                        f"{type(config).__name__}")
    kind = config.get("model_type")
    if not isinstance(kind, str):
        raise SpecError("from_config: the config has no 'model_type' (e.g. \"llama\"); it names the architecture")
    values = {k: v for k, v in config.items() if k != "model_type"}
    if kind not in transformers.CONFIG_MAPPING:
        raise SpecError(f"from_config: transformers does not know model_type {kind!r}; give the model_type of the "
                        f"model's config.json (e.g. \"llama\"), or upgrade transformers")
    try:
        return transformers.AutoConfig.for_model(kind, **values)
    except Exception as exc:  # transformers' (and huggingface_hub's strict dataclass) checks of the values
        why = " ".join(str(exc).split())
        raise SpecError(f"from_config: the config's values are not valid for model_type {kind!r}: {why}") from None


def from_config(config: Any, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The causal language model ``config`` describes, built on the meta device: no weights are
    allocated or downloaded, and fxmem analyses it as it would the real one.

    ``config``: a transformers config, a dict with ``model_type``, or a ``config.json`` path.
    ``dtype``: the parameters' dtype (default: the config's ``torch_dtype``/``dtype``, else float32).

    >>> from_config({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4}).lm_head   # doctest: +SKIP
    Linear(in_features=32, out_features=50257, bias=False)
    """
    import transformers

    cfg = _config(config)
    if dtype is None:
        # transformers >= 4.56 has dtype, and warns that torch_dtype is deprecated when it is read
        named = cfg.dtype if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)
        dtype = getattr(torch, named, None) if isinstance(named, str) else named
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SpecError(f"from_config(dtype={dtype!r}): use a floating dtype, e.g. torch.bfloat16")
    _check_sizes(cfg)
    with torch.device("meta"):
        try:
            try:
                model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
        except (RuntimeError, ValueError, ZeroDivisionError, AssertionError) as exc:
            # a size this check does not know (a layer's own width) can still make a module fail to build
            raise SpecError(f"from_config: transformers cannot build a {getattr(cfg, 'model_type', '')} model from "
                            f"this config ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); "
                            f"check the config's sizes (positive, and the hidden size divisible by the heads)") from None
    return model


# a config's sizes that are counts or widths of every model that has them: each must be a positive int
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size", "head_dim", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions",
          "n_inner", "d_model", "num_layers", "num_heads", "d_ff", "ffn_dim", "moe_intermediate_size")


def _check_sizes(cfg: Any) -> None:
    """Refuse a config whose sizes are not positive ints before building it (torch would fail with
    "Trying to create tensor with negative dimension", naming neither the config nor the size)."""
    aliases = getattr(cfg, "attribute_map", None) or {}  # gpt2's hidden_size is its n_embd
    for name in _SIZES:
        value = getattr(cfg, name, None)
        if value is None:  # not this architecture's (or derived from the others: head_dim, n_inner)
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            name = aliases.get(name, name)  # the config's own key, as the user wrote it
            raise SpecError(f"from_config: the config's {name}={value!r} must be a positive int (it is a count or a "
                            f"width of the model); give the size the model has, e.g. {name}="
                            f"{_EXAMPLE_SIZES.get(name, 8)}")


_EXAMPLE_SIZES = {"hidden_size": 4096, "intermediate_size": 11008, "vocab_size": 32000, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "n_embd": 768}


def _inexact(notes: list[str]) -> list[str]:
    """The report's "not exact" notes, once per reason (not once per line that has it)."""
    out: dict[str, str] = {}
    for n in notes:
        if "numbers may not be exact" in n:
            reason = n.split("': ", 1)[-1]
            out.setdefault(reason, n if reason == n else f"{reason} (first at {n.split(chr(39))[1]})")
    return list(out.values())


class CausalLMStep(torch.nn.Module):
    """``model(input_ids=x, attention_mask=m, labels=x).loss``: the loss a Hugging Face training step
    backpropagates (computed inside the model: the logits upcast and the cross entropy are part of
    the step). The mask is the tokenizer's for unpadded sequences, all ones (analysed as such:
    ``TensorSpec(..., fill=1)``, so the path is the real run's)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss


def _lora(model: torch.nn.Module, spec: str | dict | None) -> torch.nn.Module:
    """peft LoRA adapters (``"r=16"`` or ``{"r": 16, ...}``: peft's LoraConfig arguments)."""
    if spec is None:
        return model
    try:
        import peft
    except ImportError as exc:
        raise ModelError("lora= needs the peft package: pip install peft") from exc
    if isinstance(spec, str):
        from .parsing import parse_assignments

        spec = parse_assignments(spec, "--lora", values="literal")
    try:
        config = peft.LoraConfig(**dict(spec))
    except TypeError as exc:
        raise SpecError(f"lora={spec!r}: {exc}; give peft.LoraConfig arguments, e.g. r=16") from exc
    return peft.get_peft_model(model, config).base_model.model  # the model, adapters inside, base frozen




def fsdp_per_block(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 as Hugging Face users apply it: ``fully_shard`` on every decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in decoder_layers(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# Hugging Face's names of tensor-parallel styles (a config's ``base_model_tp_plan``) that are
# torch's own ParallelStyles; the others (gathered or local outputs, packed projections) are not
_TP_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face base model (``LlamaModel``) of a training step's module: the module paths
    of its config's tensor-parallel plan are relative to it."""
    hf = model.model if isinstance(model, CausalLMStep) else model
    return hf.base_model


def tensor_parallel_plan(model: torch.nn.Module) -> dict:
    """The model's own tensor-parallel plan (its config's ``base_model_tp_plan``, module paths
    with ``*`` for each layer) as torch's ParallelStyles; a :class:`SpecError` where the config has
    none, or a style that is not column- or row-wise."""
    from torch.distributed.tensor import parallel as tp

    base = _base_model(model)
    plan = getattr(getattr(base, "config", None), "base_model_tp_plan", None)
    name = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
    if not plan:
        raise SpecError(f"tp=: the {name} config has no tensor-parallel plan (transformers' base_model_tp_plan); "
                        f"use fsdp= alone, or fxmem.analyze with your own parallelize_module plan")
    unknown = sorted({style for style in plan.values() if style not in _TP_STYLES})
    if unknown:
        raise SpecError(f"tp=: the {name} config's tensor-parallel plan uses {unknown}, which fxmem does not map "
                        f"to torch's ParallelStyles (only {sorted(_TP_STYLES)}); use fxmem.analyze with your own "
                        f"parallelize_module plan")
    return {path: getattr(tp, _TP_STYLES[style])() for path, style in plan.items()}


def fsdp_tp_per_block(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """Tensor parallelism by the model's own plan over the mesh's ``"tp"`` dim, then FSDP2 on every
    decoder layer and the root over its ``"dp"`` dim (a 1-D mesh: tensor parallelism alone)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = mesh["tp"] if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names else mesh
    parallelize_module(_base_model(model), tp_mesh, tensor_parallel_plan(model))
    if not mesh.mesh_dim_names or "dp" not in mesh.mesh_dim_names:
        return model
    for block in decoder_layers(model):
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def training_module(model: torch.nn.Module, lora: str | dict | None = None,
                    checkpointing: bool = False, recipe: Any = None) -> CausalLMStep:
    """A copy of ``model`` as the training step runs it: parameters in ``recipe``'s dtypes (a
    :class:`fxmem.recipes.Recipe` or its name; None keeps the model's), adapters and checkpointing
    applied, in train mode, its loss as the output (:class:`CausalLMStep`). ``model`` is not changed.

    >>> training_module(model, recipe="amp-bf16")   # float32 parameters, whatever model's  # doctest: +SKIP
    """
    from .recipes import get, parameters_to

    recipe = get(recipe) if recipe is not None else None
    work = copy.deepcopy(model)
    if recipe is not None:  # before the adapters: peft makes them after the base's dtype
        parameters_to(work, recipe.dtype("parameters"))
    if checkpointing:
        if not hasattr(work, "gradient_checkpointing_enable"):
            raise ModelError("checkpointing=True needs a Hugging Face model (gradient_checkpointing_enable)")
        # the non-reentrant form: what torch recommends and transformers passes on
        work.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    work = _lora(work, lora)
    if recipe is not None:  # the trained parameters (adapters, or all) in the recipe's dtype
        parameters_to(work, recipe.dtype("trainable"), which=lambda p: p.requires_grad)
    return CausalLMStep(work).train()


@dataclasses.dataclass
class LLMAnswer:
    """What :func:`llm_answer` found (bytes; sizes as ints; ``report`` is the analysis)."""

    model: str
    batch: int
    seq: int
    parameters: int
    trainable: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    step_peak: int
    gpu: int | None
    max_batch: int | None
    max_seq: int | None
    notes: list
    report: Any = dataclasses.field(repr=False, default=None)
    recipe: str = ""  # the recipe's name (fxmem.recipes), e.g. "amp-bf16"
    recipe_text: str = ""  # what it is, in a line, and how it was chosen
    context: int | None = None  # the config's max_position_embeddings (positions), where it has one
    ranks: int = 1  # the world size (FSDP's, tensor parallelism's, or both): the numbers are one rank's
    tp: int = 1  # of which the tensor-parallel degree
    optimizer: str = "adamw"
    stages: list = dataclasses.field(default_factory=list)  # pp=: each stage's StageAnswer
    fewest: int | None = None  # fsdp="W" with gpu=: the fewest FSDP2 ranks whose step fits (0: none)

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state (bytes)."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def per_parameter(self) -> str:
        """Model states in bytes per parameter (all parameters, frozen ones included), and its parts:
        ``"16.00 B per parameter (parameters 4.00 + gradients 4.00 + optimizer state 8.00)"``."""
        n = max(self.parameters, 1)
        parts = (self.parameter_bytes / n, self.gradient_bytes / n, self.optimizer_state_bytes / n)
        # FSDP: this rank holds a shard, so its bytes per parameter of the whole model are a fraction;
        # tensor parallelism replicates what its plan does not split (embeddings, norms, the head); a
        # pipeline stage holds its own layers only
        rank = "" if self.ranks == 1 else f" on this rank, one of {self.ranks} (its stage's layers)" if self.stages \
            else f" on this rank (1/{self.ranks} of each)" if self.tp == 1 else f" on this rank, one of {self.ranks}"
        return (f"{self.model_states / n:.2f} B per parameter{rank} (parameters {parts[0]:.2f} + gradients "
                f"{parts[1]:.2f} + optimizer state {parts[2]:.2f})")

    def __str__(self) -> str:
        from .units import format_bytes as fb

        lines = [f"{self.model}: {self.parameters:,} parameters ({self.trainable:,} trainable)"]
        if self.recipe_text:
            lines.append(f"  recipe              {self.recipe_text}")
        lines += [f"  model states        {fb(self.model_states)}  (parameters {fb(self.parameter_bytes)}, "
                  f"gradients {fb(self.gradient_bytes)}, optimizer state {fb(self.optimizer_state_bytes)})",
                  f"{_INDENT}{self.per_parameter()}",
                  f"  training step peak  {fb(self.step_peak)}  at batch {self.batch}, sequence {self.seq}"]
        if self.fewest:
            layout = f"FSDP2 over {self.fewest}" + (f" x tensor parallelism over {self.tp}" if self.tp > 1 else "")
            lines.append(f"  fewest ranks        {self.ranks:,}  ({layout}) whose step fits {fb(self.gpu)} at batch "
                         f"{self.batch}, sequence {self.seq}")
        if self.gpu is not None:
            for what, value, fixed in (("batch", self.max_batch, f"sequence {self.seq}"),
                                       ("sequence length", self.max_seq, f"batch {self.batch}")):
                reason = getattr(value, "reason", None) or (past_context(self.context, value)
                                                            if what == "sequence length" else None)
                lines.append(f"  largest {what:<16}{value:,}  at {fixed} in {fb(self.gpu)}"
                             + (f"  ({reason})" if reason else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _but(sizes: dict, dim: str) -> dict:
    """``sizes`` without ``dim`` (the dim a largest size is searched for)."""
    return {k: v for k, v in sizes.items() if k != dim}


def context_length(model: torch.nn.Module) -> int | None:
    """The positions the model was built for (its config's ``max_position_embeddings``), or None."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def past_context(context: int | None, positions: int | None) -> str | None:
    """A word where a largest length lies past the model's context: memory allows it, but the model
    was built for ``context`` positions (its rotary or learned positions may not hold past it)."""
    if context is None or positions is None or positions <= context:
        return None
    return (f"memory allows it; the model's config says max_position_embeddings={context:,}: a longer "
            f"sequence needs a model trained or scaled for it")


def llm_answer(model: torch.nn.Module, *, batch: int, seq: int, optimizer: str = "adamw", gpu: Any = None,
               lora: str | dict | None = None, checkpointing: bool = False, fsdp: int | None = None,
               device: str = "cpu", recipe: Any = None, tp: int | None = None, pp: int | None = None,
               microbatches: int | None = None, schedule: str | None = None) -> LLMAnswer:
    """Analyse one training step of causal LM ``model`` (built by :func:`from_config` or real) at
    sequence length ``seq``; the numbers at ``batch``; with ``gpu`` (bytes or ``"80GiB"``) the
    largest batch (at ``seq``) and sequence length (at ``batch``) whose step fits.

    ``recipe``: the training recipe's name (see :mod:`fxmem.recipes`: ``"fp32"``, ``"bf16"``,
    ``"fp16"``, ``"amp-bf16"``, ``"amp-fp16"``, ``"lora"``) or a :class:`fxmem.recipes.Recipe`.
    It sets the parameters' dtypes (on a copy: ``"amp-bf16"`` trains float32 parameters whatever
    ``model``'s dtype) and the forward's autocast. The default, None, trains ``model`` as it is,
    in its own dtype with no autocast: the pure recipe of that dtype (a bfloat16 model is
    ``"bf16"``: parameters, gradients and AdamW state all bfloat16, 8 B per parameter); the
    answer says which. ``"lora"`` without ``lora=`` uses peft's default adapters (r=8).

    ``fsdp=W``: one rank of W, FSDP2 on every decoder layer and the root (per-rank numbers).
    ``tp=T``: tensor parallelism over T ranks by the model's own plan (its config's
    ``base_model_tp_plan``); with ``fsdp=W`` too, the ``{"dp": W, "tp": T}`` mesh of W x T ranks
    (torchtitan's layout: tensor parallelism inside each group of T, FSDP2 across them).
    ``pp=P``: the decoder layers split evenly into P pipeline stages (:mod:`fxmem.llm_stages`),
    run by ``schedule`` (torchtitan's names: ``"1F1B"``, the default, ``"GPipe"``,
    ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``,
    ``"DualPipeV"``; those of two stages a rank split the layers into 2P) over ``microbatches``
    micro-batches (default: one per stage, P or 2P; the batch must split evenly);
    with ``fsdp=``/``tp=`` too, the ``{"pp": P, "dp": W, "tp": T}`` mesh. Every stage is analysed
    (its first rank); the answer is the stage whose step peaks highest, ``stages`` has each, and
    the largest batch and sequence length are those every stage fits.
    The user's ``model`` is not changed (adapters and checkpointing go on a copy).

    >>> llm_answer(model, batch=1, seq=4096, recipe="amp-bf16").recipe   # doctest: +SKIP
    'amp-bf16'
    """
    from . import analyze
    from .units import parse_bytes
    from .specs import TensorSpec

    if optimizer not in OPTIMIZERS:
        raise SpecError(f"optimizer={optimizer!r}: use one of {sorted(OPTIMIZERS)}")
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"{name}={value!r}: a positive int")
    chosen, recipe_text = _recipe(model, recipe, optimizer)
    if chosen is not None and chosen.lora and lora is None:
        lora = {}  # peft's defaults: r=8 on the architecture's usual projections
    for name, value in (("fsdp", fsdp), ("tp", tp)):
        if name == "fsdp" and isinstance(value, str):  # a symbol: formulas in the number of FSDP2 ranks
            if pp is not None:
                raise SpecError(f"fsdp={value!r} with pp=: a later stage's ranks move with the number of FSDP2 "
                                f"ranks; give fsdp= a number with pp=")
            continue
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"{name}={value!r}: a number of ranks, a positive int (fsdp= may be a dim name, "
                            f"'W': formulas in it)")
    if chosen is not None and chosen.loss_scaling and (fsdp is not None or tp is not None):
        raise SpecError(f"recipe={chosen.name!r} with fsdp= or tp=: its GradScaler step with sharded parameters is "
                        f"not simulated yet; use recipe='amp-bf16' (no loss scaling), or drop fsdp= and tp=")
    budget = parse_bytes(gpu) if gpu is not None else None
    step = training_module(model, lora=lora, checkpointing=checkpointing, recipe=recipe)
    kw: dict = _step_options(chosen, device)
    if pp is not None:
        return _pipeline_answer(model, step, chosen, recipe_text, batch=batch, seq=seq, optimizer=optimizer,
                                budget=budget, lora=lora, checkpointing=checkpointing, fsdp=fsdp, tp=tp, pp=pp,
                                microbatches=microbatches, schedule=schedule, device=device)
    for name, value in (("microbatches", microbatches), ("schedule", schedule)):
        if value is not None:
            raise SpecError(f"{name}= is the pipeline's (pp=): give pp= too, or drop {name}=")
    if tp is not None:
        if lora is not None:  # peft's wrappers move the modules the plan's paths name
            raise SpecError("tp= with LoRA adapters is not modelled yet: use fsdp= with lora=, or tp= without it")
        tensor_parallel_plan(step)  # refused before anything is analysed
        kw.update(world_size=(fsdp or 1) * tp if not isinstance(fsdp, str) else None,
                  parallelize=fsdp_tp_per_block, rank=0, mesh={"dp": fsdp, "tp": tp} if fsdp is not None else None)
    elif fsdp is not None:
        kw.update(world_size=fsdp, parallelize=fsdp_per_block, rank=0)
    report = analyze(step, TensorSpec(("B", "L"), dtype=torch.long), TensorSpec(("B", "L"), dtype=torch.long, fill=1),
                     optimizer=OPTIMIZERS[optimizer],
                     # analysed at the sizes asked: the answer's own piece comes from this simulation
                     # (default hints are primes near 100, a region that may not hold at the user's sizes)
                     hints={"B": batch, "L": seq},
                     device=device, **kw)
    sizes, fewest, symbol = {"B": batch, "L": seq}, None, fsdp if isinstance(fsdp, str) else None
    if symbol is not None:  # the numbers of the fewest FSDP2 ranks that fit (else the fewest it holds at)
        _, low, even = report.world_dim
        fewest = report.min_size(symbol, budget, train=True, **sizes) if budget is not None else None
        fsdp = sizes[symbol] = fewest or low
    at = report.evaluate(**sizes)
    params = [p for p in step.parameters()]
    # fxmem's own storages: what this rank holds (FSDP2 shards: in W where it is a symbol), each shared
    # parameter once
    param_bytes = evaluate(sympy.Add(*[s.bytes for s in report.storages if s.role.value == "parameter"]),
                           {report.symbols[symbol]: fsdp} if symbol is not None else {})
    answer = LLMAnswer(
        model=type(model).__name__, batch=batch, seq=seq,
        parameters=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
        parameter_bytes=int(param_bytes), gradient_bytes=int(at["grads"]),
        optimizer_state_bytes=int(at["optimizer_state"]), step_peak=int(at["train_peak"]), gpu=budget,
        max_batch=report.max_size("B", budget, train=True, **_but(sizes, "B")) if budget is not None else None,
        max_seq=report.max_size("L", budget, train=True, **_but(sizes, "L")) if budget is not None else None,
        notes=_inexact(report.notes) + _scaler_notes(report.notes), report=report,
        recipe=chosen.name if chosen is not None else "as built", recipe_text=recipe_text, optimizer=optimizer,
        context=context_length(model), ranks=(fsdp or 1) * (tp or 1), tp=tp or 1, fewest=fewest)
    if symbol is not None:
        name = symbol
        answer.notes.insert(0, f"FSDP2 ranks as the symbol {name}: formulas in {name} from three analyses, exact "
                               f"where {name} divides {even} (the sharded sizes); the numbers are at {name}={fsdp}"
                               + (", the fewest such ranks whose step fits" if fewest else
                                  ", the fewest it may be" if budget is None else
                                  f" ({getattr(fewest, 'reason', '')})"))
    if tp is not None:
        layout = (f"{fsdp} x {tp}: tensor parallelism by the model's own plan within each group of {tp}, FSDP2 on "
                  f"every decoder layer and the root across the {fsdp} groups" if fsdp is not None else
                  f"{tp}: tensor parallelism by the model's own plan")
        answer.notes.insert(0, f"per rank: rank 0 of {layout}")
    elif fsdp is not None:
        answer.notes.insert(0, f"per rank: rank 0 of {fsdp} (FSDP2 on every decoder layer and the root)")
    if device == "cpu":
        answer.notes.insert(0, "the CPU's allocator: on a GPU each allocation is rounded up to 512 bytes and "
                               "kernels differ (analyse with device='cuda' where a GPU is visible)")
    return answer


_INDENT = " " * 22  # the column the answer's values start at


@dataclasses.dataclass
class StageAnswer:
    """One pipeline stage's numbers (bytes) at the batch and sequence length asked (its first rank)."""

    stage: int
    rank: int
    layers: int
    step_peak: int
    resident: int
    max_batch: int | None
    max_seq: int | None
    report: Any = dataclasses.field(repr=False, default=None)


def _pipeline_answer(model: torch.nn.Module, step: torch.nn.Module, chosen: Any, recipe_text: str, *, batch: int,
                     seq: int, optimizer: str, budget: int | None, lora: Any, checkpointing: bool, fsdp: int | None,
                     tp: int | None, pp: int, microbatches: int | None, schedule: str | None,
                     device: str) -> LLMAnswer:
    """:func:`llm_answer` with ``pp=``: every stage analysed, the answer the stage that peaks highest."""
    import functools

    from . import analyze, llm_stages
    from .distributed.pipeline import stage_ranks
    from .specs import TensorSpec

    schedule = llm_stages.schedule_named(schedule or "1F1B")
    llm_stages.check(step, pp, schedule)
    if lora is not None or checkpointing:
        raise SpecError("pp= with lora= or checkpointing=True is not modelled yet: analyse the pipeline without them")
    if chosen is not None and (chosen.loss_scaling or chosen.dtype("autocast") is not None):
        raise SpecError(f"recipe={chosen.name!r} with pp=: the stages' forwards under autocast are not simulated yet; "
                        f"use a pure recipe (fp32, bf16) with pp=")
    if tp is not None:
        tensor_parallel_plan(step)  # refused before anything is analysed
    total = pp * llm_stages.SCHEDULES[schedule][1]  # the stages, of all ranks
    micro = total if microbatches is None else microbatches
    llm_stages.check_microbatches(batch, micro)
    if schedule == "DualPipeV" and micro < total:
        raise SpecError(f"microbatches={micro}: DualPipeV needs at least as many micro-batches as stages ({total})")
    layout = llm_stages.mesh(pp, fsdp, tp)
    ranks = math.prod(layout.values())
    parallelize = functools.partial(llm_stages.pipeline_per_stage, microbatches=micro, schedule=schedule,
                                    plan=tensor_parallel_plan(step) if tp is not None else None)
    stages = []
    for stage, rank in enumerate(stage_ranks(layout)):
        report = analyze(step, TensorSpec(("B", "L"), dtype=torch.long),
                         TensorSpec(("B", "L"), dtype=torch.long, fill=1), optimizer=OPTIMIZERS[optimizer],
                         step=llm_stages.train_stage, parallelize=parallelize, world_size=ranks, rank=rank,
                         mesh=layout if len(layout) > 1 else None, hints={"B": batch, "L": seq}, device=device)
        at = report.evaluate(B=batch, L=seq)
        stages.append(StageAnswer(
            stage=stage, rank=rank, layers=_stage_layers(step, stage, pp, schedule), step_peak=int(at["train_peak"]),
            resident=int(at["train_resident"]), report=report,
            max_batch=report.max_size("B", budget, train=True, L=seq) if budget is not None else None,
            max_seq=report.max_size("L", budget, train=True, B=batch) if budget is not None else None))
    worst = max(stages, key=lambda s: s.step_peak)
    report = worst.report
    at = report.evaluate(B=batch, L=seq)
    params = list(step.parameters())
    param_bytes = sum(int(s.bytes) for s in report.storages if s.role.value == "parameter")
    answer = LLMAnswer(
        model=type(model).__name__, batch=batch, seq=seq,
        parameters=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
        parameter_bytes=param_bytes, gradient_bytes=int(at["grads"]), optimizer_state_bytes=int(at["optimizer_state"]),
        step_peak=worst.step_peak, gpu=budget,
        max_batch=min((s.max_batch for s in stages), key=int) if budget is not None else None,
        max_seq=min((s.max_seq for s in stages), key=int) if budget is not None else None,
        notes=_inexact(report.notes), report=report, recipe=chosen.name if chosen is not None else "as built",
        recipe_text=recipe_text, optimizer=optimizer, context=context_length(model), ranks=ranks,
        tp=tp or 1, stages=stages)
    others = " x ".join(f"{k} {v}" for k, v in layout.items())
    answer.notes.insert(0, f"per rank: stage {worst.stage} of {pp} (rank {worst.rank} of {ranks}, mesh {others}), "
                           f"the stage whose step peaks highest; {llm_stages.SCHEDULES[schedule][0]} over {micro} "
                           f"micro-batches of {batch // micro}; the largest sizes are those every stage fits")
    per_rank = llm_stages.SCHEDULES[schedule][1]
    for s in stages:
        held = llm_stages.own_stages(s.stage, pp, schedule)
        runs = f"runs stages {' and '.join(map(str, held))} of {pp * per_rank}: " if per_rank > 1 else ""
        answer.notes.append(f"stage {s.stage} ({runs}{s.layers} decoder layers"
                            f"{', the embedding' if 0 in held else ''}"
                            f"{', the norm, head and loss' if pp * per_rank - 1 in held else ''}): step peak "
                            f"{format_bytes(s.step_peak)}, resident {format_bytes(s.resident)}")
    if device == "cpu":
        answer.notes.insert(0, "the CPU's allocator: on a GPU each allocation is rounded up to 512 bytes and "
                               "kernels differ (analyse with device='cuda' where a GPU is visible)")
    return answer


def _stage_layers(step: torch.nn.Module, stage: int, pp: int, schedule: str) -> int:
    """How many decoder layers pipeline rank ``stage`` of ``pp`` holds under ``schedule`` (the split of
    :class:`fxmem.llm_stages.CausalLMStage`, over each stage it runs)."""
    from . import llm_stages

    n, per_rank = len(step.model.base_model.layers), llm_stages.SCHEDULES[schedule][1]
    return sum(len(llm_stages.stage_layers(n, s, pp * per_rank)) for s in llm_stages.own_stages(stage, pp, schedule))


def _recipe(model: torch.nn.Module, recipe: Any, optimizer: str) -> tuple[Any, str]:
    """The recipe a step trains with, and the line the answer prints for it: the one asked for, or
    (``recipe=None``) the pure recipe of the model's own dtype, said to be the default."""
    from .recipes import for_dtype, get

    if recipe is not None:
        chosen = get(recipe)
        return chosen, chosen.summary(optimizer)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    chosen = for_dtype(next(iter(dtypes))) if len(dtypes) == 1 else None
    if chosen is None:  # several dtypes (or an unusual one): trained as built, named as such
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes)) or "none"
        return None, (f"as built: the model's own parameter dtypes ({names}), no autocast\n{_INDENT}the default "
                      f"(recipe=None); pass a recipe (--recipe), e.g. amp-bf16 for mixed precision")
    return chosen, (f"{chosen.summary(optimizer)}\n{_INDENT}the default (recipe=None): the model's own dtype; "
                    f"pass a recipe (--recipe), e.g. amp-bf16 for mixed precision")


def _scaler_notes(notes: list[str]) -> list[str]:
    """The report's word on the GradScaler step (which of its two paths the numbers are of)."""
    return [n for n in notes if n.startswith("GradScaler:")]


def _step_options(recipe: Any, device: str) -> dict:
    """``analyze``'s options for ``recipe``'s step: the forward's autocast, or for loss scaling
    (float16) the GradScaler step, which enters autocast itself. None: the default step as before."""
    from .recipes import scaled_step

    if recipe is not None and recipe.loss_scaling:
        return dict(step=scaled_step(device, recipe.dtype("autocast")))
    return dict(loss=lambda loss: loss, autocast=recipe.dtype("autocast") if recipe is not None else None)
