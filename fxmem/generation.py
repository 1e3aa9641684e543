"""Serving: the memory of ``model.generate`` - the prefill, then one decode step per new token with
the KV cache (transformers' ``DynamicCache``, or ``StaticCache`` with ``cache="static"``) - as
formulas in the batch ``B`` and the prompt length ``P``, for ``new_tokens`` tokens.

fxmem runs transformers' own ``generate`` on fake tensors, step by step, as it runs any forward
(eager mode): every cache update, the logits it keeps, the ids it concatenates are counted as the
real call allocates them. The call is greedy (``do_sample=False``) and generates exactly
``new_tokens`` tokens for every sequence (no early stop at an end-of-sequence token: the most
memory a call of that many tokens takes); the prompt is unpadded (its attention mask all ones).
The number of new tokens is a Python loop's length: a number gives one analysis of that many
steps. A dim name (``new_tokens="T"``) gives formulas in ``T`` too (:class:`TokenFormulas`), with
either cache: every decode step is the previous one with the ids and the mask (and a dynamic cache)
one position longer, and a static cache, sized for all tokens up front, makes every step of a call
of more tokens larger by the same bytes per token. So the candidates for the peak are affine in the
step's index and in T. fxmem analyses 3, 4 and 5 new tokens and checks both: the prefill and each
decode step grow by the same bytes from 3 to 4 to 5 tokens (nothing, with a dynamic cache), and
within the call of 5 the 2nd, 3rd and 4th decode steps differ by the same bytes (the retained bytes
likewise). The peak of T tokens is then the largest of the prefill's, the first decode step's and
the 2nd and last decode steps' candidates (an affine function's largest value over the steps is at
one end), dropping those another one is at least as large as everywhere (T >= 3).
Where they do not hold (a size past a bound of the region, a batch of 1, which PyTorch treats
apart), each of the three reports is re-analysed at the sizes asked as its own ``evaluate`` would
be, and the formulas are made again from those; only a call whose steps cross a bound of the
region is analysed step by step. Progress lines (logger ``fxmem.generation``) say which.

>>> report = generation(model, ("B", "P"), new_tokens=16)          # doctest: +SKIP
>>> report.max_size("B", "80GiB", P=8192)                            # doctest: +SKIP
>>> formulas = generation(model, ("B", "P"), new_tokens="T")       # doctest: +SKIP
>>> formulas.max_size("B", "80GiB", P=8192, T=512)                   # doctest: +SKIP
"""
from __future__ import annotations

import logging
from typing import Any

import sympy
import torch

from .errors import FxMemError, ModelError, SpecError
from .records import INEXACT
from .timeout import timed

CACHES = ("dynamic", "static")
TOKENS = (3, 4, 5)  # the calls whose steps give the formulas in the number of new tokens (see above)
_log = logging.getLogger(__name__)  # progress: which analyses run, at which sizes, and why


