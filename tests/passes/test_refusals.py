"""Inputs that used to escape as raw Python exceptions (or a number for code that never runs) are
clear ``FxMemError``s naming what to do; ``max_size`` never answers 0 without saying why."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import fxmem
from fxmem.views.figure import writing


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.l(x))


class Yields(Small):
    def forward(self, x):
        for _ in range(3):
            yield self.l(x)


class Awaits(Small):
    async def forward(self, x):
        return self.l(x)


@pytest.mark.parametrize("make", [lambda: torch.jit.script(Small()),
                                  lambda: torch.jit.trace(Small(), torch.randn(2, 4))], ids=["script", "trace"])
def test_torchscript_modules_are_refused(make):
    with pytest.raises(fxmem.ModelError, match="TorchScript.*original nn.Module"):
        fxmem.analyze(make(), ("B", 4))


@pytest.mark.parametrize("model, kind", [(Yields(), "generator"), (Awaits(), "async")])
@pytest.mark.parametrize("mode", ["auto", "eager"])
def test_a_forward_that_does_not_run_when_called_gets_no_number(model, kind, mode):
    with pytest.raises(fxmem.ModelError, match=kind):
        fxmem.analyze(model, ("B", 4), mode=mode)


DEEP_NEST = """
import torch, fxmem
deep = torch.nn.Linear(4, 4)
for _ in range(3000):
    deep = torch.nn.Sequential(deep)
try:
    fxmem.analyze(deep, ("B", 4))
except fxmem.ModelError as exc:
    print("ModelError:", exc)
assert fxmem.analyze(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)]), ("B", 4)).peak
print("then a shallow model: analysed")
"""


def test_a_very_deep_nest_is_a_model_error_not_a_recursion_error():
    # in a process of its own, as a user's script meets it: in a test worker that had run ~500 tests
    # it once took 558 s (1.7 s alone; not reproduced on a smaller set, perhaps the garbage collector's
    # passes over a large heap while the 3,000 levels are copied)
    done = subprocess.run([sys.executable, "-c", DEEP_NEST], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ModelError:" in done.stdout and "recursion limit" in done.stdout, done.stdout[-2000:]
    assert "then a shallow model: analysed" in done.stdout


def test_an_input_with_thousands_of_dims_is_refused():
    with pytest.raises(fxmem.SpecError, match="5000 dims.*at most 64"):
        fxmem.analyze(Small(), ("B",) + (1,) * 4998 + (4,))


@pytest.fixture(scope="module")
def report():
    return fxmem.analyze(Small(), ("B", 4), optimizer=lambda p: torch.optim.Adam(p))


@pytest.mark.parametrize("budget", ["9" * 400, 10**400, "1e999"])
def test_max_size_of_an_astronomical_budget_is_a_spec_error(report, budget):
    with pytest.raises(fxmem.SpecError):
        report.max_size("B", budget)


@pytest.mark.parametrize("train", [False, True])
def test_max_size_zero_comes_with_its_reason(report, train):
    model = report.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    one_input = 4 * 4  # B=1: one row of 4 float32
    adam_state = 2 * params + 4 * len(list(model.parameters()))  # exp_avg, exp_avg_sq, a float32 step each
    resident = params + one_input + (adam_state if train else 0)
    with pytest.warns(UserWarning, match="nothing fits"):
        size = report.max_size("B", resident - 1, train=train)
    assert size == 0 and isinstance(size, int)
    assert f"needs {resident} B" in size.reason, size.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fits = report.max_size("B", "1MiB", train=train)
    assert fits > 0 and fits.reason is None


@pytest.mark.parametrize("target", ["/dev/full.svg", "/proc/fxmem.svg", "{tmp}/to_dev_full.svg"])
def test_drawings_are_not_written_into_devices(report, target, tmp_path):
    os.symlink("/dev/full", tmp_path / "to_dev_full.svg")
    with pytest.raises(fxmem.SpecError, match="system folder"):
        report.render(target.format(tmp=tmp_path), "diagram")
    assert not os.path.exists("/dev/full.svg")


def test_a_failed_write_is_a_spec_error_naming_the_file(tmp_path):
    with pytest.raises(fxmem.SpecError, match="out.svg.*No space left"):
        with writing(str(tmp_path / "out.svg")):
            raise OSError(28, "No space left on device")


class SparseEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)

    def forward(self, ids):
        return self.emb(ids)


def _optimizer_cases() -> list:
    cases = [("ASGD", lambda p: torch.optim.ASGD(p), "decides on the values")]
    if hasattr(torch.optim, "Adafactor"):
        cases.append(("Adafactor", lambda p: torch.optim.Adafactor(p), "decides on the values"))
    return cases


@pytest.mark.parametrize("name, make, fragment", _optimizer_cases(), ids=[c[0] for c in _optimizer_cases()])
def test_optimizers_that_read_their_values_are_refused_in_plain_words(name, make, fragment):
    with pytest.raises(fxmem.UnsupportedOpError, match=fragment) as info:
        fxmem.analyze(Small(), ("B", 4), optimizer=make)
    message = str(info.value)
    assert f"torch.optim.{name}" in message
    assert not __import__("re").search(r"\b(?:zuf|zf|[su])\d+\b", message), message  # no torch symbol


@pytest.mark.parametrize("optimizer", [lambda p: torch.optim.SparseAdam(p), lambda p: torch.optim.Adam(p)],
                         ids=["SparseAdam", "Adam"])
def test_sparse_gradients_are_refused_clearly(optimizer):
    with pytest.raises(fxmem.UnsupportedOpError, match="sparse gradients.*sparse=False"):
        fxmem.analyze(SparseEmbedding(), fxmem.TensorSpec(("B",), dtype=torch.int64), optimizer=optimizer)


# the symbolic two-layer bidirectional GRU (~30 s) runs in the slow set: the LSTM's (the one that was
# wrong) and the GRU's other forms stay in CI
_RECURRENT = [pytest.param(cell, kw, symbolic, id=f"{cell.__name__}-{'symbolic' if symbolic else 'concrete'}-kw{k}",
                           marks=[pytest.mark.slow] if (cell is torch.nn.GRU and symbolic and k == 1) else [])
              for cell in (torch.nn.GRU, torch.nn.LSTM) for symbolic in (False, True)
              for k, kw in enumerate([{"batch_first": True}, {"num_layers": 2, "bidirectional": True}])]


@pytest.mark.parametrize("cell, kw, symbolic", _RECURRENT)
def test_recurrent_layers_match_a_real_run(cell, kw, symbolic):
    # the LSTM was refused with symbolic sizes (torch's C++ read them as numbers) and, at concrete
    # sizes, 47,096 B low (oneDNN's workspace: 48,392 B real peak, 1,296 B predicted)
    from fxmem.measure import measure

    torch.manual_seed(0)
    rnn, x = cell(4, 8, **kw), torch.randn(3, 5, 4)
    report = fxmem.analyze(rnn, ("B", "L", 4)) if symbolic else fxmem.analyze(rnn, x)
    pred = report.evaluate(B=3, L=5) if symbolic else report.evaluate()
    m = measure(lambda: rnn(x))
    assert (m.peak_above_start, m.retained) == (pred["peak_above_resident"], pred["retained"])
    assert report.exact, report.notes
