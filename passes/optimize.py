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

A verification compares the whole model with the rewrite at the smallest verification size (every
mode), and each region the rewrites changed with what it replaced at every size, alike regions
(the same rewrite in each of a model's layers) once (:mod:`.local_verify`); the whole model at
every size where the regions cannot be told apart or one of them differs, so that the cost grows
with the number of distinct rewrites, not with depth.
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
from fxmem.errors import FxMemError, ModelError, ShapeError, SpecError, TraceError
from fxmem.inputs import random_inputs
from fxmem.capture.whole_graph import capture
from fxmem.specs import InputSpec, TensorSpec, choose_hints, parse_specs
from fxmem.passes.base import LOG_KEYS, REASON_LIMIT, STATUSES, Finding, Line, Pass, Probe, brief, log_entry
from fxmem.passes.modes import per_mode, trace_modes
from fxmem.passes.model_cache import without_cache
from fxmem.passes.recompute import BudgetError, plan_budget, unverified
from fxmem.passes.budget import Budget
from fxmem.passes.registry import GRAPH_PASSES, PASSES
from fxmem.passes.verify import compare
from fxmem.passes.local_verify import verify_regions
from fxmem.passes.sdpa_dropout import model_bits
from fxmem.passes import switch
from fxmem.passes.decide import Condition, Decision
from fxmem.passes.peaks import (Memory, decide_peaks, inference_options, memory, regions_of, step_options, threshold,
                                what_changed)
from fxmem.passes.probes import probe, run_values
from fxmem.passes.assemble import build, share_modules, site_groups
from fxmem import data_paths


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
    (same random numbers in both: dropout keeps the same elements; the whole model at the smallest
    size, each changed region against what it replaced at every size), and fxmem's formulas prove
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
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"model must be a torch.nn.Module, got {type(model).__name__}; wrap a function in a "
                         f"Module whose forward calls it")
    # the options, parsed once here: each pass and the second graph of a region are handed them
    opts = AnalysisOptions.of(options, **option_values)
    if opts.loss is not None or opts.hparams is not None or opts.init is not None:
        raise SpecError("optimize rewrites an nn.Module with the default loss: loss=, hparams= and init= are "
                        "options of fxmem.analyze only")
    if opts.mode == "eager":
        raise SpecError("optimize rewrites a graph of the model: mode='eager' (the original forward) cannot be "
                        "rewritten; use mode='auto' or 'graph'")
    settings = _check_settings(settings)
    fit = Budget.of(budget, dims, grad=opts.grad, optimizer=opts.optimizer)
    # First optimistically: a trial the formulas keep is verified with what follows it (the line's
    # final graph, or the recomputed plan that contains it: one verification where there were two).
    # Where any verification then fails, nothing of that pass is returned: the call starts again
    # and verifies each trial before it is kept, so that the failing rewrite is found and dropped.
    for optimistic in (True, False):
        dropped: list[str] = []  # the warnings of rewrites dropped, given once the pass stands
        try:
            out = _optimize(model, input_specs, opts, probe_sizes, settings, fit, optimistic, dropped)
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


