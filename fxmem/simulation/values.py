"""Values that decide a path: what the simulation knows about tensor *values*, and library code
that asks whether it is being traced.

Real code sometimes branches on values: transformers skips building a ``(B, 1, L, L)`` attention
mask when the given mask is all ones. On fake tensors such a decision cannot be made (they have no
values), and libraries detect fake tensors and take their "traced" path instead. fxmem never lets
that pass silently:

* an input spec can state its value (``TensorSpec(..., fill=1)``); :class:`KnownValues` follows
  that value through views, dtype casts, pointwise ops and ``all``/``any``/``amin``/``amax``, and
  answers ``bool(t)`` / ``t.item()`` on such tensors as the real run would;
* ``torch.arange`` (the position ids a model builds) is followed as a progression
  (:mod:`.progressions`) through views and arithmetic, so what real code computes from it
  (transformers' packed-sequence check: ``diff(position_ids) != 1`` all False) is known too;
* library checks that ask "is this tensor fake?" (:data:`TRACING_CHECKS`) are answered as for the
  real tensor when its values are known, and otherwise noted in the report: which library function
  asked, that the real run decides on the values, and how to state them.

>>> values = KnownValues(note)                       # doctest: +SKIP
>>> values.set(mask, 1); values.value_of(mask.bool().all())   # doctest: +SKIP
True
"""
from __future__ import annotations

import contextlib
import operator
import sys
import weakref
from typing import Any, Callable, Iterator

import torch

from .. import _torch_compat as tc
from ..records import INEXACT
from . import progressions
from .patching import patched
from .progressions import Progression

aten = torch.ops.aten
# ops whose result, from tensors that hold one value everywhere, again holds one value everywhere
_REDUCTIONS = frozenset({aten.all, aten.any, aten.amin, aten.amax, aten.max, aten.min})
_COPIES = frozenset({aten._to_copy, aten.clone, aten.contiguous, aten.lift_fresh, aten.lift_fresh_copy,
                     aten.detach, aten.alias})
# pointwise ops on values that are sizes (sum of an all-ones mask = its numel): computed on SymInts
_SYMBOLIC = {aten.eq: operator.eq, aten.ne: operator.ne, aten.lt: operator.lt, aten.le: operator.le,
             aten.gt: operator.gt, aten.ge: operator.ge, aten.mul: operator.mul, aten.add: operator.add,
             aten.sub: operator.sub}
_SYMBOLIC_NUMBERS = (torch.SymInt, torch.SymFloat, torch.SymBool)
_UNSCALE = getattr(aten, "_amp_foreach_non_finite_check_and_unscale_", None)
# factories of tensors that hold one value: op -> that value (None: the call's ``fill_value``)
_FACTORIES = {aten.ones: 1, aten.zeros: 0, aten.ones_like: 1, aten.zeros_like: 0, aten.new_ones: 1,
              aten.new_zeros: 0, aten.full: None, aten.full_like: None, aten.new_full: None}
_FILLS = frozenset({aten.fill_, aten.zero_})
# ops that read a value out of a tensor into Python
_READS = frozenset({aten._local_scalar_dense, aten.is_nonzero})

# Library functions that ask whether a tensor is fake (to take a "traced" path that does not look at
# values): (module, function). Checked only where the module is already imported.
TRACING_CHECKS = (("transformers.utils.import_utils", "is_fake_tensor"),)

# Callers of those checks whose real path decides only whether to log a warning: what they read
# (a token column or two, a few bytes freed at once, before the forward allocates anything else)
# changes no allocation of the model, so their traced path is not a source of inexactness.
# (module, function) -> what the real path does.
WARNING_ONLY = {
    ("transformers.modeling_utils", "warn_if_padding_and_no_attention_mask"):
        "looks for a pad token in the first and last token columns to decide whether to warn",
}


