"""``fxmem.optimize``: rewrite a model so that it takes less memory - verified, with the memory
formulas before and after each rewrite.

    trace (train and eval mode: :mod:`.modes`) -> run at small sizes (probes) -> each rule of
    the registry (``PASSES``) finds sites on the graph the rules before it kept -> all its sites
    in one trial (a copy of the graph with them applied -> same outputs, gradients and buffers as
    the original model, in train and eval mode, with and without grad? -> fxmem's formulas: no
    peak higher anywhere, one lower? (training: forward and training step; inference) -> keep
    them); site by site only where that fails -> the whole-graph passes (``GRAPH_PASSES``):
    another node order (:mod:`.reorder`), and with ``budget=`` what to recompute in backward so
    that the training step fits (:mod:`.recompute`). Each graph is analysed once per call.

Verification is made once where it can be: a trial the formulas keep is verified with the graph
that follows it (the line's final graph, or the recomputed plan that holds it); one the formulas
decline is verified at once (its record says it is exact). Where a verification then fails, the
call starts again and verifies each trial before keeping it, so that the failing rewrite is found,
dropped and named; nothing of the first pass is returned.

The result is a ``torch.fx.GraphModule`` with the model's call signature that shares the model's
``Parameter`` objects (training it trains the model) and follows ``train()``/``eval()`` as the
model does (``F.dropout(x, p, training=self.training)`` reads the flag when it runs, not when it
was traced); the model itself is never modified.
``opt.meta["fxmem"]`` lists every rewrite applied and every one declined: a one-line ``reason``, the
formulas, condition, verification and grouping in their own keys (:data:`.base.FIELDS`).

>>> opt = fxmem.optimize(GraphAttentionLayerFixed(6, 128), ("B", "N", 6), ("B", "N", "N"))  # doctest: +SKIP
>>> [(r["rule"], r["status"], r["peak_before"], r["peak_after"]) for r in opt.meta["fxmem"]]  # doctest: +SKIP
[('pair-linear', 'applied', '2052*B*N**2 + 536*B*N + 4096', '...')]
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Mapping, Sequence

import sympy
import torch
import torch.fx

from fxmem.isolation import carry_hooks, isolated
from fxmem.timeout import timed
from fxmem import _torch_compat as tc
from fxmem.analyze import analyze
from fxmem.options import AnalysisOptions
from fxmem.capture import forward_parameters
from fxmem.errors import FxMemError, ModelError, NothingToTrainError, ShapeError, SpecError, TraceError
from fxmem.inputs import random_inputs
from fxmem.simulation.failures import first_line
from fxmem.report import Report
from fxmem.capture.whole_graph import capture
from fxmem.specs import InputSpec, TensorSpec, check_dims, check_input_sizes, choose_hints, parse_specs
from fxmem.passes.base import LOG_KEYS, REASON_LIMIT, STATUSES, Finding, Line, Pass, Probe, brief, log_entry
from fxmem.units import format_bytes, parse_bytes
from fxmem.passes.modes import in_mode, trace_modes
from fxmem.passes.model_cache import without_cache
from fxmem.passes.recompute import BudgetError
from fxmem.passes.registry import GRAPH_PASSES, PASSES
from fxmem.passes.verify import compare
from fxmem.passes.sdpa_dropout import model_bits
from fxmem.passes import switch
from fxmem.passes.decide import Condition, Decision, candidates, decide
from fxmem import data_paths
from fxmem.accounting.symbolic import Region
from fxmem.search import first_true

# Probe sizes when the user gives none: dim k (in order of appearance) is base+k for each base of
# a rung; probes run at the first and last base, rewrites are verified at all three. Small, so a
# [.., N, N, 2F] tensor is tiny, and different in each probe, so what varies with the sizes is
# told apart from what does not. A model that cannot run that small (a pooling, a wide kernel)
# gets the next rung.
PROBE_LADDER = ((3, 4, 5), (8, 9, 10), (16, 17, 18), (32, 33, 34))


def _plain_sgd(params: Any) -> torch.optim.Optimizer:
    # no optimizer state: the training step's peak is forward + backward + gradients
    return torch.optim.SGD(params, lr=0.0)


# The analyses one call makes, each an AnalysisOptions derived from the call's own ``kw`` (the
# user's options, mode="auto", no self-check; with budget= the user's optimizer):
def _step(kw: AnalysisOptions) -> AnalysisOptions:
    """A training step: the optimizer budget= brought, else SGD without state."""
    return kw.replace(optimizer=kw.optimizer or _plain_sgd)


def _forward(kw: AnalysisOptions) -> AnalysisOptions:
    """The forward in train mode, with autograd (what backward keeps), no step."""
    return kw.replace(optimizer=None)


def _inference(kw: AnalysisOptions) -> AnalysisOptions:
    """The forward without grad (inference)."""
    return kw.replace(grad=False, optimizer=None)


@dataclasses.dataclass
class _Memory:
    """fxmem's analysis of one graph, and its peaks (bytes) at the example sizes.

    ``report`` is the train-mode analysis (with a training step when there is grad), ``inference``
    the eval-mode analysis under ``no_grad``: a rewrite must not raise either.
    """

    report: Report
    inference: Report
    at_hints: tuple[int, ...]  # (forward peak, training-step peak or 0, inference peak) at the example sizes
    # where a size the data decides chooses the graph's path (an edge list, or dense row blocks): the
    # analysis of the other path (data_paths.beyond), which the decisions compare too
    beyond: Any = None
    # why the training step could not be analysed (then ``report`` is the forward's): the decisions
    # compare forward and inference peaks only, and say so
    step_failure: str | None = None
    _texts: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    def paths(self) -> dict:
        """The data dims that choose a path, with the bound (in the dims) up to which the analysis holds."""
        return {**self.report.data_paths, **self.inference.data_paths}

    def lower_than(self, other: "_Memory") -> bool:
        """Proven by the formulas: no peak higher than ``other``'s for any size in the region, one lower somewhere."""
        return _decide(other, self, self.report.symbols, self.report.hints, None).verdict == "keep"

    def decision(self, other: "_Memory") -> str:
        """The formula comparison of this graph's peaks with ``other``'s, in words."""
        return _decide(other, self, self.report.symbols, self.report.hints, None).text

    def at_sizes(self, suffix: str) -> dict:
        """``sizes`` and ``bytes_<suffix>``: the peaks (ints, bytes) at the example sizes, for the records."""
        peak, train, inference = self.at_hints
        return {"sizes": dict(self.report.hints),
                f"bytes_{suffix}": {"peak": peak, "train_peak": train if self.report.train_peak is not None else None,
                                    "inference_peak": inference}}

    def formulas(self, suffix: str) -> dict[str, str | None]:
        if self._texts is None:  # printed once: every site's record of one graph shows the same
            r = self.report
            self._texts = {"peak": str(r.peak), "saved": str(r.saved),
                           "train_peak": str(r.train_peak) if r.train_peak is not None else None,
                           "inference_peak": str(self.inference.peak)}
        return {f"{k}_{suffix}": v for k, v in self._texts.items()}


def _change(before: _Memory, after: _Memory, room: int = REASON_LIMIT - 10) -> str:
    """The peaks that change at the example sizes, largest change first, in words: ``"inference peak
    1.96 GiB -> 8.11 MiB, peak 1.96 GiB -> 12.00 MiB at B=4, N=500"`` (a reason's numbers), as many
    as fit in ``room`` characters (one at least)."""
    names = ("peak", "training-step peak", "inference peak")
    pairs = [(n, a, b) for n, a, b in zip(names, before.at_hints, after.at_hints) if a and b and a != b]
    pairs.sort(key=lambda x: -abs(x[2] - x[1]) / x[1])
    at = ", ".join(f"{k}={v}" for k, v in after.report.hints.items())
    if not pairs:
        return f"the same peaks at {at}" if at else "the same peaks"
    words = [f"{n} {format_bytes(a)} -> {format_bytes(b)}" for n, a, b in pairs]
    at = f" at {at}" if at else ""
    while len(words) > 1 and len(", ".join(words) + at) > room:
        words.pop()
    return ", ".join(words) + at