def _optimize(model: torch.nn.Module, input_specs: tuple, opts: AnalysisOptions,
              probe_sizes: Sequence[Mapping[str, int]] | None, settings: dict, fit: Budget | None,
              optimistic: bool, dropped: list) -> torch.fx.GraphModule:
    """One pass of :func:`optimize` (see there) with its options parsed; ``fit``: ``budget=`` and
    ``dims=``; ``optimistic``: defer the verification of trials the formulas keep (a failure then
    raises :class:`_Unverified`); ``dropped`` collects the warnings."""
    name = type(model).__name__
    dtype, hints, leaf_modules = opts.dtype, opts.hints, opts.leaf_modules
    params = forward_parameters(model)
    specs, symbols = parse_specs(input_specs, params, dtype, name)
    if fit is not None:  # a size for every dim: where the budget must hold
        fit.check(symbols)
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
    kw = opts.replace(optimizer=opts.optimizer if fit is not None else None, mode="auto", check=False)
    try:
        probes, verify_at = probe(gm, specs, symbols, probe_sizes, name)
    except ShapeError:
        analyze(gm, *input_specs, options=inference_options(kw))  # a shape error at every size says where, in dims
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
    at_point = point is not None and fit is not None and fit.dims[point[0]] == point[1]
    if region is not None and fit is not None and not at_point and not region[0].holds(fit.dims):
        # at dims the result runs the model's own forward: no rewrite or recomputation reaches them
        _must_fit(model, input_specs, kw, fit,
                  f"the graph TorchDynamo captured of {name} holds only where {region[0]}, and at the dims the result "
                  f"runs the model's own forward; what to do: checkpoint the model's blocks yourself "
                  f"(torch.utils.checkpoint), dims inside that region, or a larger budget")
    verify_inputs = [random_inputs(specs, sizes, requires_grad=False) for sizes in verify_at]
    state = _Search(gm, model, input_specs, kw, verify_inputs, symbols, choose_hints(symbols, hints), None,
                    optimistic, dropped)
    if traced.capture:
        gm.meta["fxmem_capture"] = traced.capture
    if traced.reason:  # two graphs, switched by the flag: returned as traced, with the model's modules
        share_modules(gm, model)
        fitted = None
        if fit is not None:  # a training step runs the train-mode trace: recomputation there, verified
            gm, fitted = _fit_train_mode(traced, model, input_specs, kw, fit, state)
        else:
            state.faithful(gm)
        log = first + [log_entry("train/eval", "declined", name, f"declined: {traced.reason}",
                                 details=traced.reason)] + [
            log_entry(p.name, "no match", name, f"not looked for: {traced.reason}", details=traced.reason)
            for p in PASSES] + _tagged([fitted] if fitted is not None else [], None)
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
    fits_here = fit is not None and (region is None or region[0].holds(fit.dims))
    state.best = _finish(state, model, specs, symbols, hints, input_specs, kw, verify_at, fit, fits_here)
    if switched is not None:
        alt, entry = switched
        alt.best = _finish(alt, model, specs, symbols, hints, input_specs, kw, verify_at, fit, fits_here)
        best = _forms(alt.condition, switch.positions(alt.condition, specs, symbols), alt.best, state.best, model)
        log = _tagged(state.log, f"not ({alt.condition})") + _tagged(alt.log, str(alt.condition)) + [entry]
    else:
        best, log = state.best, _tagged(state.log, None)
    if not any(e["status"] == "applied" for e in log):  # returned as captured: verified as every rewrite is
        state.faithful(best)
    if region is not None:  # the captured graph holds within the model's own bounds: its forward elsewhere
        elsewhere, more = _at_point(point, model, specs, symbols, opts, settings, fit if at_point else None, name,
                                    optimistic, dropped)
        if at_point and elsewhere is None:  # no second graph: the model's own step must fit there, or say so
            _must_fit(model, input_specs, kw, fit,
                      f"the graph TorchDynamo captured of {name} holds only where {region[0]}, and no second graph "
                      f"could be made at {point[0]} == {point[1]} ({more[0]['details']})")
        best, entry = _within(region, best, model, name, elsewhere, point if elsewhere is not None else None)
        log += _tagged([entry], None) + more
    share_modules(best, model)  # every module of the model, used by the graph or not (state_dict keys)
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
                probes = [Probe(p.sizes, run_values(state.gm, specs, p.sizes, name)) for p in probes]
        findings = [(rule, f) for f in rule.find(state.gm, probes, settings.get(rule.name, {}))]
        if not findings:  # every call says what it tried, also where nothing was found
            state.log.append(log_entry(rule.name, "no match", name, **rule.no_match(state.gm, probes)))
        for _, finding in findings:
            state.log_finding(finding)
        groups = site_groups([(r, f) for r, f in findings if f.status == "match"])
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


