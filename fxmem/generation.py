"""Serving: the memory of ``model.generate`` - the prefill, then one decode step per new token with
the KV cache (transformers' ``DynamicCache``, or ``StaticCache`` with ``cache="static"``) - as
formulas in the batch ``B`` and the prompt length ``P``, for ``new_tokens`` tokens.

fxmem runs transformers' own ``generate`` on fake tensors, step by step, as it runs any forward
(eager mode): every cache update, the logits it keeps, the ids it concatenates are counted as the
real call allocates them. The call is greedy (``do_sample=False``) and generates exactly
``new_tokens`` tokens for every sequence (no early stop at an end-of-sequence token: the most
memory a call of that many tokens takes); the prompt is unpadded (its attention mask all ones).
The number of new tokens is a Python loop's length, so it is a number, not a dim: each value is
one analysis (its cost grows with it).

>>> report = generation(model, ("B", "P"), new_tokens=16)          # doctest: +SKIP
>>> report.max_size("B", "80GiB", P=8192)                            # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

from .errors import ModelError, SpecError
from .records import INEXACT

CACHES = ("dynamic", "static")


class Generate(torch.nn.Module):
    """``model.generate(input_ids, attention_mask=mask, max_new_tokens=T, ...)`` as a module's forward."""

    def __init__(self, model: torch.nn.Module, new_tokens: int, cache: str, generate_kwargs: dict):
        super().__init__()
        self.model = model
        self.new_tokens = new_tokens
        self.cache = cache
        self.generate_kwargs = generate_kwargs

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kw = dict(max_new_tokens=self.new_tokens, do_sample=False, eos_token_id=None)
        if self.cache == "static":
            kw["cache_implementation"] = "static"
        kw.update(self.generate_kwargs)
        return self.model.generate(input_ids, attention_mask=attention_mask, **kw)