def _sizes(values: Any) -> str:
    """``{"B": 1, "P": 4096}`` as "B=1, P=4096" (progress lines)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(dict(values or {}).items()))


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
        kw["stopping_criteria"] = _length_criteria(input_ids.shape[1] + self.new_tokens, kw.get("stopping_criteria"))
        with _quiet("transformers.generation.utils"):
            return self.model.generate(input_ids, attention_mask=attention_mask, **kw)


def _length_criteria(max_length: Any, given: Any) -> Any:
    """generate()'s stop at ``max_length`` tokens, as its own ``MaxLengthCriteria`` but without the
    model's ``max_position_embeddings``: transformers compares the length with it only to log a
    warning, and on fake tensors that comparison is a condition on the prompt length (P <= the
    model's length - T) that changes no memory but would end the formulas' region there. generate
    takes a criterion of the same type in place of its own; the user's criteria follow."""
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

    return StoppingCriteriaList([MaxLengthCriteria(max_length), *(given or [])])


class _quiet:
    """A logger raised to ERROR for a block (generate's notice that our criterion replaces its own
    is about fxmem's wrapper, not the user's call), its level put back after."""

    def __init__(self, name: str):
        self.logger = logging.getLogger(name)

    def __enter__(self) -> None:
        self.level = self.logger.level
        self.logger.setLevel(max(self.level, logging.ERROR))

    def __exit__(self, *exc: Any) -> None:
        self.logger.setLevel(self.level)


class TokenFormulas:
    """``generate``'s memory as formulas in the batch, the prompt length and the number of new tokens
    (bytes, CPU): ``peak``, ``resident``, ``retained`` (sympy), ``evaluate(**dims)`` and
    ``max_size(dim, budget, **fixed)``. Where the formulas do not hold (``T`` < 3, sizes outside
    the analyses' region) ``evaluate`` analyses that number of tokens itself (exact, slower).
    Built by :func:`generation` with ``new_tokens="T"``; see the module's docstring."""

    def __init__(self, model: Any, dims: tuple, name: str, cache: str, options: Any, kwargs: dict,
                 reports: dict, peak: sympy.Expr, retained: sympy.Expr, notes: list, rehinted: bool = False):
        self.model, self.dims, self.name, self.cache = model, dims, name, cache
        self._options, self._kwargs, self.reports = options, kwargs, reports
        base = reports[3]
        self.symbols = {**base.symbols, name: sympy.Symbol(name, positive=True, integer=True)}
        self.resident = base.resident
        self.peak, self.retained = peak, retained
        self.notes = notes
        self.exact = all(r.exact for r in reports.values())
        self._concrete: dict = {}
        self._near: dict = {}  # formulas re-analysed at the sizes asked, where these do not hold
        self._rehinted = rehinted  # these are such formulas: no further re-analysis from here

    @classmethod
    def of(cls, model: Any, dims: tuple, name: str, cache: str, options: Any, kwargs: dict,
           rehinted: bool = False) -> "TokenFormulas":
        if name in dims:
            raise SpecError(f"new_tokens={name!r}: the name is already one of dims={dims}")
        from .options import AnalysisOptions

        if AnalysisOptions.of(options).device != "cpu":
            raise SpecError(f"new_tokens={name!r}: formulas in the number of new tokens are CPU numbers (on CUDA each "
                            f"block is rounded to 512 bytes); give a number of tokens for device='cuda'")
        hints = AnalysisOptions.of(options).hints
        _log.info("analysing generate() for %s new tokens%s: formulas in %s from the three calls",
                  ", ".join(map(str, TOKENS)), f" at {_sizes(hints)}" if hints else "", name)
        reports = {n: generation(model, dims, new_tokens=n, cache=cache, options=options, **kwargs) for n in TOKENS}
        return cls.combine(model, dims, name, cache, options, kwargs, reports, rehinted)

    @classmethod
    def combine(cls, model: Any, dims: tuple, name: str, cache: str, options: Any, kwargs: dict, reports: dict,
                rehinted: bool = False) -> "TokenFormulas":
        """The formulas in ``name`` from the reports of the calls of 3, 4 and 5 new tokens (checked
        to grow by the same bytes per token; :class:`ModelError` where they do not)."""
        from .accounting.symbolic import Region, add_terms, build_max, max_of, to_expr

        cands = {n: r._plan.peak_candidates for n, r in reports.items()}
        step = len(cands[4]) - len(cands[3])
        pre = len(cands[3]) - 2 * step  # the prefill and generate's setup, then the first decode step

        def seg(n: int, j: int) -> list:  # segment j of the call of n tokens: 0 the prefill, j >= 1 decode step j
            return cands[n][:pre] if j == 0 else cands[n][pre + (j - 1) * step:pre + j * step]

        def diff(a: list, b: list) -> list:
            return [add_terms(y, x, signs=[1, -1]) for x, y in zip(a, b)]

        retained = {n: r._plan.retained_terms for n, r in reports.items()}
        # by_t[j]: what segment j grows by per token asked for (0 with a dynamic cache; a static cache
        # is sized for every token up front, so each step grows with T); by_j: what a decode step grows
        # by over the previous one in the same call (the ids, the mask, a dynamic cache)
        by_t = {j: diff(seg(3, j), seg(4, j)) for j in (0, 1, 2)}
        by_j = diff(seg(5, 2), seg(5, 3))
        affine = (step > 0 and pre >= 0 and len(cands[5]) == pre + 4 * step
                  and all(diff(seg(4, j), seg(5, j)) == by_t[j] for j in (0, 1, 2))
                  and diff(seg(4, 3), seg(5, 3)) == by_t[2]  # the growth in T is the same in every later step
                  and diff(seg(5, 3), seg(5, 4)) == by_j
                  and reports[3].resident == reports[5].resident
                  and add_terms(retained[4], retained[3], signs=[1, -1]) == add_terms(retained[5], retained[4],
                                                                                   signs=[1, -1]))
        if not affine:
            raise ModelError(f"new_tokens={name!r}: the decode steps of this model's generate() ({cache} cache) do not "
                             f"grow by fixed bytes per token (checked at 3 to 5 new tokens), so fxmem has no formula "
                             f"in the number of new tokens for it; give a number of tokens")
        t = sympy.Symbol(name, positive=True, integer=True)

        def at_t(c: dict, g: dict) -> dict:  # c + (T - 3) * g
            return add_terms(c, {m * t: k for m, k in g.items()}, g, signs=[1, 1, -3])

        head = [at_t(c, g) for j in (0, 1, 2) for c, g in zip(seg(3, j), by_t[j])]  # prefill, decode steps 1, 2
        # decode step T-1 (an affine function's largest value over steps 2..T-1 is at one end)
        last = [at_t(c, add_terms(gt, gj)) for c, gt, gj in zip(seg(3, 2), by_t[2], by_j)]
        # the Max over hundreds of candidates, pruned as every report's is: a candidate another one is
        # at least as large as everywhere the formulas are used (T >= 3, the sizes in the region) goes
        plan = reports[5]._plan
        region = Region(lower={**plan.region.lower, t: 3}, guards=plan.region.guards, pinned=plan.region.pinned,
                        upper=plan.region.upper)
        candidates = max_of(head + last, region, {**plan.hint_values, t: 64})  # those that can set the peak
        peak = reports[3].resident + build_max(to_expr((head + last)[i]) for i in candidates)
        kept = to_expr(at_t(retained[3], add_terms(retained[4], retained[3], signs=[1, -1])))
        notes = list(reports[5].notes) + [
            f"formulas in {name} (new tokens) for {name} >= 3: the calls of 3 to 5 new tokens grow by the same bytes "
            f"per token, step by step (checked); fewer tokens, or sizes outside the analyses' region, are analysed "
            f"as asked"]
        return cls(model, dims, name, cache, options, kwargs, reports, peak, kept, notes, rehinted)

    def _values(self, dims: dict) -> dict:
        missing = [d for d in (*self.dims, self.name) if d not in dims]
        if missing or set(dims) - {*self.dims, self.name}:
            raise SpecError(f"evaluate(): give exactly {', '.join((*self.dims, self.name))} (got {sorted(dims)})")
        for k, v in dims.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"evaluate(): {k}={v!r} must be a positive int")
        return dims

    def _holds(self, dims: dict) -> bool:
        """The formulas hold at these sizes: T >= 3 and both the prompt and the last step's length lie
        in the analyses' region (the region of 5 tokens, tried at the prompt and shifted to the end)."""
        t = dims[self.name]
        if t < 3:
            return False
        plan = self.reports[5]._plan
        prompt = self.dims[1]
        for shift in {0, max(0, t - 5)}:
            at = {plan.symbols[k]: v + (shift if k == prompt else 0) for k, v in dims.items() if k in plan.symbols}
            if min(at.values()) < 1 or plan.region.violations(at):
                return False
        return True

    def evaluate(self, **dims: int) -> dict:
        """Bytes at these sizes: ``resident``, ``peak``, ``peak_above_resident``, ``retained``."""
        dims = self._values(dims)
        if self._holds(dims):
            subs = {self.symbols[k]: v for k, v in dims.items()}
            resident = int(self.resident.subs(subs))
            peak = int(self.peak.subs(subs))
            return {"resident": resident, "peak": peak, "peak_above_resident": peak - resident,
                    "retained": int(self.retained.subs(subs))}
        t = dims[self.name]
        sizes = {k: v for k, v in dims.items() if k != self.name}
        if t >= 3 and not self._rehinted:
            for near in self._near.values():  # formulas made for other sizes may hold here too
                if near is not None and near._holds(dims):
                    return near.evaluate(**dims)
            near = self._near_formulas(sizes)
            if near is not None and near._holds(dims):
                return near.evaluate(**dims)
        if t not in self._concrete:  # the decode steps cross a bound of the region: analyse t tokens
            from .options import AnalysisOptions

            _log.info("analysing generate() for all %d new tokens at %s, one decode step at a time (slow): the "
                      "formulas in %s do not hold there (%s)", t, _sizes(sizes), self.name, self._why_not(dims))
            self._concrete[t] = generation(self.model, self.dims, new_tokens=t, cache=self.cache,
                                           options=AnalysisOptions.of(self._options, hints=sizes), **self._kwargs)
        ev = self._concrete[t].evaluate(**sizes)
        return {k: ev[k] for k in ("resident", "peak", "peak_above_resident", "retained")}

    def _near_formulas(self, sizes: dict) -> "TokenFormulas | None":
        """The formulas made from the same three calls re-analysed at ``sizes`` (each report
        re-analyses there as its own ``evaluate`` would: at exactly those sizes, a batch of 1
        included), once per sizes; None where those calls do not grow by fixed bytes per token."""
        key = tuple(sorted(sizes.items()))
        if key not in self._near:
            _log.info("re-analysing generate() for %s new tokens at %s: the formulas made at %s do not hold there (%s)",
                      ", ".join(map(str, TOKENS)), _sizes(sizes), _sizes(self.reports[TOKENS[-1]].hints),
                      self._why_not({**sizes, self.name: TOKENS[-1]}))
            try:
                reports = {n: r._reanalysed(dict(sizes)) for n, r in self.reports.items()}
                self._near[key] = TokenFormulas.combine(self.model, self.dims, self.name, self.cache, self._options,
                                                        self._kwargs, reports, rehinted=True)
            except FxMemError as exc:
                _log.info("no formulas in %s at %s: %s", self.name, _sizes(sizes), str(exc).splitlines()[0])
                self._near[key] = None
        return self._near[key]

    def _why_not(self, dims: dict) -> str:
        """Why the formulas do not hold at ``dims``, in words (the region's bounds, or T < 3)."""
        if dims[self.name] < 3:
            return f"{self.name} < 3"
        return "region " + (", ".join(self.reports[TOKENS[-1]].region) or "-")

    def max_size(self, dim: str, budget: Any, **fixed: int) -> int:
        """The largest ``dim`` whose ``generate`` peak fits ``budget`` (bytes or "80GiB") with the
        other sizes ``fixed``; 0 when even 1 does not."""
        from .accounting.budget import MaxSize
        from .units import parse_bytes
        from .units import format_bytes as fb

        limit = parse_bytes(budget)
        fits = lambda n: self.evaluate(**{**fixed, dim: n})["peak"] <= limit  # noqa: E731
        # start where the formulas hold (PyTorch treats 1 apart); below, bisect (the peak grows with
        # every dim): each size there may be an analysis of its own, so never walk them one by one
        plan = self.reports[5]._plan
        low = int(plan.region.lower.get(plan.symbols.get(dim), 1)) if dim in plan.symbols else 1
        low = max(1, low)
        if not fits(low):
            # the weights and inputs alone (a formula that holds at every size) may rule out every
            # size: then no size below needs an analysis of its own
            held = int(self.resident.subs({self.symbols[k]: v for k, v in {**fixed, dim: 1}.items()
                                           if k in self.symbols}))
            if held > limit:
                return MaxSize.of(0, f"nothing fits: at {dim}=1 resident alone (parameters, buffers and inputs) "
                                     f"needs {fb(held)}, over the budget of {fb(limit)}")
            at_one = self.evaluate(**{**fixed, dim: 1})
            if at_one["peak"] > limit:
                return MaxSize.of(0, f"nothing fits: at {dim}=1 the peak is already {fb(at_one['peak'])}, over the "
                                     f"budget of {fb(limit)}; resident alone (parameters, buffers and inputs) needs "
                                     f"{fb(at_one['resident'])}")
            lo, hi = 1, low  # fits(lo), not fits(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            return lo
        hi = low
        while fits(hi * 2):
            hi *= 2
            if hi > 2**40:
                raise SpecError(f"max_size({dim!r}): the peak does not grow with {dim}")
        lo, hi = hi, hi * 2  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    @property
    def reanalyses(self) -> int:
        """How many times these formulas were re-analysed near sizes they do not hold at."""
        return sum(1 for near in self._near.values() if near is not None)

    def __repr__(self) -> str:
        return f"TokenFormulas(peak={self.peak}, retained={self.retained})"


