"""``fxmem.optimize``: rewrite a model so that it takes less memory - verified, with the memory
formulas before and after each rewrite.

    trace (train and eval mode: :mod:`.modes`) -> run at small sizes (probes) -> passes find
    rewrites -> for each rewrite, in graph order: apply it to a copy of the graph -> same outputs,
    gradients and buffers as the original model, in train and eval mode, with and without grad?
    -> fxmem's analysis: lower peak (training: forward and training step; inference)? -> keep it
    -> another node order, kept the same way (:mod:`.reorder`) -> with ``budget=``: what to
    recompute in backward so that the training step fits (:mod:`.recompute`)

The result is a ``torch.fx.GraphModule`` with the model's call signature that shares the model's
``Parameter`` objects (training it trains the model) and follows ``train()``/``eval()`` as the
model does (``F.dropout(x, p, training=self.training)`` reads the flag when it runs, not when it
was traced); the model itself is never modified.
``opt.meta["fxmem"]`` lists every rewrite applied and every one declined, with the reason.

>>> opt = fxmem.optimize(GraphAttentionLayerFixed(6, 128), ("B", "N", 6), ("B", "N", "N"))  # doctest: +SKIP
>>> [(r["rule"], r["status"], r["peak_before"], r["peak_after"]) for r in opt.meta["fxmem"]]  # doctest: +SKIP
[('pair-linear', 'applied', '2052*B*N**2 + 536*B*N + 4096', '...')]
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from ..isolation import isolated
from .. import _torch_compat as tc
from ..analyze import analyze
from ..options import AnalysisOptions
from ..capture import forward_parameters
from ..errors import FxMemError, ModelError, ShapeError, SpecError, TraceError
from ..inputs import random_inputs
from ..report import Report
from ..capture.whole_graph import capture
from ..specs import InputSpec, check_dims, check_input_sizes, choose_hints, parse_specs
from .base import Finding, Pass, Probe
from ..accounting.budget import parse_bytes
from .modes import in_mode, trace_modes
from .recompute import fit_budget
from .reorder import reorder
from .registry import PASSES
from .verify import compare

# Probe sizes when the user gives none: dim k (in order of appearance) is base+k for each base of
# a rung; probes run at the first and last base, rewrites are verified at all three. Small, so a
# [.., N, N, 2F] tensor is tiny, and different in each probe, so what varies with the sizes is
# told apart from what does not. A model that cannot run that small (a pooling, a wide kernel)
# gets the next rung.
PROBE_LADDER = ((3, 4, 5), (8, 9, 10), (16, 17, 18), (32, 33, 34))


def _plain_sgd(params: Any) -> torch.optim.Optimizer:
    # no optimizer state: the training step's peak is forward + backward + gradients
    return torch.optim.SGD(params, lr=0.0)


@dataclasses.dataclass
class _Memory:
    """fxmem's analysis of one graph, and its peaks (bytes) at the example sizes and at twice them.

    ``report`` is the train-mode analysis (with a training step when there is grad), ``inference``
    the eval-mode analysis under ``no_grad``: a rewrite must not raise either.
    """

    report: Report
    inference: Report
    points: list[tuple[int, ...]]  # (forward peak, training-step peak or 0, inference peak) per point

    def lower_than(self, other: "_Memory") -> bool:
        """No peak higher than ``other``'s at any point, and one lower."""
        pairs = list(zip(self.points, other.points))
        return all(a <= b for p, q in pairs for a, b in zip(p, q)) and any(a < b for p, q in pairs for a, b in zip(p, q))

    def formulas(self, suffix: str) -> dict[str, str | None]:
        r = self.report
        return {f"peak_{suffix}": str(r.peak), f"saved_{suffix}": str(r.saved),
                f"train_peak_{suffix}": str(r.train_peak) if r.train_peak is not None else None,
                f"inference_peak_{suffix}": str(self.inference.peak)}