def _failed(diff: Any) -> str:
    """A failed verification, for the ``verification`` key."""
    return f"failed: max diff {diff.max_abs:.3g} in {diff.where}"


class _Unverified(Exception):
    """A verification failed in the optimistic pass while the graph held rewrites kept on their
    formulas whose own verification was deferred: which rewrite fails is not known, so the call
    starts again, verifying each trial before it is kept."""


@isolated
@timed("option_values")
def optimize(
    model: torch.nn.Module,
    *input_specs: Any,
    options: AnalysisOptions | None = None,
    probe_sizes: Sequence[Mapping[str, int]] | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    budget: Any = None,
    dims: Mapping[str, int] | None = None,
    **option_values: Any,
) -> torch.fx.GraphModule:
    """Return ``model`` rewritten to use less memory, as a GraphModule with the same call signature.

    Args:
        model: an ``nn.Module``; traced with ``torch.fx``, never modified. The result shares its
            ``Parameter`` objects and ``state_dict`` keys.
        *input_specs, options, **option_values: as for :func:`fxmem.analyze` (the options of
            :class:`fxmem.AnalysisOptions`); the memory (bytes) before and after is analysed
            with them.
        probe_sizes: two or more ``{dim: size}`` at which the model is run for real, small, to see
            what each tensor holds and to verify each rewrite (default: dim k is 3+k and 5+k,
            verified at 3+k, 4+k, 5+k; larger when the model cannot run that small). Every dim
            must differ between two of them.
        settings: choices for a pass, by its name: ``{"fused-attention": {"block_bytes": 2**20}}``
            (each pass's ``settings`` in ``fxmem.passes.PASSES`` says what it takes).
        budget, dims, optimizer=: fit a training step with ``optimizer`` (default: SGD without
            state) at ``dims`` into ``budget`` (bytes, or ``"24GiB"``) by recomputing blocks in
            backward, the fewest FLOPs that fit (:mod:`.recompute`); :class:`~.recompute.BudgetError`
            says the smallest peak reachable when none fits.

    A rewrite is kept only if the rewritten graph gives the same outputs, the same gradients
    (w.r.t. every parameter and floating input) and the same buffers as the original model on
    random inputs at the probe sizes, in train and eval mode, with autograd and under ``no_grad``
    (same random numbers in both: dropout keeps the same elements), and fxmem's formulas prove
    its peaks (train mode: forward peak and, with ``grad``, training-step peak; eval mode: the
    inference peak under ``no_grad``) never higher for every size where the analysis holds and one
    lower somewhere (:mod:`.decide`; where the two cross, both forms are returned, switched at run
    time by the condition in the dims). The hints only choose where the analysis looks first.
    ``opt.meta["fxmem"]`` lists each rewrite: ``rule``, ``status`` (``"applied"``/``"declined"``),
    ``where`` (node and file:line), ``reason`` (one line: what was decided and why), and in keys of
    their own the ``peak_``/``saved_``/``train_peak_``/``inference_peak_`` ``before``/``after``
    formulas, ``decision``, ``condition``, ``verification``, ``group``, ``details``
    (:data:`.base.FIELDS` says what each holds).

    >>> opt = fxmem.optimize(layer, ("B", "N", 6), ("B", "N", "N"))    # doctest: +SKIP
    >>> fxmem.analyze(opt, ("B", "N", 6), ("B", "N", "N")).peak          # doctest: +SKIP
    """
    # First optimistically: a trial the formulas keep is verified with what follows it (the line's
    # final graph, or the recomputed plan that contains it: one verification where there were two).
    # Where any verification then fails, nothing of that pass is returned: the call starts again
    # and verifies each trial before it is kept, so that the failing rewrite is found and dropped.
    for optimistic in (True, False):
        dropped: list[str] = []  # the warnings of rewrites dropped, given once the pass stands
        try:
            out = _optimize(model, input_specs, options, probe_sizes, settings, budget, dims, option_values,
                            optimistic, dropped)
        except _Unverified:
            continue  # that pass's records and warnings are not the call's
        except BaseException:
            _warn(dropped)
            raise
        _warn(dropped)
        return _with_the_users_hooks(model, out)
    raise AssertionError("unreachable: the careful pass raises no _Unverified")


def _with_the_users_hooks(model: torch.nn.Module, out: torch.nn.Module) -> torch.nn.Module:
    """``out`` with the user's hooks on the modules it calls as ``model`` does: the analyses and
    verifications ran without them (fxmem.isolation), the user's calls of the rewrite run them.
    A hook on a module whose code the graph runs inline has no call to run at: refused, not lost."""
    if out is model:
        return out

    def called(path: str) -> bool:
        return isinstance(out, torch.fx.GraphModule) and any(
            n.op == "call_module" and n.target == path for n in out.graph.nodes)

    missing = carry_hooks(model, out, called)
    if missing:
        raise ModelError(f"optimize cannot keep your {'; '.join(missing)}: the rewritten graph runs that module's "
                         f"code inline, so nothing would call the hook; remove it before optimize and register it "
                         f"on the result (or make the module a leaf with leaf_modules=)")
    return out


def _warn(texts: list[str]) -> None:
    for text in texts:  # at optimize's caller (past this function, optimize and its isolation wrapper)
        warnings.warn(text, RuntimeWarning, stacklevel=4)


