"""``fxmem.validate``: run the model for real and put fxmem's prediction next to the measurement.

    v = fxmem.validate(model, ("B", "N", 6), ("B", "N", "N"), dims=dict(B=4, N=500), device="cuda")
    print(v)          # predicted vs measured peak (above resident) and retained, forward and a training step

Measured the way trustworthy tools do it: a copy of the model on the device (the user's model is
untouched), one warm-up forward+backward and training step first (cuBLAS/cuBLASLt allocate their
workspaces through the caching allocator once per handle; the optimizer creates its state), then
``empty_cache``, ``reset_peak_memory_stats`` and differences against ``memory_allocated()`` taken
just before. On CPU the allocator's own counters are read through the profiler (fxmem.measure).
With ``optimized=`` (a GraphModule from ``fxmem.optimize``) the rewrite is measured too and its
outputs and gradients are compared with the original's on the device.

A row is "ok" when prediction and measurement agree within ``tolerance`` (1 % by default); the
goal is equality after allocator rounding, and every difference is reported in bytes.
"""
from __future__ import annotations

import contextlib
import copy
import os
import dataclasses
from typing import Any, Callable, Iterator, Mapping

import torch

from .isolation import isolated
from .progress import phased
from .timeout import timed
from .accounting import cuda_block_bytes
from .analyze import analyze
from .capture import trace
from .errors import DeviceError, SpecError
from .inputs import random_inputs
from .measure import machine_name, measure
from .passes import compare
from .training import default_loss, train_step


@dataclasses.dataclass
class Row:
    """One quantity: fxmem's prediction and the measurement, in bytes."""

    what: str
    predicted: int
    measured: int

    @property
    def diff(self) -> int:
        return self.measured - self.predicted

    @property
    def percent(self) -> float:
        return 100.0 * self.diff / self.measured if self.measured else (0.0 if not self.diff else float("inf"))

    def ok(self, tolerance: float) -> bool:
        return abs(self.percent) <= 100 * tolerance


@dataclasses.dataclass
class Validation:
    """The table of predicted vs measured bytes (and, with ``optimized``, the equivalence check)."""

    model: str
    device: str
    dims: dict
    rows: list
    tolerance: float
    machine: str
    torch_version: str
    outputs_match: bool | None = None
    grads_match: bool | None = None
    max_abs_diff: float | None = None
    # CUDA: the most the caching allocator's unsplit blocks can add to the forward's and the
    # training step's peak (Evaluation.allocator_slack); a difference within it is the allocator's
    slack: tuple[int, int] | None = None

    @property
    def ok(self) -> bool:
        equivalent = self.outputs_match is not False and self.grads_match is not False
        return equivalent and all(r.ok(self.tolerance) for r in self.rows)

    def to_dict(self) -> dict:
        return {"model": self.model, "device": self.device, "dims": self.dims, "machine": self.machine,
                "torch": self.torch_version, "tolerance": self.tolerance, "ok": self.ok,
                "rows": [{"what": r.what, "predicted": r.predicted, "measured": r.measured, "diff": r.diff,
                          "percent": round(r.percent, 4)} for r in self.rows],
                "outputs_match": self.outputs_match, "grads_match": self.grads_match,
                "max_abs_diff": self.max_abs_diff, "allocator_slack": self.slack}

    def __str__(self) -> str:
        head = f"fxmem.validate · {self.model} · {self.device} ({self.machine}) · torch {self.torch_version} · {self.dims}"
        lines = [head, f"{'quantity':<40} {'predicted':>16} {'measured':>16} {'diff':>12} {'%':>8}"]
        for r in self.rows:
            mark = "" if r.ok(self.tolerance) else "   <-- off"
            lines.append(f"{r.what:<40} {r.predicted:>16,} {r.measured:>16,} {r.diff:>12,} {r.percent:>7.3f}%{mark}")
        if self.outputs_match is not None:
            grads = {True: "match", False: "DIFFER", None: "not compared"}[self.grads_match]
            lines.append(f"optimized rewrite: outputs {'match' if self.outputs_match else 'DIFFER'}, gradients "
                         f"{grads} (max |diff| {self.max_abs_diff:.3g})")
        if self.slack and any(self.slack):
            lines.append(f"the caching allocator's unsplit blocks can add up to {self.slack[0]:,} B to the forward's peak "
                         f"and {self.slack[1]:,} B to the step's (allocator_slack; none with expandable_segments)")
        lines.append("all within {:.1%}: {}".format(self.tolerance, "yes" if self.ok else "NO"))
        return "\n".join(lines)


