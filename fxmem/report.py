"""The analysis result: formulas in the user's dims, per-node and per-storage detail, numbers.

Every byte count is a sympy expression in positive-integer symbols named after the user's dims.
Numbers at concrete dims come from one :class:`~fxmem.accounting.Evaluation` per set of dims,
computed once and shared by ``evaluate``, the tables and the pictures.

>>> report = fxmem.analyze(GAT(6, 128), ("B", "N", 6), ("B", "N", "N"))   # doctest: +SKIP
>>> report.peak                                                          # doctest: +SKIP
1024*B*N**2 + ...
>>> report.evaluate(B=4, N=500)["peak"]                                   # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, Callable, Mapping

import sympy
import torch

from . import views
from .accounting import FORMULA_KEYS, TRAIN_KEYS, Evaluation, Liveness, MemoryPlan, cuda_block_bytes, max_size
from .accounting.budget import MaxSize, min_size
from .accounting.symbolic import evaluate
from .accounting.caching_allocator import CachingAllocator, moved_order
from .accounting.cuda_blocks import AllocatorConfig
from .capture import Capture
from .errors import SpecError
from .kernels import environment
from .kernels.measured import StructureChanged
from .options import AnalysisOptions
from .records import INEXACT
from .parsing import parse_expression
from .progress import progress_to_stderr, showing
from . import data_paths
from .specs import check_dims, check_input_sizes
from .units import format_bytes

_log = logging.getLogger(__name__)  # progress: a re-analysis takes as long as the first one

__all__ = ["Report", "format_bytes"]


def _data_dim_name(name: str) -> bool:
    """Whether ``name`` is how fxmem names a size the data decides (K1, K2, ...)."""
    return name[:1] == "K" and name[1:].isdigit()


def _at_values(expr: Any, values: Mapping[str, int], symbols: Mapping[str, sympy.Symbol]) -> int:
    """An integer formula of the dims at ``values``."""
    return int(sympy.sympify(expr).xreplace({symbols[k]: sympy.Integer(v) for k, v in values.items() if k in symbols}))


class Report:
    """Memory of one forward (and training step) of a model, as formulas in the user's dims (bytes).

    Attributes ``resident``, ``peak``, ``retained``, ``saved``, ``output`` are sympy expressions:

    * ``resident`` - parameters + buffers + inputs;
    * ``peak`` - absolute peak during one forward (graph mode: the traced GraphModule, which frees
      each value after its last use; eager mode: the original ``forward``), autograd recording as
      in training when ``grad=True``;
    * ``retained`` - bytes allocated by the forward still held when it returns (output + saved);
    * ``saved`` - bytes autograd holds for backward beyond parameters and inputs;
    * ``output`` - bytes of the returned tensors that the forward allocated.

    With ``optimizer=`` (see :mod:`fxmem.training`), also ``train_resident`` (the above resident
    bytes + optimizer state), ``train_peak`` (absolute peak of a steady-state training step),
    ``grads`` and ``optimizer_state``; otherwise these are None.

    ``storages`` (:class:`fxmem.records.Storage`) and ``nodes`` (:class:`fxmem.records.Node`) say
    where the bytes are; ``region`` says where the formulas hold; ``notes`` what else to know.
    """

    def __init__(self, plan: MemoryPlan, *, model_name: str, specs: list, options: AnalysisOptions,
                 input_specs: tuple, model: torch.nn.Module | None, hints: dict,
                 graph_module: torch.fx.GraphModule | None, mode: str,
                 reanalyze: Callable[[dict], "Report"], capture: Capture | None = None):
        self._plan = plan
        self.model_name = model_name
        self.specs = specs
        # what was analysed, and how: every later re-analysis (a region, a rewrite) uses these
        self.options: AnalysisOptions = options
        self.input_specs: tuple = tuple(input_specs)
        # the user's model (None for a class/factory): re-analyses and recomputation planning need it
        self.model: torch.nn.Module | None = model
        self.device = options.device
        self.grad = options.grad
        self.dtype = options.dtype
        self.mode = mode
        # which code the numbers are of, and why (eager mode where torch.fx cannot trace the model)
        self.capture: Capture = capture or Capture(mode, "the original forward" if mode == "eager" else "a graph")
        self.hints = dict(hints)
        self.graph_module = graph_module
        self._reanalyze = reanalyze
        self._regions: dict[tuple, Report] = {}
        # the pieces of this one simulation (a kernel's regimes, fxmem.kernels.regimes): branch
        # choices -> their report, shared by every piece; each made once, from the same recording
        self._pieces: dict[tuple, Report] = {}
        if plan.piecewise:
            self._pieces[plan.piece_of(plan.hint_values)] = self
        # set by analyze: the self-check each new piece gets (fxmem.selfcheck), as the first one did
        self._check: Callable[["Report"], "Report"] | None = None
        self._evaluations: dict[tuple, Evaluation] = {}
        self._verified: dict[tuple, bool] = {}  # sizes -> whether every fitted kernel holds there
        self.symbols: dict[str, sympy.Symbol] = dict(plan.symbols)
        # a world size as a symbol (fxmem.distributed.world_symbol): (its name, the smallest it may be,
        # the gcd of the sharded sizes it divides - 0 where it shards nothing); None otherwise
        self.world_dim: tuple[str, int, int] | None = None
        f = plan.formulas()
        self.resident: sympy.Expr = f["resident"]
        self.peak: sympy.Expr = f["peak"]
        self.retained: sympy.Expr = f["retained"]
        self.saved: sympy.Expr = f["saved"]
        self.output: sympy.Expr = f["output"]
        self.train_resident: sympy.Expr | None = f.get("train_resident")
        self.train_peak: sympy.Expr | None = f.get("train_peak")
        self.grads: sympy.Expr | None = f.get("grads")
        self.optimizer_state: sympy.Expr | None = f.get("optimizer_state")
        self.notes: list[str] = list(plan.notes)
        self.facts: dict = dict(plan.rec.facts)
        self.storages = plan.storages
        self.nodes = plan.nodes
        # what the real-run self-check found (fxmem.selfcheck); set by analyze
        self.checked: str = "not checked against a real run"
        # eager mode: the modules the forward called (path -> class, calls, first output shape in
        # the user's dims), from hooks on fxmem's copy; graph mode reads them from the fx graph
        calls = plan.rec.module_calls
        self.module_calls: dict | None = None if calls is None else {
            path: (c.kind, c.calls, None if c.shape is None else tuple(plan.to_user(d) for d in c.shape))
            for path, c in calls.items()}
        # sizes the data decides (x[mask], nonzero): dims evaluate() needs, with what each counts
        data = plan.rec.data_dims
        self.data_dims: dict[str, str] = {
            name: d.describe(to_user=plan.to_user) for name, d in data.items()}
        self._data_bounds = {name: plan.to_user(d.upper) for name, d in data.items() if d.upper is not None}
        self._data_not_one = {name for name, d in data.items() if d.not_one}
        # sizes that choose the model's path: the formulas are those of the path taken up to this bound
        self.data_paths: dict[str, Any] = {name: plan.to_user(d.path_upper) for name, d in data.items()
                                           if d.path_upper is not None}

    # --- numbers --------------------------------------------------------------------------------
    @property
    def exact(self) -> bool:
        """False when a note says some number may differ from a real run (an unfitted kernel
        workspace, a path that real code would choose by tensor values); True otherwise."""
        return not any(INEXACT in n for n in self.notes)

    @property
    def region(self) -> list[str]:
        """Conditions on the dims under which the formulas hold (e.g. ``N >= 2``)."""
        return self._plan.region.conditions()

    def evaluate(self, **dims: int) -> Evaluation:
        """Exact byte counts at concrete dims: ``resident``, ``peak``, ``retained``, ``saved``, ...

        Outside the region where the formulas hold (say ``N=1``, which PyTorch treats specially),
        the model is re-analysed at those sizes, so the numbers are always those of a real run.
        On ``device="cuda"`` every block is rounded up to 512 bytes, as the caching allocator does.
        The result reads like a dict; ``.liveness`` has the numbers node by node.
        """
        return self._at(dims if dims or not self.symbols else None, check=True)[1]

    def _at(self, dims: Mapping[str, int] | None, check: bool = False) -> tuple["Report", Evaluation]:
        """The report whose formulas hold at ``dims`` (self, or a re-analysis, cached) and its
        evaluation there (cached): the one place that decides when to re-analyse. ``None``: the
        example sizes the analysis ran at."""
        path_key: tuple = ()
        if dims is None and not check:
            report, values = self, dict(self.hints)
        else:
            missing = [d for d in self.data_dims if d not in (dims or {})]
            if missing:
                raise SpecError(f"evaluate(): give the value of {', '.join(missing)}, a size the data decides - "
                                + "; ".join(self.data_dims[d] for d in missing))
            given = dict(dims or {})
            counts = {k: given.pop(k) for k in self.data_dims}  # may be 0: a mask that selects nothing
            later = {k: given.pop(k) for k in list(given) if k not in self.symbols and _data_dim_name(k)}
            if later:  # K1 of a path this analysis does not take (a switch's other form): the analysis there has it
                known = {**check_dims(given, {k: s for k, s in self.symbols.items() if k not in counts}), **counts}
                if self._plan.region.holds({self.symbols[k]: v for k, v in known.items()}):
                    raise SpecError(f"evaluate(): unknown dim(s) {sorted(later)}; this analysis has dims "
                                    f"{sorted(self.symbols)}")
                return self._reanalysed(known)._at({**known, **later}, check=True)
            for name, v in counts.items():
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise SpecError(f"evaluate(): {name}={v!r} must be a whole number >= 0: {self.data_dims[name]}")
                if v == 1 and name in self._data_not_one:
                    raise SpecError(f"evaluate(): {name}=1 is where a kernel takes a path for one-element tensors "
                                    f"that these formulas are not of: {self.data_dims[name]}")
            values = {**check_dims(given, {k: s for k, s in self.symbols.items() if k not in counts}), **counts}
            check_input_sizes(self.specs, values, self.symbols)
            for name, upper in self._data_bounds.items():
                bound = sympy.sympify(upper).xreplace({self.symbols[k]: sympy.Integer(v) for k, v in values.items()})
                if bound.is_number and values[name] > bound:
                    raise SpecError(f"evaluate(): {name}={values[name]} is more than it can be at these sizes "
                                    f"({name} <= {upper} = {bound}): {self.data_dims[name]}")
            report = self
            beyond = [name for name, upper in self.data_paths.items() if values[name] > _at_values(upper, values,
                                                                                                   self.symbols)]
            if beyond:  # the model takes its other path there: the analysis of that path, at these sizes
                values = {k: v for k, v in values.items() if k not in self.data_paths}
                path_key = ("beyond", tuple(beyond))
                report = self._reanalysed(values, path_key)
            elif not self._plan.region.holds({self.symbols[k]: v for k, v in values.items()}):
                report = self._reanalysed(values)
        if not report._fits_hold(values):  # a fitted kernel keeps other buffers there: analysed there
            report = self._reanalysed(values, ("fits",) + tuple(sorted(values.items())))
        elif values != report.hints and any(f.fitted is None for f in report._plan.rec.fits):
            # a calibrated kernel's workspace was unknown at the example sizes (too large to measure
            # there, no fit holds): these formulas lack it, so the sizes asked are analysed, where it
            # may be measured (kernels.measured); never a number known to miss a buffer
            report = self._reanalysed(values, ("unknown",) + tuple(sorted(values.items())))
        here = environment(self.device)
        if any(self.facts.get(k) != v for k, v in here.items()):
            # made under another thread count (or oneDNN setting): kernels would allocate otherwise now
            report = self._reanalysed(values, path_key + tuple(sorted(here.items())))
        key = tuple(sorted(values.items()))
        if key not in report._evaluations:
            try:
                report._evaluations[key] = report._plan.evaluate({report.symbols[k]: v for k, v in values.items()})
            except StructureChanged as changed:  # a measured kernel orders its outputs otherwise here
                if report.hints == values:  # recorded at these very sizes: not a question of order
                    raise
                _log.info("%s: analysing there", changed)
                return self._reanalysed(values, ("measured",) + key)._at(values, check)
        return report, report._evaluations[key]

    def _reanalysed(self, values: dict, environment_key: tuple = ()) -> "Report":
        """The analysis whose formulas hold at ``values``: one already made for a region that
        contains them (each region is analysed once), else a new one made at ``values``.
        ``environment_key`` starts with ``("beyond", dims)`` where the data dims take the model's
        other path (:func:`fxmem.data_paths.beyond`)."""
        key = (environment_key, tuple(sorted(values.items())))
        if not environment_key and key not in self._regions and self._other_piece_holds(values):
            piece = self._piece_or_none(values)  # another piece of the same simulation
            if piece is not None:
                self._regions[key] = piece
        if key not in self._regions:
            for (env_key, _), report in list(self._regions.items()):
                if env_key == environment_key and report._holds_at(values):
                    self._regions[key] = report
                    break
                if env_key == environment_key and report._other_piece_holds(values):
                    piece = report._piece_or_none(values)  # another piece of that simulation
                    if piece is not None:
                        self._regions[key] = piece
                        break
            else:
                with progress_to_stderr() if getattr(self.options, "verbose", False) and not showing() \
                        else contextlib.nullcontext():
                    _log.info("re-analysing at %s: outside the formulas' region (%s)",
                              ", ".join(f"{k}={v}" for k, v in sorted(values.items())), ", ".join(self.region) or "-")
                    with data_paths.beyond() if environment_key[:1] == ("beyond",) else contextlib.nullcontext():
                        self._regions[key] = self._reanalyze(values)
        return self._with_doubts(self._regions[key])

    def _with_doubts(self, other: "Report") -> "Report":
        """``other`` (a re-analysis of this model, or another piece of its simulation) with this
        analysis' notes that say its numbers may not be exact. Why: they are the same model's kernels,
        and a re-analysis checks itself at one size only - a real run that disagreed with this
        analysis is a doubt about every size, not only the one it was run at."""
        if other is self:
            return other
        at = ", ".join(f"{k}={v}" for k, v in sorted(self.hints.items()))
        for note in self.notes:
            inherited = f"from the analysis at {at}: {note}"
            if INEXACT in note and note not in other.notes and inherited not in other.notes:
                other.notes.append(inherited)
        return other

    def _pieces_usable(self) -> bool:
        """Whether this simulation has other pieces (a kernel's other regimes) read off its recording.
        Not where a calibrated kernel's workspace was unknown at the example sizes (a oneDNN
        convolution no fit holds for there): the sizes asked are simulated, where that kernel is
        measured. Fitted programs (oneDNN convolutions and batch norms whose example sizes are too
        large to run once) are checked at each size asked (:meth:`_fits_hold`): where one is off,
        that size is simulated."""
        return bool(self._plan.piecewise) and not any(f.fitted is None for f in self._plan.rec.fits)

    def _fits_hold(self, values: Mapping[str, int]) -> bool:
        """Whether every fitted kernel program of this recording (oneDNN convolutions, batch norm
        where the example sizes are too large to run once: fitted on small samples, checked toward
        the example sizes) gives what a real run of that kernel alone keeps at ``values`` - one
        real run per kernel and size, cached; a driver too large to run is not checked
        (:func:`fxmem.kernels.calibrate.fit_holds`)."""
        from .kernels.calibrate import fit_holds

        fits = self._plan.rec.fits
        if not fits:
            return True
        key = tuple(sorted(values.items()))
        if key not in self._verified:
            at = {self.symbols[k]: v for k, v in values.items() if k in self.symbols}
            seen, ok = set(), True
            for fit in (f for f in fits if f.fitted is not None):
                shape = tuple(int(d) if isinstance(d, int) else evaluate(self._plan.to_user(sympy.sympify(d)), at)
                              for d in fit.shape)
                if (fit.op, fit.items, fit.fitted, shape) in seen:
                    continue
                seen.add((fit.op, fit.items, fit.fitted, shape))
                if fit_holds(fit, shape) is False:
                    _log.info("a fitted %s keeps other buffers at %s: analysing there", fit.op, shape)
                    ok = False
                    break
            self._verified[key] = ok
        return self._verified[key]

    def _other_piece_holds(self, values: Mapping[str, int]) -> bool:
        """Whether a piece of this simulation (a kernel's other regime) holds at ``values``."""
        return self._pieces_usable() and set(values) == set(self.symbols) and self._plan.base_region.holds(
            {self.symbols[k]: v for k, v in values.items()})

    def _piece_at(self, values: dict) -> "Report":
        """The piece of this simulation that holds at ``values`` (where a kernel takes another
        regime than at the hints): its formulas from the same recording, no new simulation; made
        once per piece and checked against a real run like the first."""
        plan = self._plan
        key = plan.piece_of({self.symbols[k]: v for k, v in values.items()})
        if key not in self._pieces:
            _log.info("the formulas of another piece (%s)", ", ".join(f"{k}={v}" for k, v in sorted(values.items())))
            piece = Report(MemoryPlan(plan.rec, values), model_name=self.model_name, specs=self.specs,
                           options=self.options, input_specs=self.input_specs, model=self.model, hints=values,
                           graph_module=self.graph_module, mode=self.mode, reanalyze=self._reanalyze,
                           capture=self.capture)
            piece._pieces, piece._regions, piece._check = self._pieces, self._regions, self._check
            self._pieces[key] = piece
            if self._check is not None:
                self._check(piece)
        return self._pieces[key]

    def _piece_or_none(self, values: dict) -> "Report | None":
        """:meth:`_piece_at`, or None where a measured kernel (kernels.measured) allocates its
        outputs in another order at ``values`` than where it was recorded: those sizes are analysed."""
        try:
            return self._piece_at(values)
        except StructureChanged as changed:
            _log.info("%s: analysing there", changed)
            return None

    def _holds_at(self, values: Mapping[str, int]) -> bool:
        """Whether this analysis' formulas hold at ``values`` (the dims lie in its region)."""
        return set(values) == set(self.symbols) and self._plan.region.holds(
            {self.symbols[k]: v for k, v in values.items()})

    def pieces(self) -> list[tuple[list[str], "Report"]]:
        """The formulas for every size, as ``(conditions, report)`` pieces: where a kernel changes
        regime with size (ATen's CPU flash attention at L = 32, 192, 512, 768; a reduction's
        two-pass buffer from 32,768 elements), one simulation gives each side its own formulas.
        Each piece is checked against a real run at its smallest point (as the first one). Sizes
        that are not in any of them - a dim at 1, which PyTorch treats specially - are analysed
        when asked (``evaluate``): see :meth:`regions` for every analysis made so far. oneDNN
        convolutions and batch norms are measured at each size asked (one real run of each kernel
        alone, cached), or, where the example sizes were too large to run, fitted and checked by
        such a run; where a fit is off, that size is simulated.

        >>> for conditions, piece in fxmem.analyze(llama, ("B", "L"), dtype=torch.int64).pieces():   # doctest: +SKIP
        ...     print(", ".join(conditions), piece.peak)
        """
        plan = self._plan
        if not self._pieces_usable():
            return [(self.region, self)]
        out: list = []
        for point in plan.piece_points():
            values = {str(s): v for s, v in point.items()}
            piece = self if plan.piece_of(point) == plan.piece_of(plan.hint_values) else self._piece_at(values)
            if all(piece is not p for _, p in out):
                out.append((piece.region, piece))
        return out

    def regions(self) -> list[tuple[list[str], "Report"]]:
        """Every analysis made so far, as ``(region, report)``: this one first, then one per region
        ``evaluate`` had to re-analyse, each exact in its region: together, piecewise formulas
        for every size evaluated so far.

        >>> r = fxmem.analyze(model, ("B", 3, "H", "W")); r.evaluate(B=1, H=32, W=32)  # doctest: +SKIP
        >>> [(region, str(report.peak)) for region, report in r.regions()]               # doctest: +SKIP
        """
        seen, out = {id(self)}, [(self.region, self)]
        for report in self._regions.values():
            if id(report) not in seen:
                seen.add(id(report))
                out.append((report.region, report))
        return out

    def at(self, expr: sympy.Expr | str | int, **dims: int) -> int:
        """Value of any formula of this report (a storage's ``bytes``, a node's ``live_after``, or a
        string such as ``"B*N**2"`` over its dims) at ``dims``."""
        values = check_dims(dims, self.symbols, "at")
        if isinstance(expr, str):
            expr = parse_expression(expr, dict(self.symbols), "at(): expression", new_names=False)
        elif isinstance(expr, bool) or not isinstance(expr, (int, sympy.Expr)):
            raise SpecError(f"at(): expected a formula of this report, a string or an int, got {type(expr).__name__}")
        expr = sympy.sympify(expr)
        unknown = sorted(str(s) for s in expr.free_symbols if s not in self.symbols.values())
        if unknown:
            raise SpecError(f"at(): the formula uses {unknown}, which are not dims of this analysis "
                            f"(its dims: {sorted(self.symbols)})")
        return evaluate(expr, {self.symbols[k]: v for k, v in values.items()})

    def liveness(self, dims: Mapping[str, int] | None = None) -> Liveness:
        """Live activation bytes node by node, at ``dims`` (default: the example sizes ``hints``).

        ``.high[k]`` is the most bytes live at any moment while ``nodes[k]`` runs, ``.after[k]`` the
        bytes live when it ends (both above resident); ``.peak`` and ``.peak_node`` agree with
        :meth:`evaluate` and :meth:`peak_node`. Outside the formulas' region the lists belong to
        the re-analysis at ``dims``.

        >>> report.liveness({"B": 4, "N": 500}).peak_node          # doctest: +SKIP
        'cat'
        """
        return self._at(dims or None)[1].liveness

    def peak_node(self, **dims: int) -> str | None:
        """The node during which the forward's peak happens (at ``dims``, or at the example sizes)."""
        return self.liveness(dims or None).peak_node

    def max_size(self, dim: str, budget: Any, train: bool = False, on: str = "peak", **fixed: int) -> int:
        """The largest ``dim`` whose peak (``train=True``: training-step peak) fits ``budget``.
        ``on="reserved"`` (``device="cuda"``): whose caching-allocator segments fit it - what an
        out-of-memory error is about (``reserved``, ``train_reserved`` in :meth:`evaluate`).

        ``budget`` is bytes or a string such as ``"80GiB"`` or ``"32GB"``; ``fixed`` gives the other
        dims. Exact: the answer fits and the next size does not (see :mod:`fxmem.accounting.budget`);
        for a pipeline stage, the batch dim's sizes are the multiples of its micro-batches.
        A 0 (not even size 1 fits) carries its reason, ``.reason``, and warns with it.
        With recomputation in backward the model is rewritten: ``fxmem.passes.max_size(report,
        dim, budget, **fixed)`` is the largest size whose training step fits then.

        >>> report.max_size("B", budget="32GiB", N=500)           # doctest: +SKIP
        """
        if self.world_dim is not None and dim == self.world_dim[0]:
            raise SpecError(f"max_size({dim!r}): each rank holds less the more ranks there are; "
                            f"min_size({dim!r}, budget, ...) is the fewest ranks whose step fits")
        if "recompute" in fixed:
            raise SpecError("max_size(recompute=...): recomputation rewrites the model, so it is planned by the "
                            "passes: fxmem.passes.max_size(report, dim, budget, **dims)")
        key = self._budget_key("max_size", train, on)
        if dim in self.data_dims:
            raise SpecError(f"max_size({dim!r}): {dim} is decided by the data, not chosen; search over an input dim "
                            f"and give {dim} (or how it grows with that dim is yours to say): {self.data_dims[dim]}")
        if self.data_dims:
            raise SpecError(f"max_size(): the memory depends on {', '.join(self.data_dims)}, sizes the data decides "
                            f"that grow with the input; evaluate() at the values you expect instead - "
                            + "; ".join(self.data_dims.values()))
        split = self.facts.get("microbatches")
        if split and dim == self._microbatched_dim():
            # a pipeline's batch splits into equal micro-batches: its sizes are the multiples of their number
            found = max_size(lambda **d: self.evaluate(**{**d, dim: split * d[dim]}), list(self.symbols), dim, budget,
                             key=key, start=max(2, self.hints.get(dim, 2) // split), **fixed)
            return MaxSize.of(split * int(found), found.reason)
        return max_size(self.evaluate, list(self.symbols), dim, budget, key=key, start=self.hints.get(dim, 2), **fixed)

    def min_size(self, dim: str, budget: Any, train: bool = False, on: str = "peak", **fixed: int) -> int:
        """The fewest ranks ``dim`` (the world size as a symbol: ``world_size="W"``, or a mesh dim
        such as ``mesh={"dp": "D", "tp": 2}``) whose peak (``train=True``: training-step peak; ``on``
        as for :meth:`max_size`) fits ``budget``, among the world sizes the formulas hold at (each
        dividing the sharded sizes evenly; the region says which). A world size between them, with
        uneven shards, is analysed when you ask ``evaluate(W=...)`` at it. 0 (with ``.reason``) where
        none fits.

        >>> report.min_size("W", "80GiB", train=True, B=8, L=4096)      # doctest: +SKIP
        """
        if self.world_dim is None or dim != self.world_dim[0]:
            raise SpecError(f"min_size({dim!r}): the fewest ranks is asked of a world size given as a symbol "
                            f"(world_size='W' or a mesh dim such as {{'dp': 'D'}}); "
                            + (f"this analysis' is {self.world_dim[0]}" if self.world_dim else
                               "this analysis has none") + "; max_size() is the largest of a dim")
        key = self._budget_key("min_size", train, on)
        name, low, even = self.world_dim
        if even:
            candidates, why = [w for w in range(low, even + 1) if even % w == 0], f"those that divide {even}"
        else:
            candidates, why = [low], f"nothing is sharded: every {name} holds the same"
        return min_size(self.evaluate, name, candidates, budget, key=key, why=why, **fixed)

    def _budget_key(self, what: str, train: bool, on: str) -> str:
        """The evaluation key a budget question compares (``train_peak``, ``reserved`` ...), checked."""
        if train and not self.training:
            raise SpecError(f"{what}(train=True) needs a training step: analyse with optimizer=...")
        if on not in ("peak", "reserved"):
            raise SpecError(f"{what}(on={on!r}): use 'peak' (the tensors' bytes) or 'reserved' (the CUDA caching "
                            f"allocator's segments)")
        if on == "reserved" and self.device != "cuda":
            raise SpecError(f"{what}(on='reserved'): reserved memory is the CUDA caching allocator's; analyse with "
                            "device='cuda' (a CUDA build of torch, no GPU needed for a forward)")
        if on == "reserved":
            AllocatorConfig.from_environment().check_replayable()
        return ("train_" if train else "") + on

    def _microbatched_dim(self) -> str | None:
        """The dim a pipeline schedule splits into micro-batches: its inputs' first (the first spec's)."""
        first = self.specs[0].dims[0] if self.specs and self.specs[0].dims else None
        return str(first) if isinstance(first, sympy.Symbol) else None

    # --- views ----------------------------------------------------------------------------------
    @property
    def training(self) -> bool:
        """Whether a training step was analysed (``optimizer=`` given)."""
        return self.train_peak is not None

    def formulas(self) -> dict[str, sympy.Expr]:
        """The headline formulas (bytes): five for the forward, four more for a training step."""
        keys = FORMULA_KEYS + (TRAIN_KEYS if self.training else ())
        return {k: getattr(self, k) for k in keys}

    def by_line(self, dims: Mapping[str, int] | None = None) -> views.LineTable:
        """Seed 002's per-line table, automatic: per source line, bytes allocated, freed, and live
        after it (formulas, or numbers at ``dims``). Eager mode has every executed line; graph mode
        merges the fx nodes of each line. See :mod:`fxmem.views.lines`.

        >>> print(report.by_line(dict(B=64, L=32)))        # an aligned table   # doctest: +SKIP
        """
        if not dims:
            return views.by_line(self)
        return views.by_line(*self._at(dims))

    def table(self, dims: Mapping[str, int] | None = None, max_width: int = 60) -> str:
        """The per-node table: what each node allocates, what autograd saves, what is live after it.

        With ``dims`` the byte columns are numbers at those sizes instead of formulas.
        """
        if not dims:
            return views.node_table(self, None, max_width)
        return views.node_table(*self._at(dims), max_width)

    def modules(self, dims: Mapping[str, int] | None = None) -> views.ModuleTable:
        """The per-module table (as torchinfo's summary, exact): each module's class, output shape,
        parameters, and the activation bytes its tensors keep after the forward (with its
        submodules'); formulas, or numbers at ``dims``. Prints as text, shows as HTML in notebooks.

        >>> print(report.modules(dict(B=64, L=32)))                # doctest: +SKIP
        """
        if not dims:
            return views.module_rows(self)
        return views.module_rows(*self._at(dims))

    def snapshot(self, dims: Mapping[str, int] | None = None, path: str | None = None, train: bool = False) -> dict:
        """The predicted run as a PyTorch memory snapshot (the dict ``torch.cuda.memory._snapshot()``
        returns), for pytorch.org/memory_viz or ``torch.cuda._memory_viz``; ``path``: also written as
        the pickle those open. ``train=True``: the training step. See :mod:`fxmem.views.snapshot`.

        >>> snap = report.snapshot({"B": 4, "N": 500}, path="gat.pickle")   # doctest: +SKIP
        """
        if train and not self.training:
            raise SpecError("snapshot(train=True) needs a training step: analyse with optimizer=...")
        report, _ = self._at(dims or None, check=bool(dims))
        values = dict(dims) if dims else dict(self.hints)
        plan = report._plan
        events, forward = plan.trace({report.symbols[k]: v for k, v in values.items() if k in report.symbols})
        sizes = {}
        for action, what, nbytes, _ in events:  # the storages' bytes as the walk counted them
            if action == "alloc" and isinstance(what, int):
                sizes[what] = nbytes
        cuda = self.device == "cuda"
        for s in plan.rec.storages:
            if s.index not in sizes:
                n = evaluate(plan.sizes[s.index], {report.symbols[k]: v for k, v in values.items()
                                                   if k in report.symbols})
                sizes[s.index] = cuda_block_bytes(n) if cuda else n
        config = AllocatorConfig.from_environment()
        # on CUDA the caching allocator places the blocks (its segments, cached blocks included)
        allocator = CachingAllocator(config) if cuda and not config.unreplayable else None
        return views.snapshot(events, forward, [sizes[i] for i in range(len(plan.rec.storages))],
                              plan.rec.storages, plan.rec.steps, report.nodes, train=train, path=path,
                              meta={"model": self.model_name, "device": self.device, "dims": values},
                              allocator=allocator, first=[s.index for s in moved_order(plan.rec.storages)])

    def memory_viz(self, dims: Mapping[str, int] | None = None, path: str | None = None,
                   train: bool | None = None) -> str:
        """The predicted run as one self-contained HTML page: PyTorch memory_viz's active-memory
        timeline of :meth:`snapshot` (one band per allocation, in bytes - 512-byte blocks on
        ``device="cuda"`` - over the run's events, with its peak and source lines), drawn as a
        static SVG that needs no network and no script; the page also carries the snapshot (JSON,
        and the pickle pytorch.org/memory_viz opens). ``dims``: the sizes (default: the example
        sizes); ``train``: the training step (default: when the analysis had ``optimizer=``), else
        the forward; ``path``: also written there. Returns the HTML. See :mod:`fxmem.views.memory_viz`.

        >>> html = report.memory_viz({"B": 4, "N": 500}, path="gat.html")   # doctest: +SKIP
        """
        from .views.memory_viz import memory_viz_page
        from .errors import FxMemError

        if dims is not None and not isinstance(dims, Mapping):
            raise SpecError(f"memory_viz(dims=...): expected a dict of sizes such as {{'B': 4}}, "
                            f"got {type(dims).__name__}")
        if path is not None and not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
            raise SpecError(f"memory_viz(path=...): expected a file name for the .html page, got {type(path).__name__}")
        if train is not None and not isinstance(train, bool):
            raise SpecError(f"memory_viz(train=...): expected True (the training step), False (the forward) "
                            f"or None (the training step when analysed with optimizer=), got {train!r}")
        if train and not self.training:
            raise SpecError("memory_viz(train=True) needs a training step: analyse with optimizer=..., "
                            "or pass train=False for the forward")
        page = memory_viz_page(self.snapshot(dims, train=self.training if train is None else train))
        if path is not None:
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(page)
            except OSError as exc:
                raise FxMemError(f"memory_viz(path={path!r}): cannot write the page: {exc.strerror or exc}") from exc
        return page

    def summary(self, dims: Mapping[str, int] | None = None, full: bool = False) -> str:
        """The headline formulas (and numbers at ``dims``) as text.

        At ``dims`` outside the formulas' region the summary is of the re-analysis there, and says
        so. With ``dims`` a formula that is a ``Max`` of candidates (a 7B model's training peak has
        ~200) shows the one deciding at ``dims``; ``full=True`` (or ``report.train_peak`` itself)
        gives them all.

        >>> print(report.summary(dict(B=8, L=4096)))               # doctest: +SKIP
        """
        if not dims:
            return views.summary(self, None)
        report, evaluation = self._at(dims, check=True)
        return views.summary(report, evaluation, dims=dict(dims), full=full, asked_of=self)

    def diagram(self, dims: Mapping[str, int] | None = None, group: str | None = "auto",
                depth: int | None = None, train: bool | None = None) -> views.Figure:
        """The fx graph as a ``graphviz.Digraph``, coloured by live bytes, the peak marked.

        Without ``dims`` labels are formulas (bytes) and colours are at ``hints``; with ``dims``
        they are numbers. ``group="module"`` collapses each module (``blocks.3``) into one box;
        the default ``"auto"`` does so for graphs of more than 60 nodes, leaving the peak's module
        open; ``group=None`` draws every node. ``train``: the training step (the default where the
        analysis has one, ``optimizer=``): its phases drawn after the forward and its peak,
        ``train_peak``, marked where it happens (in the backward of a node: on that node's box);
        ``train=False``: the forward and its ``peak``. See :mod:`fxmem.views.diagram`.

        >>> report.diagram().save("gat.svg")                       # doctest: +SKIP
        """
        train = views.figure.training_view(train, self.training, "diagram")
        report, evaluation = self._at(dims or None)
        step = report._plan.step_liveness(
            {report.symbols[k]: v for k, v in evaluation.liveness.dims.items()}) if train else None
        return views.diagram(report, evaluation, concrete=bool(dims), group=group, depth=depth, step=step)

    def timeline(self, dims: Mapping[str, int] | None = None, train: bool | None = None) -> views.Chart:
        """Bytes live over the forward, and one bar per tensor from its allocation to its free, at
        ``dims`` (a matplotlib chart; see :mod:`fxmem.views.timeline`). ``train``: over the whole
        training step, phases marked, its peak ``train_peak`` on the dashed line (the default where
        the analysis has one, ``optimizer=``); ``train=False``: the forward alone.

        >>> report.timeline({"B": 4, "N": 500}).save("gat_timeline.png")   # doctest: +SKIP
        """
        train = views.figure.training_view(train, self.training, "timeline")
        if not dims and self.symbols:
            raise SpecError(f"the timeline draws bytes at concrete sizes: give them, e.g. "
                            f"timeline(dims={{{', '.join(f'{k!r}: ...' for k in sorted(self.symbols))}}})")
        report, evaluation = self._at(dims or None, check=True)
        step = report._plan.step_liveness(
            {report.symbols[k]: v for k, v in evaluation.liveness.dims.items()}) if train else None
        return views.timeline(report, evaluation, step=step)

    def render(self, path: str, what: str = "diagram", dims: Mapping[str, int] | None = None,
               group: str | None = "auto", train: bool | None = None) -> str:
        """Write the diagram (``what="timeline"``: the timeline, which needs ``dims``) to ``path``; SVG,
        PNG or PDF by extension. ``train`` as in :meth:`diagram`: the training step by default where
        the analysis has one.

        >>> report.render("gat.png", dims={"B": 4, "N": 500})        # doctest: +SKIP
        'gat.png'
        """
        if what == "diagram":
            return self.diagram(dims, group=group, train=train).save(path)
        if what == "timeline":
            return self.timeline(dims, train=train).save(path)
        raise SpecError(f"render(what={what!r}): use what='diagram' or what='timeline'")

    def to_dict(self) -> dict:
        """Everything, JSON-serialisable (formulas as strings)."""
        return {
            "model": self.model_name, "mode": self.mode, "capture": self.capture.text, "device": self.device, "grad": self.grad,
            "dtype": str(self.dtype).replace("torch.", ""),
            "inputs": [{"arg": s.arg, "shape": [str(d) for d in s.dims], "dtype": str(s.dtype).replace("torch.", "")}
                       for s in self.specs],
            "dims": sorted(self.symbols), "hints": self.hints, "region": self.region, "exact": self.exact,
            "notes": self.notes,
            "facts": self.facts,
            "formulas": {k: str(v) for k, v in self.formulas().items()},
            "nodes": [n.to_dict() for n in self.nodes],
            "storages": [s.to_dict() for s in self.storages],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        return self.summary() + "\n\n" + self.table()

    def __repr__(self) -> str:
        return f"<fxmem.Report {self.model_name}: peak = {self.peak}>"

    def _repr_latex_(self) -> str:
        """The headline formulas (bytes) as LaTeX, for notebooks and nbconvert."""
        names = {k: k.replace("_", r"\_") for k in self.formulas()}
        rows = [rf"\text{{{names[k]}}} &= {sympy.latex(v)}" for k, v in self.formulas().items()]
        return r"$$\begin{aligned}" + r" \\ ".join(rows) + r"\end{aligned}$$"

    def _repr_html_(self) -> str:
        """The summary and the per-node table as HTML (notebooks show this)."""
        return views.report_html(self, self._at(None)[1])