def _optimize(model: torch.nn.Module, input_specs: tuple, options: AnalysisOptions | None,
              probe_sizes: Sequence[Mapping[str, int]] | None, settings: Mapping[str, Mapping[str, Any]] | None,
              budget: Any, dims: Mapping[str, int] | None, option_values: dict, optimistic: bool,
              dropped: list) -> torch.fx.GraphModule:
    """One pass of :func:`optimize` (see there); ``optimistic``: defer the verification of trials the
    formulas keep (a failure then raises :class:`_Unverified`); ``dropped`` collects the warnings."""
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"model must be a torch.nn.Module, got {type(model).__name__}; wrap a function in a "
                         f"Module whose forward calls it")
    name = type(model).__name__
    opts = AnalysisOptions.of(options, **option_values)
    if opts.loss is not None or opts.hparams is not None or opts.init is not None:
        raise SpecError("optimize rewrites an nn.Module with the default loss: loss=, hparams= and init= are "
                        "options of fxmem.analyze only")
    if opts.mode == "eager":
        raise SpecError("optimize rewrites a graph of the model: mode='eager' (the original forward) cannot be "
                        "rewritten; use mode='auto' or 'graph'")
    dtype, grad, hints, leaf_modules = opts.dtype, opts.grad, opts.hints, opts.leaf_modules
    optimizer = opts.optimizer
    settings = _check_settings(settings)
    if budget is not None:
        parse_bytes(budget)
        if not grad:
            raise SpecError("budget= fits a training step; it needs grad=True")
        if not isinstance(dims, Mapping) or not dims:
            raise SpecError("budget= needs dims={dim: size, ...}: the sizes the training step must fit at")
    elif dims is not None or optimizer is not None:
        raise SpecError("dims= and optimizer= say where a budget= must hold; pass budget= too")
    params = forward_parameters(model)
    specs, symbols = parse_specs(input_specs, params, dtype, name)
    if budget is not None:  # {dim: int}, every dim named: where the budget must hold
        dims = dims
    model, cache_entry = without_cache(model, params.names[len(specs):], name)  # transformers' use_cache=True
    first = [cache_entry] if cache_entry is not None else []
    try:
        traced = trace_modes(model, leaf_modules, {n: params.defaults[n] for n in params.names[len(specs):]},
                             fallback=lambda m: capture(m, specs, params.names[:len(specs)]))
    except TraceError as exc:
        # a rewrite is a change to a graph: without one there is nothing to rewrite, say so plainly
        head, _, _ = str(exc).partition("\n  what to do")
        raise TraceError(f"fxmem.optimize rewrites a graph of the model, and neither torch.fx nor TorchDynamo can "
                         f"capture one: {head}\n  what to do: fxmem.analyze(model, ...) still gives its memory (it "
                         f"falls back to the original forward by itself); to rewrite, make the failing code "
                         f"traceable (mark the module that contains it as a leaf with leaf_modules=[...]), or "
                         f"optimize the submodules that can be captured") from exc
    gm = traced.graph_module
    region = _region(gm, specs, symbols, name)
    # the rewrites are judged with the user's options; the training step's optimizer is optimize's own
    # choice (SGD without state: gradients, not state, are what a rewrite changes). Its many analyses
    # are not self-checked one by one (a real run each): each rewrite is verified on real runs against
    # the original, and the user's own analysis of the result checks itself
    # with budget=, the user's optimizer: the analyses that decide the rewrites are then also the
    # training step the budget is fitted to (one analysis of the graph serves both)
    kw = opts.replace(optimizer=optimizer if budget is not None else None, mode="auto", check=False)
    try:
        probes, verify_at = _probe(gm, specs, symbols, probe_sizes, name)
    except ShapeError:
        analyze(gm, *input_specs, options=_inference(kw))  # a shape error at every size says where, in dims
        raise
    if region is not None and not all(region[0].holds(sizes) for sizes in verify_at):
        raise TraceError(f"the graph TorchDynamo captured of {name} holds only where {region[0]}, and fxmem's "
                         f"verification sizes ({'; '.join(str(v) for v in verify_at)}) are outside it; pass "
                         f"probe_sizes= inside it")
    if region is not None and hints and not region[0].holds(choose_hints(symbols, hints)):
        raise SpecError(f"hints={dict(hints)} lie outside where the graph TorchDynamo captured of {name} holds "
                        f"({region[0]}; the model bounds its own sizes there), so the rewrites cannot be judged at "
                        f"them: give hints inside it, or leave hints out (outside it the result runs the model's own "
                        f"forward, or a second graph where the region leaves out one size, such as L == block_size)")
    point = _left_out(region, specs, symbols, input_specs)
    at_point = point is not None and budget is not None and dims[point[0]] == point[1]
    if region is not None and budget is not None and not at_point and not region[0].holds(dims):
        # at dims the result runs the model's own forward: no rewrite or recomputation reaches them
        _must_fit(model, input_specs, kw, budget,
                  dims,
                  f"the graph TorchDynamo captured of {name} holds only where {region[0]}, and at the dims the result "
                  f"runs the model's own forward; what to do: checkpoint the model's blocks yourself "
                  f"(torch.utils.checkpoint), dims inside that region, or a larger budget")
    verify_inputs = [random_inputs(specs, sizes, requires_grad=False) for sizes in verify_at]
    state = _Search(gm, model, input_specs, kw, verify_inputs, symbols, choose_hints(symbols, hints), None,
                    optimistic, dropped)
    if traced.capture:
        gm.meta["fxmem_capture"] = traced.capture
    if traced.reason:  # two graphs, switched by the flag: returned as traced, with the model's modules
        _share_modules(gm, model)
        state.faithful(gm)
        if budget is not None:  # never silence: the step must fit as it is, or say so
            _must_fit(model, input_specs, kw, budget,
                      dims,
                      f"{traced.reason}; what to do: make the model compute the same graph in train and eval mode, "
                      f"or a larger budget")
        log = first + [log_entry("train/eval", "declined", name, f"declined: {traced.reason}",
                                 details=traced.reason)] + [
            log_entry(p.name, "no match", name, f"not looked for: {traced.reason}", details=traced.reason)
            for p in PASSES]
        if region is not None:
            gm, entry = _within(region, gm, model, name)
            log.append(entry)
        gm.meta["fxmem"] = log
        return gm
    hint_sizes = choose_hints(symbols, hints)
    state = _search(gm, state, probes, specs, name, settings, None)
    switched = None
    if state.switch is not None:  # a rewrite that pays only where a condition holds: a second line
        alt = _Search(gm, model, input_specs, state.switch_kw or kw, verify_inputs, symbols,
                      state.switch_hints or hint_sizes, state.switch, optimistic, dropped)
        alt.switch_text = state.switch_text
        alt.references = state.references  # the same model, the same inputs
        alt = _search(gm, alt, probes, specs, name, settings, state.switch)
        switched = _switch(state, alt, model, specs, symbols, name)
        state.switch = alt.condition if switched is not None else None  # which sizes this form runs at
    # the budget is fitted by the form that runs at dims: this graph only inside its region
    fits_here = budget is not None and (region is None or region[0].holds(dims))
    state.best = _finish(state, model, specs, symbols, hints, input_specs, kw, verify_at, budget, dims, fits_here)
    if switched is not None:
        alt, entry = switched
        alt.best = _finish(alt, model, specs, symbols, hints, input_specs, kw, verify_at, budget, dims, fits_here)
        best = _forms(alt.condition, switch.positions(alt.condition, specs, symbols), alt.best, state.best, model)
        log = _tagged(state.log, f"not ({alt.condition})") + _tagged(alt.log, str(alt.condition)) + [entry]
    else:
        best, log = state.best, _tagged(state.log, None)
    if not any(e["status"] == "applied" for e in log):  # returned as captured: verified as every rewrite is
        state.faithful(best)
    if region is not None:  # the captured graph holds within the model's own bounds: its forward elsewhere
        elsewhere, more = _at_point(point, model, specs, symbols, opts, settings, budget if at_point else None,
                                    dims, name)
        if at_point and elsewhere is None:  # no second graph: the model's own step must fit there, or say so
            _must_fit(model, input_specs, kw, budget, dims,
                      f"the graph TorchDynamo captured of {name} holds only where {region[0]}, and no second graph "
                      f"could be made at {point[0]} == {point[1]} ({more[0]['details']})")
        best, entry = _within(region, best, model, name, elsewhere, point if elsewhere is not None else None)
        log += _tagged([entry], None) + more
    _share_modules(best, model)  # every module of the model, used by the graph or not (state_dict keys)
    best.meta["fxmem"] = first + log
    if traced.capture:  # what the rewritten graph is a graph of
        best.meta["fxmem_capture"] = traced.capture
    return best


def _search(gm: torch.fx.GraphModule, state: "_Search", probes: list[Probe], specs: list[InputSpec], name: str,
            settings: dict, assume: Condition | None) -> "_Search":
    """Every pass in registry order over the graph the passes before it made; ``state`` decides."""
    for k, rule in enumerate(PASSES):
        if k:  # each pass sees the graph the passes before it made (fused attention needs decomposed scores)
            if state.accepted:  # verified before later rules build on it: a wrong rewrite is found early
                state.confirm(state.best)
            if state.rebase():
                probes = [Probe(p.sizes, _run_values(state.gm, specs, p.sizes, name)) for p in probes]
        findings = [(rule, f) for f in rule.find(state.gm, probes, settings.get(rule.name, {}))]
        if not findings:  # every call says what it tried, also where nothing was found
            state.log.append(log_entry(rule.name, "no match", name, **rule.no_match(state.gm, probes)))
        for _, finding in findings:
            state.log_finding(finding)
        groups = _groups([(r, f) for r, f in findings if f.status == "match"])
        if len(groups) > 1 and _whole(state, groups, rule):
            continue
        tried = [(g, state.try_group(g)) for g in groups]
        last_kept = max((k for k, (_, verdict) in enumerate(tried) if verdict == "kept"), default=-1)
        # a site tried before a later one was kept is tried again on top of it (the first layer's
        # attention pays only once the second layer's no longer sets the peak)
        unpaid = [g for k, (g, verdict) in enumerate(tried) if verdict == "no gain"
                  and (k > last_kept or state.try_group(g) == "no gain")]
        if len(unpaid) > 1:  # sites that pay only together (the heads of a layer, the layers of a model)
            together = [x for g in unpaid for x in g]
            if state.try_group(together) == "kept":
                for _, f in together:
                    state._entries[id(f)]["group"] = (
                        f"accepted as a group of {len(together)} {rule.name} sites that lower the peak only "
                        f"together (each alone leaves the others' tensors at it)")
    return state


