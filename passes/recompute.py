"""Fit a training step into a memory budget by recomputation: ``fxmem.optimize(..., budget=, dims=)``.

    blocks (:mod:`.segments`) -> per block: bytes autograd keeps (fxmem's analysis) and FLOPs a
    recomputation costs (``torch.utils.flop_counter`` on meta tensors) -> the cheapest choice of
    blocks to recompute, whole or selectively, whose savings cover what is over budget (a
    shortest path over (block, bytes saved) in networkx: a knapsack), its peak estimated by
    replaying the base analysis under it (:mod:`.recompute_estimate`) -> short: ask for more;
    within: ask for less -> the cheapest plan estimated to fit -> fxmem's exact analysis of the
    rewritten model -> over budget by what the estimate left out? choose again below the budget
    by that much -> proposed to optimize's driver, which verifies it (outputs and gradients) -> kept

Whole recomputation (``torch.utils.checkpoint``) keeps only a block's inputs and recomputes its
forward in backward; selective recomputation keeps the matrix products' outputs and recomputes
the cheap ops (norms, activations, softmax, copies), so it saves less and costs almost nothing.
The cost of a plan is the FLOPs it recomputes: products as ``torch.utils.flop_counter`` counts
them, every other op one FLOP per output element. The peak reported and checked against the
budget is fxmem's exact training-step peak of the rewritten model at ``dims``; the estimates
(within 1% of it on the tests' transformers) only choose what to analyse.

When no plan fits, :class:`BudgetError` says the smallest peak recomputation reaches and what it
is made of (parameters, gradients, optimizer state, a block's activations).

>>> opt = fxmem.optimize(model, ("B", "L", 512), budget="24GiB", dims=dict(B=64, L=2048),
...                      optimizer=lambda p: torch.optim.AdamW(p))            # doctest: +SKIP
>>> opt.meta["fxmem"][-1]["where"]                                             # doctest: +SKIP
'layers.0 (whole), layers.1 (selective)'
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import networkx as nx
import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from fxmem.isolation import isolated
from fxmem import _torch_compat as tc
from fxmem.analyze import analyze
from fxmem.errors import FxMemError, SpecError
from fxmem.options import AnalysisOptions
from fxmem.inputs import input_shape
from fxmem.report import Report
from fxmem.units import format_bytes
from fxmem.passes.modes import in_mode
from fxmem.passes.recompute_estimate import Estimator
from fxmem.passes.segments import Block, blocks, extract
from fxmem.passes.budget import Budget

RULE = "recompute"
LOOKS_FOR = "blocks to recompute in backward so that the training step fits budget= at dims="
HOW = ("whole", "selective")
_BUCKETS = 200  # resolution of the knapsack over bytes saved
_CHOICE_ROUNDS = 24  # how many plans the bisection estimates (milliseconds each)
_TRIALS = 3  # how many chosen plans are analysed exactly at most (an analysis each: the cost); one mostly


class BudgetError(FxMemError):
    """No recomputation plan fits the budget: ``smallest_peak`` (bytes) is the lowest training-step
    peak reached, ``parts`` what it is made of (bytes by name)."""

    def __init__(self, message: str, smallest_peak: int, parts: Mapping[str, int]):
        super().__init__(message)
        self.smallest_peak, self.parts = smallest_peak, dict(parts)


@dataclasses.dataclass
class BlockCost:
    """One block at the user's dims: bytes autograd keeps for it, bytes of its products' outputs
    (kept by selective recomputation), and the FLOPs each way of recomputing it costs."""

    block: Block
    saved: int
    products: int
    flops: dict  # how -> FLOPs recomputed in backward

    def saving(self, how: str) -> int:
        return self.saved if how == "whole" else max(0, self.saved - self.products)


@dataclasses.dataclass
class Trial:
    plan: tuple  # ((block name, how), ...)
    module: torch.fx.GraphModule
    report: Report
    peak: int
    flops: int


def node_costs(gm: torch.fx.GraphModule, specs: Sequence[Any], dims: Mapping[str, int]) -> dict:
    """Per node name: (FLOPs of its products, bytes its products output, elements its other ops
    output), from a run of a meta-device copy of ``gm`` at ``dims`` (no memory is used)."""
    # a structural copy on the meta device: no copy of the weights' memory
    twin = tc.fake_module_copy(gm, lambda t, trainable: torch.empty_like(t, device="meta"))
    inputs = [torch.empty(input_shape(spec, dims), dtype=spec.dtype, device="meta") for spec in specs]
    costs: dict = {}

    class Counting(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            counter = FlopCounterMode(display=False)
            with counter:
                out = super().run_node(n)
            flops = counter.get_total_flops()
            tensors = [t for t in tc.tree_leaves(out) if isinstance(t, torch.Tensor)]
            numel = sum(t.numel() for t in tensors)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            costs[n.name] = (flops, nbytes if flops else 0, 0 if flops else numel)
            return out

    with torch.no_grad():
        Counting(twin).run(*inputs)
    return costs


def block_costs(report: Report, found: Sequence[Block], costs: Mapping[str, tuple], dims: Mapping[str, int]) -> list:
    """What each block keeps for backward (bytes at ``dims``) and what recomputing it costs."""
    out = []
    for b in found:
        names = {n.name for n in b.nodes}
        saved = sum(report.at(s.bytes, **dims) for s in report.storages if s.saved_by and s.node in names)
        products = sum(costs.get(n, (0, 0, 0))[1] for n in names)
        whole = sum(costs.get(n, (0, 0, 0))[0] + costs.get(n, (0, 0, 0))[2] for n in names)
        selective = sum(costs.get(n, (0, 0, 0))[2] for n in names)
        out.append(BlockCost(b, saved, products, {"whole": whole, "selective": selective}))
    return out


def cheapest(choices: Sequence[BlockCost], need: int, ways: Sequence[str] = HOW) -> tuple | None:
    """The plan of least FLOPs whose estimated savings cover ``need`` bytes: a shortest path over
    states (block index, bytes saved so far, in buckets), one edge per way of treating a block."""
    if need <= 0:
        return ()
    unit = max(1, math.ceil(need / _BUCKETS))
    g = nx.DiGraph()
    frontier = {0}
    for k, c in enumerate(choices):
        nxt = set()
        for s in frontier:
            options = [(None, 0, 0)] + [(how, c.flops[how] + 1, c.saving(how) // unit)
                                        for how in ways if c.saving(how) > 0]
            for how, cost, gain in options:
                t = min(_BUCKETS, s + gain)
                if not g.has_edge((k, s), (k + 1, t)) or g[(k, s)][(k + 1, t)]["weight"] > cost:
                    g.add_edge((k, s), (k + 1, t), weight=cost, how=how)
                nxt.add(t)
        frontier = nxt
    goal = (len(choices), _BUCKETS)
    if goal not in g:
        return None
    path = nx.shortest_path(g, (0, 0), goal, weight="weight")
    plan = []
    for (k, _), v in zip(path, path[1:]):
        how = g[(k, _)][v]["how"]
        if how is not None:
            plan.append((choices[k].block.name, how))
    return tuple(plan)


def unverified(entry: dict, diff: Any) -> None:
    """A recomputed plan that does not compute what the model does: a :class:`BudgetError` (a
    budget that is not met is an error, never a warning beside a module that misses it)."""
    at = ", ".join(f"{k}={v}" for k, v in entry["dims"].items())
    raise BudgetError(
        f"fxmem.optimize(budget={format_bytes(entry['budget'])}): recomputing {entry['where']} would fit the training "
        f"step at {at} into {format_bytes(entry['budget'])} ({format_bytes(entry['peak_at_dims_after'])}), but "
        f"fxmem's recomputed graph does not compute what the model does (verification: max diff "
        f"{diff.max_abs:.3g} in {diff.where}) - a limit of fxmem's recomputation on this graph, not of your model; "
        f"without it the step takes {format_bytes(entry['peak_at_dims_before'])}. What to do: checkpoint the "
        f"model's blocks yourself (torch.utils.checkpoint) and analyse it with fxmem.analyze, or a larger budget",
        entry["peak_at_dims_before"], {})


def plan_budget(gm: torch.fx.GraphModule, input_specs: tuple, options: AnalysisOptions, budget: Budget,
                base: Report | None = None) -> tuple[torch.fx.GraphModule, dict]:
    """``gm`` with the cheapest recomputation whose training-step peak (``options``: a training
    step with its optimizer) at ``budget.dims`` fits ``budget.limit`` bytes, and its
    ``meta["fxmem"]`` entry; ``gm`` itself where the step fits already. Not yet verified (the
    entry's ``verification`` None): what the recompute pass proposes to optimize's driver, which
    verifies it (:func:`unverified` where it differs). Raises :class:`BudgetError` when no plan
    fits. ``base``: the training step of ``gm`` analysed with ``options`` already (not analysed
    again)."""
    limit, dims = budget.limit, budget.dims
    planner = _Planner(gm, input_specs, options, dims)
    base = planner.trial((), known=base)
    entry = {"rule": RULE, "status": "declined", "where": "", "budget": limit, "dims": dict(dims),
             "sizes": dict(dims), "bytes_before": {"peak": None, "train_peak": base.peak, "inference_peak": None},
             "train_peak_before": str(base.report.train_peak), "train_peak_after": None,
             "peak_at_dims_before": base.peak, "peak_at_dims_after": None, "recompute_flops": 0,
             "forward_flops": planner.forward_flops, "plan": []}
    at = budget.at()
    if base.peak <= limit:
        entry["reason"] = (f"declined: the training step already fits: peak {format_bytes(base.peak)} at {at} "
                           f"<= budget {format_bytes(limit)}; nothing is recomputed")
        return gm, entry
    choices = planner.choices()
    if not choices:
        refusals = "; ".join(f"{b.name}: {b.refusal}" for b in planner.blocks if b.refusal)
        raise BudgetError(f"fxmem.optimize({budget.said()}): the training-step peak at {at} is "
                          f"{format_bytes(base.peak)}, over the budget, and the model has no block that can be "
                          f"recomputed ({refusals or 'no submodule runs as a contiguous block of the graph'}); "
                          f"what to do: a larger budget, smaller dims, or a model made of blocks "
                          f"(submodules such as transformer layers)", base.peak, planner.parts(base))
    # choose on estimates (the base analysis replayed under each plan, :mod:`.recompute_estimate`),
    # analyse the chosen plan exactly; where it misses the budget by what the estimate left out,
    # choose again for a budget lowered by that much
    tried: dict[tuple, Trial] = {}
    fitting: list[Trial] = []
    margin = 0
    for _ in range(_TRIALS):
        plan = planner.choose(choices, base.peak, limit - margin)
        if plan is not None:
            plan = planner.gathered(choices, plan)
        if plan is None or plan in tried:
            break
        try:
            tried[plan] = trial = planner.trial(plan)
        except BudgetError:
            if planner.ways == ("whole",) or all(how == "whole" for _, how in plan):
                raise
            planner.ways = ("whole",)  # choose again among whole recomputations
            margin = 0
            continue
        if trial.peak <= limit:
            fitting.append(trial)
            break
        margin = max(margin + 1, trial.peak - planner.estimate(plan))  # what the estimate left out, at least
    if not fitting:  # the most recomputation there is (the lower estimate of whole and selective): enough?
        plan = min((tuple((c.block.name, how) for c in choices) for how in planner.ways), key=planner.estimate)
        if plan not in tried:
            tried[plan] = planner.trial(plan)
        if tried[plan].peak <= limit:
            fitting.append(tried[plan])
    if not fitting:
        best = min(tried.values(), key=lambda t: t.peak)
        parts = planner.parts(best)
        worst = max(choices, key=lambda c: c.saved)
        raise BudgetError(
            f"fxmem.optimize({budget.said()}): no recomputation fits the training step at {at} into "
            f"{format_bytes(limit)}; the smallest peak reached is {format_bytes(best.peak)} (recomputing "
            f"{_where(best.plan)}), of which " + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
            + f"; the largest block, {worst.block.name}, keeps {format_bytes(worst.saved)} for backward, which a "
            f"recomputation brings back while that block's backward runs. What to do: a larger budget, smaller "
            f"dims, or an optimizer with less state", best.peak, parts)
    best = min(fitting, key=lambda t: (t.flops, t.peak))
    share = 100.0 * best.flops / planner.forward_flops if planner.forward_flops else 0.0
    entry.update(status="applied", where=_where(best.plan), plan=list(best.plan),
                 train_peak_after=str(best.report.train_peak), peak_at_dims_after=best.peak,
                 bytes_after={"peak": None, "train_peak": best.peak, "inference_peak": None},
                 recompute_flops=best.flops,
                 reason=(f"applied: training-step peak {format_bytes(base.peak)} -> {format_bytes(best.peak)} at "
                         f"{at} (budget {format_bytes(limit)}), {share:.1f}% more FLOPs"),
                 flops=(f"recomputing {best.flops:,} FLOPs in backward ({share:.1f}% of the forward's "
                        f"{planner.forward_flops:,})"))
    if planner.uncounted:
        entry["flops"] += (f"; FLOPs could not be counted on the meta device ({planner.uncounted}), so the plan "
                           f"recomputes the fewest nodes instead and the FLOP figures count nodes")
    return best.module, entry


def propose(gm: torch.fx.GraphModule, line: Any) -> tuple[torch.fx.GraphModule, dict]:
    """The registry's entry (:class:`~.base.GraphPass`): with ``budget=``, :func:`plan_budget` on
    the graph the rules kept (its training step analysed once: the analysis they were decided on
    is the base), proposed to the driver, which verifies it (:func:`unverified` where it differs);
    else a record saying why nothing is recomputed."""
    from fxmem.passes.base import log_entry

    name = type(line.model).__name__
    if line.budget is None:
        return gm, log_entry(RULE, "no match", name, "no budget= given: nothing is recomputed")
    if not line.runs_at_dims:  # the other form runs at dims: the budget is its to meet
        return gm, log_entry(RULE, "no match", name, f"at dims {dict(line.budget.dims)} the other form runs; the budget is "
                                                     f"fitted there")
    line.share(gm)  # the model's modules under their names (tied weights by both names)
    known = line.analysed(gm)
    return plan_budget(gm, line.input_specs, line.step_options, line.budget,
                       base=known.report if known is not None else None)


def _flops(choices: Sequence[BlockCost], plan: tuple) -> int:
    """The FLOPs ``plan`` recomputes in backward."""
    return _over(choices, plan, lambda c, how: c.flops[how])


def _saving(choices: Sequence[BlockCost], plan: tuple) -> int:
    """The bytes ``plan`` saves by the knapsack's count (what autograd keeps of each block it recomputes)."""
    return _over(choices, plan, BlockCost.saving)


def _over(choices: Sequence[BlockCost], plan: tuple, value: Callable[[BlockCost, str], int]) -> int:
    by_name = {c.block.name: c for c in choices}
    return sum(value(by_name[n], how) for n, how in plan)


def _where(plan: Sequence[tuple]) -> str:
    return ", ".join(f"{name} ({how})" for name, how in plan) or "nothing"


class _Planner:
    """The blocks, their costs at ``dims``, and fxmem's exact analysis of each plan tried."""

    def __init__(self, gm: torch.fx.GraphModule, input_specs: tuple, options: AnalysisOptions,
                 dims: Mapping[str, int]):
        self.gm, self.input_specs, self.dims = gm, input_specs, dict(dims)
        self.options = options.replace(grad=True)  # a training step (options.optimizer is set)
        self.blocks = blocks(gm)
        self._base: Report | None = None
        self._costs: dict | None = None
        self.uncounted: str | None = None  # why FLOPs could not be counted (then each node costs 1)
        self._estimator: Estimator | None = None
        self._estimates: dict = {}  # plan -> estimated peak (bytes)
        # the ways of recomputing offered; selective is dropped where a plan with it cannot be analysed
        # (a selective checkpoint whose recomputation torch cannot match on this graph: Swin's slices)
        self.ways: tuple = HOW

    def analyse(self, module: torch.fx.GraphModule) -> Report:
        report = analyze(in_mode(module, True), *self.input_specs, options=self.options)
        if self._base is None:
            self._base = report
        return report

    @property
    def costs(self) -> dict:
        if self._costs is None:
            assert self._base is not None
            try:
                self._costs = node_costs(self.gm, self._base.specs, self.dims)
            except Exception as exc:  # noqa: BLE001 - an op without a meta kernel: count nodes instead
                self.uncounted = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                self._costs = {n.name: (0, 0, 1) for n in self.gm.graph.nodes}
        return self._costs

    @property
    def forward_flops(self) -> int:
        return sum(f + e for f, _, e in self.costs.values())

    def estimate(self, plan: tuple) -> int:
        """``plan``'s training-step peak at ``dims`` estimated from the base analysis (bytes)."""
        if self._estimator is None:
            assert self._base is not None
            self._estimator = Estimator(self._base, self.dims)
        if plan not in self._estimates:
            by_name = {b.name: b for b in self.blocks}
            self._estimates[plan] = self._estimator.peak([(by_name[n], how) for n, how in plan])
        return self._estimates[plan]

    def choose(self, choices: Sequence[BlockCost], base_peak: int, target: int) -> tuple | None:
        """The plan of fewest FLOPs whose estimated peak is at most ``target`` bytes, or None: a
        bisection on the bytes asked of the knapsack (:func:`cheapest`), each plan it gives
        estimated - short of the target: ask for the shortfall too; within it: ask for less, a
        cheaper plan may fit as well."""
        need, short, enough = base_peak - target, 0, None
        best: tuple | None = None
        # the most the knapsack's savings reach (every block, its larger saving), a little under so that
        # the buckets' rounding still reaches it: a need beyond it asks for that plan, which the estimate
        # may find enough (the savings count what autograd keeps, the estimate the whole peak)
        most = sum(max((c.saving(h) for h in self.ways), default=0) for c in choices) * 49 // 50
        for _ in range(_CHOICE_ROUNDS):
            plan = cheapest(choices, min(need, most), self.ways)
            if plan is None:
                break
            peak = self.estimate(plan)
            if peak <= target:
                cost = _flops(choices, plan)
                if best is None or cost < best[0]:
                    best = (cost, plan)
                enough = need
            else:  # every need up to what this plan saves by the knapsack's count gives it again: ask beyond
                short = max(short, need, _saving(choices, plan))
            if enough is not None and enough - short <= max(1, (base_peak - target) // 100):
                break
            if enough is None:
                if short >= most and peak > target:
                    break  # the most recomputation the knapsack has is estimated short too
                need = max(need + (peak - target), short + 1)
            else:
                need = (short + enough) // 2
        return best[1] if best is not None else None

    def gathered(self, choices: Sequence[BlockCost], plan: tuple) -> tuple:
        """``plan`` with alike blocks (the same costs: a transformer's layers) treated alike in one
        run each - the ways that are rarer first, or last - where that is estimated no higher: the
        same FLOPs, and the plan's analysis simulates a run of identical recomputed blocks once
        for all (:mod:`fxmem.simulation.repeats`) instead of block by block."""
        how = dict(plan)
        classes: dict = {}
        for c in choices:
            classes.setdefault((c.saved, c.products, tuple(sorted(c.flops.items()))), []).append(c.block.name)
        best_peak = self.estimate(plan)
        for rare_first in (True, False):
            new = dict(how)
            for names in classes.values():
                ways = [how.get(n) for n in names]
                count = {w: ways.count(w) for w in ways}
                ordered = sorted(ways, key=lambda w: (count[w], str(w)), reverse=not rare_first)
                new.update(zip(names, ordered))
            arranged = tuple((c.block.name, new[c.block.name]) for c in choices if new[c.block.name] is not None)
            if arranged == plan:
                return plan
            if self.estimate(arranged) <= best_peak:
                return arranged
        return plan

    def choices(self) -> list[BlockCost]:
        assert self._base is not None
        usable = [b for b in self.blocks if b.refusal is None]
        return block_costs(self._base, usable, self.costs, self.dims)

    def trial(self, plan: tuple, known: Report | None = None) -> Trial:
        by_name = {b.name: b for b in self.blocks}
        module = extract(self.gm, [(by_name[n], how) for n, how in plan]) if plan else self.gm
        if known is not None and self._base is None:
            self._base = known
        try:
            report = known if known is not None else self.analyse(module)
            peak = report.evaluate(**self.dims)["train_peak"]
        except FxMemError as exc:
            if not plan:
                raise
            # the plan's graph, not the user's shapes: say whose limit it is, and that the budget is not met
            raise BudgetError(
                f"fxmem.optimize: recomputing {_where(plan)} in backward (torch.utils.checkpoint) cannot be analysed "
                f"on this model - a limit of fxmem's recomputation, not of your model or its shapes: "
                f"{str(exc).splitlines()[0].replace(' on the given input shapes', '')}. The budget is not met; "
                f"what to do: checkpoint the blocks yourself and analyse that model with fxmem.analyze, or a larger "
                f"budget", 0, {}) from exc
        return Trial(plan, module, report, peak, _flops(self.choices(), plan) if plan else 0)

    def parts(self, trial: Trial) -> dict:
        """What the training-step peak of ``trial`` is made of (bytes at ``dims``)."""
        ev = trial.report.evaluate(**self.dims)
        params = sum(p.numel() * p.element_size() for p in self.gm.parameters())
        state, grads = ev.get("optimizer_state", 0), ev.get("grads", 0)
        rest = trial.peak - params - state - grads
        return {"parameters": params, "optimizer state": state, "gradients": grads,
                "inputs and activations": rest}


@isolated
def max_size(report: Report, dim: str, budget: Any, **fixed: int) -> int:
    """The largest ``dim`` whose training step fits ``budget`` (bytes or ``"80GiB"``) with or without
    recomputation in backward: the largest over recomputing nothing, every block whole, and every
    block selectively (each exact, as :meth:`fxmem.Report.max_size`); ``fixed`` gives the other dims.
    The rewritten models are analysed with the report's own options (``report.options``).

    >>> report = fxmem.analyze(model, ids, optimizer=adamw)                 # doctest: +SKIP
    >>> fxmem.passes.max_size(report, "B", "24GiB", L=2048)                 # doctest: +SKIP
    """
    if not isinstance(report, Report):
        raise SpecError(f"max_size(report, ...): expected the Report of fxmem.analyze, got {type(report).__name__}")
    if not report.training:
        raise SpecError("max_size with recomputation is about a training step: analyse with optimizer=...")
    model = report.model
    if model is None or report.mode != "graph":
        raise SpecError("max_size with recomputation needs a report of an nn.Module analysed in graph "
                        "mode (recomputation rewrites the traced graph): fxmem.analyze(model, ..., optimizer=...)")
    from fxmem.passes.modes import trace_modes

    traced = trace_modes(model, report.options.leaf_modules)
    if traced.reason:
        raise SpecError(f"max_size with recomputation: {traced.reason}")
    gm = traced.graph_module
    best = report.max_size(dim, budget, train=True, **fixed)
    usable = [b for b in blocks(gm) if b.refusal is None]
    if not usable:
        return best
    for how in HOW:
        module = extract(gm, [(b, how) for b in usable])
        again = analyze(in_mode(module, True), *report.input_specs, options=report.options)
        best = max(best, again.max_size(dim, budget, train=True, **fixed))
    return best
