"""``fxmem.world_sizes``: one rank's memory at several world sizes or mesh layouts, as a table.

Each world size is its own analysis (the model parallelised by the same ``parallelize`` over a
fake process group of that size); a size may also be a mesh of named dims (``{"dp": 4, "tp": 2}``,
as ``mesh=`` of :func:`fxmem.analyze`: a layout of data and tensor parallelism). The table lists
each rank's resident bytes (parameter shards, DDP's buckets, optimizer state, inputs) and its
training-step peak, as formulas in the user's dims, or in bytes at given dims;
:meth:`WorldSizes.max_size` is the largest size of a dim whose step fits a budget, per row.
For one formula in the number of ranks instead of rows, ``fxmem.analyze(..., world_size="W")``
(:mod:`fxmem.distributed.world_symbol`).

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
    """``{world size: Report}`` (rank ``rank``'s), printable as a table; a mesh layout's key is its
    text, ``"dp 4 x tp 2"``."""

    def __init__(self, reports: Mapping[int, Any], dims: Mapping[str, int] | None = None):
        super().__init__(reports)
        self.dims = dict(dims) if dims else None

    def at(self, **dims: int) -> "WorldSizes":
        """The same table in bytes at ``dims`` (e.g. ``B=8, L=4096``)."""
        return WorldSizes(self, dims)

    def max_size(self, dim: str, budget: Any, train: bool = True, **fixed: int) -> dict[int, int]:
        """``{world size or layout: the largest dim whose step fits budget}`` (bytes or ``"80GiB"``),
        per rank."""
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
        meshes = any(isinstance(w, str) for w in self)
        header = ("ranks" if meshes else "world size", "resident per rank",
                  ("step peak" if train else "peak") + " per rank")
        return text_table(header, [(_row_name(w, self[w]), a, b) for w, a, b in self.rows()],
                          right=tuple(range(1 if meshes else 0, 3 if self.dims else 1)))

    __repr__ = __str__


def _row_name(key: Any, report: Any) -> str:
    """A row's first cell: the world size, or the ranks of a mesh layout and the layout."""
    return str(key) if isinstance(key, int) else f"{report.options.world_size} ({key})"


def _layout(size: Any) -> tuple[Any, dict]:
    """``(key, options)`` of one entry of ``sizes=``: a world size, or a mesh ``{dim name: size}``."""
    if isinstance(size, Mapping):
        mesh = dict(size)
        ranks = 1
        for v in mesh.values():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"sizes=: the mesh {mesh!r} needs a positive int per dim")
            ranks *= v
        return " x ".join(f"{k} {v}" for k, v in mesh.items()), {"world_size": ranks, "mesh": mesh}
    if isinstance(size, bool) or not isinstance(size, int):
        raise SpecError(f"sizes=: each entry is a world size (an int) or a mesh {{dim name: size}}, got {size!r}")
    return size, {"world_size": size}


def world_sizes(model: Any, *input_specs: Any, parallelize: Callable | None = None,
                sizes: Sequence[Any] = (1, 2, 4, 8), **options: Any) -> WorldSizes:
    """Analyse ``model`` parallelised by ``parallelize`` at each world size in ``sizes`` (rank
    ``rank=``, default 0); ``options`` as for :func:`fxmem.analyze` (``optimizer=`` for a step).
    An entry of ``sizes`` may be a mesh of named dims instead, ``{"dp": 4, "tp": 2}`` (handed to
    ``parallelize`` as ``mesh=`` hands it: layouts of data and tensor parallelism side by side).
    A mesh with a ``"pp"`` dim is a pipeline (``parallelize`` returns the schedule, ``step=`` runs
    it): each stage's first rank is analysed, a row each (``"pp 2 x dp 2, stage 1"``), unless
    ``rank=`` names one.
    A model you wrapped already (``DistributedDataParallel``, ``fully_shard``) needs no
    ``parallelize``: its own wrapping is applied again at each size."""
    from ..analyze import analyze
    from .adopt import adopt

    if isinstance(sizes, (int, str)) or not sizes:
        raise SpecError(f"sizes= must be a list of world sizes, e.g. [1, 2, 4, 8], got {sizes!r}")
    if "world_size" in options:
        raise SpecError("world_sizes() takes sizes=[...]; world_size= is for one analysis (fxmem.analyze)")
    if "mesh" in options:
        raise SpecError("world_sizes() takes the meshes in sizes=[{'dp': 4, 'tp': 2}, ...]; mesh= is for one "
                        "analysis (fxmem.analyze)")
    if parallelize is None and adopt(model) is None:
        raise SpecError("world_sizes() needs parallelize=fn (fn(model, mesh) calls fully_shard or wraps in "
                        "DistributedDataParallel), or a model you wrapped already")
    if parallelize is not None:
        options["parallelize"] = parallelize
    out = {}
    for key, layout in (_layout(size) for size in sizes):
        mesh = layout.get("mesh") or {}
        if "pp" in mesh and "rank" not in options:  # a pipeline: each stage holds its own layers, one row each
            from .pipeline import stage_ranks
            for stage, rank in enumerate(stage_ranks(mesh)):
                out[f"{key}, stage {stage}"] = analyze(model, *input_specs, **layout, rank=rank, **options)
        else:
            out[key] = analyze(model, *input_specs, **layout, **options)
    return WorldSizes(out)
