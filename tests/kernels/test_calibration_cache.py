"""The on-disk calibration cache (fxmem.kernels.calibration_cache): a second process on the same
CPU and torch does not re-run the real kernels a first one calibrated, and gets the same formulas
as a process that calibrated for itself; a corrupt entry is ignored and rewritten; writers
running at once leave every entry whole."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

import pytest

from fxmem.kernels import calibration_cache as cc
from fxmem.kernels.registry import OUT, OutAt

ROOT = Path(__file__).resolve().parents[2]

# counts the calibrations through the documented ``fxmem`` logger, prints them and the formulas
SCRIPT = """
import logging, torch, fxmem
from fxmem.kernels import calibrate
torch.set_num_threads(1)
# the fitted path, as where the example sizes are too large to run once (tests/conftest.py: fitted_kernels)
measured = calibrate._measured
calibrate._measured = lambda call, items, x, markers=None: None if markers is None else measured(call, items, x, markers)
count = []
class Count(logging.Handler):
    def emit(self, record):
        if "calibrating" in record.getMessage():
            count.append(record.getMessage())
logging.getLogger("fxmem").addHandler(Count())
logging.getLogger("fxmem").setLevel(logging.INFO)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
report = fxmem.analyze(model, ("B", 3, "H", "W"))
print(len(count))
print(report.peak)
print(report.evaluate(B=2, H=9, W=11)["peak"])
"""


def _run(cache: Path) -> tuple[int, str, str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    calibrations, peak, at = done.stdout.strip().splitlines()[-3:]
    return int(calibrations), peak, at


def test_second_process_reads_the_cache_and_a_corrupt_file_is_ignored(tmp_path):
    first = _run(tmp_path)
    assert first[0] > 0  # a conv and a batch norm: calibrated for real
    files = list((tmp_path / "fxmem").glob("calibrations-*/*.json"))
    assert files and all(cc.decode(json.loads(f.read_text())) is not None for f in files)
    second = _run(tmp_path)
    assert second[0] == 0  # nothing re-run
    assert second[1:] == first[1:]  # the same formulas as calibrating afresh
    for f in files:
        f.write_text('["OUT", ')  # half an entry
    third = _run(tmp_path)
    assert third[0] > 0 and third[1:] == first[1:]
    assert all(cc.decode(json.loads(f.read_text())) is not None for f in files)  # rewritten whole


def test_entries_round_trip_and_garbage_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    program = [OUT, OutAt(1), (1, Fraction(1, 2), Fraction(0), Fraction(64)), -4096]
    assert cc.decode(cc.encode(program)) == program
    for bad in ({"x": 1}, [True], [[2, "1", "0", "0"]], ["OUT", "nope"]):
        with pytest.raises(ValueError):
            cc.decode(bad)
    cc.store("k", [OUT, 1])
    cc.entry_file("k").write_text(json.dumps(["OUT", "nope"]))
    assert cc.load("k") is None  # an entry that does not decode is a miss, not an error
    cc.store("k", [OUT, 1])
    assert cc.load("k") == [OUT, 1]
    monkeypatch.setattr(cc, "machine", lambda: {"torch": "0.0"})
    assert cc.load("k") is None  # made under another torch (another folder): not read


def test_concurrent_writers_keep_every_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    keys = [f"key{i}" for i in range(24)]
    threads = [threading.Thread(target=cc.store, args=(k, [OUT, i])) for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(f.stem for f in cc.cache_folder().glob("*.json")) == sorted(keys)
    assert all(cc.load(k) == [OUT, i] for i, k in enumerate(keys))
    assert not list(cc.cache_folder().glob("*.tmp"))
