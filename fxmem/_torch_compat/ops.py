"""torch's op objects and their schemas, Python dispatch, pytree: ``torch._ops``,
``torch.utils._python_dispatch``, ``torch.utils._pytree``, ``torch._decomp``, ``torch._prims_common``.

Kernel rules are keyed by op (``OpOverload`` / ``OpOverloadPacket``) and read one call's arguments by
their schema names; the simulation sees every aten op through a ``TorchDispatchMode`` (below autograd
and composite decompositions, so it sees the contiguous copies ``matmul`` makes, not just the fx
node that asked for them) and takes the tensors out of nested outputs (tuples, dicts, dataclasses)
with pytree.

On a torch upgrade, what breaks here: the fields of ``op._schema`` (``arguments``, ``alias_info``
and its ``is_write``, ``is_mutable``, the argument types ``torch._C.TensorType`` / ``NumberType``),
``OpOverload``'s ``overloadpacket`` and a packet's ``overloads()``; ``_disable_current_modes``;
pytree's functions; ``torch._decomp.decompositions.matmul``; the layout helpers of
``torch._prims_common``; the ``upsample_*`` bindings of ``torch._C._nn`` and their ``.vec``
overloads; the ops ``torch.profiler.record_function`` calls.

The lowest module of the package: it imports none of the others.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode


DispatchMode = TorchDispatchMode


def real_mode() -> Any:
    """Context in which no fake/dispatch mode is active, so ops run for real."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def torch_release() -> str:
    """This torch's ``major.minor`` (``"2.13"``), as kernel rules state what they were checked on."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def is_op(obj: Any) -> bool:
    """Whether ``obj`` is a torch op (``torch.ops.aten.mm`` or ``torch.ops.aten.mm.default``)."""
    return isinstance(obj, (OpOverload, OpOverloadPacket))


def op_packet(func: Any) -> Any:
    """The op packet of an overload (``aten.mul.Tensor`` -> ``aten.mul``); anything else as it is."""
    return getattr(func, "overloadpacket", func)


def op_name(func: Any) -> str:
    """``aten.mm.default`` -> ``aten.mm``; overload kept only when it is not ``default``."""
    name = str(func)
    return name[: -len(".default")] if name.endswith(".default") else name


def op_packet_name(func: Any) -> str:
    """``aten.mul.Tensor`` -> ``aten.mul``."""
    packet = getattr(func, "overloadpacket", None)
    return str(packet) if packet is not None else str(func)


def argument_names(op: Any) -> list[str]:
    """The names of an op overload's schema arguments (a packet: its default overload's)."""
    if isinstance(op, OpOverloadPacket):
        op = getattr(op, "default", None) or getattr(op, op.overloads()[0])
    return [a.name for a in op._schema.arguments]


def bind_arguments(func: Any, args: tuple, kwargs: dict) -> dict:
    """The arguments of one call of ``func`` by schema name, in schema order (only those given)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return dict(kwargs)
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
    return out


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes into (in-place ops, ``out=``): its schema marks them."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


def mutates(func: Any) -> bool:
    """Whether ``func`` writes into an argument (in place or ``out=``)."""
    schema = getattr(func, "_schema", None)
    return schema is None or bool(schema.is_mutable)


def python_number_in_tensor_slot(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Python numbers passed where the schema wants a ``Tensor``.

    The Python arg parser wraps such a number into a 0-dim CPU tensor before the op runs (a real
    8-byte allocation on CPU); under a dispatch mode it shows up again as the plain number.
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, None)
        if isinstance(value, _NUMBERS) and isinstance(arg.type, torch._C.TensorType):
            found.append(plain_number(value))
    return found


def scalar_args(func: Any, args: tuple, kwargs: dict, names: tuple = ("other",)) -> list[Any]:
    """Python numbers passed in the ``Scalar`` slots called ``names`` of ``func``'s schema."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, None)
        if arg.name in names and isinstance(value, _NUMBERS) and isinstance(arg.type, torch._C.NumberType):
            found.append(plain_number(value))
    return found


def tensor_iterator_operands(func: Any, args: tuple, kwargs: dict) -> list[tuple[tuple, tuple]] | None:
    """The (sizes, strides) of the operands ATen's TensorIterator gets for ``func``: its tensor
    arguments, and ``((), ())`` for a Python number in a ``Tensor`` slot (wrapped into a 0-dim
    tensor first, as ATen's ``.Scalar`` overloads wrap their ``self``/``other``: ``eq(x, 0)``); None
    where an argument is a list of tensors (not an iterator op)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    found = []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, None)
        if isinstance(value, torch.Tensor):
            found.append((tuple(value.shape), tuple(value.stride())))
        elif isinstance(value, _NUMBERS) and (isinstance(arg.type, torch._C.TensorType) or arg.name in _WRAPPED):
            found.append(((), ()))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return None
    return found


_WRAPPED = frozenset({"self", "other"})


# Python numbers, and symbolic ones (a SymInt numel passed as a Scalar is wrapped like an int)
NUMBERS = _NUMBERS = (bool, int, float, complex, torch.SymInt, torch.SymFloat, torch.SymBool)


def plain_number(value: Any) -> Any:
    """A representative Python number of the same kind (its value never matters, its type does)."""
    if isinstance(value, torch.SymBool):
        return True
    if isinstance(value, torch.SymInt):
        return 1
    if isinstance(value, torch.SymFloat):
        return 1.0
    return value


def tree_leaves(tree: Any) -> list:
    """The leaves of a nested structure of tuples, lists, dicts (and registered containers)."""
    return _pytree.tree_leaves(tree)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """``(leaves, structure)`` of a nested structure; :func:`tree_unflatten` puts it back."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    return _pytree.tree_unflatten(leaves, spec)


def matmul_decomposition() -> Any:
    """ATen's Python decomposition of ``matmul`` (the C++ algorithm, written with symbolic sizes), or
    None where this torch has none."""
    try:
        from torch._decomp import decompositions
    except ImportError:
        return None
    return getattr(decompositions, "matmul", None)


def upsample_bindings() -> dict:
    """The Python bindings ``F.interpolate`` calls (``torch._C._nn.upsample_bilinear2d`` ...), each with
    its op packet: a binding takes the packet's ``.vec`` overload (an output size or scale factors),
    whose C++ composite reads a given output size as numbers and so refuses symbolic sizes."""
    found = {}
    for name in dir(torch._C._nn):
        packet = getattr(torch.ops.aten, name, None) if "upsample" in name else None
        if packet is not None and "vec" in packet.overloads() and "default" in packet.overloads():
            found[getattr(torch._C._nn, name)] = packet
    return found


def record_function_ops() -> frozenset:
    """The ops ``torch.profiler.record_function`` enters and exits a label with (every overload)."""
    packets = [getattr(torch.ops.profiler, name, None) for name in ("_record_function_enter_new",
                                                                    "_record_function_exit")]
    return frozenset(getattr(p, n) for p in packets if p is not None for n in p.overloads())


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``t.suggest_memory_format()`` that works on symbolic strides (channels-last or contiguous)."""
    import torch._prims_common as prims_common

    suggest = getattr(prims_common, "suggest_memory_format", None)
    if suggest is not None:
        return suggest(t)
    return t.suggest_memory_format()  # pragma: no cover - torch < 2.6


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """ATen's ``is_non_overlapping_and_dense`` (the layout condition of in-place reuse)."""
    import torch._prims_common as prims_common

    check = getattr(prims_common, "is_non_overlapping_and_dense", None) or getattr(
        prims_common, "is_non_overlapping_and_dense_or_false")
    return bool(check(t))