class KnownValues:
    """Fake tensors known to hold a single value everywhere (from ``TensorSpec(fill=...)``, or made
    so: ``torch.ones``, ``zeros``, ``full``). A write into a tensor's storage (an in-place op, an
    ``out=``, a write through a view) forgets every known value on that storage, unless the write
    itself is of known values."""

    def __init__(self, note: Callable[[str], None]):
        self.note = note
        self._values: dict[int, tuple[Any, Any, Any]] = {}  # id(tensor) -> (weakref, value, storage key)

    def set(self, t: torch.Tensor, value: Any) -> None:
        self._values[id(t)] = (weakref.ref(t), value, _storage(t))

    def known(self, t: Any) -> bool:
        """Whether ``t`` holds one known value everywhere (a progression is not one value)."""
        value = self._value(t)
        return value is not None and not isinstance(value, Progression)

    def _value(self, t: Any) -> Any:
        """``t``'s known value (a number or a :class:`Progression`), or None."""
        if not isinstance(t, torch.Tensor):
            return None
        hit = self._values.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def _forget_storage_of(self, t: torch.Tensor) -> None:
        key = _storage(t)
        for k in [k for k, (ref, _, s) in self._values.items() if s == key or ref() is None]:
            del self._values[k]  # (and the entries of tensors that died)

    def value_of(self, t: torch.Tensor) -> Any:
        return self._values[id(t)][1]

    def read(self, func: Any, args: tuple) -> tuple[bool, Any]:
        """``(True, value)`` when ``func`` reads a value out of a tensor whose value is known."""
        if tc.op_packet(func) not in _READS or not args or not self.known(args[0]):
            return False, None
        value = self.value_of(args[0])
        return True, bool(value) if tc.op_packet(func) is aten.is_nonzero else value

    def follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give ``out`` a known value when it is a function of known values only."""
        if tc.op_packet(func) is _UNSCALE and len(args) > 1 and isinstance(args[1], torch.Tensor):
            # a GradScaler's check for inf/nan gradients: the steady state has finite ones, so its
            # found_inf flag stays 0 and the optimizer steps (a step with inf/nan skips it)
            self.set(args[1], 0.0)
            self.note("GradScaler: the step with finite gradients (found_inf = 0, optimizer.step() runs); a step "
                      "whose gradients overflow skips optimizer.step() and uses less")
            return
        packet = tc.op_packet(func)
        if packet in _FACTORIES and isinstance(out, torch.Tensor):
            fill = _FACTORIES[packet]
            value = tc.bind_arguments(func, args, kwargs).get("fill_value") if fill is None else fill
            if isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
                self.set(out, value)
            return
        if packet is aten.arange and isinstance(out, torch.Tensor):  # position ids: 0, 1, 2, ...
            value = progressions.arange_value(func, args, kwargs, out)
            if value is not None:
                self.set(out, value)
            return
        if not self._values:
            return
        tensors = [a for a in tc.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        values = {id(t): self._value(t) for t in tensors}
        computable = bool(tensors) and all(v is not None for v in values.values())
        lines = computable and any(isinstance(v, Progression) for v in values.values())
        for t in tc.written_tensors(func, args, kwargs):  # its storage's values are stale from here on
            self._forget_storage_of(t)
        if packet in _FILLS and args and isinstance(args[0], torch.Tensor):  # x.fill_(v), x.zero_()
            value = args[1] if packet is aten.fill_ and len(args) > 1 else 0 if packet is aten.zero_ else None
            if isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
                self.set(args[0], value)  # every element of x (other views of its storage stay unknown)
            return
        if not isinstance(out, torch.Tensor) or not computable:
            return
        if lines:  # a progression (position ids) and what is computed from it
            value = progressions.computed(func, args, kwargs, out, lambda t: values.get(id(t)))
        else:
            value = _computed(func, packet, args, kwargs, tensors, values, out)
        if value is not None:  # (an in-place op's output is the written tensor: known again)
            self.set(out, value)


def _computed(func: Any, packet: Any, args: tuple, kwargs: dict, tensors: list, values: dict, out: Any) -> Any:
    """The one value ``out`` holds, when the op's tensor inputs each hold one (``values``); else None."""
    def val(t: torch.Tensor) -> Any:
        return values[id(t)]

    if getattr(func, "is_view", False) or packet in _COPIES and packet not in (aten._to_copy,):
        return val(tensors[0])
    if packet is aten.cumsum and len(tensors) == 1:  # (diff(position_ids) != 1).cumsum(-1): a progression
        return progressions.cumsum_of_constant(val(tensors[0]), tc.bind_arguments(func, args, kwargs)["dim"], out)
    if packet is aten.sum and len(tensors) == 1:  # v summed over the reduced elements (a size)
        t = tensors[0]
        v = val(t)
        # (no comparison of the symbolic numel with 1: that would add a guard on the user's dims)
        return (int(v) if isinstance(v, bool) else v) * (t.numel() // out.numel())
    operands = [val(a) if isinstance(a, torch.Tensor) else a for a in args]
    leaves = tc.tree_leaves((operands, kwargs))
    if packet in _SYMBOLIC and len(operands) == 2 and any(isinstance(v, _SYMBOLIC_NUMBERS) for v in leaves):
        return _SYMBOLIC[packet](*operands)  # a size compared or combined: keep it symbolic
    if any(isinstance(v, (torch.SymInt, torch.SymFloat)) for v in leaves):
        # any other op on a size (an optimizer's lerp_ of a gradient that is a count of B rows) would
        # need a real number: computing it on stand-ins would fix the user's dim at its hint. (A
        # SymBool - a comparison of sizes, as generate()'s "cur_len >= max_length" - is a path the
        # real run decides on the sizes too: computed below, it guards that decision.)
        return None
    if not (packet in _REDUCTIONS or packet is aten._to_copy or torch.Tag.pointwise in getattr(func, "tags", ())):
        return None

    # the op on one-element real stand-ins of the same rank and dtype gives the value
    def stand_in(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.full([1] * a.dim(), val(a), dtype=a.dtype)
        return a
    try:
        with tc.real_mode():
            real = func(*[_map(stand_in, a) for a in args], **{k: _map(stand_in, v) for k, v in kwargs.items()})
            return real.reshape(-1)[0].item() if isinstance(real, torch.Tensor) and real.numel() else None
    except Exception:  # noqa: BLE001 - not computable on stand-ins: the value is simply not known
        return None


def _storage(t: torch.Tensor) -> Any:
    try:
        return tc.storage_key(t).cdata
    except Exception:  # noqa: BLE001 - a tensor without a storage (never written through)
        return None


def _map(fn: Callable, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return fn(value)


@contextlib.contextmanager
def tracing_checks(values: KnownValues) -> Iterator[None]:
    """While a model is simulated, library checks of :data:`TRACING_CHECKS` see through fake tensors
    whose values are known, and are noted where they are not."""
    checks = []
    for module_name, name in TRACING_CHECKS:
        module = sys.modules.get(module_name)
        original = getattr(module, name, None) if module is not None else None
        if original is None:
            continue

        def check(x: Any, *a: Any, _original: Callable = original, _name: str = f"{module_name}.{name}") -> Any:
            fake = _original(x, *a)
            if not fake or not isinstance(x, torch.Tensor):
                return fake
            caller = _caller()
            warning = WARNING_ONLY.get(_caller_key())
            if warning is not None and not values.known(x):
                values.note(f"{caller} asked whether a tensor is traced ({_name}); its real path only {warning}, "
                            f"(a few bytes, freed before the model allocates anything else: peak and retained are unchanged); the "
                            f"traced path was taken")
                return fake
            if values.known(x):
                values.note(f"{caller} asked whether a tensor is traced ({_name}); its values are known "
                            f"(all {values.value_of(x)!r}), so it was answered as for the real tensor and the "
                            f"real run's path taken")
                return False
            values.note(f"{caller} asked whether a tensor {tuple(x.shape)} is traced ({_name}) and took its "
                        f"traced path, so {INEXACT}: a real run may decide on the tensor's values (transformers skips "
                        f"building an attention mask when the mask is all ones). If your inputs hold one value, "
                        f"state it: fxmem.TensorSpec(..., fill=1)")
            return fake

        checks.append((module, name, check))
    with patched(checks):
        yield


def _caller_key() -> tuple[str, str] | None:
    """``(module, function)`` of the library function that called the tracing check."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name in ("is_tracing", "check", "is_fake_tensor", "_caller_key"):
        frame = frame.f_back
    if frame is None:
        return None
    return frame.f_globals.get("__name__", ""), frame.f_code.co_name


def _caller() -> str:
    """The library function (and line) that called the tracing check, skipping the check helpers."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name in ("is_tracing", "check", "is_fake_tensor"):
        frame = frame.f_back
    if frame is None:
        return "library code"
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"


__all__ = ["KnownValues", "TRACING_CHECKS", "tracing_checks"]