@phased("measurement")
def _measure(fn: Callable[[], Any], device: str) -> tuple[int, int]:
    m = measure(fn, device=device, warmup=1)
    return m.peak_above_start, m.retained


@isolated
@timed("analyze_kw")
def validate(model: torch.nn.Module, *input_specs: Any, dims: Mapping[str, int], device: str = "cuda",
             optimized: torch.nn.Module | None = None, optimizer: Callable | None = None,
             loss: Callable[[Any], torch.Tensor] | None = None, inputs: list | None = None,
             tolerance: float = 0.01, mode: str = "auto", snapshot: str | os.PathLike | None = None,
             **analyze_kw: Any) -> Validation:
    """Predict with fxmem and measure for real on ``device``; see the module docstring.

    ``optimizer`` (default: plain SGD) is the training step's optimizer; ``inputs`` overrides the
    random inputs (e.g. valid edge indices). ``snapshot``: a folder where the predicted and the
    real run are written side by side as PyTorch memory snapshots (``predicted_forward.pickle``,
    ``real_forward.pickle``, ``predicted_step.pickle``, ``real_step.pickle``) for
    pytorch.org/memory_viz; on CUDA the real ones are the caching allocator's recorded history.
    (It is validate's own argument, not an analysis option: it says what to write of the real run.)
    """
    if device not in ("cpu", "cuda"):
        raise DeviceError(f"device={device!r}: validate measures on 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device='cuda' needs a CUDA GPU to measure on; none is available here "
                          "(validate on device='cpu', or run on a machine with a GPU)")
    if not isinstance(dims, Mapping) or not dims:
        raise SpecError("validate(dims=...) needs the sizes to measure at, e.g. dims=dict(B=4, N=500)")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < float("inf"):
        raise SpecError(f"validate(tolerance={tolerance!r}): the allowed relative difference is a number >= 0, "
                        f"e.g. 0.01 for 1 %")
    if optimized is not None and not isinstance(optimized, torch.nn.Module):
        raise SpecError(f"validate(optimized=...) takes the module fxmem.optimize returned, got {type(optimized).__name__}")
    if analyze_kw.get("grad", True) is not True:
        raise SpecError(f"validate(grad={analyze_kw['grad']!r}): validate measures the forward and a training step, "
                        f"which needs grad=True; to check an inference analysis, compare report.evaluate(...) with "
                        f"fxmem.measure.measure(lambda: model(x)) under torch.no_grad()")
    optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=1e-3))
    loss_fn = loss or default_loss
    # (no self-check: validate's own real run, at the sizes asked for, is the check)
    report = analyze(model, *input_specs, device=device, optimizer=optimizer, loss=loss, mode=mode,
                     **{"check": False, **analyze_kw})
    predicted = report.evaluate(**dims)
    need = max(predicted["peak"], predicted["train_peak"])
    _check_fits(need, dims, device)
    with _out_of_memory(need, dims, device):  # a machine short of what it reports (other processes)
        real = copy.deepcopy(model).to(device)
        module = trace(real) if report.mode == "graph" else real  # the code the prediction is of (report.capture)
        xs = inputs if inputs is not None else random_inputs(report.specs, dims, device=device)
        xs = [x.to(device) for x in xs]
        rows = []
        fwd = _measure(lambda: module(*xs), device)
        rows += [Row("forward: peak above resident", predicted["peak_above_resident"], fwd[0]),
                 Row("forward: retained", predicted["retained"], fwd[1])]
        opt = optimizer(real.parameters())
        train_step(module, xs, opt, loss_fn)  # the optimizer's state now exists: steady state
        step = _measure(lambda: train_step(module, xs, opt, loss_fn), device)
    state = sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.device.type == device)
    rows += [Row("training step: peak above resident", predicted["train_peak"] - predicted["train_resident"], step[0]),
             Row("training step: retained", predicted["train_retained"], step[1]),
             Row("optimizer state", predicted["optimizer_state"], _rounded(state, device, opt))]
    if snapshot is not None:
        _write_snapshots(os.fspath(snapshot), report, dims, device, lambda: module(*xs),
                         lambda: train_step(module, xs, opt, loss_fn))
    result = Validation(report.model_name, device, dict(dims), rows, tolerance, machine_name(device), torch.__version__)
    if device == "cuda":
        result.slack = (predicted["allocator_slack"], predicted["train_allocator_slack"])
    if optimized is not None:
        _check_optimized(result, model, optimized, input_specs, dims, device, xs, analyze_kw)
    return result


