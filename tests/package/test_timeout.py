"""``timeout=`` and Ctrl-C (issue 43): a forward that loops or sleeps forever is stopped with
:class:`fxmem.AnalysisTimeout` naming the phase, from the main thread or another one; a
``KeyboardInterrupt`` unwinds an analysis cleanly. Either way torch's global state, the model and
the next analysis are as if nothing had happened, and no thread is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import fxmem
from fxmem.options import AnalysisOptions
from conftest import global_state as state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Loops(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        while True:
            pass


class Sleeps(Loops):
    def forward(self, x):
        time.sleep(1000)


class SwallowsErrors(Loops):
    """A forward that catches every error and carries on: still stopped."""

    def forward(self, x):
        while True:
            try:
                time.sleep(10)
            except Exception:
                pass


class SwallowsOnce(Loops):
    """A forward that swallows the interruption (a bare except) and returns normally: its run
    missed what the interruption cut short, so no number may come back."""

    slept = False

    def forward(self, x):
        if not self.slept:  # once: the analysis then ends before the watchdog's next interruption
            self.slept = True
            try:
                time.sleep(10)
            except BaseException:  # noqa: BLE001 - the point of this model
                pass
        return self.lin(x)


class CtrlC(Loops):
    def forward(self, x):
        raise KeyboardInterrupt


def _fxmem_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("fxmem-")]


def _stopped(model: torch.nn.Module, **kw) -> tuple[str, float]:
    """The timeout's message and the seconds it took, for ``analyze(model, timeout=1)``."""
    start = time.monotonic()
    with pytest.raises(fxmem.AnalysisTimeout) as info:
        fxmem.analyze(model, ("B", 4), timeout=1, **kw)
    return str(info.value), time.monotonic() - start


def _clean(model: torch.nn.Module, params: dict, before: dict) -> None:
    """Global state, the model and fxmem itself as they were: a normal analysis works."""
    assert state() == before
    assert not _fxmem_threads()
    assert time.sleep.__module__ == "time"  # the sliced sleep is gone
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert fxmem.analyze(torch.nn.Linear(4, 4), ("B", 4), check=False).peak is not None


@pytest.mark.parametrize("model, mode, phase", [
    (Loops, "auto", "capture"), (Sleeps, "auto", "capture"),
    (Loops, "eager", "simulation"), (Sleeps, "eager", "simulation"), (SwallowsErrors, "eager", "simulation")])
def test_a_forward_that_never_ends_is_stopped(model, mode, phase):
    m = model()
    params = {k: v.clone() for k, v in m.state_dict().items()}
    torch.manual_seed(3)
    before = state()
    message, took = _stopped(m, mode=mode)
    assert f"timeout=1 s, in the {phase} phase" in message and "what to do" in message
    assert took < 8
    assert isinstance(fxmem.AnalysisTimeout(""), TimeoutError)
    _clean(m, params, before)


def test_stopped_from_a_worker_thread():
    m = Loops()
    params = {k: v.clone() for k, v in m.state_dict().items()}
    torch.manual_seed(3)
    before = state()
    got: list = []

    def work() -> None:
        try:
            _stopped(m, mode="eager")
            got.append("stopped")
        except BaseException as exc:  # noqa: BLE001 - reported below
            got.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(30)
    assert got == ["stopped"]
    _clean(m, params, before)


def test_a_call_that_swallowed_the_interruption_returns_no_number():
    m = SwallowsOnce()
    params = {k: v.clone() for k, v in m.state_dict().items()}
    before = state()
    message, took = _stopped(m, mode="eager", check=False)
    assert "timeout=1 s, in the simulation phase" in message and took < 8
    _clean(m, params, before)


def test_a_timeout_that_does_not_expire_changes_nothing():
    m = torch.nn.Linear(4, 4)
    report = fxmem.analyze(m, ("B", 4), timeout=60, check=False)
    assert report.peak == fxmem.analyze(m, ("B", 4), check=False).peak
    assert report.options.timeout == 60
    assert not _fxmem_threads()


