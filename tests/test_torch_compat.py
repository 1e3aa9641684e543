"""Private PyTorch API is used in one module only, fxmem/_torch_compat.py, so that a torch upgrade
touches one file. This test reads every other module of the package (fxmem/ and passes/) and
fails on any use of torch's private modules, names or internals."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("fxmem", "passes") for p in (ROOT / folder).rglob("*.py")
                 if p.name != "_torch_compat.py")
# internals reached as attributes of torch objects (modules, ops, the ShapeEnv, optimizers)
PRIVATE_ATTRIBUTES = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_schema",
                      "_foreach_supported_types", "replacements", "var_to_range", "var_to_val", "shape_env",
                      "_disable_current_modes", "_is_torch_function_mode_enabled"}


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _dotted(node: ast.AST) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def violations(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Every use of private torch API in one file, as ``file:line: what``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "torch" and any(_private(p) for p in parts):
                found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(_private(p) for p in parts):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if chain and chain[0] == "torch" and any(_private(p) for p in chain[1:]):
                if not any(f.startswith(f"{where}: {'.'.join(chain)}") for f in found):  # once per chain
                    found.append(f"{where}: {'.'.join(chain)}")
            elif node.attr in PRIVATE_ATTRIBUTES and chain[:1] != ["tc"]:  # tc: the compat module itself
                found.append(f"{where}: .{node.attr}")
    return found


def test_the_scan_sees_the_package():
    names = {p.name for p in SOURCES}
    assert {"analyze.py", "recorder.py", "registry.py", "optimize.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_torch_api_outside_the_compat_module(path):
    assert violations(path) == []


def test_the_scan_catches_private_api(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom torch.utils._pytree import tree_leaves\nx = torch._C._get_tracing_state\n"
                   "def f(m, env):\n    return m._parameters, env.replacements\n")
    found = violations(bad, tmp_path)
    assert [f.split(":")[1] for f in found] == ["2", "3", "5", "5"], found
