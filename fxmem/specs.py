"""Input specs: what the user says about each ``forward`` argument, in their own dim names.

A spec is one of

* a tuple mixing ints and dim names/expressions: ``("B", "N", 6)``, ``("B", "H*D")``;
* ``TensorSpec(shape, dtype=..., requires_grad=...)`` for other dtypes (``bool`` adjacency,
  ``int64`` edge lists) or an input that requires grad;
* a real ``torch.Tensor``, which stands for a concrete input of its shape and dtype.

>>> spec = TensorSpec(("B", "N", "N"), dtype=torch.bool)
>>> parse_dim("H*D", {})
H*D
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import sympy
import torch

from .capture.source import Parameters
from .errors import SpecError
from .parsing import MAX_SIZE, check_name, check_sizes, dim_symbol, normal_names, parse_expression, parse_int

# Example sizes the analysis runs at when the user gives none: distinct (so no two dims are
# confused), not 0/1 (which PyTorch specialises), not powers of two (which collide with model
# constants), and large enough to survive several stride-2 downsamplings.
DEFAULT_HINTS = (97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167, 173)

# Example sizes PyTorch specialises on sight (a symbol is never made for them).
SPECIALISED_SIZES = (0, 1)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape (ints and dim names) plus dtype of one tensor argument.

    ``dtype=None`` means the ``dtype`` given to :func:`fxmem.analyze` (float32 by default).
    ``fill``: the value every element holds, when the input's values decide what the model does
    (an all-ones attention mask lets transformers skip building a mask); the analysis then takes
    the path a real run with such an input takes, and the report says so.
    """

    shape: tuple[Any, ...]
    dtype: torch.dtype | None = None
    requires_grad: bool = False
    fill: bool | int | float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.shape, (str, int)) or not isinstance(self.shape, Iterable):
            raise SpecError(
                f"TensorSpec shape must be a tuple of ints and dim names, got {self.shape!r}; "
                f"write e.g. TensorSpec(('B', 'N', 6))"
            )
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.fill is not None and not isinstance(self.fill, (bool, int, float)):
            raise SpecError(f"TensorSpec fill must be a Python number, got {self.fill!r}")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A parsed spec: the argument it belongs to and its dims as sympy expressions."""

    arg: str
    dims: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    requires_grad: bool
    text: str  # how the user wrote it, for messages
    fill: bool | int | float | None = None  # every element's value, when the user stated it

    @property
    def rank(self) -> int:
        return len(self.dims)


def parse_dim(dim: Any, symbols: dict[str, sympy.Symbol], where: str = "dim") -> sympy.Expr:
    """One dim: an int >= 0, or a name / arithmetic expression over names (``"H*D"``, ``"N-1"``).

    New names are added to ``symbols``. A dim that is negative for every size (``"-B"``) is refused.
    """
    if isinstance(dim, bool) or not isinstance(dim, (int, str, sympy.Expr, torch.SymInt)):
        raise SpecError(f"{where}: {dim!r} is neither an int nor a dim name; use e.g. 'B' or 128")
    if isinstance(dim, int):
        if dim < 0:
            raise SpecError(f"{where}: size {dim} is negative; sizes must be >= 0")
        return sympy.Integer(parse_int(dim, where, minimum=0))
    if isinstance(dim, sympy.Expr):
        names = {s: check_name(str(s), where) for s in dim.free_symbols}
        for name in names.values():
            symbols.setdefault(name, dim_symbol(name))
        expr = dim.xreplace({s: symbols[name] for s, name in names.items()})
    else:
        expr = parse_expression(dim, symbols, where)
    if expr.is_number:
        if expr < 0:
            raise SpecError(f"{where}: size {dim!r} = {expr} is negative; sizes must be >= 0")
        return expr
    large = expr.xreplace({s: 10**6 for s in expr.free_symbols})
    if large < 0:
        raise SpecError(f"{where}: {dim!r} is negative for every size of {', '.join(sorted(map(str, expr.free_symbols)))}; "
                        f"sizes must be >= 0")
    return expr


def parse_specs(
    specs: Sequence[Any],
    params: Parameters,
    default_dtype: torch.dtype,
    owner: str,
) -> tuple[list[InputSpec], dict[str, sympy.Symbol]]:
    """Parse one spec per positional ``forward`` argument, in order; returns specs and the dim
    symbols. Arguments after the last spec keep their defaults."""
    arg_names, required = params.names, params.required
    if params.keyword_only:
        raise SpecError(
            f"{owner}.forward has keyword-only argument(s) {', '.join(params.keyword_only)} without defaults; fxmem "
            f"gives input specs to positional arguments: wrap the model in a Module whose forward takes them "
            f"positionally and calls it with keywords")
    if not arg_names and params.varargs and specs:
        raise SpecError(
            f"{owner}.forward takes only *args/**kwargs, so fxmem cannot tell which spec is which argument: wrap the "
            f"model in a Module whose forward names its tensor arguments")
    if not required <= len(specs) <= len(arg_names):
        need = f"{required}" if required == len(arg_names) else f"{required} to {len(arg_names)}"
        optional = [n for n in arg_names if n in params.defaults]
        tail = (f"; {', '.join(optional)} have defaults and may be left out" if optional else "")
        raise SpecError(
            f"got {len(specs)} input spec(s) but {owner}.forward takes {need} tensor argument(s) "
            f"({', '.join(arg_names)}){tail}; give one spec per argument, in order, e.g. ('B', 'N', 6)"
        )
    symbols: dict[str, sympy.Symbol] = {}
    parsed = []
    for arg, spec in zip(arg_names, specs):
        where = f"input spec for argument '{arg}'"
        rank = len(spec.shape) if isinstance(spec, (torch.Tensor, TensorSpec)) else \
            len(spec) if isinstance(spec, (tuple, list, torch.Size)) else 0
        if rank > MAX_RANK:  # far beyond any model; symbolic shape propagation over it takes minutes
            raise SpecError(f"{where}: {rank} dims; fxmem analyses tensors of at most {MAX_RANK} dims "
                            f"(CUDA kernels take at most 25): give one spec per tensor with its real dims")
        if isinstance(spec, torch.Tensor):
            if spec.layout != torch.strided:
                raise SpecError(f"{where}: a {spec.layout} tensor; fxmem models strided (dense) tensors only, and "
                                f"analysing it as dense would count the wrong storages. Pass the dense inputs the "
                                f"model builds it from, or analyse with a dense stand-in and read the numbers as such")
            check_dtype(spec.dtype, where)
            dims = tuple(sympy.Integer(int(d)) for d in spec.shape)
            parsed.append(InputSpec(arg, dims, spec.dtype, bool(spec.requires_grad), f"tensor{tuple(spec.shape)}"))
            continue
        if isinstance(spec, (tuple, list, torch.Size)):
            spec = TensorSpec(tuple(spec))
        if not isinstance(spec, TensorSpec):
            raise SpecError(
                f"{where}: expected a tuple of dims like ('B', 'N', 6), a fxmem.TensorSpec or a tensor, "
                f"got {type(spec).__name__} {spec!r}"
            )
        dims = tuple(parse_dim(d, symbols, f"{where}, dim {i}") for i, d in enumerate(spec.shape))
        dtype = spec.dtype or default_dtype
        check_dtype(dtype, where)
        if spec.requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            raise SpecError(f"{where}: only floating point inputs can require grad (dtype is {dtype})")
        text = "(" + ", ".join(str(d) for d in spec.shape) + ")" + (f" filled with {spec.fill!r}" if spec.fill is not None
                                                                   else "")
        parsed.append(InputSpec(arg, dims, dtype, spec.requires_grad, text, spec.fill))
    return parsed, symbols


MAX_RANK = 64  # dims of one input tensor

_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


def check_dtype(dtype: Any, where: str) -> torch.dtype:
    """A dtype fxmem can simulate: a ``torch.dtype``, not a quantized one."""
    if not isinstance(dtype, torch.dtype):
        raise SpecError(f"{where}: dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    if dtype in _QUANTIZED:
        raise SpecError(f"{where}: quantized dtype {dtype} is not supported: quantized kernels cannot run on fake "
                        f"tensors with symbolic sizes; analyse the float model instead (its numbers are not the "
                        f"quantized model's)")
    return dtype


def spec_symbols(specs: Sequence[Any], symbols: dict[str, sympy.Symbol]) -> dict[str, sympy.Symbol]:
    """Add the dim names used by ``specs`` to ``symbols`` (no checking against a model)."""
    for spec in specs:
        if isinstance(spec, TensorSpec):
            spec = spec.shape
        if isinstance(spec, (tuple, list)):
            for d in spec:
                if isinstance(d, (str, sympy.Expr)):
                    parse_dim(d, symbols)
    return symbols


def choose_hints(symbols: Mapping[str, sympy.Symbol], hints: Mapping[str, int] | None) -> dict[str, int]:
    """Example sizes for every dim: the user's where given, else distinct defaults."""
    hints = normal_names(hints or {}, "hints")
    unknown = sorted(set(hints) - set(symbols))
    if unknown:
        raise SpecError(f"hints name unknown dim(s) {unknown}; the input specs use {sorted(symbols)}")
    used = set(hints.values())
    free = (h for h in DEFAULT_HINTS if h not in used)
    out = {}
    for name in symbols:
        if name in hints:
            out[name] = parse_int(hints[name], f"hints: dim '{name}'", minimum=0)
        else:
            try:
                out[name] = next(free)
            except StopIteration:
                raise SpecError(f"too many dims ({len(symbols)}); pass hints= for some of them") from None
    return out


