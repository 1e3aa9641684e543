"""Tracing: ``torch.fx`` symbolic tracing that also wraps helper libraries, with errors that point
at the user's source line.

Helper libraries such as einops call into their own backends with a ``Proxy`` and fail; fx's
``autowrap_modules`` turns each of their functions into one graph node instead, which then runs on
fake tensors like any other call.

>>> gm = trace(torch.nn.Linear(4, 2))
>>> [n.op for n in gm.graph.nodes]
['placeholder', 'call_module', 'output']
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import math
import os
import re
import traceback
from types import ModuleType
from typing import Any, Sequence

import torch
import torch.fx

from .errors import TraceError

_TORCH_DIR = os.path.dirname(torch.__file__)
# statements that contain other statements: a line inside them belongs to the inner one
_COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.AsyncFor, ast.While,
             ast.With, ast.AsyncWith, ast.Try) + ((ast.Match,) if hasattr(ast, "Match") else ())
_FXMEM_DIR = os.path.dirname(__file__)


def helper_modules() -> tuple[ModuleType, ...]:
    """Modules whose functions become single fx nodes: ``math`` and, when installed, ``einops``."""
    mods: list[ModuleType] = [math]
    try:
        import einops

        mods.append(einops)
    except ImportError:  # einops is optional
        pass
    return tuple(mods)


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf_modules: Sequence[type] = ()):
        super().__init__(autowrap_modules=helper_modules())
        self.record_stack_traces = True
        self._extra_leaves = tuple(leaf_modules)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if self._extra_leaves and isinstance(m, self._extra_leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def trace(model: torch.nn.Module, leaf_modules: Sequence[type] = ()) -> torch.fx.GraphModule:
    """Symbolically trace ``model`` into a GraphModule that shares its parameters.

    Raises :class:`TraceError` naming the user's ``file:line`` when fx cannot trace it.
    """
    if isinstance(model, torch.fx.GraphModule):
        return model
    tracer = _Tracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many types; all of them mean "cannot trace"
        raise _trace_error(model, exc) from exc
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def _library_dirs() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # virtualenvs without site.getsitepackages
        pass
    return tuple(sorted(p for p in paths if p))


_LIBRARY_DIRS = _library_dirs()


def is_user_file(filename: str, model_files: frozenset = frozenset()) -> bool:
    """Whether ``filename`` is the user's code: a file defining one of the model's modules, or
    any file outside torch, fxmem, the standard library and installed packages."""
    if filename in model_files:
        return True
    return not (filename.startswith(_TORCH_DIR) or filename.startswith(_FXMEM_DIR) or "<" in filename
                or filename.startswith(_LIBRARY_DIRS))


def model_files(model: torch.nn.Module) -> frozenset:
    """Source files of the classes of ``model``'s modules (torch's own excluded)."""
    import inspect

    files = set()
    for m in model.modules():
        try:
            f = inspect.getsourcefile(type(m))
        except (TypeError, OSError):
            continue
        if f and not f.startswith(_TORCH_DIR):
            files.add(f)
    return frozenset(files)


def _trace_error(model: torch.nn.Module, exc: BaseException) -> TraceError:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()}" if frames else "(unknown line)"
    reason = f"{type(exc).__name__}: {exc}"
    text = str(exc)
    if "control flow" in text or "bool" in text.lower() and "proxy" in text.lower():
        advice = ("Python control flow depends on a tensor's value or size. Make the branch a leaf module "
                  "(analyze(..., leaf_modules=[MyBlock])), wrap the helper with torch.fx.wrap, or rewrite it "
                  "with tensor ops (torch.where).")
    elif "cannot be interpreted as an integer" in text or "iterated" in text or "int()" in text:
        advice = ("a size is used as a Python int (range(N), int(N), a loop over a tensor). fx keeps sizes "
                  "symbolic; use tensor ops, or mark the enclosing module as a leaf (leaf_modules=[...]).")
    else:
        advice = ("fx symbolic tracing cannot follow this code. Mark the module that contains it as a leaf "
                  "(analyze(..., leaf_modules=[...])) or wrap the function with torch.fx.wrap.")
    return TraceError(f"cannot trace {type(model).__name__} at {where}\n  {reason}\n  what to do: {advice}")


@dataclasses.dataclass(frozen=True)
class SourceLine:
    """Where a node came from in the user's code."""

    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@functools.lru_cache(maxsize=256)
def _statements(filename: str) -> tuple:
    """(start, end) line ranges of the simple statements in a source file, innermost first."""
    import ast
    import linecache

    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return ()
    spans = [(n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree)
             if isinstance(n, ast.stmt) and not isinstance(n, _COMPOUND)]
    return tuple(sorted(spans, key=lambda se: se[1] - se[0]))


def statement_of(filename: str, line: int) -> tuple[int, int]:
    """The (first, last) line of the statement that ``line`` belongs to (Python 3.11+ reports the
    line of each sub-expression, so one statement spread over lines has several)."""
    for start, end in _statements(filename):
        if start <= line <= end:
            return start, end
    return line, line


def statement_text(filename: str, line: int) -> str:
    """The statement around ``line``, joined onto one line."""
    import linecache

    start, end = statement_of(filename, line)
    return " ".join(linecache.getline(filename, k).strip() for k in range(start, end + 1))


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?P<code>[^\n]*)')


def source_line(node: torch.fx.Node) -> SourceLine | None:
    """The innermost user frame of ``node.stack_trace`` (fx and fxmem frames skipped)."""
    text = node.stack_trace or node.meta.get("stack_trace") or ""
    best = None
    for m in _FRAME.finditer(text):
        if is_user_file(m.group("file")):
            best = SourceLine(m.group("file"), int(m.group("line")), m.group("fn").strip(), m.group("code").strip())
    return best


def module_path(node: torch.fx.Node) -> str:
    """Dotted path of the innermost module a node belongs to ('' at top level)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        last: Any = list(stack.values())[-1]
        return str(last[0] if isinstance(last, tuple) else last)
    return ""


def forward_arguments(gm: torch.fx.GraphModule) -> tuple[list[str], int]:
    """Names of the graph's placeholders and how many of them have no default."""
    names, required = [], 0
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if str(n.target).startswith("*"):
            continue
        names.append(str(n.target))
        if not n.args:  # placeholders with a default carry it in args
            required += 1
    return names, required
