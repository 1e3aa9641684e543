"""Tensors whose values are an arithmetic progression along one dim: ``torch.arange`` and what
real code computes from it without reading it.

Library code decides on such values: transformers' ``find_packed_sequence_indices`` (called for
``input_ids`` without an ``attention_mask`` when no cache is made: training, ``use_cache=False``)
takes the position ids ``arange(L)`` a model builds, computes ``diff(position_ids) != 1`` and its
``cumsum``, and skips the packed-sequence mask when that is all zeros. A fake tensor has no values,
so without this module the simulation takes transformers' traced path and builds a
``(B, 1, L, L)`` mask the real run never builds.

A :class:`Progression` is ``start + step * i`` along dim ``dim`` (``i`` the index there), the same
along every other dim. It follows views that keep or drop that dim (``unsqueeze``, ``expand``,
``slice``, ``select``), copies, ``+ - *`` with a constant or another progression, ``cat`` of pieces
that continue it, and ``cumsum`` of a constant (which makes one). Anything else makes the value
unknown (``None``): never a guess, so a branch on an unknown value is still noted or refused.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .. import _torch_compat as tc

aten = torch.ops.aten
_NUMBERS = (bool, int, float, torch.SymInt, torch.SymFloat)
_COPIES = frozenset({aten.alias, aten.detach, aten.clone, aten.contiguous, aten.lift_fresh,
                     aten.lift_fresh_copy})
_ARITHMETIC = frozenset({aten.add, aten.sub, aten.mul})


@dataclasses.dataclass(frozen=True)
class Progression:
    """Values ``start + step * i`` along dim ``dim`` of the tensor, equal along every other dim."""

    start: Any
    step: Any
    dim: int

    def __repr__(self) -> str:
        return f"{self.start!r} + {self.step!r}*i along dim {self.dim}"


def made(start: Any, step: Any, dim: int) -> Any:
    """The value of ``start + step * i`` along ``dim``: a :class:`Progression`, or the one number
    where the step is 0 (a constant is what the rest of the simulation reads)."""
    if isinstance(step, (bool, int, float)) and step == 0:
        return start
    return Progression(start, step, dim)


def arange_value(func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> Progression | None:
    """``torch.arange(...)``'s values (along its one dim)."""
    bound = tc.bind_arguments(func, args, kwargs)
    start, step = bound.get("start", 0), bound.get("step", 1)
    if not _integral(out.dtype) or not all(isinstance(v, (int, torch.SymInt)) for v in (start, step)):
        return None
    return Progression(start, step, 0)


def computed(func: Any, args: tuple, kwargs: dict, out: Any, value_of: Callable[[torch.Tensor], Any]) -> Any:
    """The value of ``out`` (a number, a :class:`Progression`, or None where not known) when at
    least one tensor input is a progression; ``value_of`` gives each tensor input's value."""
    if not isinstance(out, torch.Tensor) or not _integral(out.dtype):
        return None
    packet = tc.op_packet(func)
    if packet is aten.cat:
        return _cat(args, kwargs, out, value_of)
    if packet in _ARITHMETIC:
        return _arithmetic(packet, func, args, kwargs, out, value_of)
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    value = value_of(args[0])
    if not isinstance(value, Progression):
        return None
    if packet in _COPIES or packet is aten._to_copy:  # (a cast to the other wide integer dtype keeps the values)
        return value
    return _view(packet, args, out, value)


def cumsum_of_constant(value: Any, dim: int, out: torch.Tensor) -> Any:
    """``cumsum`` along ``dim`` of a tensor holding ``value`` everywhere: ``value * (i + 1)``."""
    if isinstance(value, bool):
        value = int(value)  # (a bool tensor's cumsum is an integer tensor)
    if isinstance(value, (int, float)) and value == 0:
        return value  # zeros stay zeros, in any dtype
    if not isinstance(value, (int, torch.SymInt)) or not _integral(out.dtype):
        return None
    return made(value, value, dim % out.dim()) if out.dim() else value


def _integral(dtype: torch.dtype) -> bool:
    """Progressions are followed in the wide integer dtypes only: there every value is exact (a
    float ``arange``'s differences are not exactly its step; an int8 one wraps at 127), and a
    comparison (bool) differs along the dim."""
    return dtype in (torch.int64, torch.int32)


def _view(packet: Any, args: tuple, out: torch.Tensor, p: Progression) -> Any:
    """A view of a progression: the dim moves with the view, or is indexed away."""
    x = args[0]
    if packet is aten.unsqueeze:
        d = args[1] % out.dim()
        return Progression(p.start, p.step, p.dim + (d <= p.dim))
    if packet is aten.expand:
        dim = p.dim + out.dim() - x.dim()  # new dims lead
        # the progression's own dim must keep its size (expanding a size-1 dim repeats one value)
        return dataclasses.replace(p, dim=dim) if _same_size(x.shape[p.dim], out.shape[dim]) else None
    if packet is aten.slice:
        return _slice(args, x, p)
    if packet is aten.select:
        d, index = args[1] % x.dim(), args[2]
        if d != p.dim:
            return dataclasses.replace(p, dim=p.dim - (d < p.dim))
        if not isinstance(index, (int, torch.SymInt)):
            return None
        index = index + x.shape[d] if isinstance(index, int) and index < 0 else index
        return p.start + p.step * index
    return None  # any other view (reshape, transpose ...): not followed, so unknown