@isolated
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
    (same random numbers in both: dropout keeps the same elements), and fxmem's analysis finds a
    lower peak (train mode: forward peak and, with ``grad``, training-step peak; eval mode: the
    inference peak under ``no_grad`` - none higher, one lower, at ``hints`` and at twice them).
    ``opt.meta["fxmem"]`` lists each rewrite: ``rule``, ``status`` (``"applied"``/``"declined"``),
    ``where`` (node and file:line), ``reason``, and ``peak_``/``saved_``/``train_peak_``/
    ``inference_peak_`` ``before``/``after`` formulas.

    >>> opt = fxmem.optimize(layer, ("B", "N", 6), ("B", "N", "N"))    # doctest: +SKIP
    >>> fxmem.analyze(opt, ("B", "N", 6), ("B", "N", "N")).peak          # doctest: +SKIP
    """
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
    device, dtype, grad, hints, leaf_modules = opts.device, opts.dtype, opts.grad, opts.hints, opts.leaf_modules
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
    # the rewrites are judged with the user's options; the training step's optimizer is
    # optimize's own choice (SGD without state: gradients, not state, are what a rewrite changes)
    kw = opts.replace(optimizer=None, mode="auto")
    try:
        probes, verify_at = _probe(gm, specs, symbols, probe_sizes, name)
    except ShapeError:
        analyze(gm, *input_specs, options=kw.replace(grad=False))  # a shape error at every size says where, in dims
        raise
    verify_inputs = [random_inputs(specs, sizes, requires_grad=False) for sizes in verify_at]
    state = _Search(gm, model, input_specs, kw, verify_inputs)
    if traced.capture:
        gm.meta["fxmem_capture"] = traced.capture
    if traced.reason:  # two graphs, switched by the flag: returned as traced, with the model's modules
        _share_modules(gm, model)
        gm.meta["fxmem"] = [{"rule": "train/eval", "status": "declined", "where": name, "reason": traced.reason}]
        return gm
    for k, rule in enumerate(PASSES):
        if k:  # each pass sees the graph the passes before it made (fused attention needs decomposed scores)
            if state.rebase():
                probes = [Probe(p.sizes, _run_values(state.gm, specs, p.sizes, name)) for p in probes]
        findings = [(rule, f) for f in rule.find(state.gm, probes, settings.get(rule.name, {}))]
        for _, finding in findings:
            state.log_finding(finding)
        for group in _groups([(r, f) for r, f in findings if f.status == "match"]):
            state.try_group(group)
    best = state.best
    # another order of the nodes, where fxmem's analysis finds it lowers the peak
    best, entry = reorder(best, verify_inputs[-1], specs, choose_hints(symbols, hints), lambda g: _memory(g, input_specs, kw),
                          lambda g: compare(model, g, verify_inputs), verify_at)
    if entry is not None:
        state.log.append(entry)
    if budget is not None:  # after the rewrites: recompute what still does not fit
        dims = check_dims(dict(dims), symbols, "dims")
        best, entry = fit_budget(best, model, input_specs, kw.replace(optimizer=optimizer or _plain_sgd), budget,
                                 dims, state.verify_inputs)
        state.log.append(entry)
    _share_modules(best, model)  # every module of the model, used by the graph or not (state_dict keys)
    best.meta["fxmem"] = state.log
    if traced.capture:  # what the rewritten graph is a graph of
        best.meta["fxmem_capture"] = traced.capture
    return best


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
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"settings[{name!r}][{key!r}] must be a positive int (bytes), got {value!r}")
    return dict(settings)


class _Search:
    """The greedy search: rewrites (groups of them) are tried in graph order; each one is kept if
    it is verified and lowers the memory of everything kept before it."""

    def __init__(self, gm: torch.fx.GraphModule, model: torch.nn.Module, input_specs: tuple, kw: dict,
                 verify_inputs: list) -> None:
        self.gm, self.model, self.input_specs, self.kw, self.verify_inputs = gm, model, input_specs, kw, verify_inputs
        self._current: _Memory | None = None  # analysed when first needed: most models have no finding
        self.best = _build(gm, model, [])
        self.accepted: list[tuple[Pass, Finding]] = []
        self.log: list[dict] = []
        self._entries: dict[int, dict] = {}

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
            self._current = _memory(self.gm, self.input_specs, self.kw)
        return self._current

    @current.setter
    def current(self, value: _Memory) -> None:
        self._current = value

    def log_finding(self, finding: Finding) -> None:
        """Start the ``meta["fxmem"]`` entry of ``finding`` (declined until it is applied)."""
        entry = {"rule": finding.rule, "status": "declined", "where": finding.where, "reason": finding.reason,
                 **self.current.formulas("before"),
                 **dict.fromkeys(("peak_after", "saved_after", "train_peak_after", "inference_peak_after"))}
        self.log.append(entry)
        self._entries[id(finding)] = entry

    def try_group(self, group: list[tuple[Pass, Finding]]) -> None:
        """Apply ``group`` on top of what is kept; keep it if it is verified and lowers the peak."""
        entries = [self._entries[id(f)] for _, f in group]
        for e in entries:
            e.update(self.current.formulas("before"))
        trial = _build(self.gm, self.model, self.accepted + group)
        diff = compare(self.model, trial, self.verify_inputs)
        if not diff.ok:
            if len(group) > 1:  # find the culprit: try each rewrite of the group alone
                for member in group:
                    self.try_group([member])
                return
            _, finding = group[0]
            entries[0]["reason"] = (f"verification failed (max diff {diff.max_abs:.3g} in {diff.where}): the rewrite "
                                    f"does not compute what the original does; dropped")
            warnings.warn(f"fxmem.optimize: dropped the {finding.rule} rewrite at {finding.where}: "
                          f"{entries[0]['reason']}", RuntimeWarning, stacklevel=3)
            return
        after = _memory(trial, self.input_specs, self.kw)
        for e in entries:
            e.update(after.formulas("after"))
        if not after.lower_than(self.current):
            together = f" (with the {len(group) - 1} other(s) on the same pairs)" if len(group) > 1 else ""
            for e, (_, f) in zip(entries, group):
                e["reason"] = (f"no memory saved: the rewrite is exact ({f.reason}), but fxmem's analysis of the rewrite"
                               f"{together} gives peak {after.report.peak} (was {self.current.report.peak})"
                               + (f" and training-step peak {after.report.train_peak} (was "
                                  f"{self.current.report.train_peak})" if after.report.train_peak is not None else "")
                               + f" and inference peak {after.inference.peak} (was {self.current.inference.peak})"
                               + ", so the original is kept")
            return
        names = {n.name for n in trial.graph.nodes}
        for e, (_, f) in zip(entries, group):
            e["status"] = "applied"
            gone = sorted(n.name for n in f.frees if n.name not in names)
            if gone:
                e["reason"] = f"{f.reason}; no longer built: {', '.join(gone)}"
        self.accepted += group
        self.current, self.best = after, trial


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


def _memory(gm: torch.fx.GraphModule, input_specs: tuple, kw: AnalysisOptions) -> _Memory:
    """fxmem's analysis of ``gm`` in train mode (a training step, with grad) and in eval mode
    under ``no_grad`` (inference); each on a copy of ``gm`` in that mode."""
    train, evals = in_mode(gm, True), in_mode(gm, False)
    report = None
    if kw.grad:
        try:
            report = analyze(train, *input_specs, options=kw.replace(optimizer=_plain_sgd))
        except FxMemError:  # nothing to train (no parameter reaches the output): forward only
            report = None
    if report is None:
        report = analyze(train, *input_specs, options=kw)
    inference = analyze(evals, *input_specs, options=kw.replace(grad=False))
    points = []
    for scale in (1, 2):
        at = {k: v * scale for k, v in report.hints.items()}
        values = report.evaluate(**at)
        points.append((values["peak"], values.get("train_peak", 0), inference.evaluate(**at)["peak"]))
    return _Memory(report, inference, points)
