"""A report that checks itself: where the model has real weights, the forward runs once for real at
a small size inside the formulas' region (:func:`small_point`), and the allocator's own events are
set beside the simulated ones. Equal: the report says which sizes it was checked at
(``report.checked``). Different: the report is not exact, and a note says by how many bytes and
where the two event streams first part (the predicted allocation there, with its fx node or
source line).

Every number a user reads is compared, not only the peak: ``resident`` against the real copy's
parameters, buffers and tensor attributes and the inputs (each storage once, and what the real
forward reads from outside them); for a training step also ``optimizer_state`` (the real
optimizer's ``state``), ``grads`` (the real ``.grad`` storages as ``optimizer.step()`` starts),
``train_resident`` and the absolute ``train_peak``. Evidence from the real tensors and the
allocator, never from fxmem's own formulas.

What is not checked says why (``report.checked``): a model on the meta device (no weights), a
simulated device other than this process's CPU, sizes the data decides, a distributed rank, a
user ``step=``, a run that would need more than :data:`LIMIT` bytes, the user's own profiler session
recording (the check would end it), or a real run that fails on
random inputs (an index input out of range, say). The run is on fxmem's own copy of the model,
inside fxmem's state isolation: the user's model, RNG and grad mode are untouched.

>>> report = fxmem.analyze(model, ("B", 64))              # doctest: +SKIP
>>> report.checked                                          # doctest: +SKIP
'checked against a real forward at B=2: equal'
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch

from . import _torch_compat as tc
from .isolation import isolated
from .progress import phased
from .records import INEXACT, Phase
from .training import StepHooks

LIMIT = 256 * 2**20  # bytes: a check whose predicted peak is larger is skipped (it would cost a real run that big)


@isolated  # also when evaluate() re-analyses: the real run draws from the RNG (dropout), sets modes
@phased("self-check")
def self_check(report: Any, model: torch.nn.Module) -> str:
    """Run the check; returns what ``report.checked`` says (and adds a note to ``report`` when the
    real run differs)."""
    from .inputs import random_inputs
    from .measure import allocator_events, cpu_memory_profile, measure

    opts = report.options
    why = _not_checkable(report, model)
    if why:
        return f"not checked against a real run: {why}"
    hints = {k: v for k, v in report.hints.items() if k in report.symbols}
    points = [small_point(report)]
    if points[0] != hints:
        points.append(hints)  # where the small size is outside what the model accepts on random inputs
    grad = torch.enable_grad() if opts.grad else torch.no_grad()
    for k, dims in enumerate(points):
        at = report.evaluate(**dims)
        where = ", ".join(f"{k}={v}" for k, v in dims.items()) or "the inputs' sizes"
        needed = max(at["peak"], at.get("train_peak") or 0)  # each includes the resident model and inputs
        if needed > LIMIT:
            run = "the forward and the training step" if at.get("train_peak") else "the forward"
            return f"not checked against a real run: at {where} {run} would need {needed:,} B (over {LIMIT:,} B)"
        predicted = (at["peak_above_resident"], at["retained"])
        try:
            module = copy.deepcopy(report.graph_module if report.graph_module is not None else model)
            xs = random_inputs(report.specs, dims)
            with grad:
                # The report is of a call after the first (a first call makes oneDNN's primitives, lazy
                # caches). A first call that already measures equal needs no second; one that does not
                # was the warm-up, and the second call is the one compared.
                real = measure(lambda: module(*xs), warmup=0)
                if (real.peak_above_start, real.retained) != predicted:
                    real = measure(lambda: module(*xs), warmup=0)
            break
        except Exception as exc:  # noqa: BLE001 - the model's own failure on random inputs: not a verdict
            if k + 1 < len(points):
                continue
            return f"not checked against a real run: the real forward at {where} on random inputs raised " \
                   f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    measured = (real.peak_above_start, real.retained)
    source = report.graph_module if report.graph_module is not None else model
    resident = _real_resident(source, module, xs, at["resident"], grad)
    resident_ok = resident is None or _compare(report, where, [("resident", at["resident"], resident)])
    if predicted == measured and report.training:
        return _check_step(report, module, xs, at, where, resident, resident_ok)
    if predicted == measured:
        return f"checked against a real forward at {where}: {'equal' if resident_ok else _DIFFERENT}"
    with grad:  # a third call, only to say where the two runs part
        with cpu_memory_profile() as prof:
            out = module(*xs)
        del out
    part = _first_difference(report, dims, [n for _, n in allocator_events(prof)])
    report.notes.append(
        f"self-check: a real forward at {where} measured peak above resident {measured[0]:,} B and retained "
        f"{measured[1]:,} B; the analysis says {predicted[0]:,} B and {predicted[1]:,} B "
        f"({predicted[0] - measured[0]:+,} B, {predicted[1] - measured[1]:+,} B){part}: {INEXACT}")
    return f"checked against a real forward at {where}: different (see the notes)"


def _check_step(report: Any, module: torch.nn.Module, xs: list, at: dict, where: str, resident: int | None,
                resident_ok: bool) -> str:
    """The training step too (the forward's peak was equal): a steady-state step of the same copy,
    after a first step made the optimizer's state, against the report's training formulas; and the
    absolute numbers (``resident`` is the real resident bytes, None where unknown; ``resident_ok``
    whether they were the predicted ones)."""
    from .measure import measure
    from .training import default_loss, train_step

    opts = report.options
    loss = opts.loss or default_loss
    forward = f"checked against a real forward at {where}: {'equal' if resident_ok else _DIFFERENT}"
    try:
        optimizer = opts.optimizer(module.parameters())
        train_step(module, xs, optimizer, loss)  # the optimizer's state exists from here: steady state
        state = _state_bytes(optimizer, module)  # what it holds as the measured step starts
        grads = _GradientBytes(module)
        real = measure(lambda: train_step(module, xs, optimizer, loss, hooks=grads), warmup=0)
    except Exception as exc:  # noqa: BLE001 - the user's optimizer or loss on this copy: not a verdict
        return f"{forward}; the training step not checked (it raised {type(exc).__name__})"
    predicted = (at["train_peak"] - at["train_resident"], at["train_retained"])
    measured = (real.peak_above_start, real.retained)
    rows = []
    if resident is not None:
        rows.append(("train_resident", at["train_resident"], resident + state))
    if resident is not None and predicted[0] == measured[0]:  # else the note below says by how much it differs
        rows.append(("train_peak", at["train_peak"], resident + state + real.peak_above_start))
    rows += [("optimizer_state", at["optimizer_state"], state), ("grads", at["grads"], grads.bytes)]
    absolute_ok = _compare(report, where, rows) and resident_ok
    if predicted == measured:
        return f"checked against a real forward and training step at {where}: " \
               f"{'equal' if absolute_ok else _DIFFERENT}"
    report.notes.append(
        f"self-check: a real training step at {where} measured peak above resident {measured[0]:,} B and retained "
        f"{measured[1]:,} B; the analysis says {predicted[0]:,} B and {predicted[1]:,} B "
        f"({predicted[0] - measured[0]:+,} B, {predicted[1] - measured[1]:+,} B): {INEXACT}")
    return f"{forward}; the training step: {_DIFFERENT}"


_DIFFERENT = "different (see the notes)"


def _compare(report: Any, where: str, rows: list[tuple[str, int, int]]) -> bool:
    """``rows``: (quantity, predicted bytes, measured bytes). A note names each quantity the real
    run has other bytes of (the report is then not exact); True when all agree."""
    wrong = [(name, p, m) for name, p, m in rows if p != m]
    if wrong:
        told = "; ".join(f"{name} {m:,} B (the analysis says {p:,} B, {p - m:+,} B)" for name, p, m in wrong)
        report.notes.append(f"self-check: the real run at {where} has {told}: {INEXACT}")
    return not wrong


def _real_resident(source: torch.nn.Module, module: torch.nn.Module, xs: list, predicted: int,
                   grad: Any) -> int | None:
    """Bytes held before a call: the parameters, buffers and tensor attributes of ``source`` (the
    user's module, or the traced one sharing its parameters - not the check's copy, whose
    parameters ``deepcopy`` cloned compact) and the inputs, each storage once. Where that is not
    ``predicted``, the storages the real forward of the copy ``module`` reads without having made
    them, and that are not the copy's own, count too (a global, a cache the first call filled):
    found on the real run, so a storage fxmem wrongly counts as resident is still caught. None
    where that forward raised (library code that refuses to run under a dispatch mode)."""
    own = _module_tensors(source)
    found = _storages([t for _, t in own] + list(xs))
    if sum(found.values()) == predicted:
        return predicted
    names = {name for name, _ in own}
    copied = _storages(t for name, t in _module_tensors(module) if name in names)
    try:
        with grad, _ReadFromOutside() as outside:
            out = module(*xs)
        del out
    except Exception:  # noqa: BLE001 - not a verdict on the analysis: resident goes unchecked
        return None
    found.update({key: n for key, n in outside.kept().items() if key not in copied})
    return sum(found.values())


def _module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, tensor)`` of every parameter, buffer and plain tensor attribute."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False),
            *tc.tensor_attributes(module)]


def _storages(tensors: Any) -> dict[int, int]:
    """``{storage key: bytes}`` of the CPU tensors among ``tensors`` (views of one storage once)."""
    found = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
            found[tc.storage_key(t).cdata] = t.untyped_storage().nbytes()
    return found


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the storages of ``tensors``, each once."""
    return sum(_storages(tensors).values())


def _state_bytes(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> int:
    """Bytes of the optimizer's state, each storage once, leaving out the module's own (a state
    that refers to a parameter holds no bytes of its own)."""
    own = _storages(t for _, t in _module_tensors(module))
    tensors = [v for st in optimizer.state.values() for v in (st.values() if isinstance(st, dict) else [st])]
    return sum(n for key, n in _storages(tensors).items() if key not in own)


class _ReadFromOutside(tc.DispatchMode):
    """The storages real ops read in here that no op in here made (a Python number an op wraps into
    a tensor is one too, until it dies: :meth:`kept` leaves those out)."""

    def __init__(self) -> None:
        super().__init__()
        self._found: dict[int, tuple[Any, int]] = {}  # key -> (weak reference, bytes)
        self._made: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for t in tc.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                ref = tc.storage_key(t)
                if ref.cdata not in self._made:
                    self._found.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        out = func(*args, **kwargs)
        self._made.update(k for k in _storages(tc.tree_leaves(out)) if k not in self._found)
        return out

    def kept(self) -> dict[int, int]:
        """``{storage key: bytes}`` of those still alive (call after the run's own tensors died)."""
        return {key: nbytes for key, (ref, nbytes) in self._found.items() if not ref.expired()}


class _GradientBytes(StepHooks):
    """A real training step that counts the parameters' gradients as ``optimizer.step()`` starts:
    ``bytes``, each storage once (counting allocates nothing the step's measurement would see)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.bytes = 0

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        if phase == Phase.STEP:
            self.bytes = _storage_bytes(p.grad for p in self.module.parameters() if p.grad is not None)
        yield


def small_point(report: Any) -> dict[str, int]:
    """A small size inside the formulas' region: each dim in turn lowered from the example size, by
    bisection down to 2 (PyTorch fixes 0 and 1), while every condition of the region still holds.

    Why small: the real run costs little there, and the formulas are checked at sizes the
    simulation did not run at - evidence for the formula, not only for the one point analysed.
    A region that pins a dim (``B == 97``) keeps it."""
    dims = {k: v for k, v in report.hints.items() if k in report.symbols}
    region = report._plan.region

    def inside(values: dict) -> bool:
        return not region.violations({report.symbols[k]: v for k, v in values.items()})

    if not inside(dims):
        return dims
    for name in sorted(dims):
        lo, hi = 2, dims[name]
        while lo < hi:
            mid = (lo + hi) // 2
            if inside({**dims, name: mid}):
                hi = mid
            else:
                lo = mid + 1
        if lo < dims[name] and inside({**dims, name: lo}):
            dims[name] = lo
    return dims


def _not_checkable(report: Any, model: torch.nn.Module) -> str | None:
    opts = report.options
    if opts.device != "cpu":
        return f"device={opts.device!r} is simulated, this process runs on the CPU"
    if not isinstance(model, torch.nn.Module):
        return "the model is built from a class or factory"
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.device.type == "meta" for t in tensors):
        return "the model is on the meta device (no weights)"
    if any(t.device.type != "cpu" for t in tensors):
        return "the model's weights are not on the CPU"
    if report.data_dims:
        return "sizes the data decides (random inputs would not hold the values that decide them)"
    if opts.parallelize is not None or opts.step is not None:
        return "a distributed rank or a user step= (checked by their own real runs in fxmem's tests)"
    if opts.autocast is not None or opts.hparams is not None or opts.init is not None:
        return "autocast, or a model built from hyperparameters"
    if tc.profiler_active():
        return ("your torch.profiler session is recording, and the check measures with a profiler session of its "
                "own (one per process: it would end yours)")
    if any(s.fill is not None for s in report.specs):
        return None
    return None


def _first_difference(report: Any, dims: dict, real: list[int]) -> str:
    """Where the real allocator's events and the predicted ones first differ: the predicted event
    there (its bytes and its node or line), or "" when they never do event by event."""
    snap = report.snapshot(dims)
    resident = sum(1 for s in report.storages if s.step is None and s.role.value != "optimizer_state")
    predicted = []
    for e in snap["device_traces"][0][resident:]:
        if e["action"] == "alloc":
            predicted.append((e["size"], e.get("frames") or []))
        elif e["action"] == "free_completed":
            predicted.append((-e["size"], e.get("frames") or []))
    for k, (size, frames) in enumerate(predicted):
        if k >= len(real) or real[k] != size:
            got = f"{real[k]:+,} B" if k < len(real) else "nothing"
            where = "; ".join(f"{f.get('filename', '').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name', '')}".strip()
                              for f in frames[:2]) or "?"
            return f"; the event streams first part at event {k}: predicted {size:+,} B at {where}, real {got}"
    if len(real) > len(predicted):
        return f"; the real run has {len(real) - len(predicted)} more allocator events after the predicted ones"
    return ""
