"""Where the autograd engine (and backward formulas) reuse a buffer in place for real tensors but
allocate a new one for fake tensors, which count as tensor subclasses.

An ENGINE rule is ``fn(call, table, between_nodes, node) -> tensor | None``: the argument whose
storage record the op's output takes over (the real kernel wrote into that buffer: no allocation,
and the argument's death is not a free), or None when real and fake agree. ``table`` is the
simulation's :class:`~fxmem.simulation.storages.StorageTable`; ``between_nodes`` says the engine is
between two backward nodes (where it accumulates gradients); ``node`` is the fx node being run.

>>> engine_rule(torch.ops.aten.add.Tensor).why                                     # doctest: +SKIP
'InputBuffer::accumulate adds two gradients for one input in place ...'
"""
from __future__ import annotations

from typing import Any

import torch

from .. import _torch_compat as tc
from ..records import Phase, Role
from .registry import ANY, Call, Kind, rule

aten = torch.ops.aten


@rule(Kind.ENGINE, aten.add.Tensor, device=ANY)
def _accumulates_in_place(call: Call, table: Any, between_nodes: bool, node: str) -> torch.Tensor | None:
    """InputBuffer::accumulate adds a second gradient for one input in place into the first one when
    that is a plain dense tensor it holds the last reference to (can_accumulate_inplace(old_var));
    never into the arriving one. For subclass-like (fake) tensors it always adds out of place."""
    outs, args = call.outputs, call.args
    inside = _rnn_linear_bias(call, table)
    if inside is not None:
        return inside
    if not between_nodes or call.phase != Phase.BACKWARD or len(outs) != 1 or len(args) < 2:
        return None
    for old in (args[0],):  # old_var + var: only the gradient already in the buffer is reused
        if not isinstance(old, torch.Tensor) or old.shape != outs[0].shape or old.dtype != outs[0].dtype:
            continue
        index = table.lookup(old)
        if index is None:
            continue
        rec = table.storages[index]
        # a view (a reshape backward's result) shares its storage with a base the engine still holds:
        # its storage's use count is not 1, so the real engine adds out of place
        if (rec.step is not None and rec.phase == Phase.BACKWARD and not rec.saved_by and not rec.is_output
                and rec.role != Role.GRADIENT and not tc.is_view(old) and table.is_whole(old, index)
                and tc.non_overlapping_and_dense(old) and _engine_holds_the_last_reference(old, args[1])):
            return old
    return None


def _engine_holds_the_last_reference(old: torch.Tensor, new: Any) -> bool:
    """Whether the input buffer holds ``old``'s only TensorImpl reference (use_count() == 1 in
    can_accumulate_inplace). A backward formula that passes its incoming gradient on unchanged to
    several inputs (AddBackward of GPT-NeoX's ``mlp + attn + hidden``) hands the same tensor to
    several buffers: it has more owners, and the real engine adds out of place. Counted against the
    arriving gradient, which reaches ``add`` the same way (so the dispatcher's own references cancel);
    ``x + x`` hands both buffers one tensor."""
    if not isinstance(new, torch.Tensor) or new is old:
        return False
    return tc.tensor_use_count(old) <= tc.tensor_use_count(new)


def _rnn_linear_bias(call: Call, table: Any) -> torch.Tensor | None:
    """Inside ATen's recurrent layers (C++ calling ``at::linear`` on the whole sequence): a real
    tensor's bias is added in place into the matmul's result, a subclass-like (fake) one's out of
    place (``linear``'s composite-compliance branch) - one more (T, B, gates) buffer. Only while a
    recurrent layer runs: the same add written in Python is out of place for real tensors too."""
    from .rnn import inside_aten_rnn

    outs, args = call.outputs, call.args
    if not inside_aten_rnn() or len(outs) != 1 or len(args) != 2 or call.kwargs.get("alpha", 1) != 1:
        return None
    result, bias = args
    if not (isinstance(result, torch.Tensor) and isinstance(bias, torch.Tensor)) or bias.dim() != 1 \
            or result.dim() < 3 or result.shape != outs[0].shape or result.dtype != outs[0].dtype \
            or bias.shape[0] != result.shape[-1]:
        return None
    index = table.lookup(result)
    if index is None or table.storages[index].op is None or "mm" not in table.storages[index].op:
        return None  # not the matmul's fresh result
    return result


# ops that make the zeros a backward formula then fills (by op name, as storages record it)
_ZEROS = frozenset(tc.op_name(p) for p in (aten.zeros, aten.new_zeros, aten.zeros_like, aten.full, aten.new_full,
                                           aten.full_like))


@rule(Kind.ENGINE, aten.scatter, aten.scatter_add, aten.index_add, aten.index_put, aten.masked_scatter,
      aten.index_fill, aten.index_copy, device=ANY)
def _fills_fresh_zeros(call: Call, table: Any, between_nodes: bool, node: str) -> torch.Tensor | None:
    """Backward formulas (index_select_backward, gather_backward, value_selecting_reduction_backward
    ...) fill fresh zeros in place for real tensors, out of place for subclass-like (fake) ones."""
    outs, args = call.outputs, call.args
    if call.phase != Phase.BACKWARD or len(outs) != 1 or not args:
        return None
    base = args[0]
    if not isinstance(base, torch.Tensor) or base.shape != outs[0].shape:
        return None
    index = table.lookup(base)
    if index is None:
        return None
    rec = table.storages[index]
    made_here = rec.phase == Phase.BACKWARD and rec.node == node
    if made_here and ".".join((rec.op or "").split(".")[:2]) in _ZEROS and not rec.saved_by:
        return base
    return None


def _returns_its_input(call: Call, table: Any, between_nodes: bool, node: str) -> torch.Tensor | None:
    """``wait_tensor`` waits for a collective and returns its argument itself (no allocation); its
    fake kernel returns a new tensor. (Tensor parallelism waits on every all-reduce it issues: one
    activation-sized buffer too many at each, in forward and backward, otherwise.)"""
    outs, args = call.outputs, call.args
    if len(outs) != 1 or not args or not isinstance(args[0], torch.Tensor) or table.lookup(outs[0]) is not None:
        return None  # the fake output is the argument's own storage already
    return args[0] if table.lookup(args[0]) is not None else None


_WAIT = tc.functional_collective("wait_tensor")  # None without torch.distributed
if _WAIT is not None:
    rule(Kind.ENGINE, _WAIT, device=ANY)(_returns_its_input)
