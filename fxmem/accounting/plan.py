"""From a recording to formulas and numbers: the whole memory plan on one screen.

Storages have sizes; the recording's events say, in order, which storage died, which aten call
allocated what and where each node ended. One symbolic walk (:mod:`.replay`) gives each moment's
live bytes as a polynomial in the user's dims; the peak is the ``Max`` of the moments that can be
largest for some sizes (:mod:`.symbolic` prunes the rest). One numeric walk per set of dims gives
an :class:`Evaluation`: the headline numbers and, node by node, the live bytes the views draw.

>>> plan = MemoryPlan(recording, hints)         # doctest: +SKIP
>>> plan.formulas()["peak"]                      # doctest: +SKIP
1024*B*N**2 + ...
>>> plan.evaluate({B: 4, N: 500})["peak"]        # doctest: +SKIP
2053076096
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import re
import warnings
from collections.abc import Mapping
from typing import Any, Iterator

import sympy

from .. import _torch_compat as tc
from ..records import FREE, INEXACT, NODE, STEP, Recording, Role
from ..kernels.calibrate import VERIFY_ELEMENTS
from ..kernels.measured import MeasuredBytes
from ..specs import dim_symbol
from . import caching_allocator, cuda_blocks
from .cuda_blocks import AllocatorConfig, block_slack
from .compiled import compile_conditions, compile_terms
from .replay import Liveness, StepLiveness, liveness, step_liveness, walk
from .symbolic import Evaluator, Region, add_terms, build_max, evaluate, max_of, terms, to_expr

CUDA_BLOCK = 512  # bytes; the caching allocator rounds every block up to a multiple of this
FORMULA_KEYS = ("resident", "peak", "retained", "saved", "output")
TRAIN_KEYS = ("train_resident", "train_peak", "grads", "optimizer_state")


def _grows(t: dict) -> bool:
    """Whether a hidden delta adds a measured kernel's bytes (:mod:`fxmem.kernels.measured`): an
    allocation wherever that is more than 0, so a moment the peak may be at, whatever it is at the hints."""
    return any(c > 0 and sympy.sympify(m).has(MeasuredBytes) for m, c in t.items())


def cuda_block_bytes(n: int) -> int:
    """Bytes the CUDA caching allocator reserves for an ``n``-byte request (0 stays 0)."""
    return 0 if n <= 0 else -(-n // CUDA_BLOCK) * CUDA_BLOCK


@dataclasses.dataclass(frozen=True, eq=False)  # compares as the mapping of its numbers
class Evaluation(Mapping):
    """Exact bytes at concrete dims. Reads like a dict of its public numbers (``ev["peak"]``);
    ``liveness`` holds the node-by-node numbers the tables and pictures use.

    Forward: ``resident``, ``peak``, ``peak_above_resident``, ``retained``, ``saved``, ``output``.
    Training step (None without one): ``train_resident``, ``train_peak``,
    ``train_peak_above_resident``, ``grads``, ``optimizer_state``, ``train_retained``.
    CUDA only: ``allocator_slack`` and ``train_allocator_slack``, the most the caching allocator's
    unsplit blocks can add to ``peak`` and ``train_peak`` (:mod:`~fxmem.accounting.cuda_blocks`);
    ``reserved`` and ``train_reserved``, the memory the caching allocator reserves (its segments:
    what an out-of-memory error is about), replayed in a fresh process
    (:mod:`~fxmem.accounting.caching_allocator`).
    """

    resident: int
    peak: int
    peak_above_resident: int
    retained: int
    saved: int
    output: int
    # the node-by-node numbers (a Liveness), or a function that computes them on first use: the
    # headline numbers come from compiled formulas, the walk behind ``liveness`` only when read
    _live: Any
    train_resident: int | None = None
    train_peak: int | None = None
    train_peak_above_resident: int | None = None
    grads: int | None = None
    optimizer_state: int | None = None
    train_retained: int | None = None
    # CUDA only: the most the caching allocator's unsplit blocks can add to ``peak`` and
    # ``train_peak`` in max_memory_allocated (see fxmem.accounting.cuda_blocks)
    allocator_slack: int | None = None
    train_allocator_slack: int | None = None
    # CUDA only: the caching allocator's segments at their most (fxmem.accounting.caching_allocator)
    reserved: int | None = None
    train_reserved: int | None = None

    @property
    def liveness(self) -> Liveness:
        if callable(self._live):
            object.__setattr__(self, "_live", self._live())
        return self._live

    def _keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if f.name != "_live" and getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> int:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __repr__(self) -> str:
        return repr(dict(self))


def branch_index(pairs: Any, values: Mapping[sympy.Symbol, int]) -> int:
    """The index of the first ``(expr, condition)`` of a Piecewise whose condition holds at ``values``."""
    for k, (_, cond) in enumerate(pairs):
        if cond is sympy.true or bool(cond.xreplace({s: sympy.Integer(v) for s, v in values.items()})):
            return k
    raise ValueError(f"no branch of {sympy.Piecewise(*pairs)} holds at {dict(values)}")


def _threshold_sides(c: Any, s: sympy.Symbol, fixed: Mapping[sympy.Symbol, int]) -> set[int]:
    """The whole sizes of ``s`` on both sides of where ``c`` flips (other dims at ``fixed``)."""
    try:
        roots = sympy.solve(sympy.Eq(c.lhs, c.rhs).xreplace(fixed), s)
    except (NotImplementedError, TypeError, ValueError):
        return set()
    out = set()
    for r in roots:
        if r.is_real and r.is_number:
            k = int(sympy.floor(r))
            out |= {k - 1, k, k + 1, k + 2}
    return {v for v in out if v >= 1}


def _whole(c: Any) -> Any:
    """``B*L >= 16384/25`` as ``B*L >= 656``: a relation of a whole-number side to a fraction; a
    negated ``And`` as the ``Or`` of the negations."""
    if isinstance(c, sympy.Not):
        c = sympy.to_nnf(c)
    if not isinstance(c, sympy.core.relational.Relational) or c.rel_op not in (">=", ">", "<=", "<"):
        return c
    k = c.rhs
    if not (k.is_Rational and not k.is_Integer and c.lhs.is_integer):
        return c
    if c.rel_op in (">=", ">"):
        return sympy.Ge(c.lhs, sympy.ceiling(k))
    return sympy.Le(c.lhs, sympy.floor(k))


def piece_region(region: Region, conditions: list) -> Region:
    """``region`` narrowed by a piece's ``conditions``: a bound on one dim (``L >= 192``, ``L < 768``)
    tightens its lower or upper bound, as the ShapeEnv does with a guard (the Max pruning proves
    over the bounds); any other condition is a guard."""
    lower, upper, guards = dict(region.lower), dict(region.upper), list(region.guards)
    for c in conditions:
        bound = _one_dim_bound(c)
        if bound is None or bound[0] in region.pinned:
            if c not in guards:
                guards.append(c)
            continue
        sym, low, high = bound
        if low is not None:
            lower[sym] = max(lower.get(sym, low), low)
        if high is not None:
            upper[sym] = min(upper.get(sym, high), high)
    if not conditions:
        return region
    return Region(lower, guards, region.pinned, upper)


def _one_dim_bound(c: Any) -> tuple | None:
    """``(dim, lowest, highest)`` (either None) where ``c`` is ``dim >= k``-like, else None."""
    if not isinstance(c, sympy.core.relational.Relational) or c.rel_op not in (">=", ">", "<=", "<"):
        return None
    diff = sympy.expand(c.lhs - c.rhs)  # c: diff (op) 0
    syms = diff.free_symbols
    if len(syms) != 1:
        return None
    sym = next(iter(syms))
    poly = sympy.Poly(diff, sym) if diff.is_polynomial(sym) else None
    if poly is None or poly.degree() != 1:
        return None
    a, b = poly.all_coeffs()  # a*sym + b (op) 0
    k = -b / a
    op = c.rel_op if a > 0 else {">=": "<=", ">": "<", "<=": ">=", "<": ">"}[c.rel_op]
    if op == ">=":
        return sym, int(sympy.ceiling(k)), None
    if op == ">":
        return sym, int(sympy.floor(k)) + 1, None
    if op == "<=":
        return sym, None, int(sympy.floor(k))
    return sym, None, int(sympy.ceiling(k)) - 1


class MemoryPlan:
    """Symbolic memory of one recorded forward (and training step), in the user's dims (bytes).

    ``storages`` and ``nodes`` are the recording's records in the user's dims, with the columns
    the report shows (``freed_at``, ``module``; ``allocated``, ``saved``, ``live_after``).
    """

    def __init__(self, rec: Recording, hints: Mapping[str, int]):
        self.rec = rec
        self.training = rec.training
        self.device = rec.device
        self._user_cache: dict = {}
        self.user = rec.user_map()  # env symbol -> user symbol
        self.symbols = {name: dim_symbol(name) for name in rec.env_symbols}
        self.hint_values = {self.symbols[k]: v for k, v in hints.items() if k in self.symbols}
        # a kernel's size regimes (fxmem.kernels.regimes): each Piecewise met, in the user's dims; this
        # plan takes the branch that holds at ``hints``, and its region says so (``piece``)
        self.piecewise: list[sympy.Piecewise] = []
        self.piece: list[sympy.Basic] = []
        self.sizes = [self.to_user(s.bytes) for s in rec.storages]
        self._terms = [terms(e) for e in self.sizes]
        self.region = self._region()
        self.notes = self._notes()
        self.alive = self._alive_after_forward()

        at_hint = Evaluator(self.hint_values)
        w = walk(rec, lambda i: self._terms[i], lambda p: terms(self.to_user(p)), {}, add_terms,
                 lambda t: {m: -c for m, c in t.items()}, lambda t: at_hint(t) > 0 or _grows(t), mark=rec.forward_end)
        storages = rec.storages
        self.resident_terms = add_terms(*[self._terms[s.index] for s in storages if s.step is None
                                          and s.role != Role.OPTIMIZER_STATE])
        self.retained_terms = w.at_mark
        self.saved_terms = add_terms(*[self._terms[i] for i in self.alive if storages[i].saved_by])
        self.output_terms = add_terms(*[self._terms[i] for i in self.alive if storages[i].is_output])
        # where this piece holds: the analysis' region and the branches taken (every Piecewise was met
        # by now: the storages' sizes and every hidden program were walked), before any Max is pruned
        self.base_region = self.region
        self.region = piece_region(self.region, self.piece)
        self.final_terms = w.final
        self._fast: Any = None  # the headline formulas, compiled on first evaluate (see _numbers)
        self.peak_candidates = [c for _, c in w.candidates[:w.forward_candidates]] or [{}]
        self.peak_kept = max_of(self.peak_candidates, self.region, self.hint_values)
        if self.training:
            self.state_terms = add_terms(*[self._terms[s.index] for s in storages if s.role == Role.OPTIMIZER_STATE])
            self.grad_terms = add_terms(*[self._terms[s.index] for s in storages if s.role == Role.GRADIENT])
            self.train_candidates = [c for _, c in w.candidates] or [{}]
            self.train_kept = max_of(self.train_candidates, self.region, self.hint_values)
        self.storages, self.nodes = self._user_records(w.after_node)

    # --- once per recording ---------------------------------------------------------------------
    def _alive_after_forward(self) -> list[int]:
        """Indices of storages the forward allocated and still holds when it returns."""
        events = self.rec.forward_events
        born = [s.index for s in self.rec.storages if s.step is not None]
        dead = {i for kind, i in events if kind == FREE}
        last_step = max((i for kind, i in events if kind == STEP), default=-1)
        return [i for i in born if i not in dead and self.rec.storages[i].step <= last_step]

    def _freed_at(self) -> dict[int, str]:
        """Storage index -> the node by whose end it had been freed (``"<return>"``: after the last)."""
        rec, freed_at, pending = self.rec, {}, []
        for kind, i in rec.events:
            if kind == FREE:
                pending.append(i)
            elif kind == NODE:
                for s in pending:
                    freed_at[s] = rec.nodes[i].name
                pending.clear()
        for s in pending:
            freed_at[s] = "<return>"
        return freed_at

    def _user_records(self, after_node: list) -> tuple[list, list]:
        rec = self.rec
        freed_at = self._freed_at()
        alive = set(self.alive)
        module_of = {n.name: n.module for n in rec.nodes}
        storages = [dataclasses.replace(
            s, bytes=self.sizes[s.index], shape=tuple(self.to_user(d) for d in s.shape), saved_by=list(s.saved_by),
            freed_at=freed_at.get(s.index),
            module=s.module or (module_of.get(s.node, "") if s.node and rec.module_calls is None else ""),
            kept_after_forward=s.index in alive) for s in rec.storages]
        by_node: dict[str, list] = {}
        for s in storages:
            if s.node is not None:
                by_node.setdefault(s.node, []).append(s)
        nodes = []
        for k, n in enumerate(rec.nodes):
            allocs = by_node.get(n.name, [])
            live = after_node[k] if k < len(after_node) else {}
            nodes.append(dataclasses.replace(
                n, shapes=[tuple(self.to_user(d) for d in shape) for shape in n.shapes],
                value=self.to_user(n.value) if n.value is not None else None, allocations=allocs,
                allocated=sympy.Add(*[a.bytes for a in allocs]) if allocs else sympy.Integer(0),
                saved=(sympy.Add(*[a.bytes for a in allocs if a.saved_by and a.kept_after_forward])
                       if allocs else sympy.Integer(0)),
                live_after=to_expr(live)))
        return storages, nodes

    # --- conversions ----------------------------------------------------------------------------
    def to_user(self, expr: sympy.Expr) -> sympy.Expr:
        """An env-space size as a simplified expression in the user's dims."""
        if expr.is_number:
            return expr
        hit = self._user_cache.get(expr)
        if hit is None:
            user = tc.plain_sympy(tc.simplify(self.rec.env, expr).xreplace(self.user))
            if user.has(sympy.Piecewise):
                user = user.replace(sympy.Piecewise, self._branch)
            hit = self._user_cache[expr] = sympy.expand(user)
        return hit

    def _branch(self, *pairs: Any) -> sympy.Expr:
        """The branch of a kernel's regime (a Piecewise, innermost first) that holds at this plan's
        hints; its conditions join the piece (``self.piece``)."""
        whole = sympy.Piecewise(*pairs)
        if whole not in self.piecewise:
            self.piecewise.append(whole)
        k = branch_index(pairs, self.hint_values)
        for j, (_, cond) in enumerate(pairs[:k + 1]):
            c = _whole(cond if j == k else sympy.Not(cond))
            if c is not sympy.true and c != sympy.true and c not in self.piece:
                self.piece.append(c)
        return pairs[k][0]

    def piece_points(self, limit: int = 4096) -> list[dict[sympy.Symbol, int]]:
        """One point in each piece of this recording that sizes near the regimes' thresholds reach
        (the smallest such point of each piece): per dim its lower bound, the hint, and both sides
        of every threshold of every regime solved for it (the other dims at their lower bound or
        hint), tried in every combination (at most ``limit``)."""
        base = self.base_region
        dims = sorted({s for p in self.piecewise for _, c in p.args for s in c.free_symbols}, key=str)
        if not dims:
            return [dict(self.hint_values)]
        anchors = {s: {base.lower.get(s, 1), self.hint_values.get(s, base.lower.get(s, 1))} for s in dims}
        values = {s: set(v) for s, v in anchors.items()}
        for p in self.piecewise:
            for _, c in p.args:
                if not isinstance(c, sympy.core.relational.Relational):
                    continue
                for s in c.free_symbols & set(dims):
                    for others in itertools.product(*[sorted(anchors[o]) for o in sorted(c.free_symbols - {s}, key=str)]):
                        fixed = dict(zip(sorted(c.free_symbols - {s}, key=str), others))
                        values[s] |= _threshold_sides(c, s, fixed)
        for s in dims:
            low, high = base.lower.get(s, 1), base.upper.get(s)
            values[s] = {v for v in values[s] if v >= low and (high is None or v <= high)}
        grid = [sorted(values[s]) for s in dims]
        total = 1
        for g in grid:
            total *= len(g)
        if total > limit:  # too many combinations: the thresholds of each dim, others at their hints
            points = [{**self.hint_values, s: v} for s, g in zip(dims, grid) for v in g]
        else:
            points = [{**self.hint_values, **dict(zip(dims, combo))} for combo in itertools.product(*grid)]
        found: dict[tuple, dict] = {}
        for point in sorted(points, key=lambda q: sum(q[s] for s in dims)):
            if base.holds(point):
                found.setdefault(self.piece_of(point), point)
        return list(found.values())

    def piece_conditions(self, point: Mapping[sympy.Symbol, int]) -> list[str]:
        """The conditions, as text, that set the piece holding at ``point`` apart from the others
        (the analysis' own region left out)."""
        conds = []
        for p in self.piecewise:
            k = branch_index(p.args, point)
            for j, (_, cond) in enumerate(p.args[:k + 1]):
                c = _whole(cond if j == k else sympy.Not(cond))
                if c is not sympy.true and c != sympy.true and c not in conds:
                    conds.append(c)
        common = set(self.base_region.conditions())
        return [c for c in piece_region(self.base_region, conds).conditions() if c not in common]

    def piece_of(self, values: Mapping[sympy.Symbol, int]) -> tuple[int, ...]:
        """Which branch of each of the plan's regimes holds at ``values``: equal tuples, one piece."""
        if getattr(self, "_piece_fast", None) is None:
            conds = [c for p in self.piecewise for _, c in p.args]
            symbols = sorted({s for c in conds for s in c.free_symbols}, key=str)
            try:
                self._piece_fast = (compile_conditions(conds, symbols), symbols)
            except (NotImplementedError, TypeError, ValueError, AttributeError):
                self._piece_fast = False
        fast = self._piece_fast
        if not fast or any(s not in values for s in fast[1]):
            return tuple(branch_index(p.args, values) for p in self.piecewise)
        held, out, k = fast[0](values), [], 0
        for p in self.piecewise:
            n = len(p.args)
            out.append(held[k:k + n].index(True))
            k += n
        return tuple(out)

    def _pins(self) -> dict[sympy.Symbol, sympy.Expr]:
        """User dims the analysis no longer treats as free: ``{dim: value or expression}``."""
        return {self.symbols[name]: self.to_user(v) if not v.is_number else v
                for name, v in tc.pinned_dims(self.rec.env, self.rec.env_symbols).items()}

    def _region(self) -> Region:
        env = self.rec.env
        outer = {self.symbols[name]: low for name, low in self.rec.outer_dims.items()}
        lower = {self.user[s]: outer.get(self.user[s]) or tc.symbol_lower_bound(env, s) for s in self.user}
        upper = {self.user[s]: hi for s in self.user
                 if self.user[s] not in outer and (hi := tc.symbol_upper_bound(env, s)) is not None}
        guards = []
        for g in [*tc.shape_guards(self.rec.env), *self.rec.outer_guards]:
            ug = tc.plain_sympy(tc.simplify(self.rec.env, g).xreplace(self.user))
            if ug is sympy.true or ug == sympy.true or ug is sympy.false or not ug.free_symbols:
                continue
            if ug not in guards:
                guards.append(ug)
        return Region(lower, guards, self._pins(), upper)

    def _notes(self) -> list[str]:
        names = {str(env): str(user) for env, user in self.user.items()}
        notes = [re.sub(r"\bs\d+\b", lambda m: names.get(m.group(), m.group()), n) for n in self.rec.notes]
        if self.device == "cuda":
            config = AllocatorConfig.from_environment()
            notes.append(cuda_blocks.note(config))
            if config.unreplayable:
                notes.append(f"CUDA: no reserved memory: PYTORCH_CUDA_ALLOC_CONF sets {config.unreplayable}, which "
                             f"fxmem's replay of the caching allocator does not model")
            if config.power2_rounding:
                notes.append(f"PYTORCH_CUDA_ALLOC_CONF sets roundup_power2_divisions: the allocator rounds requests to "
                             f"power-of-two divisions, not to 512 bytes as fxmem counts; {INEXACT}")
        fitted = sorted({getattr(f.op, "__name__", str(f.op)) for f in self.rec.fits if f.fitted is not None})
        if fitted:  # fxmem.kernels.calibrate: only where a kernel cannot be measured at the example sizes
            notes.append(f"{', '.join(fitted)}: hidden buffers fitted from small samples (the kernel's input at the "
                         f"example sizes is too large to measure, even along the batch); each size asked is checked "
                         f"by a real run of that kernel up to {VERIFY_ELEMENTS:,}-element inputs and analysed again "
                         f"where the fit is off, but above that the fit is not checked; {INEXACT}")
        for dim, value in self.region.pinned.items():
            if value.is_number:
                notes.append(f"PyTorch fixed dim {dim} at {value} while analysing: these formulas hold only at "
                             f"{dim} == {value}; evaluate() at other sizes re-analyses there (exact, slower)")
            else:
                notes.append(f"dim {dim} was found to equal {value}: these formulas hold only where {dim} == {value}; "
                             f"evaluate() elsewhere re-analyses")
        return notes

    # --- formulas -------------------------------------------------------------------------------
    def formulas(self) -> dict[str, sympy.Expr]:
        """``resident``, ``peak``, ``retained``, ``saved``, ``output`` and, for a training step,
        ``train_resident``, ``train_peak``, ``grads``, ``optimizer_state`` (bytes)."""
        resident = to_expr(self.resident_terms)
        out = {
            "resident": resident,
            "peak": resident + build_max(to_expr(self.peak_candidates[i]) for i in self.peak_kept),
            "retained": to_expr(self.retained_terms),
            "saved": to_expr(self.saved_terms),
            "output": to_expr(self.output_terms),
        }
        if self.training:
            train_resident = resident + to_expr(self.state_terms)
            out["train_resident"] = train_resident
            out["train_peak"] = train_resident + build_max(to_expr(self.train_candidates[i]) for i in self.train_kept)
            out["grads"] = to_expr(self.grad_terms)
            out["optimizer_state"] = to_expr(self.state_terms)
        return out

    # --- numbers --------------------------------------------------------------------------------
    def trace(self, values: Mapping[sympy.Symbol, int], raw: bool = False) -> tuple[list, int]:
        """Every allocation and free of the run at ``values``, in order, as ``(action, what, bytes,
        step)`` (see :func:`~fxmem.accounting.replay.walk`; on CUDA storages in 512-byte blocks
        unless ``raw``: the bytes requested, as the caching allocator is asked for them),
        and how many of them the forward made (the rest are the training step's). The same walk as
        :meth:`evaluate`, so its running sum reaches exactly the peaks ``evaluate`` gives."""
        block = self.bytes_at(values, raw)
        events: list = []

        def hear(action: str, what: Any, nbytes: int, step: int | None) -> None:
            events.append((action, what, int(nbytes), step))  # hidden scratch as evaluate() counts it

        walk(self.rec, lambda i: block[i], self._delta(values, raw), 0, operator.add,
             operator.neg, lambda d: d > 0, mark=self.rec.forward_end, trace=hear)
        marks = [k for k, e in enumerate(events) if e[0] == "mark"]
        forward = marks[0] if marks else len(events)
        return [e for e in events if e[0] != "mark"], forward

    def step_liveness(self, values: Mapping[sympy.Symbol, int]) -> StepLiveness:
        """The training step's live bytes at ``values``, stretch by stretch (forward nodes, each
        node's backward, the optimizer step ...): from :meth:`trace`, so its peak is ``train_peak``.
        ``resident`` is ``train_resident`` (optimizer state included). Bytes throughout.

        >>> plan.step_liveness({B: 4}).peak == plan.evaluate({B: 4})["train_peak"]   # doctest: +SKIP
        True
        """
        if not self.training:
            raise ValueError("step_liveness() needs a recording of a training step (optimizer=)")
        events, _ = self.trace(values)
        block = self.bytes_at(values)
        resident = sum(block[s.index] for s in self.rec.storages if s.step is None)  # optimizer state too
        dims = {str(k): int(v) for k, v in values.items()}
        return step_liveness(events, self.rec.steps, dims, resident, block)

    def bytes_at(self, values: Mapping[sympy.Symbol, int], raw: bool = False) -> list[int]:
        """Each storage's bytes at ``values``, as the walks count them (on CUDA, 512-byte blocks,
        unless ``raw``)."""
        sizes = [evaluate(e, values) for e in self.sizes]
        return [cuda_block_bytes(n) for n in sizes] if self.device == "cuda" and not raw else sizes

    def _delta(self, values: Mapping[sympy.Symbol, int], raw: bool = False) -> Any:
        """A kernel's hidden allocation or free in bytes at ``values``; on CUDA each is its own
        caching-allocator block, rounded up to 512 bytes like a tensor's storage (unless ``raw``)."""
        if self.device != "cuda" or raw:
            return lambda p: evaluate(self.to_user(p), values)

        def rounded(p: Any) -> int:
            n = evaluate(self.to_user(p), values)
            return cuda_block_bytes(n) if n >= 0 else -cuda_block_bytes(-n)

        return rounded

    def reserved_at(self, values: Mapping[sympy.Symbol, int]) -> dict:
        """CUDA: what the caching allocator reserves at ``values`` (bytes), by replaying its algorithm
        on this run (:mod:`~fxmem.accounting.caching_allocator`): ``reserved`` for forwards from a
        fresh process, ``train_reserved`` for training steps; ``{}`` where PYTORCH_CUDA_ALLOC_CONF
        sets what the replay does not model (the report's notes say which)."""
        config = AllocatorConfig.from_environment()
        if config.unreplayable:
            return {}
        events, forward = self.trace(values, raw=True)
        try:
            return caching_allocator.predicted_reserved(self.rec, events, forward, self.bytes_at(values, raw=True),
                                                        self.training, config)
        except (KeyError, ValueError) as exc:  # an event log the replay cannot follow: no number rather than a crash
            warnings.warn(f"fxmem could not replay the caching allocator on this run ({exc!r}; an fxmem bug, "
                          f"please report it): evaluate() gives no reserved memory here", stacklevel=3)
            return {}

    def _allocator_slack(self, values: Mapping[sympy.Symbol, int], block: list, peak: int,
                         train_peak: int | None) -> dict:
        """The same walk with every block widened by the most the caching allocator can count
        beyond it: how far above ``peak`` (and ``train_peak``) max_memory_allocated can be."""
        config = AllocatorConfig.from_environment()
        wide = [b + block_slack(b, config) for b in block]
        rounded = self._delta(values)

        def widened(p: Any) -> int:
            n = rounded(p)
            return n + block_slack(n, config) if n >= 0 else n - block_slack(-n, config)

        w = walk(self.rec, lambda i: wide[i], widened, 0, operator.add, operator.neg, lambda d: d > 0,
                 mark=self.rec.forward_end)
        storages = self.rec.storages
        resident = sum(wide[s.index] for s in storages if s.step is None and s.role != Role.OPTIMIZER_STATE)
        forward = max([c for _, c in w.candidates[:w.forward_candidates]] + [0])
        out = {"allocator_slack": resident + forward - peak}
        if train_peak is not None:
            state = sum(wide[s.index] for s in storages if s.role == Role.OPTIMIZER_STATE)
            out["train_allocator_slack"] = resident + state + max([c for _, c in w.candidates] + [0]) - train_peak
        return out

    def _numbers(self, values: Mapping[sympy.Symbol, int]) -> dict | None:
        """The headline numbers at ``values`` from the compiled formulas (microseconds), or None
        where they cannot be compiled (then the walk gives them). Exact: within the region the
        kept candidates of each Max decide it (the dropped ones are dominated everywhere there)."""
        if self._fast is None:
            forms = [self.resident_terms, self.retained_terms, self.saved_terms, self.output_terms]
            forms += [self.peak_candidates[i] for i in self.peak_kept]
            if self.training:
                forms += [self.state_terms, self.grad_terms, self.final_terms]
                forms += [self.train_candidates[i] for i in self.train_kept]
            symbols = sorted({s for t in forms for m in t for s in sympy.sympify(m).free_symbols}, key=str)
            try:
                self._fast = (compile_terms(forms, symbols), symbols)
            except (NotImplementedError, TypeError, ValueError):
                self._fast = False
        if not self._fast:
            return None
        fn, symbols = self._fast
        if any(s not in values for s in symbols):
            return None
        v = fn(values)
        resident, retained, saved, output = v[:4]
        k = len(self.peak_kept)
        live = max(max(v[4:4 + k]), 0)
        out = dict(resident=resident, peak=resident + live, peak_above_resident=live, retained=retained,
                   saved=saved, output=output)
        if self.training:
            state, grads, final = v[4 + k:7 + k]
            train_live = max(max(v[7 + k:]), 0)
            out.update(train_resident=resident + state, train_peak=resident + state + train_live,
                       train_peak_above_resident=train_live, grads=grads, optimizer_state=state,
                       train_retained=final)
        return out

    def evaluate(self, values: Mapping[sympy.Symbol, int]) -> Evaluation:
        """Exact bytes at ``values`` (which must lie in ``self.region``): the compiled formulas for
        the headline numbers, one numeric walk (when ``liveness`` is read) for the node-by-node ones."""
        cuda = self.device == "cuda"
        numbers = None if cuda else self._numbers(values)
        if numbers is not None:
            return Evaluation(**numbers, _live=lambda: self._walk_at(values).liveness)
        return self._walk_at(values)

    def _walk_at(self, values: Mapping[sympy.Symbol, int]) -> Evaluation:
        """The numeric walk at ``values``: every number, node by node."""
        cuda = self.device == "cuda"
        block = self.bytes_at(values)
        w = walk(self.rec, lambda i: block[i], self._delta(values), 0,
                 operator.add, operator.neg, lambda d: d > 0, mark=self.rec.forward_end)
        storages = self.rec.storages
        resident = sum(block[s.index] for s in storages if s.step is None and s.role != Role.OPTIMIZER_STATE)
        dims = {str(k): int(v) for k, v in values.items()}
        live = liveness(self.nodes, self.rec.steps, w, dims, resident, block)
        train: dict[str, int] = {}
        if self.training:
            state = sum(block[s.index] for s in storages if s.role == Role.OPTIMIZER_STATE)
            train_live = max((c for _, c in w.candidates), default=0)
            train_live = max(train_live, 0)
            train = dict(train_resident=resident + state, train_peak=resident + state + train_live,
                         train_peak_above_resident=train_live,
                         grads=sum(block[s.index] for s in storages if s.role == Role.GRADIENT),
                         optimizer_state=state, train_retained=w.final)
        if cuda:
            train.update(self._allocator_slack(values, block, live.peak, train.get("train_peak")))
            train.update(self.reserved_at(values))
        return Evaluation(resident=resident, peak=live.peak, peak_above_resident=live.peak_above_resident,
                          retained=w.at_mark, saved=sum(block[i] for i in self.alive if storages[i].saved_by),
                          output=sum(block[i] for i in self.alive if storages[i].is_output), _live=live, **train)