def _memory_of(device: str) -> int | None:
    """The bytes ``device`` has in all (physical memory for 'cpu'); None when unknown."""
    try:
        if device == "cuda":
            return torch.cuda.mem_get_info()[1]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def _too_large(need: int, dims: Mapping[str, int], device: str, has: int | None) -> SpecError:
    from .units import format_bytes
    sizes = ", ".join(f"{k}={v}" for k, v in dims.items())
    than = f"more than this machine's {format_bytes(has)} of {device} memory" if has else \
        f"more than this machine can allocate on {device}"
    return SpecError(f"validate(dims=dict({sizes})): these sizes need {need:,} bytes ({format_bytes(need)}, the "
                     f"predicted peak), {than}; what to do: measure at smaller dims= (the formulas "
                     f"hold at every size; report.evaluate({sizes}) gives the numbers without running)")


def _check_fits(need: int, dims: Mapping[str, int], device: str) -> None:
    """Refuse, before allocating anything, sizes whose predicted peak exceeds all the device's memory
    (torch would fail with its allocator's raw error, or the machine would start swapping)."""
    has = _memory_of(device)
    if has is not None and need > has:
        raise _too_large(need, dims, device, has)


@contextlib.contextmanager
def _out_of_memory(need: int, dims: Mapping[str, int], device: str) -> Iterator[None]:
    """The real run's allocation failures, in words naming ``dims=`` and the bytes they need."""
    try:
        yield
    except MemoryError:
        raise _too_large(need, dims, device, None) from None
    except RuntimeError as exc:  # torch.OutOfMemoryError, or the CPU allocator's "can't allocate memory"
        if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate memory" not in str(exc) \
                and "out of memory" not in str(exc).lower():
            raise
        raise _too_large(need, dims, device, None) from None


def _write_snapshots(folder: str, report: Any, dims: Mapping[str, int], device: str, forward: Callable,
                     step: Callable) -> None:
    """The predicted and the real forward and training step, as memory snapshots in ``folder``."""
    import pickle

    from .measure import record_snapshot

    os.makedirs(folder, exist_ok=True)
    for name, train, run in (("forward", False, forward), ("step", True, step)):
        report.snapshot(dims, path=os.path.join(folder, f"predicted_{name}.pickle"), train=train)
        real = record_snapshot(run, device)
        with open(os.path.join(folder, f"real_{name}.pickle"), "wb") as f:
            pickle.dump(real, f)


def _rounded(state: int, device: str, opt: torch.optim.Optimizer) -> int:
    if device != "cuda":
        return state
    return sum(cuda_block_bytes(t.untyped_storage().nbytes()) for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.device.type == device)


def _check_optimized(result: Validation, model: torch.nn.Module, optimized: torch.nn.Module, specs: tuple,
                     dims: Mapping[str, int], device: str, xs: list, analyze_kw: dict) -> None:
    """Outputs and gradients of the rewrite against the original, and its memory, on the device."""
    diff = compare(model, optimized, [xs], device=device)
    failed_output = not diff.ok and diff.where.startswith("output")
    result.outputs_match = not failed_output
    result.grads_match = diff.ok if not failed_output else None
    result.max_abs_diff = diff.max_abs
    report = analyze(optimized, *specs, device=device, **{"check": False, **analyze_kw})
    predicted = report.evaluate(**dims)
    rewritten = copy.deepcopy(optimized).to(device)
    fwd = _measure(lambda: rewritten(*xs), device)
    result.rows += [Row("optimized forward: peak above resident", predicted["peak_above_resident"], fwd[0]),
                    Row("optimized forward: retained", predicted["retained"], fwd[1])]
