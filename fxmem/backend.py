"""``fxmem.backend``: memory formulas for models already run with ``torch.compile``.

``torch.compile(model, backend=fxmem.backend(...))`` hands every graph TorchDynamo captures to
fxmem, which analyses it (:mod:`fxmem.capture.dynamo`: the graph as Dynamo made it, the user's dim
names) and returns the graph's own ``forward``: the model runs as it would without a backend
(eagerly, graph by graph), so its outputs do not change and the formulas are those of the code
that runs. With graph breaks there is one report per graph; the Python between graphs runs as
written and is not in any report (``report.notes`` says so).

>>> b = fxmem.backend(names={"x": ("B", "N", 6)})                            # doctest: +SKIP
>>> compiled = torch.compile(model, backend=b, dynamic=True); compiled(x)     # doctest: +SKIP
>>> b.reports[0].peak                                                          # doctest: +SKIP
536*B*N + 3584
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import torch

from .capture import Capture
from .capture.dynamo import from_dynamo
from .errors import FxMemError, SpecError

class Backend:
    """A ``torch.compile`` backend that analyses each graph it is given (see :func:`backend`).

    ``reports``: one :class:`fxmem.Report` per compiled graph, in the order Dynamo compiled them;
    ``failures``: ``(graph number, FxMemError)`` for graphs fxmem could not analyse (the graph
    still runs: a compiled model never fails because of its memory analysis).
    """

    def __init__(self, names: Mapping[str, Sequence[Any]] | None, options: dict):
        if names is not None and not isinstance(names, Mapping):
            raise SpecError(f"fxmem.backend(names=...) maps forward argument names to their dims, e.g. "
                            f"names={{'x': ('B', 'N', 6)}}; got {type(names).__name__}")
        for arg, dims in (names or {}).items():
            if isinstance(dims, (str, int)) or not isinstance(dims, Sequence):
                raise SpecError(f"fxmem.backend(names=...): the dims of {arg!r} are a tuple of names and ints, "
                                f"e.g. ('B', 'N', 6); got {dims!r}")
        self.names = dict(names or {})
        self.options = options
        self._reports: list = []
        self._failures: list[tuple[int, FxMemError]] = []
        self._pending: list[tuple[int, Any, bool]] = []  # (graph number, DynamoGraph, grad)
        self._graphs = 0

    @property
    def reports(self) -> list:
        """One :class:`fxmem.Report` per graph analysed, in the order Dynamo compiled them."""
        self._analyse_pending()
        return list(self._reports)

    @property
    def failures(self) -> list:
        """``(graph number, FxMemError)`` for each graph fxmem could not analyse."""
        self._analyse_pending()
        return list(self._failures)

    @property
    def report(self) -> Any:
        """The report of the only graph; a :class:`SpecError` when there were none or several."""
        if len(self.reports) != 1 or self.failures:
            raise SpecError(f"{len(self.reports)} graph(s) analysed, {len(self.failures)} not: use .reports "
                            f"(one per graph Dynamo compiled) and .failures")
        return self._reports[0]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        number = self._graphs
        self._graphs += 1
        try:
            graph = from_dynamo(gm, example_inputs, self.names if number == 0 else None)
        except FxMemError as exc:
            warnings.warn(f"fxmem.backend: graph {number + 1} not analysed: {exc}", stacklevel=2)
            self._failures.append((number, exc))
        else:
            # analysed later, outside Dynamo: library code (optimizers, transformers) asks whether it
            # is being compiled and would take another path than the compiled model's real run
            self._pending.append((number, graph, torch.is_grad_enabled()))
        return gm.forward

    def _analyse_pending(self) -> None:
        from .analyze import analyze

        while self._pending:
            number, graph, grad = self._pending.pop(0)
            options = dict(self.options)
            options.setdefault("grad", grad)
            try:
                report = analyze(graph.module, *graph.specs, hints={**graph.hints, **options.pop("hints", {})},
                                 mode="graph", **options)
            except FxMemError as exc:
                self._failures.append((number, exc))
                continue
            report.capture = Capture("graph", f"graph {number + 1} that torch.compile (TorchDynamo) captured")
            report.notes[:0] = graph.notes + ([] if number == 0 else [
                f"graph {number + 1} of the compiled model (after a graph break): its inputs are the values the "
                f"Python between the graphs passes on, named after them; that Python is not in this report"])
            self._reports.append(report)


def backend(names: Mapping[str, Sequence[Any]] | None = None, **options: Any) -> Backend:
    """A ``torch.compile`` backend that records the memory formulas (bytes) of every graph.

    Args:
        names: dims of the model's inputs by ``forward`` argument name, ``{"x": ("B", "N", 6)}``;
            sizes Dynamo keeps symbolic get these names (others: ``x_0``, ``x_1``, ...). Compile
            with ``dynamic=True`` for formulas in every size; a size Dynamo specialised is the
            number it was compiled for (its graph runs at no other).
        **options: as for :func:`fxmem.analyze` (``optimizer=``, ``device=``, ``grad=``, ...);
            ``grad`` defaults to whether autograd was on when the graph was compiled.

    >>> b = fxmem.backend(names={"x": ("B", 6)})                                   # doctest: +SKIP
    >>> torch.compile(torch.nn.Linear(6, 128), backend=b, dynamic=True)(torch.randn(3, 6))  # doctest: +SKIP
    >>> b.report.peak                                                                 # doctest: +SKIP
    536*B + 3584
    """
    for bad in ("mode", "hparams", "init", "leaf_modules"):
        if bad in options:
            raise SpecError(f"fxmem.backend({bad}=...): the graphs come from torch.compile; {bad} is an option of "
                            f"fxmem.analyze, not of the backend")
    return Backend(names, options)