def _finish(state: "_Search", model, specs, symbols, hints, input_specs, kw, verify_at, fit: Budget | None,
            fits_here: bool = True) -> torch.fx.GraphModule:
    """The whole-graph passes of the registry (reorder, then recompute), in order, on one line's
    best graph: each proposes, the driver verifies (:func:`_accepted`); their entries go to its log."""
    runs_at_dims = fit is not None and fits_here and (
        state.condition is None or state.condition.holds(fit.dims)) and (
        state.condition is not None or state.switch is None or not state.switch.holds(fit.dims))
    step = step_options(kw)
    # the analyses made already serve when they are of the same training step (not a line that
    # looked at other sizes)
    reuse = state.kw == kw and kw.grad
    line = Line(model, specs, input_specs, choose_hints(symbols, hints), verify_at, state.verify_inputs, step, fit,
                runs_at_dims, state.memory,
                state.analysed if reuse else (lambda g: None),
                lambda g: share_modules(g, model))
    best = state.best
    try:
        for p in GRAPH_PASSES:
            proposed, entry = p.run(best, line)
            if proposed is not best:
                proposed, entry = _accepted(state, p.failed, best, proposed, entry)
            best = proposed
            state.log.append(entry)
    except BudgetError:
        state.confirm(best)  # the error tells peaks of the rewritten graph: verified before they are told
        raise
    state.confirm(best)
    return best


def _accepted(state: "_Search", failed: Any, before: torch.fx.GraphModule, proposed: torch.fx.GraphModule,
              entry: dict) -> tuple[torch.fx.GraphModule, dict]:
    """The driver's side of a whole-graph pass's proposal: verified against the model as a rule's
    rewrite is (with what the rules kept before it, where that was deferred); the graph before it
    and a declined entry where it differs, or ``failed(entry, difference)`` (the pass's
    :attr:`~.base.GraphPass.failed`) raises."""
    diff = state.verify(proposed)
    if diff.ok:
        entry["verification"] = "passed"
        return proposed, entry
    if failed is not None:
        failed(entry, diff)
    entry.update(status="declined", verification=_failed(diff), details=f"{entry.get('details') or ''}; "
                 f"verification failed: {_failed(diff)}".lstrip("; "),
                 reason=f"declined: verification failed (max diff {diff.max_abs:.3g}); the graph before it is kept")
    return before, entry


def _forms(cond: Condition, where: Mapping, when: torch.fx.GraphModule, otherwise: torch.fx.GraphModule,
           model: torch.nn.Module) -> torch.fx.GraphModule:
    """:func:`.switch.build`, sharing the model's modules first: ``parameters()`` in the model's order."""
    best = switch.build(cond, where, when, otherwise, type(model).__name__)
    forms = tc.pop_child(best, "fxmem_forms")
    share_modules(best, model)
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
              opts: AnalysisOptions, settings: dict, fit: Budget | None, name: str, optimistic: bool,
              dropped: list) -> tuple:
    """The model optimized with ``point``'s dim fixed at its size (its own capture, rewrites,
    verification and, with ``fit`` - dims at that size - recomputation), switched in where the
    call's size is that one; and its entries. ``(None, [])`` when there is no such point or the
    second capture fails (the model's own forward then runs there, as the region's record says).
    One more pass of this call (:func:`_optimize`, with its options and its optimism), not a call
    of :func:`optimize`: the user's hooks go on the result once, not also on the graph inside it."""
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
    hints = {k: v for k, v in (opts.hints or {}).items() if k != dim} or None
    mine: list[str] = []  # this pass's warnings: the call's only where its graph is used
    try:
        second = _optimize(model, tuple(fixed), opts.replace(hints=hints), None, settings,
                           fit.without(dim) if fit is not None else None, optimistic, mine)
    except BudgetError:
        dropped.extend(mine)
        raise
    except FxMemError as exc:
        first = str(exc).splitlines()[0]
        return None, _tagged([log_entry("region", "declined", name,
                                        f"declined: no second graph at {dim} == {size}: {first}",
                                        details=f"a second graph at {dim} == {size} (the size the captured graph "
                                                f"leaves out) could not be made: {first}; the model's own forward "
                                                f"runs there", condition=f"{dim} == {size}")],
                             f"{dim} == {size}")
    dropped.extend(mine)
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