def _token(model: torch.nn.Module) -> int:
    """A prompt token id that is no special token (the prompt's values are stated: any ordinary
    token takes the path every ordinary token takes)."""
    config = getattr(model, "config", None)
    special = {getattr(config, k, None) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    vocab = int(getattr(config, "vocab_size", 8) or 8)
    return next(t for t in range(3, max(vocab, 4)) if t not in special)


def generation(model: torch.nn.Module, dims: tuple = ("B", "P"), new_tokens: int = 16, cache: str = "dynamic",
               options: Any = None, **generate_kwargs: Any) -> Any:
    """The memory of ``model.generate`` on a ``dims`` = (batch, prompt length) prompt for
    ``new_tokens`` tokens: an :class:`fxmem.Report` (bytes; inference, no autograd) whose
    formulas are in those dims; ``report.max_size("B", "80GiB", P=...)`` is the largest batch of
    concurrent sequences. ``cache``: "dynamic" (default) or "static". ``generate_kwargs`` go to
    ``generate`` (greedy decoding is what is modelled). ``options``: an
    :class:`fxmem.AnalysisOptions` (device, dtype, ...)."""
    from . import analyze
    from .options import AnalysisOptions
    from .specs import TensorSpec

    if not hasattr(model, "generate"):
        raise ModelError(f"{type(model).__name__} has no generate(): give a transformers model with a language "
                         f"modeling head (e.g. AutoModelForCausalLM)")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise SpecError(f"new_tokens={new_tokens!r}: a positive int (the number of tokens generate() makes; a "
                        f"Python loop's length, so a number, not a dim)")
    if cache not in CACHES:
        raise SpecError(f"cache={cache!r}: use one of {CACHES}")
    if not isinstance(dims, tuple) or len(dims) != 2:
        raise SpecError(f"dims={dims!r}: the prompt's (batch, length), e.g. ('B', 'P')")
    if generate_kwargs.get("do_sample") or generate_kwargs.get("num_beams", 1) != 1:
        raise SpecError("generation() models greedy decoding (do_sample=False, num_beams=1)")
    opts = AnalysisOptions.of(options, grad=False) if options is not None else AnalysisOptions(grad=False)
    wrapped = Generate(model, new_tokens, cache, dict(generate_kwargs))
    token = _token(model)
    report = analyze(wrapped, TensorSpec(dims, dtype=torch.long, fill=token),
                     TensorSpec(dims, dtype=torch.long, fill=1), options=opts)
    report.notes.append(f"generate(): greedy, {new_tokens} new tokens for every sequence (no early stop), "
                        f"{cache} KV cache, an unpadded prompt (attention mask of ones)")
    if cache == "static" and opts.device == "cuda":
        # tests/gpu/test_gpu_llm.py: the dynamic cache is exact on an H100; the static one was not
        report.notes.append(f"a static KV cache on CUDA: a real generate() on an H100 (torch 2.11) allocated "
                            f"66,560 B more than predicted at B=3, P=37, 3 new tokens, not yet explained; "
                            f"{INEXACT}")
    return report


def serve_summary(model: torch.nn.Module, batch: int, prompt: int, new_tokens: int, dtype: Any = None,
                  gpu: Any = None) -> str:
    """A few lines for ``fxmem llm --serve``: the weights, the peak of one ``generate`` call at
    ``batch`` x ``prompt`` for ``new_tokens`` tokens, and with ``gpu`` (bytes or "80GiB") the
    largest batch and prompt length whose call fits. ``dtype``: the model's parameters' (it is
    built in it; said in the first line)."""
    from .accounting.budget import parse_bytes
    from .views.text import format_bytes as fb

    report = generation(model, ("B", "P"), new_tokens=new_tokens)
    at = report.evaluate(B=batch, P=prompt)
    weights = sum(int(s.bytes) for s in report.storages if s.role.value == "parameter")
    try:
        kind_name = str(next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.", "")
        kv = int(kv_cache_bytes(model.config, batch, prompt, new_tokens, dtype=kind_name))
    except (ModelError, AttributeError):
        kv = None
    kind = dtype or next((p.dtype for p in model.parameters()), None)
    lines = [f"{type(model).__name__}.generate() ({str(kind).replace('torch.', '')}): {new_tokens} new tokens, "
             f"greedy, dynamic KV cache",
             f"  weights             {fb(weights)}",
             f"  peak                {fb(at['peak'])}  at batch {batch}, prompt {prompt}"]
    if kv is not None:
        lines.insert(2, f"  KV cache at the end {fb(kv)}  ({prompt + new_tokens - 1} positions x batch {batch})")
    if gpu is not None:
        budget = parse_bytes(gpu)
        for what, value, fixed in (("batch", report.max_size("B", budget, P=prompt), f"prompt {prompt}"),
                                   ("prompt", report.max_size("P", budget, B=batch), f"batch {batch}")):
            reason = getattr(value, "reason", None)
            lines.append(f"  largest {what:<12}{value:,}  at {fixed} in {fb(budget)}" + (f"  ({reason})" if reason else ""))
    lines += [f"  note: {n}" for n in report.notes if "numbers may not be exact" in n][:3]
    return "\n".join(lines)


# --- the KV cache alone, from the config ----------------------------------------------------------
# After a greedy generate(max_new_tokens=T) transformers' DynamicCache holds P + T - 1 positions
# (the last new token is produced but never fed back): per layer a key and a value of shape
# (B, KV heads, positions, head dim). A closed formula, checked against real caches in
# tests/test_generation.py; generation() counts the cache as the run allocates it.
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _geometry(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder's attention, read from its transformers config."""
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, name, None), int):
            raise ModelError(f"kv_cache_bytes: config has no integer {name!r}; only decoders with standard "
                             "attention caches are supported (state-space and encoder-decoder models are not)")
    # a sliding window bounds the cache by the window, not by P + T: refuse rather than overcount
    types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in types):
        raise ModelError("kv_cache_bytes: config uses sliding-window layers, whose cache is bounded by the "
                         "window; not supported yet — set use_sliding_window=False or use a full-attention model")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_cache_bytes(config, batch="B", prompt="P", new_tokens="T", dtype="float32") -> sympy.Expr:
    """Bytes of the DynamicCache left by greedy ``generate`` of ``new_tokens`` after ``prompt`` tokens.

    ``batch``/``prompt``/``new_tokens`` are dim names (symbols) or ints; ``dtype`` names the cache's
    dtype (the model's). Example: ``kv_cache_bytes(cfg, 4, 128, 32)`` gives an integer of bytes.
    """
    if str(dtype).replace("torch.", "") not in _ITEMSIZE:
        raise ModelError(f"kv_cache_bytes: dtype {dtype!r} not one of {sorted(_ITEMSIZE)}")
    itemsize = _ITEMSIZE[str(dtype).replace("torch.", "")]
    layers, kv_heads, head_dim = _geometry(config)
    B, P, T = (sympy.Symbol(v, positive=True, integer=True) if isinstance(v, str) else sympy.Integer(v)
               for v in (batch, prompt, new_tokens))
    # key + value per layer
    return sympy.factor(2 * layers * kv_heads * head_dim * itemsize * B * (P + T - 1))