@pytest.mark.parametrize("bad", [0, -1, float("inf"), "10", True])
def test_timeout_must_be_positive_seconds(bad):
    with pytest.raises(fxmem.SpecError, match="timeout="):
        AnalysisOptions.of(timeout=bad)


def test_optimize_and_validate_take_the_timeout():
    with pytest.raises(fxmem.AnalysisTimeout, match="phase"):
        fxmem.optimize(Loops(), ("B", 4), timeout=1)
    with pytest.raises(fxmem.AnalysisTimeout, match="phase"):
        fxmem.validate(Loops(), ("B", 4), dims={"B": 2}, device="cpu", timeout=1)
    assert not _fxmem_threads()


@pytest.mark.parametrize("mode", ["auto", "eager"])
def test_keyboard_interrupt_in_the_forward_propagates(mode):
    m = CtrlC()
    torch.manual_seed(3)
    before = state()
    with pytest.raises(KeyboardInterrupt):
        fxmem.analyze(m, ("B", 4), mode=mode)
    assert state() == before
    done: list = []  # the lock was released: another thread can analyse
    other = threading.Thread(target=lambda: done.append(fxmem.analyze(torch.nn.Linear(4, 4), ("B", 4), check=False)))
    other.start()
    other.join(60)
    assert done and done[0].peak is not None


def test_ctrl_c_from_outside_propagates():
    """_thread.interrupt_main from a timer: Python's own Ctrl-C, in the middle of a looping forward;
    the next analysis works. In a process of its own: a Ctrl-C in a pytest-xdist worker ends it."""
    # SIGINT handled as in a terminal: a process started in the background inherits it ignored, and
    # Python then keeps it so (interrupt_main does nothing), whoever runs this suite
    out = subprocess.run([sys.executable, "-c", CTRL_C], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["interrupted", "True"], out.stdout + out.stderr[-2000:]


LOOPING_FILE = textwrap.dedent("""
    import torch


    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            while True:
                pass
""")

# the looping model, interrupted from outside by Python's own Ctrl-C; then another analysis
CTRL_C = LOOPING_FILE + textwrap.dedent("""
    import _thread, sys, threading, time
    import fxmem


    def press():  # Ctrl-C once the forward loops (a fixed delay could land in torch's lazy imports)
        main = threading.main_thread().ident
        while True:
            time.sleep(0.1)
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code is not Loop.forward.__code__:
                frame = frame.f_back
            if frame is not None:
                _thread.interrupt_main()
                return


    threading.Thread(target=press, daemon=True).start()
    try:
        fxmem.analyze(Loop(), ("B", 4), mode="eager")
    except KeyboardInterrupt:
        print("interrupted")
    print(fxmem.analyze(torch.nn.Linear(4, 4), ("B", 4), check=False).peak is not None)
""")


def test_cli_timeout(tmp_path):
    (tmp_path / "loop.py").write_text(LOOPING_FILE)
    out = subprocess.run([sys.executable, "-m", "fxmem", "analyze", f"{tmp_path / 'loop.py'}:Loop", "--input", "B,4",
                          "--timeout", "1", "--quiet"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "fxmem: error: fxmem stopped after timeout=1 s, in the capture phase" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_refuses_a_timeout_that_is_not_seconds(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fxmem", "analyze", "torch.nn:Linear", "--input", "B,4",
                          "--timeout", "-3"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "--timeout" in out.stderr


def test_cli_ctrl_c_exits_130_without_a_traceback(tmp_path):
    (tmp_path / "loop.py").write_text(LOOPING_FILE)
    # SIGINT as the terminal sends it (a background job may inherit it ignored: Python then keeps it so)
    proc = subprocess.Popen([sys.executable, "-m", "fxmem", "analyze", f"{tmp_path / 'loop.py'}:Loop", "--input",
                             "B,4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stderr:  # the progress says when the forward runs
            if "tracing" in line:
                break
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130
    assert err.strip() == "fxmem: interrupted (Ctrl-C)"
