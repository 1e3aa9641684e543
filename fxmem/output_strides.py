"""The strides ATen gives an op's new output, where fake tensors give others.

A dim of size 1 may have any stride, and ATen's kernels and PyTorch's Python references (which fake
tensors run) choose differently. ``h / 2`` of a batch-1 image made from tokens, a (1, C, H, W) view
with strides (C, 1, W*C, C), keeps the batch stride C in ATen's TensorIterator and gets C*H*W from
the reference. It is not cosmetic: kernels read every stride to choose a memory format
(``suggest_memory_format``). At batch 1 the real tensor is then contiguous-by-default and the fake
one channels-last, so the real GroupNorm copies it to NCHW and its convolution takes another path,
which the simulation never shows (a diffusers UNet's attention block was 32,768 B high at B=1).
``tests/simulation/test_output_strides.py`` checks every rule against real ATen outputs.

The knowledge is a registry keyed by op packet; each rule gives the strides ATen would give:

* ops tagged ``pointwise`` run on a TensorIterator (:func:`tensor_iterator_strides`, ATen's
  ``fast_set_up`` and ``reorder_dimensions``); only their size-1 dims are corrected, where the
  Python reference parts from ATen;
* ``empty_like(memory_format=preserve)`` and the ops built on it (``zeros_like`` ... ``flip``,
  ``roll``, ``sort``) keep the input's strides when it is non-overlapping and dense
  (:func:`preserve_strides`).

Sizes and strides may be SymInts: every comparison is made only where it is known without adding a
guard, and a rule that cannot decide leaves the fake strides as they are.

>>> tensor_iterator_strides((1, 4, 2, 2), [((1, 4, 2, 2), (4, 1, 8, 4)), ((), ())])
[4, 1, 8, 4]
>>> preserve_strides((1, 4, 2, 2), (4, 1, 8, 4))
[4, 1, 8, 4]
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true


aten = torch.ops.aten


class _Unknown(Exception):
    """A comparison that depends on sizes the analysis keeps symbolic."""


def _known(cond: Any) -> bool:
    return cond if isinstance(cond, bool) else bool(statically_known_true(cond))


def _lt(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    if _known(a < b):
        return True
    if _known(a >= b):
        return False
    raise _Unknown


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if _known(a == b):
        return True
    if _known(a != b):
        return False
    raise _Unknown


def _is(size: Any, value: int) -> bool:
    return isinstance(size, int) and size == value


def non_overlapping_and_dense(shape: Sequence[Any], strides: Sequence[Any]) -> bool:
    """ATen's ``compute_non_overlapping_and_dense`` (dims of size < 2 are ignored)."""
    if len(shape) == 1:
        return _lt(shape[0], 2) or _eq(strides[0], 1)
    dims = [d for d in range(len(shape)) if not _lt(shape[d], 2)]
    dims = _stable_sort(dims, lambda a, b: _lt(strides[a], strides[b]))
    need = 1
    for d in dims:
        if not _eq(strides[d], need):
            return False
        need = need * shape[d]
    return True


def _stable_sort(items: list, less: Callable[[Any, Any], bool]) -> list:
    out: list = []
    for x in items:
        i = len(out)
        while i > 0 and less(x, out[i - 1]):
            i -= 1
        out.insert(i, x)
    return out


def _is_contiguous(shape: Sequence[Any], strides: Sequence[Any]) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if _is(size, 1):
            continue
        if not _eq(stride, expected):
            return False
        expected = expected * size
    return True


def _is_channels_last(shape: Sequence[Any], strides: Sequence[Any]) -> bool:
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(len(shape))
    if order is None:
        return False
    expected = 1
    for d in order:
        if _is(shape[d], 1):
            continue
        if not _eq(strides[d], expected):
            return False
        expected = expected * shape[d]
    return True


def _channels_last_strides(shape: Sequence[Any]) -> list:
    order = (1, 3, 2, 0) if len(shape) == 4 else (1, 4, 3, 2, 0)
    strides: list = [0] * len(shape)
    run: Any = 1
    for d in order:
        strides[d] = run
        run = run * shape[d]
    return strides


