"""From a recording to formulas: live bytes at every moment, the peak, what is retained.

The whole plan on one screen: storages have sizes; the recording's events say, in order, which
storage died, which aten op allocated what (with any hidden scratch, see :mod:`fxmem.hidden`), and
where each fx node ended. Replaying the events with symbolic sizes gives each moment's live bytes
as a polynomial; the peak is the ``Max`` of the moments that can be largest for some sizes.
Replaying with integers gives exact numbers, including the CUDA allocator's 512-byte rounding.

>>> plan = MemoryPlan(recording)          # doctest: +SKIP
>>> plan.formulas()["peak"]               # doctest: +SKIP
1024*B*N**2 + ...
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import sympy

from . import _torch_compat as tc
from .hidden import OUT
from .simulate import Recording
from .specs import dim_symbol
from .symbolic import Evaluator, Region, Terms, add_terms, build_max, evaluate, max_of, terms, to_expr

CUDA_BLOCK = 512  # bytes; the caching allocator rounds every block up to a multiple of this


def cuda_block_bytes(n: int) -> int:
    """Bytes the CUDA caching allocator reserves for an ``n``-byte request (0 stays 0)."""
    return 0 if n <= 0 else -(-n // CUDA_BLOCK) * CUDA_BLOCK


@dataclasses.dataclass
class Replay:
    """What a walk over the events produced (symbolic ``Terms`` or ints)."""

    candidates: list  # [(step index, value)] - live bytes at each moment something was allocated
    after_node: list  # live bytes when each fx node ended
    final: Any  # live bytes when the forward returned (= retained)


def replay(rec: Recording, size: Callable[[int], Any], delta: Callable[[Any], Any], zero: Any,
           add: Callable[[Any, Any], Any], neg: Callable[[Any], Any], positive: Callable[[Any], bool]) -> Replay:
    """Walk ``rec.events`` with any number system (symbolic ``Terms`` or plain ints).

    Only activations count: parameters, buffers, inputs and constants are resident throughout.
    """
    activation = [s.alloc_step is not None for s in rec.storages]
    live = zero
    candidates, after_node = [], []
    for kind, i in rec.events:
        if kind == "free":
            if activation[i]:
                live = add(live, neg(size(i)))
        elif kind == "step":
            step = rec.steps[i]
            out = zero
            for s in step.allocs:
                out = add(out, size(s))
            cur = live
            for p in step.program or [OUT]:
                if p is OUT:
                    cur = add(cur, out)
                    candidates.append((i, cur))
                else:
                    d = delta(p)
                    cur = add(cur, d)
                    if positive(d):
                        candidates.append((i, cur))
            live = add(live, out)
        else:
            after_node.append(live)
    return Replay(candidates, after_node, live)


class MemoryPlan:
    """Symbolic memory of one recorded forward, in the user's dims (bytes)."""

    def __init__(self, rec: Recording, hints: Mapping[str, int]):
        self.rec = rec
        self._user_cache: dict = {}
        self.user = rec.user_map()  # env symbol -> user symbol
        self.symbols = {name: dim_symbol(name) for name in rec.env_symbols}
        self.hint_values = {self.symbols[k]: v for k, v in hints.items() if k in self.symbols}
        self.sizes = [self.to_user(s.nbytes) for s in rec.storages]
        self._terms = [terms(e) for e in self.sizes]
        self.region = self._region()
        self.notes = self._notes()

        at_hint = Evaluator(self.hint_values)
        sym = replay(rec, lambda i: self._terms[i], lambda p: terms(self.to_user(p)), {}, add_terms,
                     lambda t: {m: -c for m, c in t.items()}, lambda t: at_hint(t) > 0)
        self.replay = sym
        self.resident_terms = add_terms(*[self._terms[s.index] for s in rec.storages if s.alloc_step is None])
        self.retained_terms = sym.final
        alive = [s for s in rec.storages if s.alloc_step is not None and not s.freed]
        self.saved_terms = add_terms(*[self._terms[s.index] for s in alive if s.saved_by])
        self.output_terms = add_terms(*[self._terms[s.index] for s in alive if s.is_output])
        cands = [c for _, c in sym.candidates] or [{}]
        self.peak_kept = max_of(cands, self.region, self.hint_values)
        self.peak_candidates = cands

    # --- conversions ----------------------------------------------------------------------------
    def to_user(self, expr: sympy.Expr) -> sympy.Expr:
        """An env-space size as a simplified expression in the user's dims."""
        if expr.is_number:
            return expr
        hit = self._user_cache.get(expr)
        if hit is None:
            user = tc.plain_sympy(self.rec.env.simplify(expr).xreplace(self.user))
            hit = self._user_cache[expr] = sympy.expand(user)
        return hit

    def _region(self) -> Region:
        lower = {self.user[s]: tc.symbol_lower_bound(self.rec.env, s) for s in self.user}
        guards = []
        for g in tc.shape_guards(self.rec.env):
            ug = tc.plain_sympy(self.rec.env.simplify(g).xreplace(self.user))
            if ug is sympy.true or ug == sympy.true:
                continue
            if ug is sympy.false:
                continue
            if not ug.free_symbols:
                continue
            if ug not in guards:
                guards.append(ug)
        return Region(lower, guards)

    def _notes(self) -> list[str]:
        notes = list(self.rec.notes)
        replacements = getattr(self.rec.env, "replacements", {})
        for env_sym, user_sym in self.user.items():
            r = replacements.get(env_sym)
            if r is None or r == env_sym:
                continue
            r_user = tc.plain_sympy(r.xreplace(self.user))
            if r_user.is_number:
                notes.append(f"dim {user_sym} was specialised to {r_user}: formulas hold only at {user_sym}={r_user}")
            else:
                notes.append(f"dim {user_sym} was found to equal {r_user}; formulas use {r_user}")
        return notes

    # --- formulas -------------------------------------------------------------------------------
    @property
    def peak_above_resident(self) -> sympy.Expr:
        return build_max(to_expr(self.peak_candidates[i]) for i in self.peak_kept)

    def formulas(self) -> dict[str, sympy.Expr]:
        """``resident``, ``peak``, ``retained``, ``saved``, ``output`` (bytes)."""
        resident = to_expr(self.resident_terms)
        return {
            "resident": resident,
            "peak": resident + self.peak_above_resident,
            "retained": to_expr(self.retained_terms),
            "saved": to_expr(self.saved_terms),
            "output": to_expr(self.output_terms),
        }

    # --- numbers --------------------------------------------------------------------------------
    def evaluate(self, values: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Exact byte counts at ``values`` (which must lie in ``self.region``)."""
        cuda = self.rec.device == "cuda"
        raw = [evaluate(e, values) for e in self.sizes]
        block = [cuda_block_bytes(n) if cuda else n for n in raw]
        num = replay(self.rec, lambda i: block[i], lambda p: evaluate(self.to_user(p), values), 0,
                     lambda a, b: a + b, lambda a: -a, lambda d: d > 0)
        peak_step, peak_live = max(num.candidates, key=lambda c: c[1], default=(None, 0))
        peak_live = max(peak_live, 0)
        alive = [s for s in self.rec.storages if s.alloc_step is not None and not s.freed]
        resident = sum(block[s.index] for s in self.rec.storages if s.alloc_step is None)
        return {
            "resident": resident,
            "peak": resident + peak_live,
            "peak_above_resident": peak_live,
            "retained": num.final,
            "saved": sum(block[s.index] for s in alive if s.saved_by),
            "output": sum(block[s.index] for s in alive if s.is_output),
            "_peak_step": peak_step,
            "_after_node": num.after_node,
            "_sizes": block,
        }
