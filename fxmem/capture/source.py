"""Where code came from: the user's source line of an fx node or a frame, and whether a file is the
user's code (not torch's, fxmem's, the standard library's or an installed package's).

>>> statement_of(__file__, 1)
(1, 7)
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
from typing import Any

import torch
import torch.fx

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXMEM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fxmem's own code: the package, and the rewrite passes (the top-level passes/ of a source checkout)
_OWN_DIRS = (_FXMEM_DIR, os.path.join(os.path.dirname(_FXMEM_DIR), "passes") + os.sep)
# statements that contain other statements: a line inside them belongs to the inner one
_COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.AsyncFor, ast.While,
             ast.With, ast.AsyncWith, ast.Try) + ((ast.Match,) if hasattr(ast, "Match") else ())


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
    return not (filename.startswith(_TORCH_DIR) or filename.startswith(_OWN_DIRS) or "<" in filename
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


def short_path(filename: str) -> str:
    """An installed package's file as its import path (``timm/layers/patch_embed.py``), others as given."""
    for base in sorted(_LIBRARY_DIRS, key=len, reverse=True):
        if filename.startswith(base.rstrip(os.sep) + os.sep):
            return filename[len(base.rstrip(os.sep)) + 1:]
    return filename


def in_library(filename: str) -> bool:
    """Whether ``filename`` belongs to an installed package or the standard library (not torch, not fxmem)."""
    return filename.startswith(_LIBRARY_DIRS) and not _own_or_torch(filename)


def _own_or_torch(filename: str) -> bool:
    # torch's own folder, not torch_geometric's or torchvision's next to it
    return filename.startswith(_TORCH_DIR + os.sep) or filename.startswith(_OWN_DIRS) or "<" in filename


def raised_at(exc: BaseException, files: frozenset = frozenset()) -> str | None:
    """Where ``exc`` was raised in code that is not torch's or fxmem's: ``file:line: code`` of the
    innermost such frame (a library's file by its import path, ``timm/layers/patch_embed.py:127``),
    followed by ``(called from file:line)``, the innermost user frame, when that is another frame.
    None when every frame is torch's or fxmem's.

    >>> raised_at(ValueError("no traceback")) is None
    True
    """
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _own_or_torch(f.filename)]
    if not frames:
        return None
    last = frames[-1]
    text = f"{short_path(last.filename)}:{last.lineno}: {(last.line or '').strip()}"
    users = [f for f in frames if is_user_file(f.filename, files) and not f.filename.startswith(_LIBRARY_DIRS)]
    if users and users[-1] is not last:
        text += f" (called from {users[-1].filename}:{users[-1].lineno}: {(users[-1].line or '').strip()})"
    return text


_RUNNERS = ("graph_runner.py", "line_runner.py", "simulate.py")  # fxmem's frames that call the model


def running_line() -> str | None:
    """``file:line: code`` of the model code running the current torch call, read off the Python
    stack from inside fxmem's dispatch mode: the innermost frame outside torch and fxmem, if it is
    below fxmem's runner (None in graph mode, where the runner calls torch directly)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_OWN_DIRS) and os.path.basename(name) in _RUNNERS:
            return None  # reached fxmem's runner: no model code between (graph mode)
        if not (_own_or_torch(name)):
            break
        frame = frame.f_back
    if frame is None:
        return None
    name, line = frame.f_code.co_filename, frame.f_lineno
    import linecache

    return f"{short_path(name)}:{line}: {linecache.getline(name, line).strip()}"


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
    return _stack_text(list(stack.values())[-1]) if stack else ""


def _stack_text(entry: Any) -> str:
    """An ``nn_module_stack`` entry's path as written: ``(path, module type)`` or the path alone."""
    return str(entry[0] if isinstance(entry, tuple) else entry)


def stack_path(entry: Any) -> str:
    """The module path of an ``nn_module_stack`` entry as the model names it. TorchDynamo writes the
    root as the local it was called through - ``L['self']``, or ``L['module']`` where fxmem's capture
    calls the model from a function - and list items as ``[0]`` in some versions:
    ``L['module'].blocks[0].attn`` is ``blocks.0.attn``, ``L['module']`` the model itself ('').

    >>> stack_path(("L['module'].blocks[0].attn", object)), stack_path("blocks.0")
    ('blocks.0.attn', 'blocks.0')
    """
    path = re.sub(r"^L\['[^']*'\]\.?", "", _stack_text(entry))
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")


@dataclasses.dataclass(frozen=True)
class Parameters:
    """What ``forward`` accepts: positional parameters (with their defaults), and what it cannot take
    from positional specs."""

    names: tuple  # positional parameters, in order
    defaults: dict  # name -> default, for those that have one
    keyword_only: tuple  # keyword-only parameters without a default
    varargs: bool  # *args or **kwargs

    @property
    def required(self) -> int:
        return sum(1 for n in self.names if n not in self.defaults)


def forward_parameters(module: torch.nn.Module) -> Parameters:
    """The parameters of ``module.forward`` (a GraphModule's are its placeholders)."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return Parameters((), {}, (), True)
    names, defaults, keyword_only, varargs = [], {}, [], False
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
            if p.default is not p.empty:
                defaults[p.name] = p.default
        elif p.kind == p.KEYWORD_ONLY and p.default is p.empty:
            keyword_only.append(p.name)
        elif p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            varargs = True
    return Parameters(tuple(names), defaults, tuple(keyword_only), varargs)
