"""Shared test helpers: every prediction is checked against an independent measurement of a real
run (the CPU allocator's own counters, read through the profiler), at sizes the analysis never saw.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import pathlib
import sys
from typing import Any, Callable, Mapping

import pytest
import torch

import fxmem
from fxmem.inputs import random_inputs
from fxmem.measure import measure

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# Triton's interpreter for the Triton kernels' tests (tests/kernels/triton_interpreter.py), set before
# any test module is collected where no GPU runs the kernels compiled: Triton reads it once, when it
# is first imported, and modules collected earlier may import it (torch.distributed.pipelining does, on
# a CUDA build)
if torch.backends.cuda.is_built() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
_EXAMPLES: dict[str, Any] = {}


def load_example(name: str) -> Any:
    """Import ``examples/<name>.py`` as a module (examples are scripts, not a package)."""
    if name not in _EXAMPLES:
        spec = importlib.util.spec_from_file_location(f"fxmem_example_{name}", ROOT / "examples" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        _EXAMPLES[name] = mod
    return _EXAMPLES[name]


def real_inputs(report: fxmem.Report, dims: Mapping[str, int],
                makers: Mapping[str, Callable[[tuple], torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """Real tensors matching the report's input specs at ``dims``."""
    torch.manual_seed(0)  # makers draw from the global generator
    return random_inputs(report.specs, dims, makers=makers)


def real_resident(model: torch.nn.Module, inputs: list[torch.Tensor], traced: torch.nn.Module | None = None) -> int:
    """Bytes of the distinct storages of parameters, buffers and inputs of a real model (and of
    the tensor constants fx put on the traced module, e.g. a ``torch.tensor([0, 2])`` in forward)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers()) + list(inputs)
    if traced is not None:
        tensors += list(traced.buffers())
        tensors += [v for m in traced.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def check_against_real_run(model: torch.nn.Module, specs: tuple, sizes: list[dict], *, grad: bool = True,
                           makers: Mapping[str, Callable] | None = None, report: fxmem.Report | None = None,
                           **analyze_kw: Any) -> fxmem.Report:
    """Analyse once, then run the traced module for real at each of ``sizes`` and compare bytes."""
    # the comparison below is the self-check's, at sizes the analysis did not see: the report's own
    # check at its small size would repeat it (a profiled real run); test_selfcheck.py tests that
    analyze_kw.setdefault("check", False)
    report = report or fxmem.analyze(model, *specs, grad=grad, **analyze_kw)
    gm = report.graph_module
    for dims in sizes:
        for name, value in dims.items():
            assert value != report.hints.get(name), "test sizes must differ from the analysed example sizes"
        xs = real_inputs(report, dims, makers)
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx:
            m = measure(lambda: gm(*xs))
        pred = report.evaluate(**dims)
        measured = (m.peak_above_start, m.retained)
        predicted = (pred["peak_above_resident"], pred["retained"])
        assert measured == predicted, (
            f"{report.model_name} at {dims}: measured (peak above start, retained) = {measured}, "
            f"fxmem predicted {predicted}\nformulas:\n{report.summary()}"
        )
        assert pred["resident"] == real_resident(model, xs, gm), f"{report.model_name} at {dims}: resident"
    return report


@pytest.fixture(autouse=True)
def _torch_state_restored():
    """Each test starts with the process's torch settings: a test that pins threads (the real
    distributed runs do, for steady timings) or changes the default dtype or grad mode leaves them
    as it found them, so no test's numbers depend on which tests ran before it in the process."""
    state = (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled())
    yield
    if (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled()) != state:
        torch.set_num_threads(state[0])
        torch.set_default_dtype(state[1])
        torch.set_grad_enabled(state[2])


@contextlib.contextmanager
def threads(n: int | None):
    """Run with ``n`` intra-op threads (None: leave as is)."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (the profiler hears only the calling thread's allocations)."""
    with threads(1):
        yield


@pytest.fixture
def fitted_kernels(monkeypatch):
    """Calibrated kernels (oneDNN convolution, batch norm) take their fitted path, as where the example
    sizes are too large to run once (fxmem.kernels.calibrate): no measurement at the example sizes."""
    from fxmem.kernels import calibrate

    measured = calibrate._measured
    monkeypatch.setattr(calibrate, "_measured", lambda call, items, x, markers=None:
                        None if markers is None else measured(call, items, x, markers))


