"""The strides ATen's ``view`` gives its result, where they matter and fake tensors differ.

A view's strides are fixed by its sizes except at dims of size 1, whose stride is arbitrary. ATen
(``computeStride`` in TensorUtils.cpp) and PyTorch's Python reference used for fake tensors choose
different arbitrary values there: ``x.transpose(1, 2).reshape(1, C, H, W)`` gets a batch stride
of C (ATen) or C*H*W (fake). It is not cosmetic: kernels pick their memory format from *all* strides
(``suggest_memory_format``: at batch 1 that view is channels-last for the fake tensor, contiguous
for the real one), so a real convolution then copies its input and reorders it, which the fake
one never shows. The simulation gives each view the strides ATen would.

>>> aten_view_strides((1, 16, 64), (1024, 1, 16), (1, 16, 8, 8))
[16, 1, 128, 16]
"""
from __future__ import annotations

from typing import Any, Sequence


def aten_view_strides(old_shape: Sequence[Any], old_strides: Sequence[Any], new_shape: Sequence[Any]) -> list | None:
    """The strides ATen's ``view`` gives a tensor of ``old_shape``/``old_strides`` viewed as
    ``new_shape`` (sizes may be SymInts), or None where ATen could not view it (or it is empty)."""
    if not old_shape or any(_is(d, 0) for d in old_shape):
        return None
    new_strides: list = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    # walk the old dims from the innermost: a run of dims that are contiguous with each other (a
    # "chunk") can be split or merged freely; its innermost stride is the base of the new strides
    chunk_base = old_strides[-1]
    tensor_numel, view_numel = 1, 1
    for d in range(len(old_shape) - 1, -1, -1):
        tensor_numel = tensor_numel * old_shape[d]
        chunk_ends = d == 0 or (not _is(old_shape[d - 1], 1) and old_strides[d - 1] != tensor_numel * chunk_base)
        if not chunk_ends:
            continue
        # new dims take the chunk's elements; a size-1 new dim takes the stride of what follows it
        while view_d >= 0 and (view_numel < tensor_numel or _is(new_shape[view_d], 1)):
            new_strides[view_d] = view_numel * chunk_base
            view_numel = view_numel * new_shape[view_d]
            view_d -= 1
        if view_numel != tensor_numel:
            return None
        if d > 0:
            chunk_base, tensor_numel, view_numel = old_strides[d - 1], 1, 1
    return new_strides if view_d == -1 else None


def _is(size: Any, value: int) -> bool:
    # only a size known to be ``value`` counts (a symbolic size never is 0 or 1 in an analysis)
    return isinstance(size, int) and size == value


def size_one_strides(old_shape: Sequence[Any], old_strides: Sequence[Any], new_shape: Sequence[Any],
                     new_strides: Sequence[Any]) -> list | None:
    """``new_strides`` with the strides of the size-1 dims ATen's view would give, or None when
    they already agree (or there is no size-1 dim, or ATen would not view)."""
    ones = [i for i, d in enumerate(new_shape) if _is(d, 1)]
    if not ones:
        return None
    try:
        real = aten_view_strides(old_shape, old_strides, new_shape)
    except RuntimeError:  # a comparison on a size the data decides (x[mask]): leave the strides as they are
        return None
    if real is None:
        return None
    fixed = list(new_strides)
    for i in ones:
        fixed[i] = real[i]
    return None if all(_same(a, b) for a, b in zip(fixed, new_strides)) else fixed


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a == b or a is b
