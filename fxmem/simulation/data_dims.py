"""Sizes that depend on tensor values, as dims the user can name.

``x[mask]``, ``nonzero``, ``masked_select`` (and PyG's default self-loop handling, which keeps the
edges that are not loops) make tensors whose size only the data decides. PyTorch gives such a size
an *unbacked* symbol (``u0``); fxmem makes it a dim of the formulas - ``K1`` for the first, ``K2``
... - with what it counts, where it is made, and its bound where one is known (the number of
elements of the mask: ``K1 <= E``). ``Report.evaluate`` then needs a value for it, as for any
other dim. Nothing is guessed: the formulas hold for every value of the dim.

>>> dims = DataDims(taken={"N", "E"}, device="cpu")        # doctest: +SKIP
>>> dims.found(aten.index.Tensor, args, out, "loop.py:88")  # doctest: +SKIP
>>> dims.named()                                            # doctest: +SKIP
{'K1': u0}

Paths the data decides (an edge list, or dense row blocks): :mod:`fxmem.data_paths`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch

from .. import _torch_compat as tc
from .. import data_paths
from .failures import NotModelled

# ops whose data-dependent output size fxmem names, and whose real kernels' allocations are
# checked against real runs (tests/simulation/test_data_dims.py); others are refused rather than guessed
NAMED = ("aten.nonzero", "aten.index.Tensor")


@dataclasses.dataclass
class DataDim:
    """One size the data decides: its ``name``, ShapeEnv ``symbol``, the ``op`` and ``where`` that made
    it, and ``upper`` (an expression over ShapeEnv symbols, or None when unknown)."""

    name: str
    symbol: sympy.Symbol
    op: str
    where: str
    upper: Any = None
    example: int = 101  # a value to order candidates by (half the bound at the example sizes)
    # a path chosen by this size (see within()): taken up to path_upper, what the code does beyond it
    path_upper: Any = None
    beyond: str = ""
    not_one: bool = False  # a kernel takes another path where this size is 1 (a one-element reduction)
    counts: str = "the number of elements the mask selects"

    def describe(self, rename: Any = str, to_user: Any = None) -> str:
        """In words; ``rename`` writes torch's symbols in a text as the user's dims, or ``to_user``
        (when given) turns a bound into the user's dims."""
        show = (lambda e: str(to_user(e))) if to_user is not None else (lambda e: rename(str(e)))
        bound = f"; 0 <= {self.name} <= {show(self.upper)}" if self.upper is not None else ""
        if self.not_one:
            bound += f"; not {self.name} = 1, where a kernel takes another path for one-element tensors"
        text = (f"{self.name}: a size that depends on tensor values (made by {self.op} at {self.where}{bound}); "
                f"evaluate() needs its value, e.g. {self.counts}")
        if self.path_upper is not None:
            text += (f"; the formulas are those of {self.name} <= {show(self.path_upper)}: above it "
                     f"{self.beyond} (evaluate() re-analyses that path)")
        return text


class DataDims:
    """The unbacked size symbols of one run, named in the order they appear."""

    def __init__(self, taken: set, device: str = "cpu"):
        self._taken = set(taken)
        self.device = device
        self.env: Any = None  # the run's ShapeEnv (bounds are written over its symbols)
        self.dims: dict[sympy.Symbol, DataDim] = {}

    def active(self) -> Any:
        """While the run is simulated: :mod:`fxmem.data_paths` speaks to these dims."""
        return data_paths.active(self)

    def _next_name(self) -> str:
        k = 1
        while f"K{k}" in self._taken:
            k += 1
        self._taken.add(f"K{k}")
        return f"K{k}"

    def found(self, func: Any, args: tuple, out: Any, where: Any, env: Any) -> None:
        """Name the new unbacked symbols in ``out``'s sizes (bounded by the numel of a boolean
        argument, or of the input of ``nonzero``, when there is one); ``where()`` says where."""
        new = []
        for t in tc.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for d in t.shape:
                    for s in tc.unbacked_symbols(tc.raw_expr(d)):
                        if s not in self.dims and s not in new:
                            new.append(s)
        if not new:
            return
        self.env = env
        if self.device != "cpu":
            raise NotModelled(
                f"{tc.op_name(func)} makes a tensor whose size depends on the data; fxmem names such sizes on "
                f"device='cpu' only (the scratch of the CUDA kernels behind them is not checked). Analyse on "
                f"device='cpu', or give that size as an input")
        if not tc.op_name(func).startswith(NAMED):
            raise NotModelled(
                f"{tc.op_name(func)} makes a tensor whose size depends on the data; fxmem names such sizes for "
                f"nonzero and boolean-mask indexing (x[mask]), whose real kernels it has checked, not for this op. "
                f"Write it with x[mask] or nonzero, or give that size as an input")
        inputs = [a for a in tc.tree_leaves(args) if isinstance(a, torch.Tensor)]
        masks = [a for a in inputs if a.dtype == torch.bool]
        counted = masks[0] if masks else (inputs[0] if inputs and "nonzero" in tc.op_name(func) else None)
        upper = tc.size_expr(env, counted.numel()) if counted is not None else None
        example = max(1, self.example_of(counted.numel()) // 2) if counted is not None else 101
        for s in new:
            self.dims[s] = DataDim(self._next_name(), s, tc.op_name(func), where(), upper, example)

    def example_of(self, size: Any) -> int:
        """A size's value at the example sizes, the data dims it counts taken at their examples: a mask
        over what an earlier filter kept (``torch.where(area[keep] > 0)``) has ``K1`` elements, a size
        PyTorch has no example value for."""
        if not isinstance(size, torch.SymInt):
            return tc.size_hint(size)
        expr = tc.size_expr(self.env, size)
        unbacked = tc.unbacked_symbols(expr)
        if not unbacked:
            return tc.size_hint(size)
        values = {**tc.symbol_hints(self.env), **{d.symbol: d.example for d in self.dims.values()}}
        if not unbacked <= set(values):
            return 101  # a size no named dim accounts for: any positive example orders candidates
        return int(expr.xreplace({k: sympy.Integer(v) for k, v in values.items()}))

    def knows(self, symbols: set) -> bool:
        return all(s in self.dims for s in symbols)

    def named(self) -> dict[str, sympy.Symbol]:
        return {d.name: d.symbol for d in self.dims.values()}