def _must_fit(model: torch.nn.Module, input_specs: tuple, kw: AnalysisOptions, fit: Budget, why: str) -> None:
    """Raise :class:`BudgetError` unless the model's own training step (``step_options(kw)``) fits
    ``fit.limit`` at ``fit.dims``."""
    report = analyze(model, *input_specs, options=step_options(kw))
    peak = report.evaluate(**fit.dims)["train_peak"]
    if peak > fit.limit:
        raise BudgetError(f"fxmem.optimize({fit.said()}): the training step at {fit.at()} takes {peak:,} bytes, over "
                          f"the budget, and nothing could be rewritten or recomputed: {why}", peak, {})


def _fit_train_mode(traced: Any, model: torch.nn.Module, input_specs: tuple, kw: AnalysisOptions, fit: Budget,
                    state: "_Search") -> tuple[torch.fx.GraphModule, dict]:
    """``budget=`` on a model whose train and eval modes run other code (timm's drop path: ``if
    self.training``): the blocks of the train-mode trace are recomputed (a training step runs it),
    the eval-mode trace is left as it is, and the result - the two again, switched by the flag - is
    verified against the model in every mode. Raises :class:`BudgetError` where no plan fits."""
    train, evals = traced.modes
    share_modules(train, model)
    try:
        recomputed, entry = plan_budget(train, input_specs, step_options(kw), fit)
    except BudgetError as exc:  # said with why only the train-mode graph was looked at
        raise BudgetError(f"{exc} (the model runs other code in train and eval mode, so only its train-mode "
                          f"graph was recomputed and nothing else rewritten: {traced.reason})",
                          exc.smallest_peak, exc.parts) from exc
    if recomputed is train:  # it fits as it is: the two traces, as traced
        out = traced.graph_module
        state.faithful(out)
    else:  # proposed to the driver as the recompute pass's plans are: verified in every mode
        out, entry = _accepted(state, unverified, traced.graph_module, _per_mode_shared(model, recomputed, evals),
                               entry)
    entry["details"] = (f"recomputed in the train-mode graph (the model runs other code in eval mode, where its own "
                        f"trace runs unchanged): {entry.get('details') or entry['reason']}")
    return out, entry


