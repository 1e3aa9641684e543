"""A world size (or one dim of the mesh) as a symbol: one rank's formulas in ``W`` as well as the dims.

Where every size the ranks shard divides evenly by the world size, each storage of a rank is
``a + b/W`` bytes: a parameter's shard is its size over ``W``, an all-gather's output the whole
tensor, an activation of data parallelism the same at every ``W``. So fxmem analyses the rank at
three world sizes that divide evenly, solves ``a`` and ``b`` of every storage, shape and hidden
buffer from two of them and checks them at the third, and requires the three runs to be the same
run but for those sizes (the same storages, aten steps and events, in the same order). The
formulas then hold at every ``W`` that divides the sharded sizes - the region says so
(``4096 divisible by W``). Any other ``W`` (uneven shards, which FSDP2 pads and DTensor splits
unequally) is outside that region: ``evaluate(W=...)`` analyses it when asked, exact, and keeps
it as a piece of its own (:meth:`fxmem.Report.regions`).

>>> report = fxmem.analyze(llama, fxmem.TensorSpec(("B", "L"), dtype=torch.int64), dtype=torch.bfloat16,
...                        optimizer=lambda p: torch.optim.AdamW(p), world_size="W",
...                        parallelize=fsdp)                                      # doctest: +SKIP
>>> report.optimizer_state    # the 2-layer Llama-7B of docs/distributed.md (doctested there)  # doctest: +SKIP
84 + 2667659264/W
>>> report.min_size("W", "80GiB", train=True, B=8, L=4096)  # the fewest ranks that fit  # doctest: +SKIP

A mesh names the dim that varies: ``mesh={"dp": "D", "tp": 2}`` (FSDP2 over ``D`` ranks, tensor
parallelism over 2). A pipeline's ``pp`` dim cannot vary (which layers a rank holds changes with it).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping

import sympy
import torch

from ..accounting import MemoryPlan
from ..capture import Capture
from ..errors import ModelError, SpecError
from ..records import Recording
from ..specs import SPECIALISED_SIZES, dim_symbol, spec_symbols
from .adopt import adopt
from .world_option import symbolic_world

_POINTS = 3  # two solve a + b/W per storage, the third checks it


class _Differs(Exception):
    """The runs at two world sizes differ beyond their sizes (``str``: where)."""


def analyze_over_world(analyze: Callable[..., Any], model: Any, input_specs: tuple, options: Any) -> Any:
    """The report of rank ``options.rank`` whose formulas hold for every world size that divides
    the sharded sizes evenly (see the module docstring); ``analyze`` is :func:`fxmem.analyze`."""
    name, key = symbolic_world(options)
    if options.parallelize is None and (not isinstance(model, torch.nn.Module) or adopt(model) is None):
        raise SpecError(f"world_size={options.world_size!r}: a symbolic world size needs parallelize=fn (the model "
                        f"is analysed at several world sizes), or a model you wrapped already")
    dims = spec_symbols(input_specs, {})
    if name in dims:
        raise SpecError(f"the world size {name!r} is also a dim of the inputs; name it otherwise (e.g. "
                        f"world_size='R')")
    rank = options.rank or 0
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise SpecError(f"rank={rank!r}: a rank is a whole number >= 0")
    if key is not None and "pp" in options.mesh and rank != 0:
        raise SpecError(f"rank={rank} of a pipeline whose mesh has the symbol {name!r}: the ranks of a later stage "
                        f"move with {name}; analyse the first stage (rank 0), or give {name} a number")
    low = max(2, rank + 1)  # one rank runs no collective (torch takes shortcuts there): W = 1 is analysed alone
    hints = dict(options.hints or {})
    first = hints.pop(name, None)
    if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < low):
        raise SpecError(f"hints={{{name!r}: {first!r}}}: the example world size is a whole number >= {low}")

    def concrete(w: int, at: Mapping[str, int] | None = None) -> Any:
        mesh = dict(options.mesh) if key is not None else None
        if mesh is not None:
            mesh[key] = w
        values = dict(hints if at is None else at)
        # rank 0 of each world size unless rank= says which (a model you wrapped: not your process's)
        return dataclasses.replace(options, world_size=math.prod(mesh.values()) if mesh else w, mesh=mesh,
                                   hints=values or None, rank=rank)

    def run(w: int, at: Mapping[str, int] | None = None) -> Any:
        return analyze(model, *input_specs, options=concrete(w, at))

    analysed: dict[int, Any] = {}
    x = first or _first_guess(model, low)
    analysed[x] = run(x)
    divisor, sharded = _sharded_gcd(analysed[x]._plan.rec, key, options.mesh)
    points = _points(divisor, low, x, name, sharded)
    for w in points:
        if w not in analysed:
            analysed[w] = run(w)
    reports = [analysed[w] for w in points]
    if name in reports[0].symbols:
        raise SpecError(f"the world size {name!r} is also a dim of the model (hparams=); name it otherwise")
    symbol = dim_symbol(name)
    try:
        for r, w in zip(reports[1:], points[1:]):  # (a guard that moves with W: L divisible by W)
            if r.region != reports[0].region:
                raise _Differs(f"where the formulas hold: {', '.join(reports[0].region)} at {name} = {points[0]}, "
                               f"{', '.join(r.region)} at {name} = {w}")
        rec, divides = _merged([r._plan.rec for r in reports], points, symbol)
        guards, even = _conditions(divides, divisor, symbol)
    except _Differs as why:
        raise ModelError(
            f"{name} as a symbol: the runs at {name} = {', '.join(map(str, points))} differ beyond their sizes "
            f"({why}), so one formula cannot hold for every {name}; give world_size= a number (or "
            f"fxmem.world_sizes(sizes=[...]) for several)") from None
    rec = dataclasses.replace(rec, env_symbols={**rec.env_symbols, name: symbol}, outer_dims={name: low},
                              outer_guards=guards)
    base = reports[0]
    values = {**base.hints, name: points[0]}
    plan = MemoryPlan(rec, values)
    between = f"the analyses at {name} = {', '.join(map(str, points))}"
    notes = [f"{name} (the world size{'' if key is None else f' of mesh dim {key!r}'}) as a symbol: each storage is "
             f"a + b/{name} bytes, solved from {between[4:]} (two solve it, the third checks it); the formulas hold "
             f"where every sharded size divides by {name} ({', '.join(plan.region.conditions()) or 'every size'}); "
             f"evaluate() at any other {name} analyses it there"]
    notes += _notes(reports, points, name)

    def reanalyze(at: Mapping[str, int]) -> Any:
        """evaluate() outside the region: at a world size that divides the shards evenly (other dims
        outside it: a longer sequence), formulas in ``name`` made there; at any other (uneven
        shards), that world size analysed."""
        at = dict(at)
        w = at.pop(name)
        if w >= low and (not even or even % w == 0) and not any(v in SPECIALISED_SIZES for v in at.values()):
            again = analyze_over_world(analyze, model, input_specs, dataclasses.replace(options, hints={**at, name: w}))
            if again._holds_at({**at, name: w}):
                return again
        # (analyze() makes formulas at general sizes where a dim is 0 or 1: these sizes exactly, then)
        there = run(w, at)
        return _pinned(there if there._holds_at(at) else there._reanalysed(at), name, w)

    where = "" if key is None else f" in mesh dim {key!r}"
    capture = Capture("eager", base.capture.how.replace(f"over {base.options.world_size} ranks",
                                                        f"over {name} ranks{where}"))
    report = _report(base, plan, values, options, notes, reanalyze, capture)
    report.checked = f"{between}: {base.checked}"
    report.world_dim = (name, low, even)
    for w, other in analysed.items():  # a first guess with uneven shards: that world size's own piece (exact)
        if w not in points:
            report._regions[((), tuple(sorted({**other.hints, name: w}.items())))] = _pinned(other, name, w)
    return report


def _first_guess(model: Any, low: int) -> int:
    """A world size likely to divide every sharded size: the smallest divisor (from ``low``) of all
    the model's parameter sizes (any dim may be sharded); ``low`` for a model built from a class."""
    if not isinstance(model, torch.nn.Module):
        return low
    g = 0
    for p in model.parameters():
        for d in p.shape:
            g = math.gcd(g, int(d))
    return next((w for w in range(low, min(g, 64) + 1) if g % w == 0), low) if g else low


