"""TorchDynamo and fx: ``torch._dynamo`` (what a captured graph's placeholders were traced with, the
size guards the graph holds under, the compiled frames Dynamo keeps per code object, what
``torch.compile`` returns) and higher-order operators (``torch._ops.HigherOrderOperator``: an fx node
that runs a subgraph of its own, such as checkpoint, cond, wrap).

On a torch upgrade, what breaks here: the keys of a Dynamo node's ``meta`` (``example_value``,
``tensor_dict``), ``torch._C._dynamo.eval_frame._debug_get_cache_entry_list``,
``torch._dynamo.eval_frame.reset_code`` and ``OptimizedModule``, the ``_torchdynamo_orig_callable``
attribute, and where ``HigherOrderOperator`` lives.

Imports :mod:`.fake` (a SymInt's sympy expression, the ShapeEnv's replacements).
"""
from __future__ import annotations

from typing import Any, Sequence

import sympy
import torch

from .fake import raw_expr, replacements


def dynamo_example_value(node: Any) -> Any:
    """What TorchDynamo traced a placeholder of its graph with: a FakeTensor whose sizes are
    SymInts (or ints where Dynamo specialised), or a SymInt; None if the graph does not say."""
    return node.meta.get("example_value")


def dynamo_input_sizes(value: Any) -> list[sympy.Expr] | None:
    """The sizes of a Dynamo example tensor as sympy expressions over Dynamo's own symbols."""
    if not isinstance(value, torch.Tensor):
        return None
    return [raw_expr(d) for d in value.shape]


def dynamo_wrapped_number(node: Any, real: Any) -> bool:
    """Whether a Dynamo graph input is a Python float Dynamo wrapped into a 0-d float64 tensor
    (``specialize_float=False``; it makes the tensor at each call and reads it with ``.item()``),
    not a tensor the caller passed (those carry their ``__dict__`` as ``tensor_dict``)."""
    return (isinstance(real, torch.Tensor) and real.dim() == 0 and real.dtype == torch.float64
            and "tensor_dict" not in node.meta)


def dynamo_shape_guards(values: Sequence[Any]) -> list[sympy.Expr]:
    """The size guards TorchDynamo's graph holds under (``s77 <= 10`` after a branch on a size),
    with the sizes it fixed put in (``Eq(s27, 16)`` becomes true and is left out)."""
    env = None
    for v in values:
        sizes = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        env = next((d.node.shape_env for d in sizes if isinstance(d, torch.SymInt)), None)
        if env is not None:
            break
    if env is None:
        return []
    fixed = replacements(env)
    out = []
    for g in env.guards:
        expr = g.expr.xreplace(fixed)
        if expr is not sympy.true and expr != sympy.true:
            out.append(expr)
    return out


def dynamo_cache_entries(code: Any) -> int:
    """How many compiled frames TorchDynamo keeps for a code object (0 where this torch cannot say)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - older torch
        return 0
    return len(_debug_get_cache_entry_list(code))


def forget_compiled(code: Any) -> None:
    """Drop what TorchDynamo keeps for ``code`` once a capture is done: its compiled frames, and
    with them the globals Dynamo installed in the frame's module (``__builtins_dict___0``,
    ``__compiled_fn_...``), removed by cleanup hooks when the compiled code dies. Left until
    interpreter exit, those hooks run after the module's dict was cleared and print "Exception
    ignored ... KeyError: '__builtins_dict___0'"; run now, they find their globals."""
    try:
        from torch._dynamo.eval_frame import reset_code
    except ImportError:  # pragma: no cover - older torch
        return
    reset_code(code)


def is_compiled_function(fn: Any) -> bool:
    """Whether ``fn`` is what ``torch.compile`` returns: a function wrapped by TorchDynamo (it keeps
    the original as ``_torchdynamo_orig_callable``), or a compiled module (``OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule
    return isinstance(fn, OptimizedModule) or hasattr(fn, "_torchdynamo_orig_callable")


def is_higher_order_op(target: Any) -> bool:
    """Whether an fx node's target is a higher-order operator (checkpoint, cond, wrap, ...), which
    runs a subgraph of its own."""
    from torch._ops import HigherOrderOperator

    return isinstance(target, HigherOrderOperator)


def side_effect(fn: Any) -> Any:
    """``fn`` marked as an fx call with a side effect, so dead-code elimination keeps its node (an
    attribute the forward stores): ``torch.fx.node.has_side_effect``."""
    mark = getattr(torch.fx.node, "has_side_effect", None)
    return mark(fn) if mark is not None else fn
