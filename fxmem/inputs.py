"""Real random inputs for a model's input specs at concrete sizes - for probes, verification and
real runs that check a prediction. One maker, so every real run in fxmem means the same thing.

Floats are standard normal, bools fair coins, integers lie in ``[0, smallest size)``, which is a
valid index along every dim (pass ``makers`` for inputs whose values must mean more, such as an
edge list).

>>> [tuple(t.shape) for t in random_inputs(parse(("B", 3)), {"B": 2})]       # doctest: +SKIP
[(2, 3)]
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from .specs import InputSpec

Maker = Callable[[tuple, Mapping[str, int]], torch.Tensor]


def input_shape(spec: InputSpec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """``spec``'s shape at ``sizes`` (``{dim name: size}``)."""
    return tuple(int(d.xreplace({s: sizes[str(s)] for s in d.free_symbols})) for d in spec.dims)


def random_inputs(specs: Sequence[InputSpec], sizes: Mapping[str, int], *, seed: int = 0, device: str = "cpu",
                  makers: Mapping[str, Maker] | None = None, requires_grad: bool = True) -> list[torch.Tensor]:
    """One real tensor per spec at ``sizes``; ``makers[arg](shape, sizes)`` makes that argument's.

    With ``requires_grad`` an input whose spec says so requires grad.
    """
    gen = torch.Generator().manual_seed(seed)
    high = max(1, min(sizes.values(), default=1))
    out = []
    for spec in specs:
        shape = input_shape(spec, sizes)
        if spec.fill is not None:
            t = torch.full(shape, spec.fill, dtype=spec.dtype)
        elif makers and spec.arg in makers:
            t = makers[spec.arg](shape, sizes)
        elif spec.dtype == torch.bool:
            t = torch.rand(shape, generator=gen) > 0.5
        elif spec.dtype.is_floating_point or spec.dtype.is_complex:
            t = torch.randn(shape, generator=gen, dtype=spec.dtype)
        else:
            t = torch.randint(0, high, shape, generator=gen, dtype=spec.dtype)
        t = t.to(device)
        if requires_grad and spec.requires_grad:
            t.requires_grad_(True)
        out.append(t)
    return out