def _sharded_gcd(rec: Recording, key: str | None, mesh: Mapping | None) -> tuple[int, dict[int, str]]:
    """The gcd of the sizes the symbolic dim shards (each parameter dim it shards, over the other
    mesh dims that shard the same tensor dim): a world size divides every shard evenly exactly where
    it divides this. 0 where it shards nothing (DDP: no size depends on it). With ``{size: the first
    parameter of that size}``."""
    sizes = {k: v for k, v in (mesh or {}).items() if isinstance(v, int)}
    g, sizes_seen = 0, {}
    for param, shape, shards in rec.sharded:
        for dim_name, d in shards:
            if key is not None and dim_name != key:  # (a 1-D mesh: every shard is the world's)
                continue
            others = math.prod(sizes[m] for m, e in shards if e == d and m != dim_name and m in sizes)
            if shape[d] % others:
                raise SpecError(f"parameter {param} (dim {d} of {shape[d]}) does not divide evenly over the other "
                                f"mesh dims that shard it ({others} ranks): its shards are uneven at every world "
                                f"size; give world_size= a number")
            g = math.gcd(g, shape[d] // others)
            sizes_seen.setdefault(shape[d] // others, param)
    return g, sizes_seen


def _points(divisor: int, low: int, first: int, name: str, sharded: Mapping[int, str]) -> list[int]:
    """Three world sizes from ``low`` that divide ``divisor`` (any, where it is 0), ``first`` first
    where it is one of them."""
    if divisor:
        even = [w for w in range(low, divisor + 1) if divisor % w == 0]
    else:  # nothing sharded: every size is even
        even = sorted({first, *range(low, low + _POINTS)})
    if first in even:  # the analysis made already (the user's hint, or the guess) is one of them
        even = [first] + [w for w in even if w != first]
    if len(even) < _POINTS:
        few = sorted(sharded, key=lambda n: (sum(n % k == 0 for k in range(2, n + 1)), n))[:3]
        raise SpecError(f"{name} as a symbol needs {_POINTS} world sizes from {low} that divide every size it shards "
                        f"(each world size between divides the shards unevenly, and FSDP2 pads them); their greatest "
                        f"common divisor {divisor} has {'only ' + str(even) if even else 'none'} (the sizes with the "
                        f"fewest divisors: {', '.join(f'{sharded[n]} {n}' for n in few)}): give world_size= a number, "
                        f"or compare several with fxmem.world_sizes(sizes=[...])")
    return even[:_POINTS]


def _fit(values: list, xs: list[int], symbol: sympy.Symbol) -> Any:
    """``a + b/symbol`` through ``(xs[0], values[0])`` and ``(xs[1], values[1])``, checked at the
    third; the value itself where all are equal. Raises :class:`_Differs` where it misses."""
    if all(v == values[0] for v in values[1:]):
        return values[0]
    if not all(isinstance(v, (int, sympy.Basic)) and not isinstance(v, bool) for v in values):
        raise _Differs(f"{values[0]!r} and {values[1]!r}")
    v1, v2, v3 = (sympy.sympify(v) for v in values)
    x1, x2, x3 = (sympy.Integer(x) for x in xs)
    b = sympy.expand((v1 - v2) * x1 * x2 / (x2 - x1))
    a = sympy.expand(v1 - b / x1)
    if sympy.expand(a + b / x3 - v3) != 0:
        raise _Differs(f"{v1}, {v2} and {v3} at {xs} are not a + b/{symbol}")
    return sympy.expand(a + b / symbol)


class _Merge:
    """Three recordings' fields, fitted where they differ; the integers a shape divides by."""

    def __init__(self, xs: list[int], symbol: sympy.Symbol):
        self.xs, self.symbol = xs, symbol
        self.divides: set = set()  # the b of every shape, size or value b/W: W must divide each

    def same(self, what: str, values: list) -> Any:
        if any(v != values[0] for v in values[1:]):
            raise _Differs(f"{what}: {values[0]!r:.80} and {values[1]!r:.80}")
        return values[0]

    def size(self, values: list) -> Any:
        out = _fit(values, self.xs, self.symbol)
        if isinstance(out, sympy.Basic) and out.has(self.symbol):
            b = sympy.expand(out.coeff(self.symbol, -1))
            self.divides.add(b)
        return out

    def text(self, what: str, texts: list) -> str:
        """A name that says a size (``"kept between forwards ... (6,)"``): its numbers fitted like
        sizes (``(12/W,)``); every other character must be the same."""
        if all(t == texts[0] for t in texts[1:]):
            return texts[0]
        parts = [re.split(r"(\d+)", t) for t in texts]
        self.same(what, [p[0::2] for p in parts])
        out = parts[0][:]
        for k in range(1, len(out), 2):
            out[k] = str(self.size([int(p[k]) for p in parts]))
        return "".join(out)

    def shape(self, shapes: list) -> tuple:
        if shapes[0] is None or any(s is None for s in shapes):
            return self.same("a shape", shapes)
        self.same("a rank", [len(s) for s in shapes])
        return tuple(self.size(list(dims)) for dims in zip(*shapes))


def _merged(recs: list[Recording], xs: list[int], symbol: sympy.Symbol) -> tuple[Recording, list]:
    """One recording whose sizes are in ``symbol`` (see :func:`_fit`) and the conditions on it that
    shapes and values add (``L divisible by W``); raises :class:`_Differs`."""
    m = _Merge(xs, symbol)
    first = recs[0]
    for field in ("events", "forward_end", "training", "device", "env_symbols"):
        m.same(field, [getattr(r, field) for r in recs])
    m.same("the number of storages", [len(r.storages) for r in recs])
    m.same("the number of aten steps", [len(r.steps) for r in recs])
    m.same("the number of nodes", [len(r.nodes) for r in recs])
    m.same("the sizes the data decides", [sorted(r.data_dims) for r in recs])
    storages = []
    for group in zip(*[r.storages for r in recs]):
        s = group[0]
        for f in ("role", "node", "op", "step", "phase", "saved_by", "is_output", "copy_of", "dtype"):
            m.same(f"storage {s.name} ({f})", [getattr(t, f) for t in group])
        storages.append(dataclasses.replace(s, bytes=m.size([t.bytes for t in group]), name=m.text(
            f"storage {s.name} (name)", [t.name for t in group]), shape=m.shape([t.shape for t in group])))
    steps = []
    for group in zip(*[r.steps for r in recs]):
        s = group[0]
        for f in ("node", "op", "allocs", "phase", "reads"):
            m.same(f"step {s.index} ({s.op}, {f})", [getattr(t, f) for t in group])
        m.same(f"step {s.index} ({s.op}) program", [len(t.program) for t in group])
        program = []
        for items in zip(*[t.program for t in group]):
            if all(isinstance(i, (int, sympy.Basic)) and not isinstance(i, bool) for i in items):
                program.append(m.size(list(items)))  # a byte delta
            else:  # where the outputs appear (OUT, Placed)
                program.append(m.same(f"step {s.index} ({s.op}) program", list(items)))
        steps.append(dataclasses.replace(s, program=program))
    nodes = []
    for group in zip(*[r.nodes for r in recs]):
        n = group[0]
        for f in ("name", "op", "target", "outputs", "first_step", "end_step", "dtypes"):
            m.same(f"node {n.name} ({f})", [getattr(t, f) for t in group])
        count = m.same(f"node {n.name} (outputs)", [len(t.shapes) for t in group])
        shapes = [m.shape([t.shapes[k] for t in group]) for k in range(count)]
        value = m.size([t.value for t in group]) if any(t.value is not None for t in group) else None
        nodes.append(dataclasses.replace(n, shapes=shapes, value=value))
    calls = first.module_calls
    if calls is not None:
        calls = {path: dataclasses.replace(c, shape=m.shape([r.module_calls[path].shape for r in recs]))
                 for path, c in calls.items()}
    rec = dataclasses.replace(first, storages=storages, steps=steps, nodes=nodes, module_calls=calls)
    return rec, m.divides


def _conditions(divides: set, divisor: int, symbol: sympy.Symbol) -> tuple[list, int]:
    """``symbol`` divides ``divisor`` (the sharded sizes' gcd) and each ``b`` of a size ``b/symbol``:
    the numbers as one gcd (returned too; 0 where nothing is sharded); an expression (``12*B``)
    only where that gcd does not imply it (its coefficients' gcd a multiple of it)."""
    numbers = divisor
    for b in divides:
        if b.is_Integer:
            numbers = math.gcd(numbers, abs(int(b)))
        elif b.is_number:
            raise _Differs(f"a size {b}/{symbol} is not whole")
    guards = [sympy.Eq(sympy.Mod(numbers, symbol), 0)] if numbers else []  # (0: nothing sharded, any W)
    for b in sorted((b for b in divides if not b.is_number), key=sympy.default_sort_key):
        content = sympy.gcd([t.as_coeff_Mul()[0] for t in sympy.Add.make_args(sympy.expand(b))])
        if not (numbers and content.is_Integer and int(content) % numbers == 0):
            guards.append(sympy.Eq(sympy.Mod(b, symbol), 0))
    return guards, numbers


def _notes(reports: list, points: list[int], name: str) -> list[str]:
    """The analyses' notes: once where the three say the same, else the first's, marked with its
    world size (a bound of gloo's asynchronous collectives in bytes holds at that size)."""
    out = []
    for k, note in enumerate(reports[0].notes):
        same = all(k < len(r.notes) and r.notes[k] == note for r in reports[1:])
        out.append(note if same else f"at {name} = {points[0]}: {note}")
    return out


def _report(base: Any, plan: MemoryPlan, values: dict, options: Any, notes: list, reanalyze: Callable,
            capture: Capture) -> Any:
    """A :class:`~fxmem.Report` like ``base`` (the analysis at the first world size) over ``plan``."""
    from ..report import Report

    report = Report(plan, model_name=base.model_name, specs=base.specs, options=options,
                    input_specs=base.input_specs, model=base.model, hints=values, graph_module=None,
                    mode=base.mode, reanalyze=reanalyze, capture=capture)
    report.notes = notes + [n for n in plan.notes if n not in base.notes and n not in notes]
    return report


def _pinned(report: Any, name: str, w: int) -> Any:
    """``report`` (an analysis at world size ``w``) with the dim ``name`` fixed at ``w``: a piece
    of a report in ``name`` (its region holds there only)."""
    rec = report._plan.rec
    rec = dataclasses.replace(rec, env_symbols={**rec.env_symbols, name: sympy.Integer(w)})
    values = {**report.hints, name: w}
    out = _report(report, MemoryPlan(rec, values), values, report.options,
                  [n for n in report.notes], report._reanalyze, report.capture)
    out.notes = [n for n in out.notes if not n.startswith(f"PyTorch fixed dim {name} ")]
    out.notes.insert(0, f"{name} = {w}: a world size outside the formulas' region (uneven shards), analysed there")
    out.checked = report.checked
    return out
