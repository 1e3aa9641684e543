"""``fxmem.world_sizes``: one rank's memory at several world sizes, as a table.

Each world size is its own analysis (the model parallelised by the same ``parallelize`` over a
fake process group of that size); the table lists each rank's resident bytes (parameter shards,
DDP's buckets, optimizer state, inputs) and its training-step peak, as formulas in the user's
dims, or in bytes at given dims; :meth:`WorldSizes.max_size` is the largest size of a dim whose
step fits a budget, per world size.

>>> table = fxmem.world_sizes(model, ("B", "L", 13), parallelize=fsdp, sizes=[1, 2, 4],
...                           optimizer=lambda p: torch.optim.AdamW(p))          # doctest: +SKIP
>>> print(table)                                                                  # doctest: +SKIP
>>> table.max_size("B", "80GiB", L=4096)                                           # doctest: +SKIP
{1: 3, 2: 5, 4: 7}
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ..errors import SpecError
from ..units import format_bytes
from ..views.text import formula_text, text_table


class WorldSizes(dict):
    """``{world size: Report}`` (rank ``rank``'s), printable as a table."""

    def __init__(self, reports: Mapping[int, Any], dims: Mapping[str, int] | None = None):
        super().__init__(reports)
        self.dims = dict(dims) if dims else None

    def at(self, **dims: int) -> "WorldSizes":
        """The same table in bytes at ``dims`` (e.g. ``B=8, L=4096``)."""
        return WorldSizes(self, dims)

    def max_size(self, dim: str, budget: Any, train: bool = True, **fixed: int) -> dict[int, int]:
        """``{world size: the largest dim whose step fits budget}`` (bytes or ``"80GiB"``), per rank."""
        return {w: report.max_size(dim, budget, train=train, **fixed) for w, report in self.items()}

    def rows(self) -> list[tuple]:
        out = []
        for w, report in self.items():
            if self.dims is None:
                resident = report.train_resident if report.training else report.resident
                peak = report.train_peak if report.training else report.peak
                out.append((w, formula_text(resident), formula_text(peak)))
            else:
                e = report.evaluate(**self.dims)
                key = "train_" if report.training else ""
                out.append((w, format_bytes(e[key + "resident"]), format_bytes(e[key + "peak"])))
        return out

    def __str__(self) -> str:
        train = any(r.training for r in self.values())
        header = ("world size", "resident per rank", ("step peak" if train else "peak") + " per rank")
        return text_table(header, [(str(w), a, b) for w, a, b in self.rows()],
                          right=(0, 1, 2) if self.dims else (0,))

    __repr__ = __str__


def world_sizes(model: Any, *input_specs: Any, parallelize: Callable | None = None,
                sizes: Sequence[int] = (1, 2, 4, 8), **options: Any) -> WorldSizes:
    """Analyse ``model`` parallelised by ``parallelize`` at each world size in ``sizes`` (rank
    ``rank=``, default 0); ``options`` as for :func:`fxmem.analyze` (``optimizer=`` for a step).
    A model you wrapped already (``DistributedDataParallel``, ``fully_shard``) needs no
    ``parallelize``: its own wrapping is applied again at each size."""
    from ..analyze import analyze
    from .adopt import adopt

    if isinstance(sizes, (int, str)) or not sizes:
        raise SpecError(f"sizes= must be a list of world sizes, e.g. [1, 2, 4, 8], got {sizes!r}")
    if "world_size" in options:
        raise SpecError("world_sizes() takes sizes=[...]; world_size= is for one analysis (fxmem.analyze)")
    if "mesh" in options:
        raise SpecError("world_sizes() varies a 1-D mesh; a mesh= of named dims has its own world size: analyse "
                        "each layout with fxmem.analyze(..., world_size=, mesh=)")
    if parallelize is None and adopt(model) is None:
        raise SpecError("world_sizes() needs parallelize=fn (fn(model, mesh) calls fully_shard or wraps in "
                        "DistributedDataParallel), or a model you wrapped already")
    if parallelize is not None:
        options["parallelize"] = parallelize
    return WorldSizes({int(w): analyze(model, *input_specs, world_size=w, **options) for w in sizes})
