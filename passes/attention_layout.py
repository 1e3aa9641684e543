"""Attention layouts: the model's tensors laid out as the fused kernel wants them, and back.

An attention over decomposed scores has axes of four kinds: *i* (the rows softmax normalises, the
s side), *j* (the columns it runs over, the t side), *group* axes (both sides vary: a batch, the
heads) and size-1 axes. The fused kernel (:mod:`fxmem.ops.attention`) takes ``s`` as
[Gm, Gh, N], ``t`` as [Gm, Gh, M], the values as [Gm, Gh, M, F] and the mask's source as
[Am, N, M], where the Gm group axes are those the mask varies along (a batch) and the Gh ones those
it is shared by (heads). An :class:`Axes` recipe - which size-1 dims to drop, how to permute, how
many axes form each group - says how to get there from a tensor of the model; applied with
:func:`gather_axes` (views, or a copy where a permuted tensor must be flattened), undone for the
result with :func:`scatter_axes`. Recipes are tuples of ints, so they print in the rewritten
graph's code.

>>> gather_axes(torch.zeros(4, 1, 7, 3), ((1,), (0, 2, 1), (1, 1)))).shape   # doctest: +SKIP
torch.Size([4, 3, 7])
"""
from __future__ import annotations

from typing import Sequence

import torch

# (dims to squeeze, permutation of the rest, sizes of the leading groups flattened to one axis each)
Axes = tuple


def gather_axes(x: torch.Tensor, axes: Axes) -> torch.Tensor:
    """``x`` with the size-1 dims ``axes[0]`` dropped, permuted by ``axes[1]``, and its leading
    axes merged group by group (``axes[2]``: a group of 0 axes becomes a new size-1 axis)."""
    squeeze, order, groups = axes
    if squeeze:
        x = x.squeeze(squeeze)
    if tuple(order) != tuple(range(len(order))):
        x = x.permute(order)
    pos = 0
    for n in groups:
        if n == 0:
            x = x.unsqueeze(pos)
        elif n > 1:
            x = x.flatten(pos, pos + n - 1)
        pos += 1
    return x


def scatter_axes(r: torch.Tensor, like: torch.Tensor, like_axes: Axes, order: Sequence[int],
                 unsqueeze: Sequence[int]) -> torch.Tensor:
    """Undo :func:`gather_axes` on a result ``r`` whose leading group axes match those of ``like``
    gathered with ``like_axes`` (their sizes come from ``like``): split the groups, permute by
    ``order``, insert size-1 dims at ``unsqueeze`` (increasing)."""
    squeeze, like_order, groups = like_axes
    sizes = like.squeeze(squeeze) if squeeze else like
    if tuple(like_order) != tuple(range(len(like_order))):
        sizes = sizes.permute(like_order)
    pos, k = 0, 0
    for n in groups:
        if n == 0:
            r = r.squeeze(pos)
        elif n == 1:
            pos += 1
        else:
            r = r.unflatten(pos, tuple(sizes.shape[k:k + n]))
            pos += n
        k += n
    if tuple(order) != tuple(range(len(order))):
        r = r.permute(tuple(order))
    for a in unsqueeze:
        r = r.unsqueeze(a)
    return r


def recipe(shape: Sequence[int], varying_axes: Sequence[int], wanted: Sequence[int],
           groups: Sequence[int]) -> Axes:
    """The recipe that takes a tensor of ``shape`` - whose non-1 dims are, in order, the
    ``varying_axes`` of the attention - to the axes ``wanted`` (in that order), grouped as ``groups``.

    The size-1 dims of ``shape`` are dropped (at probe sizes every dim that varies is >= 3, so a
    size-1 dim is one at every size).
    """
    squeeze = tuple(d for d, size in enumerate(shape) if size == 1)
    kept = list(varying_axes)
    return squeeze, tuple(kept.index(a) for a in wanted), tuple(groups)
