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

import ast
import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import sympy
import torch

from .errors import SpecError

# Example sizes the analysis runs at when the user gives none: distinct (so no two dims are
# confused), not 0/1 (which PyTorch specialises), not powers of two (which collide with model
# constants), and large enough to survive several stride-2 downsamplings.
DEFAULT_HINTS = (97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167, 173)

# Example sizes PyTorch specialises on sight (a symbol is never made for them).
SPECIALISED_SIZES = (0, 1)

_ALLOWED_AST = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.Name, ast.Constant, ast.Load,
    ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Pow, ast.USub, ast.UAdd,
)


def dim_symbol(name: str) -> sympy.Symbol:
    """The sympy symbol fxmem uses for the user's dim ``name`` (a positive integer)."""
    return sympy.Symbol(name, integer=True, positive=True)


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

    New names are added to ``symbols``.
    """
    if isinstance(dim, bool) or not isinstance(dim, (int, str, sympy.Expr, torch.SymInt)):
        raise SpecError(f"{where}: {dim!r} is neither an int nor a dim name; use e.g. 'B' or 128")
    if isinstance(dim, int):
        if dim < 0:
            raise SpecError(f"{where}: size {dim} is negative; sizes must be >= 0")
        return sympy.Integer(dim)
    if isinstance(dim, sympy.Expr):
        for s in dim.free_symbols:
            symbols.setdefault(str(s), dim_symbol(str(s)))
        return dim.xreplace({s: symbols[str(s)] for s in dim.free_symbols})
    text = str(dim).strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise SpecError(f"{where}: cannot parse dim {text!r}; use a name like 'N' or an expression like 'H*D'") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_AST):
            raise SpecError(
                f"{where}: dim {text!r} may only use names, integers and + - * // ** (found {type(node).__name__})"
            )
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            raise SpecError(f"{where}: dim {text!r} contains the non-integer {node.value!r}")
    names = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)})
    for n in names:
        symbols.setdefault(n, dim_symbol(n))
    expr = _eval_ast(tree.body, symbols)
    return sympy.expand(expr)


def _eval_ast(node: ast.AST, symbols: dict[str, sympy.Symbol]) -> sympy.Expr:
    # A tiny evaluator (instead of sympify) so that names such as N, E, I, S, Q mean the user's
    # dims and never sympy's built-ins.
    if isinstance(node, ast.Constant):
        return sympy.Integer(node.value)
    if isinstance(node, ast.Name):
        return symbols[node.id]
    if isinstance(node, ast.UnaryOp):
        v = _eval_ast(node.operand, symbols)
        return -v if isinstance(node.op, ast.USub) else v
    assert isinstance(node, ast.BinOp)
    a, b = _eval_ast(node.left, symbols), _eval_ast(node.right, symbols)
    if isinstance(node.op, ast.Add):
        return a + b
    if isinstance(node.op, ast.Sub):
        return a - b
    if isinstance(node.op, ast.Mult):
        return a * b
    if isinstance(node.op, ast.FloorDiv):
        return sympy.floor(a / b)
    return a**b


def parse_specs(
    specs: Sequence[Any],
    arg_names: Sequence[str],
    required: int,
    default_dtype: torch.dtype,
    owner: str,
) -> tuple[list[InputSpec], dict[str, sympy.Symbol]]:
    """Parse one spec per positional ``forward`` argument; returns specs and the dim symbols."""
    if not required <= len(specs) <= len(arg_names):
        need = f"{required}" if required == len(arg_names) else f"{required} to {len(arg_names)}"
        raise SpecError(
            f"got {len(specs)} input spec(s) but {owner}.forward takes {need} tensor argument(s) "
            f"({', '.join(arg_names)}); give one spec per argument, e.g. ('B', 'N', 6)"
        )
    symbols: dict[str, sympy.Symbol] = {}
    parsed = []
    for arg, spec in zip(arg_names, specs):
        where = f"input spec for argument '{arg}'"
        if isinstance(spec, torch.Tensor):
            if spec.layout != torch.strided:
                raise SpecError(f"{where}: a {spec.layout} tensor; fxmem models strided (dense) tensors only, and "
                                f"analysing it as dense would count the wrong storages. Pass the dense inputs the "
                                f"model builds it from, or analyse with a dense stand-in and read the numbers as such")
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
        if not isinstance(dtype, torch.dtype):
            raise SpecError(f"{where}: dtype must be a torch.dtype, got {dtype!r}")
        if spec.requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            raise SpecError(f"{where}: only floating point inputs can require grad (dtype is {dtype})")
        text = "(" + ", ".join(str(d) for d in spec.shape) + ")" + (f" filled with {spec.fill!r}" if spec.fill is not None
                                                                   else "")
        parsed.append(InputSpec(arg, dims, dtype, spec.requires_grad, text, spec.fill))
    return parsed, symbols


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
    hints = dict(hints or {})
    unknown = sorted(set(hints) - set(symbols))
    if unknown:
        raise SpecError(f"hints name unknown dim(s) {unknown}; the input specs use {sorted(symbols)}")
    used = set(hints.values())
    free = (h for h in DEFAULT_HINTS if h not in used)
    out = {}
    for name in symbols:
        if name in hints:
            value = hints[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"hint for dim '{name}' must be an int >= 0, got {value!r}")
            out[name] = value
        else:
            try:
                out[name] = next(free)
            except StopIteration:
                raise SpecError(f"too many dims ({len(symbols)}); pass hints= for some of them") from None
    return out


def check_dims(dims: Mapping[str, Any], symbols: Mapping[str, sympy.Symbol], what: str = "evaluate") -> dict[str, int]:
    """Validate a ``{name: size}`` mapping against the analysis' dims."""
    unknown = sorted(set(dims) - set(symbols))
    if unknown:
        raise SpecError(f"{what}(): unknown dim(s) {unknown}; this analysis has dims {sorted(symbols)}")
    missing = sorted(set(symbols) - set(dims))
    if missing:
        raise SpecError(f"{what}(): missing dim(s) {missing}; give a size for each of {sorted(symbols)}")
    out = {}
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int):
            try:
                as_int = int(value)
            except (TypeError, ValueError):
                as_int = None
            if as_int is None or as_int != value:
                raise SpecError(f"{what}(): dim {name}={value!r} is not an integer")
            value = as_int
        if value <= 0:
            raise SpecError(f"{what}(): dim {name}={value} must be a positive integer")
        out[name] = value
    return out


def check_input_sizes(specs: Sequence[InputSpec], dims: Mapping[str, int], symbols: Mapping[str, sympy.Symbol]) -> None:
    """Raise if some input dim expression is negative at ``dims`` (e.g. ``N-5`` with N=3)."""
    subs = {symbols[k]: v for k, v in dims.items()}
    for spec in specs:
        for i, d in enumerate(spec.dims):
            value = d.xreplace(subs)
            if not getattr(value, "is_number", True) or value < 0:
                raise SpecError(
                    f"input '{spec.arg}' {spec.text}: dim {i} = {d} is {value} at "
                    f"{', '.join(f'{k}={v}' for k, v in dims.items())}; sizes must be >= 0"
                )
