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
import operator
import re
from collections.abc import Mapping
from typing import Any, Iterator

import sympy

from .. import _torch_compat as tc
from ..records import FREE, INEXACT, NODE, STEP, Recording, Role
from ..specs import dim_symbol
from . import cuda_blocks
from .cuda_blocks import AllocatorConfig, block_slack
from .replay import Liveness, liveness, walk
from .symbolic import Evaluator, Region, add_terms, build_max, evaluate, max_of, terms, to_expr

CUDA_BLOCK = 512  # bytes; the caching allocator rounds every block up to a multiple of this
FORMULA_KEYS = ("resident", "peak", "retained", "saved", "output")
TRAIN_KEYS = ("train_resident", "train_peak", "grads", "optimizer_state")


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
    unsplit blocks can add to ``peak`` and ``train_peak`` (:mod:`~fxmem.accounting.cuda_blocks`).
    """

    resident: int
    peak: int
    peak_above_resident: int
    retained: int
    saved: int
    output: int
    liveness: Liveness
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

    def _keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if f.name != "liveness" and getattr(self, f.name) is not None]

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
        self.sizes = [self.to_user(s.bytes) for s in rec.storages]
        self._terms = [terms(e) for e in self.sizes]
        self.region = self._region()
        self.notes = self._notes()
        self.alive = self._alive_after_forward()

        at_hint = Evaluator(self.hint_values)
        w = walk(rec, lambda i: self._terms[i], lambda p: terms(self.to_user(p)), {}, add_terms,
                 lambda t: {m: -c for m, c in t.items()}, lambda t: at_hint(t) > 0, mark=rec.forward_end)
        storages = rec.storages
        self.resident_terms = add_terms(*[self._terms[s.index] for s in storages if s.step is None
                                          and s.role != Role.OPTIMIZER_STATE])
        self.retained_terms = w.at_mark
        self.saved_terms = add_terms(*[self._terms[i] for i in self.alive if storages[i].saved_by])
        self.output_terms = add_terms(*[self._terms[i] for i in self.alive if storages[i].is_output])
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
            hit = self._user_cache[expr] = sympy.expand(user)
        return hit

    def _pins(self) -> dict[sympy.Symbol, sympy.Expr]:
        """User dims the analysis no longer treats as free: ``{dim: value or expression}``."""
        return {self.symbols[name]: self.to_user(v) if not v.is_number else v
                for name, v in tc.pinned_dims(self.rec.env, self.rec.env_symbols).items()}

    def _region(self) -> Region:
        env = self.rec.env
        lower = {self.user[s]: tc.symbol_lower_bound(env, s) for s in self.user}
        upper = {self.user[s]: hi for s in self.user if (hi := tc.symbol_upper_bound(env, s)) is not None}
        guards = []
        for g in tc.shape_guards(self.rec.env):
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
            if config.power2_rounding:
                notes.append(f"PYTORCH_CUDA_ALLOC_CONF sets roundup_power2_divisions: the allocator rounds requests to "
                             f"power-of-two divisions, not to 512 bytes as fxmem counts; {INEXACT}")
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
    def trace(self, values: Mapping[sympy.Symbol, int]) -> tuple[list, int]:
        """Every allocation and free of the run at ``values``, in order, as ``(action, what, bytes,
        step)`` (see :func:`~fxmem.accounting.replay.walk`; on CUDA storages in 512-byte blocks),
        and how many of them the forward made (the rest are the training step's). The same walk as
        :meth:`evaluate`, so its running sum reaches exactly the peaks ``evaluate`` gives."""
        block = self.bytes_at(values)
        events: list = []

        def hear(action: str, what: Any, nbytes: int, step: int | None) -> None:
            events.append((action, what, int(nbytes), step))  # hidden scratch as evaluate() counts it

        walk(self.rec, lambda i: block[i], self._delta(values), 0, operator.add,
             operator.neg, lambda d: d > 0, mark=self.rec.forward_end, trace=hear)
        marks = [k for k, e in enumerate(events) if e[0] == "mark"]
        forward = marks[0] if marks else len(events)
        return [e for e in events if e[0] != "mark"], forward

    def bytes_at(self, values: Mapping[sympy.Symbol, int]) -> list[int]:
        """Each storage's bytes at ``values``, as the walks count them (on CUDA, 512-byte blocks)."""
        raw = [evaluate(e, values) for e in self.sizes]
        return [cuda_block_bytes(n) for n in raw] if self.device == "cuda" else raw

    def _delta(self, values: Mapping[sympy.Symbol, int]) -> Any:
        """A kernel's hidden allocation or free in bytes at ``values``; on CUDA each is its own
        caching-allocator block, rounded up to 512 bytes like a tensor's storage."""
        if self.device != "cuda":
            return lambda p: evaluate(self.to_user(p), values)

        def rounded(p: Any) -> int:
            n = evaluate(self.to_user(p), values)
            return cuda_block_bytes(n) if n >= 0 else -cuda_block_bytes(-n)

        return rounded

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

    def evaluate(self, values: Mapping[sympy.Symbol, int]) -> Evaluation:
        """Exact bytes at ``values`` (which must lie in ``self.region``): one numeric walk."""
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
        return Evaluation(resident=resident, peak=live.peak, peak_above_resident=live.peak_above_resident,
                          retained=w.at_mark, saved=sum(block[i] for i in self.alive if storages[i].saved_by),
                          output=sum(block[i] for i in self.alive if storages[i].is_output), liveness=live, **train)