def _whole(state: "_Search", groups: list, rule: Pass) -> bool:
    """Every site of ``rule`` tried in one trial (one verification, one analysis): a model's layers
    are alike, and one trial then decides them all. True when that settles them: kept, or the same
    peak formulas as before (no site touches a peak: none alone can lower one) or lower only where
    a condition holds (the conditioned line tries them again). False when a site must be tried
    alone: the verification failed (which one?) or some peak is higher somewhere (a site that
    raises it may hide one that lowers it)."""
    whole = [x for g in groups for x in g]
    verdict = state.try_group(whole, culprit=False, together=f"tried in one trial with the other {len(whole) - 1} "
                                                               f"{rule.name} site(s)")
    if verdict == "kept":
        for _, f in whole:
            state._entries[id(f)]["group"] = (f"applied with the other {len(whole) - 1} {rule.name} site(s) in one "
                                              f"trial (one verification, one analysis): together never higher")
        return True
    return verdict == "no gain" and state.last is not None and (state.last.same or state.last.verdict == "switch")


def _finish(state: "_Search", model, specs, symbols, hints, input_specs, kw, verify_at, budget, dims,
            fits_here: bool = True) -> torch.fx.GraphModule:
    """The whole-graph passes of the registry (reorder, then recompute), in order, on one line's
    best graph; their entries go to its log."""
    runs_at_dims = budget is not None and fits_here and (state.condition is None or state.condition.holds(dims)) and (
        state.condition is not None or state.switch is None or not state.switch.holds(dims))
    step = _step(kw)
    # the analyses made already serve when they are of the same training step (not a line that
    # looked at other sizes)
    reuse = state.kw == kw and kw.grad
    line = Line(model, specs, input_specs, choose_hints(symbols, hints), verify_at, state.verify_inputs, step, budget,
                dims, runs_at_dims, state.memory,
                state.analysed if reuse else (lambda g: None), state.verify,
                lambda g: _share_modules(g, model))
    best = state.best
    try:
        for p in GRAPH_PASSES:
            best, entry = p.run(best, line)
            state.log.append(entry)
    except BudgetError:
        state.confirm(best)  # the error tells peaks of the rewritten graph: verified before they are told
        raise
    state.confirm(best)
    return best


def _forms(cond: Condition, where: Mapping, when: torch.fx.GraphModule, otherwise: torch.fx.GraphModule,
           model: torch.nn.Module) -> torch.fx.GraphModule:
    """:func:`.switch.build`, sharing the model's modules first: ``parameters()`` in the model's order."""
    best = switch.build(cond, where, when, otherwise, type(model).__name__)
    forms = tc.pop_child(best, "fxmem_forms")
    _share_modules(best, model)
    best.add_module("fxmem_forms", forms)
    # the flags of the wrappers only: the modules inside are the model's, whose flags are the user's
    for m in (best, forms, forms.when, forms.otherwise):
        m.training = model.training
    return best


def _region(gm: torch.fx.GraphModule, specs: Sequence[InputSpec], symbols: Mapping, name: str) -> tuple | None:
    """``(Guards, positions)`` where a captured graph holds only within size guards (``L <= 64``, the
    model's own ``assert t <= block_size``), or None: every size."""
    exprs = gm.meta.get("fxmem_guards")
    if not exprs:
        return None
    guards = switch.Guards(exprs)
    where = switch.positions(guards, specs, symbols)
    try:
        if where is None:
            raise ValueError("a dim that is no input's size")
        guards.holds({d: 2 for d in guards.dims})  # each can be evaluated on sizes
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise TraceError(f"the graph TorchDynamo captured of {name} holds only where {guards} (Python decides on "
                         f"sizes there), and fxmem cannot check that at each call ({exc})") from exc
    return guards, where


def _within(region: tuple, best: torch.fx.GraphModule, model: torch.nn.Module, name: str,
            elsewhere: torch.nn.Module | None = None, point: tuple | None = None) -> tuple:
    """``best`` where the region's guards hold, ``elsewhere`` (default: the model's own forward)
    at other sizes; and its record. ``point``: (dim, size) where ``elsewhere`` runs a second graph."""
    guards, where = region
    out = _forms(guards, where, best, elsewhere if elsewhere is not None else model, model)
    second = (f"the graph captured at {point[0]} == {point[1]} (optimized as well: the entries marked "
              f"'{point[0]} == {point[1]}') at that size, and the model's own forward at every other size"
              if point is not None else "the model's own forward at every other size")
    short = (f"a second graph at {point[0]} == {point[1]} and the model's own forward at every other size"
             if point is not None else "the model's own forward at every other size")
    entry = log_entry("region", "applied", name, f"applied: the captured graph where {guards}, {short}",
                      details=f"the graph TorchDynamo captured holds where {guards} (the model bounds its own sizes "
                              f"there, with an assert or a branch on sizes; Dynamo's guards): the result runs it "
                              f"there, {second} (none of the rewrites, none of their savings), so it computes what "
                              f"the model computes everywhere", condition=str(guards), when=None)
    return out, entry


def _left_out(region: tuple | None, specs: Sequence[InputSpec], symbols: Mapping, input_specs: tuple) -> tuple | None:
    """``(dim, size)`` when the captured graph's region leaves out one size of one dim (``L != 48``:
    TorchDynamo specialises nanoGPT's ``bias[:, :, :L, :L]`` where L is the whole block_size - the
    length such a model is trained at), so a second graph at that size is worth capturing; else None."""
    if region is None or len(specs) != len(input_specs):
        return None
    dims = {k for k, v in symbols.items() if isinstance(v, sympy.Symbol)}  # the guards' symbols are the dims by name
    found = []
    for g in region[0].exprs:
        if isinstance(g, sympy.Ne):
            sym, c = (g.lhs, g.rhs) if g.rhs.is_Integer else (g.rhs, g.lhs)
            if sym.is_Symbol and str(sym) in dims and c.is_Integer and int(c) > 0:
                found.append((str(sym), int(c)))
    return found[0] if len(found) == 1 else None


def _at_point(point: tuple | None, model: torch.nn.Module, specs: Sequence[InputSpec], symbols: Mapping,
              opts: AnalysisOptions, settings: dict, budget: Any, dims: Mapping | None, name: str) -> tuple:
    """The model optimized with ``point``'s dim fixed at its size (its own capture, rewrites,
    verification and, with ``budget`` - dims at that size - recomputation), switched in where the
    call's size is that one; and its entries. ``(None, [])`` when there is no such point or the
    second capture fails (the model's own forward then runs there, as the region's record says)."""
    if point is None:
        return None, []
    dim, size = point
    sym = symbols[dim]
    fixed = []
    for spec in specs:
        shape = []
        for d in spec.dims:
            d = sympy.sympify(d).xreplace({sym: sympy.Integer(size)})
            shape.append(int(d) if d.is_Integer else str(d))
        fixed.append(TensorSpec(tuple(shape), dtype=spec.dtype, requires_grad=spec.requires_grad, fill=spec.fill))
    rest = {k: v for k, v in (dims or {}).items() if k != dim} if budget is not None else None
    try:
        second = optimize(model, *fixed, options=opts.replace(optimizer=opts.optimizer if budget is not None else None,
                                                             hints={k: v for k, v in (opts.hints or {}).items()
                                                                    if k != dim} or None),
                          settings=settings or None, budget=budget, dims=rest)
    except BudgetError:
        raise
    except FxMemError as exc:
        first = str(exc).splitlines()[0]
        return None, _tagged([log_entry("region", "declined", name,
                                        f"declined: no second graph at {dim} == {size}: {first}",
                                        details=f"a second graph at {dim} == {size} (the size the captured graph "
                                                f"leaves out) could not be made: {first}; the model's own forward "
                                                f"runs there", condition=f"{dim} == {size}")],
                             f"{dim} == {size}")
    at = switch.Guards([sympy.Eq(sym, size)])
    return _forms(at, switch.positions(at, specs, symbols), second, model, model), \
        _tagged(second.meta["fxmem"], f"{dim} == {size}")


