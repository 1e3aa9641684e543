"""The command line calls only what it knows to be a model: an ``nn.Module`` subclass or a factory
function written in the user's own file. Every other ``module:Name`` is refused *before* it is
called - each case here would leave a marker file (or exit, or delete a folder) if it were called."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from fxmem.cli import load_model
from fxmem.errors import SpecError

USER_FILE = """
import torch
from subprocess import getoutput
from shutil import rmtree
from os import system
import builtins


class Net(torch.nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.l = torch.nn.Linear(width, 2)

    def forward(self, x):
        return self.l(x)


def make(width=4):
    return Net(width)


built = Net(3)


class NotAModule:
    def __init__(self, **kw):
        open({marker!r}, "w").write("called")


def gen(**kw):
    open({marker!r}, "w").write("called")
    yield Net()


quit_ = builtins.exit
"""


@pytest.fixture()
def user_file(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    marker = tmp_path / "marker"
    path = tmp_path / "user_models.py"
    path.write_text(USER_FILE.format(marker=str(marker)))
    (tmp_path / "victim").mkdir()
    return path, marker


def _hostile_init(tmp_path: pathlib.Path) -> dict:
    marker = tmp_path / "marker"
    (tmp_path / "victim").mkdir(exist_ok=True)
    return {"cmd": f"touch {marker}", "command": f"touch {marker}", "path": str(tmp_path / "victim"),
            "code": 0, "status": 0}


@pytest.mark.parametrize("target", [
    "subprocess:getoutput", "subprocess:run", "shutil:rmtree", "os:system", "builtins:exit", "builtins:eval",
    "os:_exit", "sys:exit", "pathlib:Path", "functools:partial", "torch:save",
])
def test_library_callables_are_refused_before_being_called(target, tmp_path):
    with pytest.raises(SpecError, match="nothing else is ever run|not an nn.Module subclass") as info:
        load_model(target, _hostile_init(tmp_path))
    assert target in str(info.value)
    assert not (tmp_path / "marker").exists()
    assert (tmp_path / "victim").is_dir()


@pytest.mark.parametrize("name, fragment", [
    ("getoutput", "not written in"), ("rmtree", "not written in"), ("system", "not written in"),
    ("quit_", "Quitter"), ("NotAModule", "not an nn.Module subclass"), ("gen", "generator function"),
])
def test_names_in_the_user_file_that_are_not_models_are_refused(name, fragment, user_file, tmp_path):
    path, marker = user_file
    with pytest.raises(SpecError, match=fragment):
        load_model(f"{path}:{name}", _hostile_init(tmp_path))
    assert not marker.exists()
    assert (tmp_path / "victim").is_dir()


def test_models_classes_and_own_factories_still_load(user_file):
    path, _ = user_file
    assert isinstance(load_model(f"{path}:Net", {"width": 5}), torch.nn.Module)
    assert load_model(f"{path}:make", {"width": 6}).l.in_features == 6
    assert load_model(f"{path}:built", {}).l.in_features == 3
    assert isinstance(load_model("torch.nn:Linear", {"in_features": 2, "out_features": 3}), torch.nn.Linear)


def test_cli_refuses_a_shell_command_as_model_with_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FXMEM_TRACEBACK"}
    out = subprocess.run([sys.executable, "-m", "fxmem", "analyze", "subprocess:getoutput", "--init",
                          f"cmd='touch {tmp_path / 'marker'}'", "--input", "B,4"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr
    assert "nothing else is ever run" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "marker").exists()
