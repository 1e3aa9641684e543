"""What a candidate graph takes, and whether a rewrite lowers it: the analyses ``fxmem.optimize``
decides by, and the comparison of their formulas.

:func:`memory` analyses a graph three ways - the forward in train mode with autograd, the training
step (the optimizer ``budget=`` brought, else SGD without state: gradients, not state, are what a
rewrite changes) and inference (eval mode, no grad) - into a :class:`Memory` with its peaks at the
example sizes; :func:`decide_peaks` compares two such analyses' formulas over the region where
both hold (:func:`.decide.decide`), on each path a data dim chooses; :func:`change` says what moved
at the example sizes, in words, for a record's reason.

>>> before, after = memory(gm, specs, kw), memory(rewritten, specs, kw)              # doctest: +SKIP
>>> after.lower_than(before), what_changed(before, after)                                   # doctest: +SKIP
(True, 'inference peak 1.96 GiB -> 8.11 MiB at B=4, N=500')
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import sympy
import torch
import torch.fx

from fxmem import data_paths
from fxmem.accounting.symbolic import Region
from fxmem.analyze import analyze
from fxmem.errors import FxMemError, NothingToTrainError
from fxmem.options import AnalysisOptions
from fxmem.passes.base import REASON_LIMIT
from fxmem.passes.decide import Condition, Decision, candidates, decide
from fxmem.passes.modes import in_mode
from fxmem.report import Report
from fxmem.search import first_true
from fxmem.simulation.failures import first_line
from fxmem.units import format_bytes


def _plain_sgd(params: Any) -> torch.optim.Optimizer:
    # no optimizer state: the training step's peak is forward + backward + gradients
    return torch.optim.SGD(params, lr=0.0)


# The analyses one call makes, each an AnalysisOptions derived from the call's own ``kw`` (the
# user's options, mode="auto", no self-check; with budget= the user's optimizer):
def step_options(kw: AnalysisOptions) -> AnalysisOptions:
    """A training step: the optimizer budget= brought, else SGD without state."""
    return kw.replace(optimizer=kw.optimizer or _plain_sgd)


def forward_options(kw: AnalysisOptions) -> AnalysisOptions:
    """The forward in train mode, with autograd (what backward keeps), no step."""
    return kw.replace(optimizer=None)


def inference_options(kw: AnalysisOptions) -> AnalysisOptions:
    """The forward without grad (inference)."""
    return kw.replace(grad=False, optimizer=None)


@dataclasses.dataclass
class Memory:
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

    def lower_than(self, other: "Memory") -> bool:
        """Proven by the formulas: no peak higher than ``other``'s for any size in the region, one lower somewhere."""
        return decide_peaks(other, self, self.report.symbols, self.report.hints, None).verdict == "keep"

    def decision(self, other: "Memory") -> str:
        """The formula comparison of this graph's peaks with ``other``'s, in words."""
        return decide_peaks(other, self, self.report.symbols, self.report.hints, None).text

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


def what_changed(before: Memory, after: Memory, room: int = REASON_LIMIT - 10) -> str:
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


def threshold(dim: str, regions: list, symbols: Mapping, at: Mapping[str, int]) -> int | None:
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


def decide_peaks(before: Memory, after: Memory, symbols: Mapping, hints: Mapping[str, int],
            assume: Condition | None, search: bool = True) -> Decision:
    """The formula comparison of every peak (forward, training step, inference) over the region
    where both analyses hold (the higher lower bound of each dim); ``search``: see :func:`.decide.decide`."""
    # where every analysis holds: a kernel's block count makes its own region (many blocks or one)
    regions = regions_of(before) + regions_of(after)
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


def regions_of(memory: Memory) -> list:
    """Where each analysis of a graph holds: train and inference mode, on each path the data chooses."""
    return [m._plan.region for g in (memory, memory.beyond) if g is not None for m in (g.report, g.inference)]


def _on_paths(before: Memory, after: Memory) -> list[tuple[Memory, Memory, str]]:
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


def memory(gm: torch.fx.GraphModule, input_specs: tuple, kw: AnalysisOptions) -> Memory:
    """fxmem's analysis of ``gm`` in train mode (a training step, with grad) and in eval mode
    under ``no_grad`` (inference); each on a copy of ``gm`` in that mode."""
    train, evals = in_mode(gm, True), in_mode(gm, False)
    report, failure = None, None
    if kw.grad:
        try:  # SGD without state unless budget= brought the user's optimizer
            report = analyze(train, *input_specs, options=step_options(kw))
        except NothingToTrainError:  # no parameter reaches the output: forward only, as there is no step
            report = None
        except FxMemError as exc:  # the step cannot be analysed: forward only, and the decisions say so
            failure = f"{type(exc).__name__}: {first_line(str(exc))[:200]}"
    if report is None:
        report = analyze(train, *input_specs, options=forward_options(kw))
    inference = analyze(evals, *input_specs, options=inference_options(kw))
    values = report.evaluate(**report.hints)
    beyond = None
    if report.data_paths or inference.data_paths:  # the path the graph takes on denser data, analysed too
        with data_paths.beyond():
            beyond = memory(gm, input_specs, kw)
    return Memory(report, inference, (values["peak"], values.get("train_peak", 0),
                                       inference.evaluate(**report.hints)["peak"]), beyond, failure)
