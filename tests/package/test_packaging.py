"""The layout installs as it should: the top-level passes/ folder becomes ``fxmem.passes`` in a
wheel (``pip install .``), in an editable install, and in a bare source checkout; no top-level
module called ``passes`` is ever importable; every subpackage of fxmem/ is in the wheel."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ("import importlib.util, fxmem, fxmem.passes, fxmem.passes.pair_linear; "
         "print(fxmem.__file__); print(fxmem.passes.__file__); print(importlib.util.find_spec('passes'))\n"
         "try:\n    import passes\nexcept ImportError as e:\n    print(e)\nelse:\n    print('imported')")


def _run(args: list[str], cwd: pathlib.Path, env: dict | None = None) -> list[str]:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_every_subpackage_is_in_the_wheel():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fxmem").rglob("__init__.py")}
    assert set(config["packages"]) == folders | {"fxmem.passes"}
    assert config["package-dir"]["fxmem.passes"] == "passes"


@pytest.mark.slow
def test_pip_install_puts_the_passes_inside_the_package(tmp_path):
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(ROOT)], tmp_path)
    assert (target / "fxmem" / "passes" / "pair_linear.py").exists() and not (target / "passes").exists()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    fxmem_file, passes_file, top_level, imported = _run([sys.executable, "-c", CHECK], tmp_path, env)
    assert fxmem_file.startswith(str(target)) and passes_file.startswith(str(target / "fxmem" / "passes"))
    assert top_level == "None" and imported == "No module named 'passes'"


def test_a_bare_checkout_works_without_any_install(tmp_path):
    """No site hooks (-S: no editable finder): fxmem/ from the checkout finds passes/ beside it. The
    checkout's root on sys.path makes the folder findable as ``passes``; importing it so says what it is."""
    packages = sysconfig.get_paths()["purelib"]
    code = f"import sys; sys.path[:0] = [{str(ROOT)!r}, {packages!r}]; " + CHECK
    fxmem_file, passes_file, _, imported = _run([sys.executable, "-S", "-c", code], tmp_path)
    assert fxmem_file == str(ROOT / "fxmem" / "__init__.py") and passes_file == str(ROOT / "passes" / "__init__.py")
    assert imported.startswith("this folder is the package fxmem.passes")


def _pins() -> dict[str, str]:
    lines = (ROOT / "scripts" / "pinned.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_the_tests_run_on_the_pinned_versions():
    """scripts/setup.sh installs with scripts/pinned.txt as constraints (``--latest``: without): every
    package installed here that the file names is at its version, so what CI proved is what runs."""
    import importlib.metadata
    import os

    from packaging.utils import canonicalize_name

    pins = {canonicalize_name(k): v for k, v in _pins().items()}
    assert {"transformers", "kernels", "torch-geometric", "sympy", "networkx", "pytest"} <= set(pins)
    if os.environ.get("FXMEM_LATEST") == "1":
        pytest.skip("--latest: the newest versions, not the pins")
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    off = {name: (installed[name], pin) for name, pin in pins.items() if name in installed and installed[name] != pin}
    assert not off, f"installed (version, pin) differ from scripts/pinned.txt: {off}; run scripts/setup.sh"