def _slice(args: tuple, x: torch.Tensor, p: Progression) -> Any:
    """``x[..., start:end:step]`` along a dim: along the progression's dim it starts later and
    strides further; along any other dim the values are unchanged."""
    d = (args[1] if len(args) > 1 else 0) % x.dim()
    if d != p.dim:
        return p
    begin = args[2] if len(args) > 2 and args[2] is not None else 0
    stride = args[4] if len(args) > 4 else 1
    if not isinstance(begin, (int, torch.SymInt)) or not isinstance(stride, int):
        return None
    if isinstance(begin, int) and begin < 0:
        if not tc.known_true(x.shape[d] + begin >= 0):  # clamped to 0 for real: not decided on sizes here
            return None
        begin = x.shape[d] + begin
    return made(p.start + p.step * begin, p.step * stride, p.dim)


def _arithmetic(packet: Any, func: Any, args: tuple, kwargs: dict, out: torch.Tensor,
                value_of: Callable[[torch.Tensor], Any]) -> Any:
    """``a + alpha * b``, ``a - alpha * b``, ``a * b`` where each operand is a number, a tensor holding
    one value, or a progression along a dim ``out`` keeps at its size."""
    if len(args) < 2:
        return None
    alpha = kwargs.get("alpha", 1)
    a, b = (_operand(v, out, value_of) for v in args[:2])
    if a is None or b is None or not isinstance(alpha, _NUMBERS):
        return None
    if packet is aten.mul:
        if isinstance(a, Progression) and isinstance(b, Progression):
            return None  # quadratic in i
        p, c = (a, b) if isinstance(a, Progression) else (b, a)
        return made(p.start * c, p.step * c, p.dim)
    sign = -1 if packet is aten.sub else 1
    a, b = _as_progression(a), _as_progression(b)
    if a.dim is not None and b.dim is not None and a.dim != b.dim:
        return None  # a plane, not a line
    dim = a.dim if a.dim is not None else b.dim
    return made(a.start + sign * alpha * b.start, a.step + sign * alpha * b.step, dim)


def _operand(v: Any, out: torch.Tensor, value_of: Callable[[torch.Tensor], Any]) -> Any:
    """An operand's value as it broadcasts into ``out``: a number, or a progression along ``out``'s dim;
    None where not known (or where broadcasting repeats a progression's one element)."""
    if isinstance(v, _NUMBERS):
        return v
    if not isinstance(v, torch.Tensor):
        return None
    value = value_of(v)
    if not isinstance(value, Progression):
        return value
    dim = value.dim + out.dim() - v.dim()  # broadcasting aligns trailing dims
    if not _same_size(v.shape[value.dim], out.shape[dim]):
        return None
    return dataclasses.replace(value, dim=dim)


@dataclasses.dataclass(frozen=True)
class _Line:
    start: Any
    step: Any
    dim: int | None  # None: a constant


def _as_progression(v: Any) -> _Line:
    if isinstance(v, Progression):
        return _Line(v.start, v.step, v.dim)
    return _Line(v, 0, None)


def _cat(args: tuple, kwargs: dict, out: torch.Tensor, value_of: Callable[[torch.Tensor], Any]) -> Any:
    """``torch.cat`` along the progressions' dim of pieces that continue one another (as
    ``torch.diff(x, prepend=x[:, :1] - 1)`` makes: the constant ``start - 1`` of length 1 before
    ``x``); along another dim, of pieces with one and the same progression."""
    pieces = list(args[0])
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.dim()
    values = [value_of(t) for t in pieces]
    if any(v is None for v in values):
        return None
    lines = [p for p in values if isinstance(p, Progression)]
    if any(p.dim != dim for p in lines):  # along another dim: the same progression in every piece
        return lines[0] if all(v == lines[0] for v in values) else None
    step, start, offset = lines[0].step, None, 0
    for t, v in zip(pieces, values):
        first = v.start if isinstance(v, Progression) else v
        if isinstance(v, Progression) and not _equal(v.step, step):
            return None
        if not isinstance(v, Progression) and not tc.known_true(t.shape[dim] == 1):
            return None  # a run of one value inside a progression
        if start is None:
            start = first
        elif not _equal(first, start + step * offset):
            return None
        offset = offset + t.shape[dim]
    return Progression(start, step, dim)


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for numbers or sizes, decided without adding a guard on the user's dims."""
    if isinstance(a, (bool, int, float)) and isinstance(b, (bool, int, float)):
        return a == b
    return tc.known_true(a == b)


def _same_size(a: Any, b: Any) -> bool:
    return a is b or _equal(a, b)


__all__ = ["Progression", "arange_value", "computed", "cumsum_of_constant", "made"]
