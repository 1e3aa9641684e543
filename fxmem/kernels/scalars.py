"""Python numbers that become tensors, and the dtype-cast copies CPU TensorIterator makes.

The Python arg parser wraps a number passed where the schema wants a ``Tensor`` into a 0-dim CPU
tensor (a real 8-byte allocation); binary TensorIterator ops wrap their ``Scalar`` operand the same
way and, on CPU, copy every operand whose dtype differs from the common dtype before computing.
On CUDA the wrapped number lives in host memory and kernels cast on the fly: no device memory.
These apply to every op, so they wrap the op's own rule (see :func:`fxmem.kernels.hidden_program`).

>>> wrapped_numbers(Call(torch.ops.aten.mul.Tensor, (x, 0.5), {}, (out,), "cpu"))   # doctest: +SKIP
[8, 4, OUT, -4, -8]
"""
from __future__ import annotations

from typing import Any

import torch

from .. import _torch_compat as tc
from ..records import Phase
from .registry import OUT, Call, Keep, hidden

aten = torch.ops.aten

_WRAPPED_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}

# Ops whose autograd formula saves the ``other`` operand (derivatives.yaml: mul, div).
_SAVES_OTHER = frozenset({aten.mul, aten.div, aten.mul_, aten.div_})

# Binary TensorIterator ops: their Scalar overloads wrap ``other`` into a tensor and run the Tensor
# kernel, and on CPU every operand whose dtype differs from the common dtype is copied first.
_WRAPS_SCALAR_SLOT = frozenset({
    aten.add, aten.sub, aten.mul, aten.div, aten.rsub, aten.remainder, aten.fmod,
    aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge,
    aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor,
    aten.add_, aten.sub_, aten.mul_, aten.div_, aten.remainder_, aten.fmod_,
    aten.eq_, aten.ne_, aten.lt_, aten.le_, aten.gt_, aten.ge_,
})

_FOREACH_WRAPPING = frozenset(getattr(aten, f"_foreach_{op}{suffix}")
                              for op in ("add", "sub", "mul", "div") for suffix in ("", "_"))


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    # ATen's combine_categories (None = undefined): a lower-priority participant only matters
    # when it is of a higher category.
    if higher is not None and higher.is_complex:
        return higher
    if lower is not None and lower.is_complex:
        if higher is not None and higher.is_floating_point:
            return torch.promote_types(higher, torch.complex64)
        return lower
    if higher is not None and higher.is_floating_point:
        return higher
    if higher == torch.bool or (lower is not None and lower.is_floating_point):
        if higher is None or lower is None:
            return higher if lower is None else lower
        return torch.promote_types(higher, lower)
    return higher if higher is not None else lower


def result_dtype(tensors: list[torch.Tensor], numbers: list[Any]) -> torch.dtype:
    """PyTorch's type promotion: dim>0 tensors, then 0-dim tensors, then Python numbers."""
    dim = zero = wrapped = None
    for t in tensors:
        if t.dim() > 0:
            dim = t.dtype if dim is None else torch.promote_types(dim, t.dtype)
        else:
            zero = t.dtype if zero is None else torch.promote_types(zero, t.dtype)
    for n in numbers:
        d = (torch.bool if isinstance(n, bool) else torch.int64 if isinstance(n, int)
             else torch.get_default_dtype() if isinstance(n, float) else torch.complex64)
        wrapped = d if wrapped is None else torch.promote_types(wrapped, d)
    out = _combine(dim, _combine(zero, wrapped))
    return out if out is not None else torch.get_default_dtype()


def wrapped_numbers(call: Call) -> list:
    """Wrapped Python numbers, and the dtype-cast copies CPU TensorIterator makes of operands."""
    packet = tc.op_packet(call.func)
    in_tensor_slot = tc.python_number_in_tensor_slot(call.func, call.args, call.kwargs)
    binary = packet in _WRAPS_SCALAR_SLOT
    numbers = list(in_tensor_slot) + (tc.scalar_args(call.func, call.args, call.kwargs) if binary else [])
    inputs = call.tensors
    if not numbers and not binary:
        return []
    common = result_dtype(inputs, numbers) if binary else None
    # x * 0.5 with x requiring grad: MulBackward0 keeps the wrapped 0.5 until backward
    saved = (call.grad_enabled and packet in _SAVES_OTHER and bool(in_tensor_slot)
             and any(t.requires_grad for t in inputs))
    # a custom autograd.Function's backward is Python: its numbers are wrapped afresh, call by call
    python_backward = call.phase == Phase.BACKWARD and bool(in_tensor_slot) and tc.in_python_backward()
    before: list = []
    after: list = []
    for k, n in enumerate(numbers):
        wrapped = _WRAPPED_DTYPE[type(n)]
        if call.phase == Phase.BACKWARD and k < len(in_tensor_slot) and not python_backward:
            continue  # a backward formula's number in a Tensor slot is the wrapped tensor it saved
        if saved and k == 0:
            before.append(Keep(wrapped.itemsize, wrapped, f"{packet} saves the wrapped number {n!r} for backward"))
        else:
            before.append(wrapped.itemsize)
            after.append(-wrapped.itemsize)
    casts = []
    if binary:
        for n in numbers:
            if _WRAPPED_DTYPE[type(n)] != common:
                casts.append(common.itemsize)
        outputs = {id(o) for o in call.outputs}
        for t in inputs:
            if t.dtype != common and id(t) not in outputs:
                casts.append(t.numel() * common.itemsize)
    return before + casts + [OUT] + [-c for c in reversed(casts)] + after


def foreach_numbers(call: Call) -> list:
    """CPU runs ``_foreach`` ops as a loop of per-tensor ops; each add/sub/mul/div by a Python number
    wraps the number (and casts it to the tensor's dtype) again, one tensor at a time."""
    if tc.op_packet(call.func) not in _FOREACH_WRAPPING:
        return []
    scalar = None
    for value in call.bound.values():
        if isinstance(value, tc.NUMBERS):
            scalar = tc.plain_number(value)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], tc.NUMBERS):
            scalar = tc.plain_number(value[0])
    tensors = call.tensors
    if scalar is None or not tensors:
        return []
    wrapped = _WRAPPED_DTYPE[type(scalar)]
    common = result_dtype([tensors[0]], [scalar])
    cast = common.itemsize if common != wrapped else 0
    return [wrapped.itemsize, cast, OUT, -cast, -wrapped.itemsize] if cast else [wrapped.itemsize, OUT, -wrapped.itemsize]


@hidden(aten.mean, device="cpu")
def _mean_cpu(call: Call) -> list | None:
    """sum (with a reduction's cast and two-pass buffer, see cpu.reduction_scratch), then div_ by the
    element count: an int64 wrapped scalar copied to the result dtype."""
    from .cpu import reduction_scratch  # the sum inside mean is a reduction like any other

    out = call.outputs[0]
    if not out.dtype.is_floating_point:
        return None
    cast, buffer, flags = reduction_scratch(call)
    inner = [c for c in (cast, buffer) if not (isinstance(c, int) and c == 0)]
    return [OUT, *inner, *[-c for c in reversed(inner)], 8, out.element_size(), -out.element_size(), -8, *flags]