def _per_mode_shared(model: torch.nn.Module, train: torch.fx.GraphModule,
                     evals: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The two traces switched by the flag (:func:`.modes.per_mode`), with the model's own modules."""
    out = per_mode(model, train, evals)
    share_modules(out, model)
    return out


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
        self._current: Memory | None = None  # analysed when first needed: most models have no finding
        self.best = build(gm, model, [])
        self.base = self.best  # the graph as captured: what a rewrite's regions are compared with
        self.accepted: list[tuple[Pass, Finding]] = []
        self.log: list[dict] = []
        self._entries: dict[int, dict] = {}
        self._analysed: dict[int, tuple] = {}  # id(graph module) -> (it, its Memory): each analysed once
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
        diff = self.verify(graph if graph is not None else build(self.gm, self.model, []))
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
        own runs made once per call: they are the same for every candidate): the whole model at the
        smallest size, and each region the rewrites changed at every size (:mod:`.local_verify`,
        alike regions once); the whole model at every size where the regions cannot be told apart
        or one differs. Where the candidate chooses a path by the data (an edge list or dense row
        blocks), each path is compared. Under ``model_bits`` an attention given SDPA's own dropout
        (``same_distribution=True``) draws the model's bits, compared exactly; its own dropout is
        checked as a distribution by the rule."""
        with data_paths.asked() as taken, model_bits():
            diff = self._compare(candidate)
        for side in sorted({True, False} - set(taken)) if taken and diff.ok else ():  # the paths not taken
            with data_paths.forced(side), model_bits():
                other = self._compare(candidate)
            if not other.ok or other.max_abs > diff.max_abs:
                diff = other
            if not diff.ok:
                break
        if diff.ok:
            self._verified.append(candidate)
        elif self.unverified:  # this rewrite's fault, or one of those kept unverified? Start again
            raise _Unverified(f"{diff.where}: max diff {diff.max_abs:.3g}")
        return diff

    def _compare(self, candidate: torch.nn.Module) -> Any:
        """One comparison of :meth:`verify`: whole at the smallest size and region by region, or whole."""
        if len(self.verify_inputs) > 1:
            whole = compare(self.model, candidate, self.verify_inputs[:1], references=self.references)
            if not whole.ok:
                return whole
            local = verify_regions(self.base, candidate, self.verify_inputs,
                                   lambda a, b, xs: compare(a, b, xs))
            if local is not None and local.ok:
                return local if local.max_abs > whole.max_abs else whole
        return compare(self.model, candidate, self.verify_inputs, references=self.references)

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
        decision = decide_peaks(self.current, after, self.symbols, self.hints, self.condition, search=False)
        return decision if decision.verdict == "keep" else None

    def memory(self, gm: torch.fx.GraphModule) -> "Memory":
        """fxmem's analysis of ``gm`` with this line's options, made once per graph module."""
        known = self.analysed(gm)
        if known is None:
            known = memory(gm, self.input_specs, self.kw)
            self._analysed[id(gm)] = (gm, known)
        return known

    def analysed(self, gm: torch.fx.GraphModule) -> "Memory | None":
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
    def current(self) -> Memory:
        """The memory of the graph with every rewrite kept so far."""
        if self._current is None:
            self._current = self.memory(self.best)
        return self._current

    @current.setter
    def current(self, value: Memory) -> None:
        self._current = value

    def _beyond(self, trial: torch.fx.GraphModule, after: Memory) -> Decision | None:
        """A second look where the rewrite's analysis stops holding (its kernel changes regime at a
        size, as the fused attention does when one row block no longer holds every row): both forms
        analysed at example sizes doubled until every analysis holds with no upper end, and where the
        rewrite is never higher there, a switch from the size that regime starts at (one dim's
        condition: the model has one dim). None otherwise."""
        dims = [n for n in self.hints if isinstance(self.symbols.get(n), sympy.Symbol)]
        if len(dims) != 1:
            return None
        dim, sym = dims[0], self.symbols[dims[0]]
        first = regions_of(after)
        for k in range(1, 11):
            scaled = {n: v * 2 ** k for n, v in self.hints.items()}
            if not any(r.violations({sym: scaled[dim]}) for r in first):
                continue  # still the example sizes' regime
            kw = self.kw.replace(hints=scaled)
            try:
                before2, after2 = memory(self.gm, self.input_specs, kw), memory(trial, self.input_specs, kw)
            except FxMemError:
                return None
            held = regions_of(before2) + regions_of(after2)
            if any(sym in r.upper or r.violations({sym: 4 * scaled[dim]}) for r in held):
                continue  # a regime that ends too (a bound, or a guard such as one row block holding every row)
            decision = decide_peaks(before2, after2, self.symbols, scaled, None)
            if decision.verdict == "keep":
                least = 0
            elif decision.verdict == "switch" and decision.condition.other is None and decision.condition.dim == dim:
                least = decision.condition.k
            else:
                return None
            start = threshold(dim, held, self.symbols, scaled)
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
        trial = build(self.gm, self.model, self.accepted + group)
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
        change = what_changed(self.current, after)
        short = what_changed(self.current, after, room=REASON_LIMIT - 100)  # after a decline's longer words
        for e in entries:  # verified now, or (optimistic) with the graph that follows it: the call restarts if not
            e.update(after.formulas("after"), **{**self.current.at_sizes("before"), **after.at_sizes("after")},
                     verification="passed")
        decision = deferred if deferred is not None else decide_peaks(self.current, after, self.symbols, self.hints,
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
                # a saving somewhere does not pay for a peak raised elsewhere (16 bytes of a new scalar)
                why = (" (a peak would be higher at some sizes: see decision)"
                       if decision.text.startswith("higher somewhere") else "")
                e.update(reason=f"declined: exact, but no memory saved where the formulas hold{why}; {short}",
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


