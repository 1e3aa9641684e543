"""``fxmem.precisions``: one model's memory in several precisions, side by side.

What ``accelerate estimate-memory`` prints for four dtypes at once, but exact and for the whole
forward (and training step), not the weights alone: each precision is its own analysis.

* ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float64"``: the weights (floating parameters and
  buffers) and the inputs in that dtype, as ``model.to(dtype)`` would make them. The model is
  never converted: a copy is built on the meta device, which costs no memory.
* ``"autocast-bfloat16"``, ``"autocast-float16"``: float32 weights and inputs, the forward under
  ``torch.autocast(device, dtype)`` (mixed precision); autocast's casts and the half-precision
  tensors autograd keeps are counted like every other tensor.

>>> table = fxmem.precisions(model, ("B", "L", 512), dims=dict(B=64, L=32))   # doctest: +SKIP
>>> print(table)                                                              # doctest: +SKIP
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, Mapping, Sequence

import torch

from .isolation import isolated
from .analyze import analyze
from .errors import ModelError, SpecError
from .report import Report
from .simulation.events import places
from .units import format_bytes
from .views.text import formula_text, text_table

DEFAULT = ("float32", "bfloat16", "float16", "autocast-bfloat16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclasses.dataclass
class Precision:
    """One row: the precision's name, its report, and its numbers at the table's dims (or None)."""

    name: str
    report: Report
    numbers: Mapping[str, int] | None

    @property
    def exact(self) -> bool:
        """False when the report notes a kernel workspace it cannot predict (see ``report.notes``)."""
        return not any("cannot predict" in n for n in self.report.notes)


class PrecisionTable(list):
    """The rows (:class:`Precision`) of :func:`precisions`; prints as a text table."""

    def __init__(self, rows: list[Precision], dims: Mapping[str, int] | None):
        super().__init__(rows)
        self.dims = dict(dims) if dims else None

    def __str__(self) -> str:
        keys = ["resident", "peak", "retained"]
        if self[0].report.training:
            keys += ["train_peak"]
        header = ("precision", "parameters", *keys, "exact")
        rows = []
        for p in self:
            params = sum(int(s.bytes) for s in p.report.storages if s.kind == "parameter")
            if self.dims:
                cells = [format_bytes(p.numbers[k]) for k in keys]
            else:
                cells = [formula_text(getattr(p.report, k)) for k in keys]
            rows.append((p.name, format_bytes(params), *cells, "yes" if p.exact else "no: see notes"))
        table = text_table(header, rows, right=tuple(range(1, len(keys) + 2)) if self.dims else (1,))
        notes = [f"{p.name}: {sum(places(n) for n in p.report.notes if 'cannot predict' in n)} kernel call(s) "
                 f"with workspace fxmem "
                 f"cannot predict, so the peak may be higher (.report.notes says which)" for p in self if not p.exact]
        return table + "".join("\n  note: " + n for n in notes)


@isolated
def precisions(model: torch.nn.Module, *input_specs: Any, precisions: Sequence[str] = DEFAULT,
               dims: Mapping[str, int] | None = None, **analyze_kw: Any) -> PrecisionTable:
    """Analyse ``model`` once per precision (see the module docstring); numbers at ``dims``.

    ``analyze_kw`` go to every :func:`fxmem.analyze` call (``optimizer=``, ``grad=``, ``device=`` ...).
    """
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"precisions() needs an nn.Module, got {type(model).__name__}")
    for key in ("dtype", "autocast"):
        if key in analyze_kw:
            raise SpecError(f"precisions() chooses {key}= itself; name the precisions instead, e.g. "
                            f"precisions=('float32', 'bfloat16', 'autocast-bfloat16')")
    rows = []
    for name in precisions:
        weights, autocast = _parse(name)
        report = analyze(_converted(model, weights), *input_specs, dtype=weights, autocast=autocast, **analyze_kw)
        rows.append(Precision(name, report, report.evaluate(**dims) if dims else None))
    return PrecisionTable(rows, dims)


def _parse(name: str) -> tuple[torch.dtype, torch.dtype | None]:
    if name in _DTYPES:
        return _DTYPES[name], None
    if name.startswith("autocast-") and name[len("autocast-"):] in ("bfloat16", "float16"):
        return torch.float32, _DTYPES[name[len("autocast-"):]]
    raise SpecError(f"precision {name!r}: use one of {', '.join(_DTYPES)}, autocast-bfloat16, autocast-float16")


def _converted(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` on the meta device with floating parameters and buffers in ``dtype``
    (no memory: only shapes, strides and dtypes matter to the analysis)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype if t.is_floating_point() else t.dtype,
                                   device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)
