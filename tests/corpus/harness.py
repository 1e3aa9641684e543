"""Put fxmem's prediction next to a real run for one model: forward and a training step, at given
sizes. The rows are what ``benchmarks/exactness.py`` tabulates and what the corpus test asserts.

>>> rows = compare(model, specs, [dict(B=1, L=7)])      # doctest: +SKIP
>>> rows[0].predicted == rows[0].measured                              # doctest: +SKIP
True
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch

import fxmem
from fxmem.inputs import random_inputs
from fxmem.measure import measure
from fxmem.training import default_loss, train_step
from conftest import real_resident


@dataclasses.dataclass
class Row:
    model: str
    mode: str  # graph | eager
    what: str  # forward | train
    sizes: dict
    predicted: Any  # (peak above start, retained, resident) bytes (train: train_resident), or the refusal
    measured: Any
    says_inexact: bool = False  # the report's notes say its numbers may not be exact

    @property
    def exact(self) -> bool:
        if isinstance(self.measured, str):  # the real model rejects these sizes: fxmem must refuse them too
            return isinstance(self.predicted, str) and self.predicted.startswith("refused")
        return self.predicted == self.measured


def _rejects(model: Any, xs: list) -> str | None:
    """Why the real model rejects ``xs`` (a size it does not accept), or None where it runs."""
    try:
        with torch.no_grad():
            model(*xs)
    except (RuntimeError, ValueError) as exc:
        return str(exc).splitlines()[0][:200]
    return None


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def compare(name: str, build: Callable[[], torch.nn.Module], specs: tuple, sizes: list, *, mode: str = "auto",
            makers: dict | None = None, optimizer: Callable = adamw, train: bool = True,
            data: Callable[[list], dict] | None = None) -> list[Row]:
    """Analyse (forward, and a training step with ``optimizer``) and measure real runs at ``sizes``;
    ``data(inputs)`` gives the values of the sizes the data decides (``{"K1": ...}``) for those inputs."""
    rows = []
    model = build().train()
    forward = fxmem.analyze(model, *specs, mode=mode)
    step = fxmem.analyze(model, *specs, mode=mode, optimizer=optimizer) if train else None
    mode = forward.mode  # the capture the analysis used (auto: graph where fx traces, else eager)
    assert step is None or step.mode == mode
    for dims in sizes:
        xs = random_inputs(forward.specs, dims, makers=makers)
        real = forward.graph_module if mode == "graph" else model
        values = {**dims, **(data(xs) if data else {})}
        rejected = _rejects(real, xs)
        if rejected is not None:  # the model does not accept these sizes: fxmem must refuse them too
            try:
                forward.evaluate(**values)
            except fxmem.FxMemError as refused:
                rows.append(Row(name, mode, "forward", dims, f"refused: {refused}", f"refused: {rejected}"))
                continue
            rows.append(Row(name, mode, "forward", dims, "answered", f"refused: {rejected}"))
            continue
        ev = forward.evaluate(**values)
        m = measure(lambda: real(*xs))
        # resident too: the real parameters', buffers' and inputs' storages, each once
        resident = real_resident(model, xs, forward.graph_module)
        rows.append(Row(name, mode, "forward", dims, (ev["peak_above_resident"], ev["retained"], ev["resident"]),
                        (m.peak_above_start, m.retained, resident), not forward.exact))
        if step is None:
            continue
        real = copy.deepcopy(step.graph_module if mode == "graph" else model)
        opt = optimizer(real.parameters())
        train_step(real, xs, opt, default_loss)  # the optimizer's state, as in a steady state
        m = measure(lambda: train_step(real, xs, opt, default_loss))
        ev = step.evaluate(**values)
        state = _storage_bytes(t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
        rows.append(Row(name, mode, "train", dims,
                        (ev["train_peak"] - ev["train_resident"], ev["train_retained"], ev["train_resident"]),
                        (m.peak_above_start, m.retained, resident + state), not step.exact))
    return rows