def _dense_in_order(shape: Sequence[Any], perm: Sequence[int]) -> list:
    """Strides packing ``shape`` densely, ``perm[0]`` fastest (a size-1 dim takes the stride of what
    follows it, as ATen's ``compatible_stride`` / ``infer_dense_strides`` give)."""
    strides: list = [0] * len(shape)
    run: Any = 1
    for d in perm:
        strides[d] = run
        if not _is(shape[d], 1):
            run = run * shape[d]
    return strides


def _permutation(shape: Sequence[Any], operand_strides: list[list]) -> list[int]:
    """ATen's ``reorder_dimensions`` (and ``infer_dense_strides``): the dims from fastest to slowest,
    by an insertion sort that keeps the order where the operands' strides do not tell."""
    ndim = len(shape)
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(d0: int, d1: int) -> int:
        for strides in operand_strides:
            s0, s1 = strides[d0], strides[d1]
            if _is(s0, 0) or _is(s1, 0):
                continue
            if _lt(s0, s1):
                return -1
            if _lt(s1, s0):
                return 1
            if _lt(shape[d1], shape[d0]):
                return 1
        return 0

    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    return perm


def tensor_iterator_strides(shape: Sequence[Any], operands: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list:
    """The strides of a TensorIterator's new output of ``shape`` over input ``operands`` (each
    ``(sizes, strides)``; a Python number in a tensor slot is ``((), ())``)."""
    ndim = len(shape)
    if ndim == 0:
        return []
    if all(len(s) == ndim and all(_eq(a, b) for a, b in zip(s, shape)) for s, _ in operands):
        # fast_set_up: every operand has the output's shape
        if all(_is_contiguous(s, st) for s, st in operands):
            return _dense_in_order(shape, range(ndim - 1, -1, -1))
        if all(_is_channels_last(s, st) for s, st in operands):
            return _channels_last_strides(shape)
        if all(non_overlapping_and_dense(s, st) for s, st in operands):
            last = list(operands[-1][1])
            if all(len(st) == ndim and all(_eq(a, b) for a, b in zip(st, last)) for _, st in operands):
                return last
    aligned = []
    for sizes, strides in operands:
        offset = ndim - len(sizes)
        row: list = [0] * ndim
        for i, (size, stride) in enumerate(zip(sizes, strides)):
            row[offset + i] = 0 if _is(size, 1) and not _is(shape[offset + i], 1) else stride
        aligned.append(row)
    if ndim == 1:
        return [1]
    return _dense_in_order(shape, _permutation(shape, aligned))


def preserve_strides(shape: Sequence[Any], strides: Sequence[Any]) -> list:
    """The strides of ``empty_like(t, memory_format=torch.preserve_format)`` for ``t`` of ``shape``
    and ``strides``: the same where ``t`` is non-overlapping and dense, else dense in ``t``'s order."""
    if non_overlapping_and_dense(shape, strides):
        return list(strides)
    return _dense_in_order(shape, _permutation(shape, [list(strides)]))


def _tensor_iterator(args: tuple, kwargs: dict, operands: list | None, out: torch.Tensor) -> list | None:
    if not operands:
        return None
    return tensor_iterator_strides(tuple(out.shape), operands)


def _input(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor | None:
    x = args[0] if args else kwargs.get("self", kwargs.get("input"))
    if not isinstance(x, torch.Tensor) or len(x.shape) != len(out.shape):
        return None
    return x


def _like(args: tuple, kwargs: dict, operands: list | None, out: torch.Tensor) -> list | None:
    """``empty_like``'s family, ``clone`` and ``_to_copy``: the memory format asked for; preserve
    (the default) keeps a non-overlapping and dense input's strides."""
    x = _input(args, kwargs, out)
    if x is None:
        return None
    fmt = kwargs.get("memory_format")
    if fmt is None or fmt == torch.preserve_format:
        return preserve_strides(tuple(x.shape), tuple(x.stride()))
    if fmt == torch.contiguous_format:
        return _contiguous(args, kwargs, operands, out)
    if fmt == torch.channels_last and out.dim() == 4 or fmt == torch.channels_last_3d and out.dim() == 5:
        return _channels_last_strides(tuple(out.shape))
    return None


def _preserve(args: tuple, kwargs: dict, operands: list | None, out: torch.Tensor) -> list | None:
    x = _input(args, kwargs, out)
    return None if x is None else preserve_strides(tuple(x.shape), tuple(x.stride()))


def _contiguous(args: tuple, kwargs: dict, operands: list | None, out: torch.Tensor) -> list:
    return _dense_in_order(tuple(out.shape), range(out.dim() - 1, -1, -1))


def _suggested(args: tuple, kwargs: dict, operands: list | None, out: torch.Tensor) -> list | None:
    """Dense in the input's suggested memory format (``roll`` copies a non-contiguous input so)."""
    x = _input(args, kwargs, out)
    if x is None:
        return None
    if _strides_like_channels_last(tuple(x.shape), tuple(x.stride())):
        return _channels_last_strides(tuple(out.shape))
    return _contiguous(args, kwargs, operands, out)


def _strides_like_channels_last(shape: Sequence[Any], strides: Sequence[Any]) -> bool:
    """ATen's ``is_channels_last_strides_2d`` / ``_3d`` (what ``suggest_memory_format`` reads)."""
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(len(shape))
    if order is None or _is(strides[1], 0):
        return False
    low: Any = 0
    for d in order:
        if _is(shape[d], 0) or _lt(strides[d], low):
            return False
        if d == 0 and _eq(low, strides[1]):
            return False  # N111-like: ambiguous, ATen falls back to contiguous
        low = strides[d] if _is(shape[d], 1) else strides[d] * shape[d]
    return True


# op packet -> (rule, whether it may change strides at dims of any size, not only size-1 ones). Read
# off ATen's kernels; tests/simulation/test_output_strides.py checks each against real outputs.
RULES: dict[Any, tuple[Callable[..., list | None], bool]] = {
    **{p: (_like, True) for p in (aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like,
                                  aten.randn_like, aten.randint_like, aten.clone, aten._to_copy)},
    **{p: (_preserve, True) for p in (aten.flip, aten.sort)},
    aten.roll: (_suggested, True),
    # batch norm's CPU kernels: empty_like(input, input.suggest_memory_format())
    aten.native_batch_norm: (_suggested, True),
    aten._native_batch_norm_legit: (_suggested, True),
    aten._native_batch_norm_legit_no_training: (_suggested, True),
    # masked_fill: an expanded contiguous clone, filled in place; layer norm: contiguous Y, mean, rstd
    aten.masked_fill: (_contiguous, True),
    aten.native_layer_norm: (_contiguous, True),
}


def _rule(func: Any) -> tuple[Callable[..., list | None], bool] | None:
    packet = getattr(func, "overloadpacket", None)
    found = RULES.get(packet)
    if found is not None:
        return found
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return _tensor_iterator, False
    return None


def aten_output_strides(func: Any, args: tuple, kwargs: dict, operands: list | None, out: torch.Tensor) -> list | None:
    """The strides ATen would give ``func``'s new output ``out``, where they differ from ``out``'s,
    or None (no rule, the same strides, or sizes that keep the answer symbolic). ``operands``: the
    (sizes, strides) of the TensorIterator's inputs, or None where ``func`` is not a functional
    iterator op (it writes into an argument, or takes a list of tensors)."""
    if out.layout != torch.strided or out.dim() == 0:
        return None
    found = _rule(func)
    if found is None:
        return None
    rule, any_dim = found
    if not any_dim and not any(_is(d, 1) for d in out.shape):
        return None
    try:
        real = rule(args, kwargs, operands, out)
        if real is None:
            return None
        have = list(out.stride())
        fixed = [r if any_dim or _is(size, 1) else h for r, h, size in zip(real, have, out.shape)]
        if all(_eq(a, b) for a, b in zip(fixed, have)):
            return None
        if not non_overlapping_and_dense(tuple(out.shape), fixed):
            return None  # never make a new output overlap or leave gaps: its storage is the fake one's
    except (_Unknown, RuntimeError):  # RuntimeError: a comparison on a size the data decides
        return None
    return fixed
