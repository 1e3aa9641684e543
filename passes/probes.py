"""The traced graph run for real at small sizes: what each node holds (the rules read it), and the
sizes rewrites are verified at.

Probe sizes when the user gives none come from :data:`PROBE_LADDER`; a model that cannot run that
small (a pooling, a wide kernel) gets the next rung.

>>> probes, verify_at = probe(gm, specs, symbols, None, "Net")                     # doctest: +SKIP
>>> probes[0].sizes, verify_at
({'B': 3, 'N': 4}, [{'B': 3, 'N': 4}, {'B': 4, 'N': 5}, {'B': 5, 'N': 6}])
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxmem.errors import FxMemError, ShapeError, SpecError
from fxmem.inputs import random_inputs
from fxmem.passes.base import Probe
from fxmem.specs import InputSpec, check_dims, check_input_sizes


# Probe sizes when the user gives none: dim k (in order of appearance) is base+k for each base of
# a rung; probes run at the first and last base, rewrites are verified at all three. Small, so a
# [.., N, N, 2F] tensor is tiny, and different in each probe, so what varies with the sizes is
# told apart from what does not. A model that cannot run that small (a pooling, a wide kernel)
# gets the next rung.
PROBE_LADDER = ((3, 4, 5), (8, 9, 10), (16, 17, 18), (32, 33, 34))


def probe(gm: torch.fx.GraphModule, specs: list[InputSpec], symbols: Mapping[str, Any],
           given: Sequence[Mapping[str, int]] | None, name: str) -> tuple[list[Probe], list[dict]]:
    """Run the graph for real at the probe sizes; returns the probes and the sizes to verify at."""
    names = list(symbols)
    if given is not None:
        if isinstance(given, Mapping) or len(given) < 2:
            raise SpecError("probe_sizes= must be a list of two or more {dim: size} dicts, e.g. "
                            "[{'B': 2, 'N': 3}, {'B': 3, 'N': 5}]")
        rungs = [[check_dims(dict(s), symbols, "probe_sizes") for s in given]]
        fixed = [n for n in names if len({p[n] for p in rungs[0]}) < 2]
        if fixed:
            raise SpecError(f"probe_sizes: dim(s) {fixed} have the same size in every probe; give each dim two "
                            f"different sizes, so that what varies with it can be told apart")
    else:
        rungs = [[{n: base + k for k, n in enumerate(names)} for base in bases] for bases in PROBE_LADDER]
    if not names:  # every size is a constant: one run says it all
        rungs = [rung[:1] for rung in rungs[:1]]
    failure: FxMemError | None = None
    for rung in rungs:
        try:
            for sizes in rung:
                check_input_sizes(specs, sizes, symbols)
            envs = [run_values(gm, specs, sizes, name) for sizes in rung]
        except (ShapeError, SpecError) as exc:  # too small for this model: try the next rung
            failure = exc  # the largest sizes tried are the ones to report
            continue
        probe_at = rung if given is not None or len(rung) < 3 else [rung[0], rung[-1]]
        return [Probe(sizes, envs[rung.index(sizes)]) for sizes in probe_at], rung
    assert failure is not None
    raise failure


def run_values(gm: torch.fx.GraphModule, specs: list[InputSpec], sizes: Mapping[str, int],
                name: str) -> dict[torch.fx.Node, Any]:
    """The value of every node of ``gm`` on random inputs at ``sizes`` (run on a copy of the model,
    so that e.g. batch-norm statistics of the user's model do not move)."""
    twin = copy.deepcopy(gm).eval()  # eval mode: what tensors hold, without dropout's noise
    interp = torch.fx.Interpreter(twin, garbage_collect_values=False)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            interp.run(*random_inputs(specs, sizes, requires_grad=False))
    except FxMemError:
        raise
    except Exception as exc:  # the model's own error, at sizes the user did not choose
        at = ", ".join(f"{k}={v}" for k, v in sizes.items())
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ShapeError(f"fxmem.optimize runs {name} for real at small sizes to see what each tensor holds, and "
                         f"it failed at {at}: {type(exc).__name__}: {first}\n  what to do: pass "
                         f"probe_sizes=[{{...}}, {{...}}] with two sets of sizes the model accepts "
                         f"(every dim different between them)") from exc
    by_name = {n.name: v for n, v in interp.env.items()}
    return {n: by_name[n.name] for n in gm.graph.nodes if n.name in by_name}
