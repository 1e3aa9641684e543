"""Which world size of an analysis' options is a symbol (``world_size="W"``, ``mesh={"dp": "D",
"tp": 2}``), checked: the options' side of :mod:`fxmem.distributed.world_symbol` (no analysis here).

>>> import fxmem
>>> symbolic_world(fxmem.AnalysisOptions(world_size="W", parallelize=lambda m, mesh: m))
('W', None)
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from ..errors import SpecError


def symbolic_world(options: Any) -> tuple[str, str | None] | None:
    """``(dim name, mesh dim)`` where ``world_size=`` (mesh dim None) or one dim of ``mesh=`` is a
    dim name instead of a number; None where every size is a number."""
    mesh = options.mesh if isinstance(options.mesh, Mapping) else None
    named = [(k, v) for k, v in (mesh or {}).items() if isinstance(v, str)]
    if isinstance(options.world_size, str):
        if mesh is not None:
            raise SpecError(f"world_size={options.world_size!r} with mesh={mesh!r}: with a mesh, name the dim "
                            f"that varies in the mesh instead (mesh={{'dp': 'D', 'tp': 2}}) and leave world_size= out")
        return _checked_name(options.world_size, "world_size"), None
    if not named:
        return None
    if len(named) > 1:
        raise SpecError(f"mesh={mesh!r}: one dim of the mesh may be a symbol, not {len(named)}; give the others "
                        f"as numbers (fxmem.world_sizes compares layouts)")
    key, name = named[0]
    if key == "pp":
        raise SpecError(f"mesh={mesh!r}: the number of pipeline stages cannot be a symbol (the layers a rank holds "
                        f"change with it); give pp= a number, or compare several with fxmem.world_sizes")
    if options.world_size is not None:
        raise SpecError(f"mesh={mesh!r} has the symbol {name!r}: leave world_size= out (it is the mesh's product)")
    return _checked_name(name, f"mesh[{key!r}]"), key


def stand_in(options: Any) -> Any:
    """``options`` with the symbolic world size at a number (the smallest it may be), for the checks
    that read numbers (a rank below the world size, the mesh's product)."""
    name, key = symbolic_world(options)
    low = max(2, options.rank + 1) if isinstance(options.rank, int) else 2
    if key is None:
        return dataclasses.replace(options, world_size=low)
    mesh = {**options.mesh, key: low}
    return dataclasses.replace(options, mesh=mesh, world_size=math.prod(v for v in mesh.values() if isinstance(v, int)))


def _checked_name(name: str, where: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise SpecError(f"{where}={name!r}: a symbolic world size is a dim name (a letter, then letters, digits "
                        f"or _), e.g. 'W'")
    return name
