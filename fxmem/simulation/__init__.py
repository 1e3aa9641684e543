"""Simulation: run the model once on fake tensors with symbolic sizes and write down what it does.

:func:`simulate` wires the parts: the :class:`~.recorder.Recorder` (a dispatch mode over every
aten call), the :class:`~.storages.StorageTable` (storages and their deaths), the
:class:`~.events.EventLog` (what happened, in order, and where), :class:`~.autograd.Autograd` (what
is saved for backward), and a runner - :class:`~.graph_runner.GraphRunner` for a traced graph,
:class:`~.line_runner.LineRunner` for the original ``forward`` line by line.

It is handed the analysis' :class:`~fxmem.AnalysisOptions` as one value, resolved for this run
(``mode`` "graph" or "eager", ``hints`` a size for every dim), and reads each option from it:

>>> rec = simulate(gm, specs, opts.replace(mode="graph", hints={"B": 97}), symbols)   # doctest: +SKIP
"""
from .simulate import check_device, simulate

__all__ = ["simulate", "check_device"]
