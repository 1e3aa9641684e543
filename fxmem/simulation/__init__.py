"""Simulation: run the model once on fake tensors with symbolic sizes and write down what it does.

:func:`simulate` wires the parts: the :class:`~.recorder.Recorder` (a dispatch mode over every
aten call), the :class:`~.storages.StorageTable` (storages and their deaths), the
:class:`~.events.EventLog` (what happened, in order, and where), :class:`~.autograd.Autograd` (what
is saved for backward), and a runner - :class:`~.graph_runner.GraphRunner` for a traced graph,
:class:`~.line_runner.LineRunner` for the original ``forward`` line by line.

>>> rec = simulate(gm, specs, symbols, hints)           # doctest: +SKIP
"""
from .simulate import check_device, simulate

__all__ = ["simulate", "check_device"]
