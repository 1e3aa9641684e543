"""The package's shape, read from its own imports (docs/make_architecture.py): the committed
picture of the pipeline is the code's, no modules import each other in a circle, and no module
outgrows the size limit unless it is a catalogue of rules or named with its reason."""
from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("make_architecture", ROOT / "docs" / "make_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_has_a_stage():
    assert _tool().unplaced() == [], "give each new top-level module a stage in docs/make_architecture.py"


def test_the_committed_picture_is_the_codes():
    tool = _tool()
    committed = (ROOT / "docs" / "architecture.dot").read_text()
    assert committed == tool.dot_text(), "run python docs/make_architecture.py and commit docs/architecture.*"
    svg = (ROOT / "docs" / "architecture.svg").read_text()
    for name in tool.STAGES:  # the SVG was drawn from this DOT: every stage is a box in it
        assert f"<title>{name}</title>" in svg


def test_the_reader_sees_imports_it_must():
    """The reading itself, against imports written in the code: a relative import, an import inside
    a function (dashed), and an import of a package's module by its folder."""
    edges = _tool().imports()
    assert edges[("fxmem.accounting.budget", "fxmem.units")] is True
    assert ("fxmem.passes.optimize", "fxmem.analyze") in edges
    assert any(a == "fxmem.cli" and not top for (a, _), top in edges.items())  # cli imports lazily


def test_no_import_circle():
    assert _tool().import_cycles() == []


def test_a_circle_would_be_found(tmp_path, monkeypatch):
    tool = _tool()
    pkg = tmp_path / "fxmem"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from fxmem.a import y\n")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    assert tool.import_cycles() == [["fxmem.a", "fxmem.b"]]


def test_no_module_over_the_limit():
    assert _tool().long_modules() == {}


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_the_picture_renders(tmp_path):
    out = tmp_path / "architecture.svg"
    subprocess.run(["dot", "-Tsvg", str(ROOT / "docs" / "architecture.dot"), "-o", str(out)], check=True)
    assert out.stat().st_size > 10_000
