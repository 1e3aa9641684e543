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

import torch

from .errors import ModelError, SpecError

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
    kind = dtype or next((p.dtype for p in model.parameters()), None)
    lines = [f"{type(model).__name__}.generate() ({str(kind).replace('torch.', '')}): {new_tokens} new tokens, "
             f"greedy, dynamic KV cache",
             f"  weights             {fb(weights)}",
             f"  peak                {fb(at['peak'])}  at batch {batch}, prompt {prompt}"]
    if gpu is not None:
        budget = parse_bytes(gpu)
        for what, value, fixed in (("batch", report.max_size("B", budget, P=prompt), f"prompt {prompt}"),
                                   ("prompt", report.max_size("P", budget, B=batch), f"batch {batch}")):
            reason = getattr(value, "reason", None)
            lines.append(f"  largest {what:<12}{value:,}  at {fixed} in {fb(budget)}" + (f"  ({reason})" if reason else ""))
    lines += [f"  note: {n}" for n in report.notes if "numbers may not be exact" in n][:3]
    return "\n".join(lines)
