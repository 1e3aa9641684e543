"""One causal LM's training step on several parallel layouts, side by side: ``fxmem.llm_layouts`` and
``fxmem llm --layouts dp8 dp4xtp2 pp2xdp4``.

Each layout is a mesh of data (FSDP2, ``dp``), tensor (``tp``) and pipeline (``pp``) parallelism;
:func:`fxmem.llm.llm_answer` analyses it (a pipeline: every stage, the one that peaks highest),
and the table has one row per layout: its ranks, each rank's model states and step peak at the
batch and sequence length asked, and, with ``gpu=``, the largest batch that fits every rank (a
multiple of the micro-batches where there is a pipeline).

>>> table = fxmem.llm_layouts(model, batch=8, seq=4096, gpu="80GiB",
...                           layouts=["dp16", "dp8xtp2", "pp2xdp4xtp2"])      # doctest: +SKIP
>>> print(table)                                                              # doctest: +SKIP
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from .errors import SpecError
from .units import format_bytes
from .views.text import text_table

_DIMS = ("pp", "dp", "tp")
_PART = re.compile(r"^(pp|dp|tp)([1-9][0-9]*)$")


def parse_layout(layout: Any) -> dict:
    """``"pp2xdp4xtp2"`` or ``{"pp": 2, "dp": 4, "tp": 2}`` as ``{dim: size}`` (dims among pp, dp, tp)."""
    if isinstance(layout, str):
        parts = [_PART.match(p) for p in layout.strip().split("x")]
        if not layout.strip() or not all(parts):
            raise SpecError(f"layouts=: {layout!r} is not a layout; write its dims and sizes joined by x, e.g. "
                            f"'dp8', 'dp4xtp2', 'pp2xdp4xtp2' (dims: pp, dp, tp)")
        out = {m.group(1): int(m.group(2)) for m in parts}
        if len(out) != len(parts):
            raise SpecError(f"layouts=: {layout!r} names a dim twice")
        return out
    if isinstance(layout, dict) and layout and all(k in _DIMS and isinstance(v, int) and not isinstance(v, bool)
                                                   and v >= 1 for k, v in layout.items()):
        return dict(layout)
    raise SpecError(f"layouts=: {layout!r} is not a layout; give 'dp4xtp2' or {{'dp': 4, 'tp': 2}} (dims: pp, dp, tp)")


def _name(layout: dict) -> str:
    return " x ".join(f"{k} {layout[k]}" for k in _DIMS if k in layout)


class LayoutTable(dict):
    """``{layout name: LLMAnswer}``, printable as a table (bytes per rank)."""

    def __str__(self) -> str:
        any_gpu = any(a.gpu is not None for a in self.values())
        header = ("layout", "ranks", "model states per rank", "step peak per rank") + (("largest batch",) if any_gpu
                                                                                         else ())
        rows = []
        for name, a in self.items():
            row = (name, str(a.ranks), format_bytes(a.model_states), format_bytes(a.step_peak))
            rows.append(row + ((f"{int(a.max_batch):,}",) if any_gpu else ()))
        first = next(iter(self.values()), None)
        title = (f"{first.model} at batch {first.batch}, sequence {first.seq}"
                 + (f", in {format_bytes(first.gpu)} a rank" if first.gpu is not None else "")) if first else ""
        return title + "\n" + text_table(header, rows, right=tuple(range(1, len(header))))

    __repr__ = __str__


def llm_layouts(model: torch.nn.Module, *, batch: int, seq: int, layouts: Sequence[Any], **options: Any) -> LayoutTable:
    """:func:`fxmem.llm.llm_answer` of ``model`` on each of ``layouts`` (``"dp4xtp2"`` strings or
    ``{"dp": 4, "tp": 2}`` dicts; ``dp``: FSDP2, ``tp``: the model's own tensor-parallel plan, ``pp``:
    pipeline stages); ``options`` as for ``llm_answer`` (``gpu=``, ``recipe=``, ``optimizer=``,
    ``microbatches=`` and ``schedule=`` for the pipelines, ...). Layouts of one rank (``dp1``) are the
    single-device step."""
    from .llm import llm_answer

    if isinstance(layouts, (str, dict)) or not layouts:
        raise SpecError(f"layouts= must be a list of layouts, e.g. ['dp8', 'dp4xtp2'], got {layouts!r}")
    for name in ("fsdp", "tp", "pp"):
        if name in options:
            raise SpecError(f"llm_layouts() takes the parallelism in layouts=; {name}= is for one layout (llm_answer)")
    out = LayoutTable()
    for given in layouts:
        layout = parse_layout(given)
        kw = {k: v for k, v in (("pp", layout.get("pp")), ("fsdp", layout.get("dp")), ("tp", layout.get("tp")))
              if v is not None and v > 1}
        piped = {k: options.get(k) if "pp" in kw else None for k in ("microbatches", "schedule")}  # the pipelines'
        out[_name(layout)] = llm_answer(model, batch=batch, seq=seq, **{**options, **piped}, **kw)
    return out
