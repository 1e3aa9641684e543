"""Check one generated model against real runs: forward and one training step, at held-out sizes.

Outcomes (:class:`Outcome`): ``exact`` - every number equals the allocator's; ``refused`` - fxmem
raised an ``FxMemError`` (its message is the reason; where the real run fails too, refusing is
right); ``flagged`` - the report's notes say a number is not exact (a kernel workspace fxmem could
not fit); ``mismatch`` - fxmem returned a number that differs from the real run, or returned one
where the real run fails, without saying so: a silent wrong number, which must never happen.

>>> outcome = check(generate(7))          # doctest: +SKIP
>>> outcome.status, outcome.detail         # doctest: +SKIP
('exact', '')
"""
from __future__ import annotations

import copy
import dataclasses
import traceback
from typing import Any

import torch

import fxmem
from fxmem.inputs import random_inputs
from fxmem.measure import measure
from fxmem.records import INEXACT
from fxmem.training import default_loss, train_step


@dataclasses.dataclass
class Outcome:
    seed: int
    status: str  # exact | refused | flagged | mismatch
    detail: str = ""
    rows: list = dataclasses.field(default_factory=list)  # (mode, sizes, predicted, measured)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def _real_forward(model: torch.nn.Module, xs: list) -> tuple[int, int] | Exception:
    try:
        m = measure(lambda: model(*xs))
    except Exception as exc:  # noqa: BLE001 - the real run failing is an outcome
        return exc
    return m.peak_above_start, m.retained


def _real_step(model: torch.nn.Module, xs: list) -> tuple[int, int] | Exception:
    opt = _sgd(model.parameters())
    try:
        train_step(model, xs, opt, default_loss)
        m = measure(lambda: train_step(model, xs, opt, default_loss))
    except Exception as exc:  # noqa: BLE001
        return exc
    return m.peak_above_start, m.retained


def _at(report: Any, dims: dict) -> Any:
    """The report whose numbers ``evaluate(**dims)`` gave (a re-analysis outside the region)."""
    return report._at(dims, check=True)[0]


def check(case: Any, train: bool = True) -> Outcome:
    """Analyse ``case.model`` (graph mode; training step with SGD) and compare at ``case.sizes``."""
    torch.manual_seed(case.seed)
    model = case.model.train()
    rows = []
    try:
        forward = fxmem.analyze(model, *case.specs)
        step = fxmem.analyze(model, *case.specs, optimizer=_sgd) if train else None
    except fxmem.FxMemError as exc:
        return Outcome(case.seed, "refused", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a crash is not a clear refusal: report it as such
        return Outcome(case.seed, "mismatch", "crash: " + "".join(traceback.format_exception_only(exc)).strip())
    gm = forward.graph_module
    for dims in case.sizes:
        xs = random_inputs(forward.specs, dims, seed=case.seed)
        for mode, report in (("forward", forward), ("train", step)):
            if report is None:
                continue
            real_model = report.graph_module
            if mode == "train":  # a fresh copy: real steps change the weights and buffers
                real_model = copy.deepcopy(real_model)
            measured = _real_forward(real_model, xs) if mode == "forward" else _real_step(real_model, xs)
            try:
                ev = report.evaluate(**dims)
                predicted = ((ev["peak_above_resident"], ev["retained"]) if mode == "forward" else
                             (ev["train_peak"] - ev["train_resident"], ev["train_retained"]))
            except fxmem.FxMemError as exc:
                if isinstance(measured, Exception):
                    rows.append((mode, dims, "refused", "fails"))
                    continue  # the real run fails too: refusing is right
                return Outcome(case.seed, "refused", f"at {dims} ({mode}): {type(exc).__name__}: {exc}", rows)
            except Exception as exc:  # noqa: BLE001
                return Outcome(case.seed, "mismatch", f"crash at {dims} ({mode}): {exc!r}", rows)
            if isinstance(measured, Exception):
                return Outcome(case.seed, "mismatch", f"at {dims} ({mode}): fxmem predicted {predicted} but the real "
                                                      f"run fails: {measured!r}", rows)
            rows.append((mode, dims, predicted, measured))
            unsure = [n for n in _at(report, dims).notes if INEXACT in n]
            if predicted != measured and unsure:
                return Outcome(case.seed, "flagged", f"at {dims} ({mode}): {unsure[0]}", rows)
            if predicted != measured:
                return Outcome(case.seed, "mismatch", f"at {dims} ({mode}): predicted (peak above start, retained) "
                                                      f"{predicted}, measured {measured}", rows)
    del gm
    return Outcome(case.seed, "exact", "", rows)