def _tagged(log: list[dict], when: str | None) -> list[dict]:
    """``log``'s entries in the one schema (:data:`.base.LOG_KEYS`), each saying for which sizes it
    holds (``when``: None for every size, one form)."""
    out = []
    for e in log:
        e = {**dict.fromkeys(LOG_KEYS), **e}
        assert e["status"] in STATUSES, e  # a pass that writes another status is a bug here
        e["reason"] = brief(e["reason"])  # one line: the rest is in the other keys
        e["when"] = when if e["when"] is None else e["when"]
        out.append(e)
    return out


def _must_fit(model: torch.nn.Module, input_specs: tuple, kw: AnalysisOptions, budget: Any, dims: dict,
              why: str) -> None:
    """Raise :class:`BudgetError` unless the model's own training step (``_step(kw)``) fits ``budget`` at ``dims``."""
    report = analyze(model, *input_specs, options=_step(kw))
    peak = report.evaluate(**dims)["train_peak"]
    limit = parse_bytes(budget)
    if peak > limit:
        at = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise BudgetError(f"fxmem.optimize(budget={budget!r}): the training step at {at} takes {peak:,} bytes, over "
                          f"the budget, and nothing could be rewritten or recomputed: {why}", peak, {})


def _switch(main: "_Search", alt: "_Search", model: torch.nn.Module, specs: list[InputSpec], symbols: Mapping,
            name: str) -> tuple["_Search", dict] | None:
    """Both forms, when the conditioned line kept something and both are verified on their side of
    the condition; the ``meta`` entry saying so. None (and main's entries say why) otherwise."""
    cond = alt.condition
    where = switch.positions(cond, specs, symbols)
    why, verification = None, None
    if not alt.kept:
        why = "no rewrite was kept where the condition holds (see the entries for it)"
    elif where is None:
        why = f"{cond.dim} or {cond.other} is not the size of an input axis, so the call cannot read it"
    if why is None:
        forms = _forms(cond, where, alt.best, main.best, model)
        for side in (True, False):  # each form on its own side, and the call's own choice
            forms.fxmem_forms.force = side
            diff = main.verify(forms)
            if not diff.ok:
                if alt.unverified:  # the optimistic pass: a rewrite of the other line, kept unverified?
                    raise _Unverified(f"{diff.where}: max diff {diff.max_abs:.3g}")
                why = (f"the {'rewritten' if side else 'original'} form differs (max diff {diff.max_abs:.3g} in "
                       f"{diff.where})")
                verification = f"{_failed(diff)} ({'rewritten' if side else 'original'} form)"
                break
        forms.fxmem_forms.force = None
        if why is None:  # each line's graph, verified whole on its side
            for line in (main, alt):
                line._verified.append(line.best)
    details = (f"two forms: the rewritten one where {cond}, the original otherwise; picked at each call from the "
               f"inputs' sizes, each verified against the model on its side. Decided by the formulas over the whole "
               f"region, not at the example sizes: {alt.switch_text}. The hints only chose where to look first; they "
               f"decide nothing") if why is None else (
               f"rewrites never higher where {cond} were found, but {why}; the original form is kept")
    reason = (f"applied: the rewritten form where {cond}, the original elsewhere, picked at each call"
              if why is None else f"declined: lower where {cond}, but {why}")
    verification = "passed" if why is None else verification
    entry = log_entry("switch", "applied" if why is None else "declined", name, reason, details=details,
                      when=str(cond), condition=str(cond), decision=alt.switch_text, verification=verification)
    if why is not None:
        main.log.append(entry)
        return None
    return alt, entry