def check_dims(dims: Mapping[str, Any], symbols: Mapping[str, sympy.Symbol], what: str = "evaluate") -> dict[str, int]:
    """Validate a ``{name: size}`` mapping against the analysis' dims (whole numbers >= 1)."""
    return check_sizes(dims, symbols, what)


def check_input_sizes(specs: Sequence[InputSpec], dims: Mapping[str, int], symbols: Mapping[str, sympy.Symbol],
                      advice: str = "") -> None:
    """Raise if some input dim is negative at ``dims`` (``N-5`` with N=3), or an input would be
    larger than torch can index."""
    subs = {symbols[k]: v for k, v in dims.items()}
    at = ", ".join(f"{k}={v}" for k, v in dims.items())
    for spec in specs:
        numel = 1
        for i, d in enumerate(spec.dims):
            value = d.xreplace(subs)
            if not getattr(value, "is_number", True) or value < 0:
                raise SpecError(f"input '{spec.arg}' {spec.text}: dim {i} = {d} is {value} at {at}; "
                                f"sizes must be >= 0{advice}")
            numel *= int(value)
        if numel * spec.dtype.itemsize > MAX_SIZE:
            raise SpecError(f"input '{spec.arg}' {spec.text} would hold {numel:,} elements at {at}, more bytes than "
                            f"torch can index ({MAX_SIZE:,}); use smaller sizes{advice}")
