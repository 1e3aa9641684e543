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
from .symbolic import Evaluator, Region, add_terms, build_max, evaluate, max_of, terms, to_expr

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
           add: Callable[[Any, Any], Any], neg: Callable[[Any], Any], positive: Callable[[Any], bool],
           events: list | None = None) -> Replay:
    """Walk ``rec.events`` (or a prefix) with any number system (symbolic ``Terms`` or ints).

    Only what the run allocates counts: parameters, buffers, inputs, constants and optimizer
    state are resident throughout.
    """
    activation = [s.alloc_step is not None for s in rec.storages]
    live = zero
    candidates, after_node = [], []
    for kind, i in (rec.events if events is None else events):
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
    """Symbolic memory of one recorded forward (and training step), in the user's dims (bytes)."""

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
        self.forward_events = rec.events[:rec.forward_end] if rec.forward_end >= 0 else rec.events

        at_hint = Evaluator(self.hint_values)
        args = (lambda i: self._terms[i], lambda p: terms(self.to_user(p)), {}, add_terms,
                lambda t: {m: -c for m, c in t.items()}, lambda t: at_hint(t) > 0)
        forward = replay(rec, *args, events=self.forward_events)
        self.replay = replay(rec, *args) if rec.training else forward  # after_node covers every node
        storages = rec.storages
        state = [s for s in storages if s.role == "optimizer_state"]
        self.resident_terms = add_terms(*[self._terms[s.index] for s in storages
                                          if s.alloc_step is None and s.role != "optimizer_state"])
        self.retained_terms = forward.final
        alive = self.alive_after_forward()
        self.saved_terms = add_terms(*[self._terms[i] for i in alive if storages[i].saved_by])
        self.output_terms = add_terms(*[self._terms[i] for i in alive if storages[i].is_output])
        cands = [c for _, c in forward.candidates] or [{}]
        self.peak_kept = max_of(cands, self.region, self.hint_values)
        self.peak_candidates = cands
        if rec.training:
            self.state_terms = add_terms(*[self._terms[s.index] for s in state])
            self.grad_terms = add_terms(*[self._terms[s.index] for s in storages if s.role == "gradient"])
            tcands = [c for _, c in self.replay.candidates] or [{}]
            self.train_kept = max_of(tcands, self.region, self.hint_values)
            self.train_candidates = tcands

    def alive_after_forward(self) -> list[int]:
        """Indices of storages the forward allocated and still holds when it returns."""
        born = [s.index for s in self.rec.storages if s.alloc_step is not None]
        dead = {i for kind, i in self.forward_events if kind == "free"}
        last_step = max((i for kind, i in self.forward_events if kind == "step"), default=-1)
        return [i for i in born if i not in dead and self.rec.storages[i].alloc_step <= last_step]

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
        """``resident``, ``peak``, ``retained``, ``saved``, ``output`` and, for a training step,
        ``train_resident``, ``train_peak``, ``grads``, ``optimizer_state`` (bytes)."""
        resident = to_expr(self.resident_terms)
        out = {
            "resident": resident,
            "peak": resident + self.peak_above_resident,
            "retained": to_expr(self.retained_terms),
            "saved": to_expr(self.saved_terms),
            "output": to_expr(self.output_terms),
        }
        if self.rec.training:
            train_resident = resident + to_expr(self.state_terms)
            out["train_resident"] = train_resident
            out["train_peak"] = train_resident + build_max(to_expr(self.train_candidates[i]) for i in self.train_kept)
            out["grads"] = to_expr(self.grad_terms)
            out["optimizer_state"] = to_expr(self.state_terms)
        return out

    # --- numbers --------------------------------------------------------------------------------
    def evaluate(self, values: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Exact byte counts at ``values`` (which must lie in ``self.region``)."""
        cuda = self.rec.device == "cuda"
        raw = [evaluate(e, values) for e in self.sizes]
        block = [cuda_block_bytes(n) if cuda else n for n in raw]
        args = (lambda i: block[i], lambda p: evaluate(self.to_user(p), values), 0,
                lambda a, b: a + b, lambda a: -a, lambda d: d > 0)
        fwd = replay(self.rec, *args, events=self.forward_events)
        full = replay(self.rec, *args) if self.rec.training else fwd
        peak_step, peak_live = max(fwd.candidates, key=lambda c: c[1], default=(None, 0))
        peak_live = max(peak_live, 0)
        storages = self.rec.storages
        alive = self.alive_after_forward()
        resident = sum(block[s.index] for s in storages if s.alloc_step is None and s.role != "optimizer_state")
        out = {
            "resident": resident,
            "peak": resident + peak_live,
            "peak_above_resident": peak_live,
            "retained": fwd.final,
            "saved": sum(block[i] for i in alive if storages[i].saved_by),
            "output": sum(block[i] for i in alive if storages[i].is_output),
            "_peak_step": peak_step,
            "_after_node": full.after_node,
            "_sizes": block,
        }
        if self.rec.training:
            state = sum(block[s.index] for s in storages if s.role == "optimizer_state")
            train_step, train_live = max(full.candidates, key=lambda c: c[1], default=(None, 0))
            out.update({
                "train_resident": resident + state,
                "train_peak": resident + state + max(train_live, 0),
                "train_peak_above_resident": max(train_live, 0),
                "grads": sum(block[s.index] for s in storages if s.role == "gradient"),
                "optimizer_state": state,
                "train_retained": full.final,
                "_train_peak_step": train_step,
            })
        return out