def _check_settings(settings: Mapping[str, Mapping[str, Any]] | None) -> dict:
    if settings is None:
        return {}
    known = {p.name: p for p in PASSES}
    if not isinstance(settings, Mapping):
        raise SpecError("settings= must be a dict {pass name: {setting: value}}, e.g. "
                        "{'fused-attention': {'block_bytes': 2**20}}")
    for name, values in settings.items():
        if name not in known:
            raise SpecError(f"settings: no pass is called {name!r}; the passes are {sorted(known)}")
        unknown = sorted(set(values) - set(known[name].settings))
        if unknown:
            raise SpecError(f"settings[{name!r}]: {unknown} cannot be set; it takes "
                            f"{dict(known[name].settings) or 'nothing'}")
        for key, value in values.items():
            if key in known[name].flags:
                if not isinstance(value, bool):
                    raise SpecError(f"settings[{name!r}][{key!r}] must be True or False, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"settings[{name!r}][{key!r}] must be a positive int (bytes), got {value!r}")
    return dict(settings)


class _Search:
    """The greedy search: rewrites (groups of them) are tried in graph order; each one is kept if
    it is verified and lowers the memory of everything kept before it."""

    def __init__(self, gm: torch.fx.GraphModule, model: torch.nn.Module, input_specs: tuple, kw: dict,
                 verify_inputs: list, symbols: Mapping, hints: Mapping[str, int], condition: Condition | None,
                 optimistic: bool = False, dropped: list | None = None) -> None:
        self.gm, self.model, self.input_specs, self.kw, self.verify_inputs = gm, model, input_specs, kw, verify_inputs
        self.symbols, self.hints = symbols, hints
        # the line's assumption (the conditioned form of a switch): decisions hold where it holds
        self.condition = condition
        self.switch: Condition | None = None  # the first condition a rewrite needed (main line)
        self.switch_text = ""
        # where that condition was found, when it was found beyond the example sizes (see _beyond)
        self.switch_hints: dict | None = None
        self.switch_kw: AnalysisOptions | None = None
        self.kept = 0
        self.last: Decision | None = None  # the decision of the last trial (None: it failed verification)
        self._current: _Memory | None = None  # analysed when first needed: most models have no finding
        self.best = _build(gm, model, [])
        self.accepted: list[tuple[Pass, Finding]] = []
        self.log: list[dict] = []
        self._entries: dict[int, dict] = {}
        self._analysed: dict[int, tuple] = {}  # id(graph module) -> (it, its _Memory): each analysed once
        self.references: dict = {}  # the model's own verification runs (shared with the other line's search)
        self.graph_checked = False  # whether the graph as captured, no rewrite on it, was verified
        # the optimistic pass (see optimize): a trial the formulas keep is verified with the graph
        # that follows it; ``unverified`` while the best graph holds such a rewrite
        self.optimistic, self.unverified = optimistic, False
        self._verified: list[torch.nn.Module] = []  # the modules verified (the final one may be one)
        self.dropped = dropped if dropped is not None else []  # warnings of rewrites dropped

    def faithful(self, graph: torch.fx.GraphModule | None = None) -> None:
        """Verify the graph as captured (no rewrite) against the model, once per call; a TraceError if
        it differs. Every rewrite is verified, but the graph they apply to is what optimize returns
        when none is kept, and what a failed rewrite's verification may be failing on: a capture that
        drops a custom ``torch.autograd.Function``'s backward computes other gradients than the model."""
        if self.graph_checked:
            return
        self.graph_checked = True
        diff = self.verify(graph if graph is not None else _build(self.gm, self.model, []))
        if not diff.ok:
            how = self.gm.meta.get("fxmem_capture") or "the graph torch.fx traced"
            raise TraceError(f"{type(self.model).__name__}: {how}; that graph does not compute what the model does "
                             f"(max diff {diff.max_abs:.3g} in {diff.where}, on real inputs, before any rewrite), so "
                             f"there is nothing faithful to rewrite - a limit of the capture, not of your model\n  what "
                             f"to do: fxmem.analyze(model, ...) still gives the model's memory (its own forward); to "
                             f"rewrite, optimize the submodules that capture faithfully (code such as a custom "
                             f"torch.autograd.Function, whose backward a captured graph can lose, kept out of them)")

    def verify(self, candidate: torch.nn.Module) -> Any:
        """:func:`.verify.compare` of ``candidate`` with the model on this call's inputs (the model's
        own runs made once per call: they are the same for every candidate). Where the candidate
        chooses a path by the data (an edge list or dense row blocks), each path is compared. Under
        ``model_bits`` an attention given SDPA's own dropout (``same_distribution=True``) draws the
        model's bits, compared exactly; its own dropout is checked as a distribution by the rule."""
        with data_paths.asked() as taken, model_bits():
            diff = compare(self.model, candidate, self.verify_inputs, references=self.references)
        for side in sorted({True, False} - set(taken)) if taken and diff.ok else ():  # the paths not taken
            with data_paths.forced(side), model_bits():
                other = compare(self.model, candidate, self.verify_inputs, references=self.references)
            if not other.ok or other.max_abs > diff.max_abs:
                diff = other
            if not diff.ok:
                break
        if diff.ok:
            self._verified.append(candidate)
        elif self.unverified:  # this rewrite's fault, or one of those kept unverified? Start again
            raise _Unverified(f"{diff.where}: max diff {diff.max_abs:.3g}")
        return diff

    def confirm(self, final: torch.nn.Module) -> None:
        """The optimistic pass: the line's final graph verified, unless a pass verified it already (the
        recomputed plan); :class:`_Unverified` where it fails."""
        if self.unverified and not any(m is final for m in self._verified):
            self.verify(final)
        self.unverified = False

    def _deferred(self, trial: torch.fx.GraphModule) -> Decision | None:
        """The optimistic pass: the formulas' decision on ``trial`` where it keeps the trial outright
        (its verification then waits for the graph that follows it). None otherwise: the trial is
        verified first, as in the careful pass (a declined rewrite's record says it is exact)."""
        if not self.optimistic:
            return None
        try:
            after = self.memory(trial)
        except Exception:  # noqa: BLE001 - a graph the analysis refuses: verification first says whose fault
            return None
        # never higher, plainly: no condition is looked for on a graph not yet verified (the costly
        # part of a decision, wasted where the verification fails)
        decision = _decide(self.current, after, self.symbols, self.hints, self.condition, search=False)
        return decision if decision.verdict == "keep" else None

    def memory(self, gm: torch.fx.GraphModule) -> "_Memory":
        """fxmem's analysis of ``gm`` with this line's options, made once per graph module."""
        known = self.analysed(gm)
        if known is None:
            known = _memory(gm, self.input_specs, self.kw)
            self._analysed[id(gm)] = (gm, known)
        return known

    def analysed(self, gm: torch.fx.GraphModule) -> "_Memory | None":
        """The analysis of ``gm`` made already, or None."""
        held = self._analysed.get(id(gm))
        return held[1] if held is not None and held[0] is gm else None

    def rebase(self) -> bool:
        """Make the graph with every rewrite kept so far the one later rewrites apply to; whether it changed."""
        if not self.accepted:
            return False
        self.gm, self.accepted = self.best, []
        return True

    @property
    def current(self) -> _Memory:
        """The memory of the graph with every rewrite kept so far."""
        if self._current is None:
            self._current = self.memory(self.best)
        return self._current

    @current.setter
    def current(self, value: _Memory) -> None:
        self._current = value

    def _beyond(self, trial: torch.fx.GraphModule, after: _Memory) -> Decision | None:
        """A second look where the rewrite's analysis stops holding (its kernel changes regime at a
        size, as the fused attention does when one row block no longer holds every row): both forms
        analysed at example sizes doubled until every analysis holds with no upper end, and where the
        rewrite is never higher there, a switch from the size that regime starts at (one dim's
        condition: the model has one dim). None otherwise."""
        dims = [n for n in self.hints if isinstance(self.symbols.get(n), sympy.Symbol)]
        if len(dims) != 1:
            return None
        dim, sym = dims[0], self.symbols[dims[0]]
        first = _regions(after)
        for k in range(1, 11):
            scaled = {n: v * 2 ** k for n, v in self.hints.items()}
            if not any(r.violations({sym: scaled[dim]}) for r in first):
                continue  # still the example sizes' regime
            kw = self.kw.replace(hints=scaled)
            try:
                before2, after2 = _memory(self.gm, self.input_specs, kw), _memory(trial, self.input_specs, kw)
            except FxMemError:
                return None
            held = _regions(before2) + _regions(after2)
            if any(sym in r.upper or r.violations({sym: 4 * scaled[dim]}) for r in held):
                continue  # a regime that ends too (a bound, or a guard such as one row block holding every row)
            decision = _decide(before2, after2, self.symbols, scaled, None)
            if decision.verdict == "keep":
                least = 0
            elif decision.verdict == "switch" and decision.condition.other is None and decision.condition.dim == dim:
                least = decision.condition.k
            else:
                return None
            start = _threshold(dim, held, self.symbols, scaled)
            if start is None:
                return None
            cond = Condition(dim, max(start, least))
            self.switch_hints, self.switch_kw = scaled, kw
            return Decision("switch", f"{decision.text}; analysed at {dim}={scaled[dim]}: from {dim} >= {start} the "
                                      f"kernels work in another regime than at the example sizes, and there every "
                                      f"analysis holds with no upper end (checked to {dim}={4 * scaled[dim]})", cond)
        return None

    def log_finding(self, finding: Finding) -> None:
        """Start the ``meta["fxmem"]`` entry of ``finding`` (declined until it is applied)."""
        reason = f"declined: {finding.reason}" if finding.status == "declined" else "declined: not tried"
        entry = log_entry(finding.rule, "declined", finding.where, reason, details=finding.reason,
                          **self.current.formulas("before"))
        self.log.append(entry)
        self._entries[id(finding)] = entry

    def try_group(self, group: list[tuple[Pass, Finding]], culprit: bool = True, together: str | None = None) -> str:
        """Apply ``group`` on top of what is kept; keep it if it is verified and lowers the peak.
        Returns ``"kept"``, ``"failed"`` (verification) or ``"no gain"`` (exact, not lower).
        ``culprit``: on a failed verification of several, try each alone (else the caller does);
        ``together``: how the group was tried, for the records (default: on the same pairs)."""
        self.last = None
        entries = [self._entries[id(f)] for _, f in group]
        for e in entries:  # what an earlier trial of the site said is replaced by this one's outcome
            e.update(self.current.formulas("before"), condition=None, verification=None, group=None)
        trial = _build(self.gm, self.model, self.accepted + group)
        deferred = self._deferred(trial)
        diff = self.verify(trial) if deferred is None else None
        if diff is not None and not diff.ok:
            self.faithful()  # the rewrite's fault, or the captured graph's? (a TraceError for the latter)
            if len(group) > 1:  # find the culprit: try each rewrite of the group alone
                for member in group if culprit else ():
                    self.try_group([member])
                return "failed"
            _, finding = group[0]
            entries[0].update(reason=f"declined: verification failed (max diff {diff.max_abs:.3g}); dropped",
                              verification=_failed(diff))
            self.dropped.append(f"fxmem.optimize: dropped the {finding.rule} rewrite at {finding.where}: "
                                f"verification failed (max diff {diff.max_abs:.3g} in {diff.where}): the rewrite "
                                f"does not compute what the original does; dropped")
            return "failed"
        after = self.memory(trial)
        change = _change(self.current, after)
        short = _change(self.current, after, room=REASON_LIMIT - 100)  # after a decline's longer words
        for e in entries:  # verified now, or (optimistic) with the graph that follows it: the call restarts if not
            e.update(after.formulas("after"), **{**self.current.at_sizes("before"), **after.at_sizes("after")},
                     verification="passed")
        decision = deferred if deferred is not None else _decide(self.current, after, self.symbols, self.hints,
                                                                 self.condition)
        if decision.verdict == "decline" and self.condition is None:
            decision = self._beyond(trial, after) or decision
        for e in entries:
            e["decision"] = decision.text
        self.last = decision
        if decision.verdict == "switch" and self.condition is not None:  # a stronger condition, same dims
            self.condition = decision.condition
            self.switch_text = decision.text
        elif decision.verdict == "switch":
            if self.switch is None:
                self.switch, self.switch_text = decision.condition, decision.text
            for e in entries:
                e.update(reason=f"declined in this form: exact, lowers the peak only where {decision.condition} "
                                f"(the other form); {short}", condition=str(decision.condition))
            return "no gain"
        if decision.verdict == "decline":
            together = (together if together else
                        f"with the {len(group) - 1} other(s) on the same pairs" if len(group) > 1 else None)
            for e in entries:
                e.update(reason=f"declined: exact, but no memory saved where the formulas hold; {short}",
                         group=together)
            return "no gain"
        names = {n.name for n in trial.graph.nodes}
        for e, (_, f) in zip(entries, group):
            gone = sorted(n.name for n in f.frees if n.name not in names)
            e.update(status="applied", no_longer_built=gone or None,
                     reason=f"applied: {change}" if not change.startswith("the same") else
                     f"applied: no peak higher at any size, one lower somewhere ({change})")
        self.accepted += group
        self.kept += len(group)
        self.current, self.best = after, trial
        self.unverified = deferred is not None  # else verified, with every rewrite kept before it
        return "kept"


def _beyond_hints(hints: Mapping[str, int], symbols: Mapping, regions: list) -> dict | None:
    """The example sizes doubled until they leave one of ``regions`` (a kernel's regime that ends at
    a size, such as one row block holding every row), at most 64x; None if they never do."""
    for k in range(1, 7):
        scaled = {name: v * 2 ** k for name, v in hints.items()}
        values = {symbols[n]: v for n, v in scaled.items() if isinstance(symbols.get(n), sympy.Symbol)}
        if any(r.violations(values) for r in regions):
            return scaled
    return None


def _threshold(dim: str, regions: list, symbols: Mapping, at: Mapping[str, int]) -> int | None:
    """The smallest size of ``dim`` from which every one of ``regions`` holds (the other dims as in
    ``at``), by bisection below ``at[dim]``; None where a guard or a fixed dim involves another
    dim too, or the regions stop holding above it."""
    sym = symbols[dim]
    for r in regions:
        if r.pinned or sym in r.upper or any(g.free_symbols - {sym} for g in r.guards if sym in g.free_symbols):
            return None
    values = {symbols[n]: v for n, v in at.items() if isinstance(symbols.get(n), sympy.Symbol)}

    def holds(v: int) -> bool:
        return not any(r.violations({**values, sym: v}) for r in regions)

    if not holds(at[dim]):
        return None
    hi = first_true(holds, 1, at[dim])  # size 1 untested: a regime from 1 or 2 is one from 2
    # from hi on: larger sizes up to 4x the look's must hold too (a regime that ends there is not taken)
    return hi if all(holds(v) for v in (hi + 1, 2 * hi, 2 * at[dim], 4 * at[dim])) else None


def _decide(before: _Memory, after: _Memory, symbols: Mapping, hints: Mapping[str, int],
            assume: Condition | None, search: bool = True) -> Decision:
    """The formula comparison of every peak (forward, training step, inference) over the region
    where both analyses hold (the higher lower bound of each dim); ``search``: see :func:`.decide.decide`."""
    # where every analysis holds: a kernel's block count makes its own region (many blocks or one)
    regions = _regions(before) + _regions(after)
    lower: dict = {}
    guards: list = []
    for r in regions:
        for sym, v in r.lower.items():
            lower[sym] = max(lower.get(sym, v), v)
        guards += [g for g in r.guards if g not in guards]
    region = Region(lower, guards)
    pairs = []
    for b, a, which in _on_paths(before, after):
        pairs.append((f"peak{which}", b.report.peak, a.report.peak))
        if b.report.train_peak is not None and a.report.train_peak is not None:
            pairs.append((f"training-step peak{which}", b.report.train_peak, a.report.train_peak))
        pairs.append((f"inference peak{which}", b.inference.peak, a.inference.peak))
    pairs = [(name, _across(b, before.paths(), after.paths(), sympy.S.Zero),
              _across(a, after.paths(), before.paths(), None)) for name, b, a in pairs]
    if after.step_failure and not before.step_failure:  # a step the original has and the rewrite cannot show
        return Decision("decline", f"the training step of the rewrite cannot be analysed by fxmem "
                                   f"({after.step_failure}), where the original's can: nothing proves it not higher")
    decision = decide(pairs, region, symbols, hints, assume, search)
    if before.step_failure:  # neither step analysed: said, never silently left out of the comparison
        decision = dataclasses.replace(decision, text=f"{decision.text}; the training step is not compared: fxmem "
                                                      f"cannot analyse the original's ({before.step_failure})")
    return decision


def _regions(memory: _Memory) -> list:
    """Where each analysis of a graph holds: train and inference mode, on each path the data chooses."""
    return [m._plan.region for g in (memory, memory.beyond) if g is not None for m in (g.report, g.inference)]


def _on_paths(before: _Memory, after: _Memory) -> list[tuple[_Memory, _Memory, str]]:
    """The analyses to compare: each graph's path within its data dims' bounds, and - where either
    has a path chosen by the data - the other path (an adjacency too dense for an edge list)."""
    out = [(before, after, "")]
    if before.beyond is not None or after.beyond is not None:
        out.append((before.beyond or before, after.beyond or after, " (adjacency too dense for an edge list)"))
    return out


def _across(expr: sympy.Expr, paths: Mapping[str, Any], other: Mapping[str, Any], value: Any) -> sympy.Expr:
    """``expr`` with each data dim that only this graph has replaced by ``value`` (None: the bound its
    path holds to, the most it can be; 0: the least) - sound where ``expr`` grows with it, else left
    a symbol (nothing is then proven for its values). Dims both graphs have stay symbols: the
    comparison holds for each of their values."""
    for name in set(paths) - set(other):
        x = next((s for s in expr.free_symbols if str(s) == name), None)
        if x is None:
            continue
        if not _grows_with(expr, x):
            continue
        # floor(N**2/20) <= N**2/20: an expression that grows with x is at most its value there
        at = sympy.S(paths[name]).replace(sympy.floor, lambda a: a) if value is None else value
        expr = expr.xreplace({x: at})
    return expr


def _grows_with(expr: sympy.Expr, x: sympy.Symbol) -> bool:
    """Every candidate of the peak ``expr`` has a derivative in ``x`` with no negative coefficient."""
    return all(all(k >= 0 for k in sympy.expand(sympy.diff(c, x)).as_coefficients_dict().values())
               for c in candidates(expr))


def _groups(matches: list[tuple[Pass, Finding]]) -> list[list[tuple[Pass, Finding]]]:
    """Matches that free the same nodes (several heads reading one pair tensor) form one group:
    only all of them together free the pair tensor."""
    groups: list[list[tuple[Pass, Finding]]] = []
    for item in matches:
        joined = [g for g in groups if any(item[1].frees & f.frees for _, f in g)]
        merged = [item] + [x for g in joined for x in g]
        groups = [g for g in groups if g not in joined] + [merged]
    order = {id(f): k for k, (_, f) in enumerate(matches)}
    for g in groups:
        g.sort(key=lambda x: order[id(x[1])])
    return sorted(groups, key=lambda g: order[id(g[0][1])])


def _probe(gm: torch.fx.GraphModule, specs: list[InputSpec], symbols: Mapping[str, Any],
           given: Sequence[Mapping[str, int]] | None, name: str) -> tuple[list[Probe], list[dict]]:
    """Run the graph for real at the probe sizes; returns the probes and the sizes to verify at."""
    names = list(symbols)
    if given is not None:
        if isinstance(given, Mapping) or len(given) < 2:
            raise SpecError("probe_sizes= must be a list of two or more {dim: size} dicts, e.g. "
                            "[{'B': 2, 'N': 3}, {'B': 3, 'N': 5}]")
        rungs = [[check_dims(dict(s), symbols, "probe_sizes") for s in given]]
        fixed = [n for n in names if len({p[n] for p in rungs[0]}) < 2]
        if fixed:
            raise SpecError(f"probe_sizes: dim(s) {fixed} have the same size in every probe; give each dim two "
                            f"different sizes, so that what varies with it can be told apart")
    else:
        rungs = [[{n: base + k for k, n in enumerate(names)} for base in bases] for bases in PROBE_LADDER]
    if not names:  # every size is a constant: one run says it all
        rungs = [rung[:1] for rung in rungs[:1]]
    failure: FxMemError | None = None
    for rung in rungs:
        try:
            for sizes in rung:
                check_input_sizes(specs, sizes, symbols)
            envs = [_run_values(gm, specs, sizes, name) for sizes in rung]
        except (ShapeError, SpecError) as exc:  # too small for this model: try the next rung
            failure = exc  # the largest sizes tried are the ones to report
            continue
        probe_at = rung if given is not None or len(rung) < 3 else [rung[0], rung[-1]]
        return [Probe(sizes, envs[rung.index(sizes)]) for sizes in probe_at], rung
    assert failure is not None
    raise failure


def _run_values(gm: torch.fx.GraphModule, specs: list[InputSpec], sizes: Mapping[str, int],
                name: str) -> dict[torch.fx.Node, Any]:
    """The value of every node of ``gm`` on random inputs at ``sizes`` (run on a copy of the model,
    so that e.g. batch-norm statistics of the user's model do not move)."""
    twin = copy.deepcopy(gm).eval()  # eval mode: what tensors hold, without dropout's noise
    interp = torch.fx.Interpreter(twin, garbage_collect_values=False)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            interp.run(*random_inputs(specs, sizes, requires_grad=False))
    except FxMemError:
        raise
    except Exception as exc:  # the model's own error, at sizes the user did not choose
        at = ", ".join(f"{k}={v}" for k, v in sizes.items())
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ShapeError(f"fxmem.optimize runs {name} for real at small sizes to see what each tensor holds, and "
                         f"it failed at {at}: {type(exc).__name__}: {first}\n  what to do: pass "
                         f"probe_sizes=[{{...}}, {{...}}] with two sets of sizes the model accepts "
                         f"(every dim different between them)") from exc
    by_name = {n.name: v for n, v in interp.env.items()}
    return {n: by_name[n.name] for n in gm.graph.nodes if n.name in by_name}


def _build(gm: torch.fx.GraphModule, model: torch.nn.Module,
           rewrites: Sequence[tuple[Pass, Finding]]) -> torch.fx.GraphModule:
    """A new GraphModule: ``gm``'s graph (copied) with ``rewrites`` applied, sharing ``model``'s modules."""
    graph = copy.deepcopy(gm.graph)  # keeps node names, so nodes are matched by name
    by_name = {n.name: n for n in graph.nodes}
    nodes = {n: by_name[n.name] for n in gm.graph.nodes}
    # nodes kept although nothing reads them (in-place ops, side effects), unless a rewrite replaces them
    unused_before = {n for n in graph.nodes if not n.users} - {nodes[f.node] for _, f in rewrites}
    for rule, finding in rewrites:
        old = nodes[finding.node]
        before = set(graph.nodes)
        new = rule.rewrite(graph, nodes, finding, gm)
        for n in graph.nodes:
            if n not in before:  # tables and diagrams show the user's line for the new nodes
                n.meta["stack_trace"] = old.meta.get("stack_trace")
                n.meta["fxmem_rewrite"] = finding.rule
                if "nn_module_stack" in old.meta:  # the module that ran the replaced code runs the new
                    n.meta["nn_module_stack"] = dict(old.meta["nn_module_stack"])  # (recompute's blocks)
        old.replace_all_uses_with(new)
        nodes[finding.node] = new
    out = torch.fx.GraphModule(gm, graph, type(model).__name__)
    _share_modules(out, model)
    # drop what only fed the replaced nodes (the pair tensor and its copies), nothing else
    graph.eliminate_dead_code(is_impure_node=lambda n: n in unused_before or n.is_impure())
    graph.lint()
    out.recompile()
    out.training = model.training
    return out


def _share_modules(out: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Give ``out`` the model's own submodules, parameters and buffers (same objects, same names),
    so its ``state_dict`` keys are the model's and training ``out`` trains the model."""
    for name, child in model.named_children():
        if not hasattr(torch.fx.GraphModule, name):
            setattr(out, name, child)
    for name, p in model.named_parameters(recurse=False):
        if getattr(out, name, None) is not p:
            out.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        if getattr(out, name, None) is not b:
            out.register_buffer(name, b, persistent=name not in tc.non_persistent_buffers(model))
    # in the model's order (a graph copies what it reads in the order it reads it): parameters() then
    # come as the model's do, so an optimizer state loaded by position matches; the graph's own last
    tc.order_like(out, model)
    for name, held in vars(out).items():  # the graphs a rewrite holds (the original attention a fallback runs)
        if name.startswith("_fxmem_") and isinstance(held, tuple):
            for sub in held:
                if isinstance(sub, torch.fx.GraphModule):
                    _share_held(sub, model)


def _share_held(sub: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Point what ``sub`` reads of the model (a dropout module, a mask buffer) at the model's own
    objects: they were copied from the traced graph's copy of the model when ``sub`` was built, and
    a copy's flag does not follow ``model.train()``/``eval()`` (a dropout that never turns on)."""
    for n in sub.graph.nodes:
        if n.op not in ("call_module", "get_attr"):
            continue
        parent_path, _, leaf = str(n.target).rpartition(".")
        try:
            owner = model.get_submodule(parent_path) if parent_path else model
            parent = sub.get_submodule(parent_path) if parent_path else sub
        except AttributeError:
            continue
        children = dict(owner.named_children())
        if n.op == "call_module" and leaf in children:
            setattr(parent, leaf, children[leaf])
        elif leaf in dict(owner.named_parameters(recurse=False)):
            parent.register_parameter(leaf, getattr(owner, leaf))
        elif leaf in dict(owner.named_buffers(recurse=False)):
            parent.register_buffer(leaf, getattr(owner, leaf))


def _memory(gm: torch.fx.GraphModule, input_specs: tuple, kw: AnalysisOptions) -> _Memory:
    """fxmem's analysis of ``gm`` in train mode (a training step, with grad) and in eval mode
    under ``no_grad`` (inference); each on a copy of ``gm`` in that mode."""
    train, evals = in_mode(gm, True), in_mode(gm, False)
    report, failure = None, None
    if kw.grad:
        try:  # SGD without state unless budget= brought the user's optimizer
            report = analyze(train, *input_specs, options=_step(kw))
        except NothingToTrainError:  # no parameter reaches the output: forward only, as there is no step
            report = None
        except FxMemError as exc:  # the step cannot be analysed: forward only, and the decisions say so
            failure = f"{type(exc).__name__}: {first_line(str(exc))[:200]}"
    if report is None:
        report = analyze(train, *input_specs, options=_forward(kw))
    inference = analyze(evals, *input_specs, options=_inference(kw))
    values = report.evaluate(**report.hints)
    beyond = None
    if report.data_paths or inference.data_paths:  # the path the graph takes on denser data, analysed too
        with data_paths.beyond():
            beyond = _memory(gm, input_specs, kw)
    return _Memory(report, inference, (values["peak"], values.get("train_peak", 0),
                                       inference.evaluate(**report.hints)["peak"]), beyond, failure)