def quadratic_float_activations(report: fxmem.Report, dim: str) -> list:
    """Float storages the run makes whose size grows with ``dim``**2 (inputs excluded): the N x N
    scores and weights a fused attention rewrite must not build."""
    import sympy

    found = []
    for s in report.storages:
        n = next((x for x in s.bytes.free_symbols if x.name == dim), None)
        if n is not None and s.kind in ("activation", "gradient") and s.dtype.is_floating_point \
                and sympy.Poly(sympy.expand(s.bytes), n).degree() >= 2:
            found.append(s)
    return found


def check_training_against_real_run(model: torch.nn.Module, specs: tuple, sizes: list[dict], optimizer,
                                    *, makers: Mapping[str, Callable] | None = None, num_threads: int | None = None,
                                    **analyze_kw: Any) -> fxmem.Report:
    """Analyse a training step, then run steady-state steps for real and compare bytes.

    ``num_threads=1`` is for kernels that allocate inside parallel regions (CPU flash attention's
    backward): the profiler only sees the calling thread's allocations, fxmem predicts them all.
    """
    from fxmem.training import default_loss

    loss = analyze_kw.get("loss") or default_loss
    analyze_kw.setdefault("check", False)  # the real steps below are the check (see check_against_real_run)
    with threads(num_threads):
        report = fxmem.analyze(model, *specs, optimizer=optimizer, **analyze_kw)
        check_steps_against_report(model, report, sizes, optimizer, makers=makers, loss=loss)
    return report


def check_steps_against_report(model: torch.nn.Module, report: fxmem.Report, sizes: list[dict], optimizer,
                               *, makers: Mapping[str, Callable] | None = None, loss: Callable | None = None) -> None:
    """Run steady-state training steps of ``model`` for real at each of ``sizes`` and compare their
    bytes with ``report``'s (peak above start, retained, optimizer state, resident)."""
    from fxmem.training import default_loss, train_step

    loss = loss or default_loss
    for dims in sizes:
        xs = real_inputs(report, dims, makers)
        opt = optimizer(model.parameters())
        module = report.graph_module if report.mode == "graph" else model
        train_step(module, xs, opt, loss)  # creates the optimizer state
        m = measure(lambda: train_step(module, xs, opt, loss))
        pred = report.evaluate(**dims)
        measured = (m.peak_above_start, m.retained)
        predicted = (pred["train_peak"] - pred["train_resident"], pred["train_retained"])
        assert measured == predicted, (
            f"{report.model_name} training step at {dims}: measured (peak above start, retained) = "
            f"{measured}, fxmem predicted {predicted}"
        )
        state = sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor))
        assert pred["optimizer_state"] == state, f"{report.model_name}: optimizer state bytes"
        assert pred["train_resident"] == real_resident(model, xs, report.graph_module) + state, \
            f"{report.model_name}: resident bytes of the training step"


# The CUDA-build phase of CI (scripts/test.sh) runs what only that build can check - CUDA simulated
# with fake tensors, the CUDA build's own refusals - and a smoke set on its torch release; the first
# phase already proves the rest on the CPU build.
CUDA_PHASE_FILES = {"test_cuda_sim.py", "test_packaging.py", "test_options.py", "test_torch_compat.py",
                    "test_exactness.py", "test_errors.py"}


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    cuda_built = torch.backends.cuda.is_built()
    gpu = torch.cuda.is_available()
    if os.environ.get("FXMEM_TEST_PHASE") == "cuda-build":
        keep = [i for i in items if "cuda_sim" in i.keywords or "cuda_build" in i.keywords
                or pathlib.Path(str(i.fspath)).name in CUDA_PHASE_FILES]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    for item in items:
        if "cuda_sim" in item.keywords and not cuda_built:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA build of torch (CI runs these in a second venv)"))
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def global_state() -> dict:
    """torch's and Python's global state an analysis must leave as it was (tests/package/test_global_state.py)."""
    return {"cpu rng": torch.get_rng_state().tolist(), "python rng": random.getstate(),
            "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
            "dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))}
