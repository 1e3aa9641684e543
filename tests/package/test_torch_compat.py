"""Private PyTorch API is used only inside the folder fxmem/_torch_compat/, one module per torch
subsystem (fake tensors, fx and Dynamo, nn.Module, autograd, devices, distributed, ...), so that a
torch upgrade touches that folder only and a break in one subsystem is read in its own module. This
test reads every module of the package outside that folder (fxmem/ and passes/) and fails on any
use of torch's private modules, names or internals; it also checks that the folder's modules are
the subsystems, and that its ``__init__`` only re-exports them."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPAT = ROOT / "fxmem" / "_torch_compat"
SOURCES = sorted(p for folder in ("fxmem", "passes") for p in (ROOT / folder).rglob("*.py")
                 if COMPAT not in p.parents)
# the compat package's modules: the torch subsystem each wraps (its docstring's first line names it),
# and its layer (a module imports only modules of lower layers: no circles, the volatile ones on top)
SUBSYSTEMS = {
    "ops": ("torch._ops", 0),
    "modules": ("torch.nn.Module", 0),
    "autograd": ("torch.autograd", 0),
    "devices": ("torch.cuda", 0),
    "fake": ("torch._subclasses.fake_tensor", 1),
    "fx": ("torch._dynamo", 2),
    "distributed": ("torch.distributed", 2),
    "conv_backend": ("torch._subclasses.fake_impls", 0),
    "pipelining": ("torch.distributed.pipelining", 0),
}
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
    assert not any(COMPAT in p.parents for p in SOURCES) and (COMPAT / "fake.py").exists()
    assert not (ROOT / "fxmem" / "_torch_compat.py").exists()  # the package, not a module beside it


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_torch_api_outside_the_compat_module(path):
    assert violations(path) == []


def test_the_scan_catches_private_api(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom torch.utils._pytree import tree_leaves\nx = torch._C._get_tracing_state\n"
                   "def f(m, env):\n    return m._parameters, env.replacements\n")
    found = violations(bad, tmp_path)
    assert [f.split(":")[1] for f in found] == ["2", "3", "5", "5"], found


def _modules() -> dict[str, pathlib.Path]:
    return {p.stem: p for p in sorted(COMPAT.glob("*.py")) if p.name != "__init__.py"}


def test_the_compat_modules_are_the_torch_subsystems():
    """One module per torch subsystem, each saying in its docstring which subsystem it wraps (first
    line) and what breaks there on a torch upgrade; each imports only the layers below its own."""
    modules = _modules()
    assert set(modules) == set(SUBSYSTEMS), "a new compat module: name its subsystem and layer in SUBSYSTEMS"
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        doc = ast.get_docstring(tree) or ""
        subsystem, layer = SUBSYSTEMS[name]
        first_paragraph = doc.split("\n\n")[0]
        assert subsystem in first_paragraph, f"{path.name}: its docstring's first paragraph names {subsystem}"
        assert "On a torch upgrade, what breaks here" in doc, f"{path.name}: say what breaks on an upgrade"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                target = (node.module or "").split(".")[0]
                assert target, f"{path.name}:{node.lineno}: imports the package itself (its __init__)"
                assert SUBSYSTEMS[target][1] < layer, f"{path.name}:{node.lineno}: imports .{target}, not below it"


def test_the_compat_init_only_reexports():
    """``fxmem/_torch_compat/__init__.py`` defines nothing and touches no torch API itself: its
    docstring, imports from its own modules, and ``__all__`` (every name it imports)."""
    path = COMPAT / "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    imported, listed = set(), None
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in SUBSYSTEMS:
            imported |= {a.asname or a.name for a in node.names}
            continue
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"]:
            listed = set(ast.literal_eval(node.value))
            continue
        raise AssertionError(f"__init__.py:{node.lineno}: only re-exports belong here ({ast.dump(node)[:80]})")
    assert listed == imported
    import fxmem._torch_compat as tc
    assert all(hasattr(tc, name) for name in listed)


def test_importing_the_compat_package_leaves_torch_distributed_unloaded():
    """Distributed internals are imported inside the functions that need them (a fifth of a second)."""
    code = ("import sys, torch; before = set(sys.modules); import fxmem._torch_compat; "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch.distributed')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