def _token(model: torch.nn.Module) -> int:
    """A prompt token id that is no special token (the prompt's values are stated: any ordinary
    token takes the path every ordinary token takes)."""
    config = getattr(model, "config", None)
    special = {getattr(config, k, None) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    vocab = int(getattr(config, "vocab_size", 8) or 8)
    return next(t for t in range(3, max(vocab, 4)) if t not in special)


@timed(None)
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
    if isinstance(new_tokens, str) and new_tokens.isidentifier():
        return TokenFormulas.of(model, dims, new_tokens, cache, options, generate_kwargs)
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise SpecError(f"new_tokens={new_tokens!r}: a positive int (the number of tokens generate() makes), or a "
                        f"dim name such as 'T' for formulas in the number of new tokens")
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


class _AtTokens:
    """TokenFormulas at a fixed number of new tokens, read like a report (evaluate, max_size, notes)."""

    def __init__(self, formulas: TokenFormulas, tokens: int):
        self.formulas, self.tokens = formulas, tokens
        self.storages = formulas.reports[3].storages
        self.notes = formulas.notes

    def evaluate(self, **dims: int) -> dict:
        return self.formulas.evaluate(**dims, **{self.formulas.name: self.tokens})

    def max_size(self, dim: str, budget: Any, **fixed: int) -> int:
        return self.formulas.max_size(dim, budget, **fixed, **{self.formulas.name: self.tokens})


def serve_summary(model: torch.nn.Module, batch: int, prompt: int, new_tokens: int, dtype: Any = None,
                  gpu: Any = None, cache: str = "dynamic") -> str:
    """A few lines for ``fxmem llm --serve``: the weights, the KV cache and the peak (bytes) of one
    ``generate`` call at ``batch`` x ``prompt`` for ``new_tokens`` tokens, and with ``gpu`` (bytes
    or "80GiB") the largest batch and prompt length whose call fits. ``dtype``: the model's
    parameters' (it is built in it; said in the first line). ``cache``: "dynamic" or "static", as
    for :func:`generation`. Example: ``serve_summary(meta_llama, 1, 4096, 128, gpu="80GiB")``.

    The calls are analysed at the sizes asked (hints ``B=batch, P=prompt``): one analysis (the
    calls of 3, 4 and 5 new tokens, see :class:`TokenFormulas`) answers the peak and both searches
    where its region holds; a batch of 1 takes a second one, at ``B=1`` (PyTorch fixes a dim
    analysed at 1, so the first one is made at a larger batch and answers the largest batch)."""
    from .units import parse_bytes
    from .llm import context_length, past_context
    from .options import AnalysisOptions
    from .units import format_bytes as fb

    options = AnalysisOptions(hints={"B": batch, "P": prompt})
    report = None
    if new_tokens >= 6:  # formulas in the number of tokens: 3 short calls instead of new_tokens steps
        try:
            formulas = generation(model, ("B", "P"), new_tokens="T", cache=cache, options=options)
        except ModelError as exc:
            _log.info("no formulas in the number of new tokens (%s): analysing all %d decode steps",
                      str(exc).splitlines()[0], new_tokens)
            formulas = None
        if formulas is not None:
            report = _AtTokens(formulas, new_tokens)
    if report is None:
        _log.info("analysing generate() for %d new tokens at B=%d, P=%d", new_tokens, batch, prompt)
        report = generation(model, ("B", "P"), new_tokens=new_tokens, cache=cache, options=options)
    at = report.evaluate(B=batch, P=prompt)
    weights = sum(int(s.bytes) for s in report.storages if s.role.value == "parameter")
    kind = dtype or next((p.dtype for p in model.parameters()), None)
    lines = [f"{type(model).__name__}.generate() ({str(kind).replace('torch.', '')}): {new_tokens} new tokens, "
             f"greedy, {cache} KV cache",
             f"  weights             {fb(weights)}",
             f"  peak                {fb(at['peak'])}  at batch {batch}, prompt {prompt}"]
    kv = _kv_line(model, batch, prompt, new_tokens, cache)
    if kv:
        lines.insert(2, kv)
    if gpu is not None:
        budget = parse_bytes(gpu)
        for what, dim, fixed, at_sizes in (("batch", "B", f"prompt {prompt}", {"P": prompt}),
                                           ("prompt", "P", f"batch {batch}", {"B": batch})):
            _log.info("largest %s at %s in %s", what, fixed, fb(budget))
            value = report.max_size(dim, budget, **at_sizes)
            reason = getattr(value, "reason", None) or (
                past_context(context_length(model), value + new_tokens - 1) if dim == "P" else None)
            lines.append(f"  largest {what:<12}{value:,}  at {fixed} in {fb(budget)}" + (f"  ({reason})" if reason else ""))
    context = context_length(model)
    if context is not None and prompt + new_tokens - 1 > context:
        # past the positions the model was built for, models may change code path (Phi-3's rotary
        # scaling): fxmem follows the real code, but the formulas in T may no longer hold
        lines.append(f"  note: the prompt and new tokens ({prompt + new_tokens - 1:,} positions) run past the model's "
                     f"max_position_embeddings ({context:,})")
    lines += [f"  note: {n}" for n in report.notes if "numbers may not be exact" in n][:3]
    return "\n".join(lines)


def _kv_line(model: torch.nn.Module, batch: int, prompt: int, new_tokens: int, cache: str) -> str | None:
    """The summary's line on the KV cache left at the end of the call (bytes, and the positions each
    kind of layer holds); None where :func:`kv_cache_bytes` does not model the model's cache."""
    from .units import format_bytes as fb

    config = getattr(model, "config", None)
    try:
        kind_name = str(next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.", "")
        kv = int(kv_cache_bytes(config, batch, prompt, new_tokens, dtype=kind_name, cache=cache))
        windows = cache_layers(config, cache)
    except (ModelError, SpecError, AttributeError):
        return None
    full = prompt + new_tokens - 1
    P, T = sympy.Integer(prompt), sympy.Integer(new_tokens)
    kinds: dict = {}  # positions held -> layers holding them
    for w in windows:
        held = int(_positions(w, cache, P, T))
        kinds[held] = kinds.get(held, 0) + 1
    if set(kinds) == {full}:
        where = f"{full} positions x batch {batch}"
    else:
        where = ", ".join(f"{held} positions in {n} layer{'s' * (n > 1)}" for held, n in sorted(kinds.items()))
        where += f" (sliding windows), x batch {batch}"
    return f"  KV cache at the end {fb(kv)}  ({where})"


# --- the KV cache alone, from the config ----------------------------------------------------------
# After a greedy generate(max_new_tokens=T) a full-attention layer holds P + T - 1 positions (the
# last new token is produced but never fed back): a key and a value of shape (B, KV heads, positions,
# head dim), in a DynamicCache as in a StaticCache (generate sizes it P + T - 1 for a fresh model).
# A sliding-window layer (Mistral, Phi-3: a `sliding_window` and no `layer_types`; Gemma-2/3: every
# other layer) holds fewer, by transformers' own rule (cache_utils.py, transformers 5):
#  * DynamicSlidingWindowLayer keeps a view of the last window - 1 positions of the concatenation
#    [cache, new]: the storage held is that concatenation, min(window - 1, P + T - 2) + 1 = min(window,
#    P + T - 1) positions after a decode step; after the prefill alone (T = 1) all P positions.
#  * StaticSlidingWindowLayer is allocated min(window, P + T - 1) positions up front.
# Which layer is which is read off the cache transformers builds for the config (no tensors are
# allocated before the first update). Checked against real caches in tests/llm/test_generation_caches.py;
# generation() counts the cache as the run allocates it.
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_REFUSED_CACHES = {"offloaded": "the offloaded cache moves layers between the GPU and the CPU (transformers asks "
                                "for CUDA for it); its GPU bytes are not modelled - use cache='dynamic' or 'static'"}


def _geometry(config) -> tuple[int, int]:
    """(KV heads, head dim) of a decoder's attention, read from its transformers config."""
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, name, None), int):
            raise ModelError(f"kv_cache_bytes: config has no integer {name!r}; only decoders with standard "
                             "attention caches are supported (state-space and encoder-decoder models are not)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def cache_layers(config, cache: str = "dynamic") -> list:
    """Per decoder layer, the window of the KV cache layer transformers builds for ``config``
    (positions; ``None`` for a full-attention layer, ``0`` for a layer that keeps no cache).

    Read off transformers' own ``DynamicCache(config=...)`` / ``StaticCache(config=...)``, which
    allocate nothing until their first update. Example: a Gemma-2 config with ``sliding_window=4096``
    gives ``[4096, None, 4096, None, ...]``; a Llama config ``[None] * layers``. Raises
    :class:`ModelError` for layers whose cache is not keys and values per position (state-space,
    linear-attention, indexed or quantized layers).
    """
    from transformers import cache_utils as cu

    if cache in _REFUSED_CACHES:
        raise ModelError(f"kv_cache_bytes: cache={cache!r}: {_REFUSED_CACHES[cache]}")
    if cache not in CACHES:
        raise SpecError(f"kv_cache_bytes: cache={cache!r}: use one of {CACHES}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    _geometry(text)
    if getattr(text, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise ModelError("kv_cache_bytes: encoder-decoder models keep a cross-attention cache too; only decoders "
                         "are supported - use fxmem.generation(model, ...) on the model")
    try:
        if cache == "static":  # a window larger than any cache length, so each layer's length is its window
            built = cu.StaticCache(config=text, max_cache_len=2**62)
        else:
            built = cu.DynamicCache(config=text)
    except Exception as exc:  # transformers cannot build its cache for this config: nor can we count it
        raise ModelError(f"kv_cache_bytes: transformers builds no {cache} cache for this config "
                         f"({type(exc).__name__}: {exc}); use fxmem.generation(model, ...) on the model") from exc
    layers = built.layers or [cu.DynamicLayer() for _ in range(text.num_hidden_layers)]
    return [_window(layer, cu) for layer in layers]


def _window(layer, cu) -> Any:
    """A cache layer's window (positions), ``None`` when it keeps every position, 0 when nothing."""
    kind = type(layer)
    if kind is cu.DummyLayer:  # a layer that reads another layer's cache (KV sharing) keeps none
        return 0
    if kind in (cu.DynamicLayer, cu.StaticLayer):
        return None
    if kind is cu.DynamicSlidingWindowLayer:
        return int(layer.sliding_window)
    if kind is cu.StaticSlidingWindowLayer:
        return int(layer.max_cache_len)  # min(window, 2**62)
    raise ModelError(f"kv_cache_bytes: transformers builds a {kind.__name__} for a layer of this config, whose "
                     f"memory is not keys and values per position (state-space, linear-attention, indexed or "
                     f"quantized caches are not supported); use fxmem.generation(model, ...) on the model")


def _positions(window: Any, cache: str, P: sympy.Expr, T: sympy.Expr) -> sympy.Expr:
    """Positions one cache layer's storage holds after greedy generate of T tokens on P (see above)."""
    full = P + T - 1
    if window is None:
        return full
    if window == 0:
        return sympy.Integer(0)
    bounded = sympy.Min(window, full)
    if cache == "static":
        return bounded
    if T.is_number:  # after the prefill alone the dynamic layer still holds the whole prompt
        return P if T == 1 else bounded
    return sympy.Piecewise((P, sympy.Eq(T, 1)), (bounded, True))


def kv_cache_bytes(config, batch="B", prompt="P", new_tokens="T", dtype="float32", cache="dynamic") -> sympy.Expr:
    """Bytes of the KV cache left by greedy ``generate`` of ``new_tokens`` after ``prompt`` tokens,
    for the cache transformers builds for ``config`` (``cache``: "dynamic" or "static"):
    ``prompt + new_tokens - 1`` positions in a full-attention layer (the last token is never fed
    back), at most the window in a sliding-window layer (``sympy.Min``; see :func:`cache_layers`).

    ``batch``/``prompt``/``new_tokens`` are dim names (symbols) or ints; ``dtype`` names the cache's
    dtype (the model's). Example: ``kv_cache_bytes(cfg, 4, 128, 32)`` gives an integer of bytes; for
    a Mistral config with ``sliding_window=4096`` and 32 layers of 8 KV heads of 128,
    ``kv_cache_bytes(cfg, dtype="bfloat16")`` is ``131072*B*Min(4096, P + T - 1)`` for T >= 2.
    A static cache is that of a model's first call (transformers sizes later calls' for the
    largest call so far).
    """
    if str(dtype).replace("torch.", "") not in _ITEMSIZE:
        raise ModelError(f"kv_cache_bytes: dtype {dtype!r} not one of {sorted(_ITEMSIZE)}")
    itemsize = _ITEMSIZE[str(dtype).replace("torch.", "")]
    windows = cache_layers(config, cache)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kv_heads, head_dim = _geometry(text)
    B, P, T = (sympy.Symbol(v, positive=True, integer=True) if isinstance(v, str) else sympy.Integer(v)
               for v in (batch, prompt, new_tokens))
    positions = sympy.Add(*(_positions(w, cache, P, T) for w in windows))
    # key + value per layer
    return sympy.factor(2 * kv_heads * head_dim * itemsize * B * positions)
