"""Command line: ``fxmem analyze path/to/file.py:ModelOrFactory --input B,N,6 --input B,N,N``.

    fxmem analyze examples/seed_gat.py:GraphAttentionLayer --input B,N,6 --input B,N,N --dims B=4,N=500
    fxmem analyze torch.nn:Linear --init in_features=6,out_features=128 --input B,6 --modules
    fxmem analyze examples/seed_gat.py:GraphAttentionLayer --input B,N,6 --input B,N,N --diagram gat.svg --timeline t.png

An input is comma-separated dims (ints or names), optionally ``:dtype`` (``B,N,N:bool``,
``2,E:int64``). ``--init`` passes constructor/factory keyword arguments as Python literals.

torch is imported only after the arguments are parsed (``fxmem --help`` answers at once); the
steps that take seconds (importing torch, tracing, simulating, calibrating real kernels) are
reported on stderr as they start, so stdout stays the result alone.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import logging
import os
import sys
import time
from typing import Any, Sequence

from .errors import FxMemError, SpecError

DTYPES = ("float32", "float64", "bfloat16", "float16")


def parse_input(text: str) -> Any:
    """``"B,N,N:bool"`` -> ``TensorSpec(("B", "N", "N"), dtype=torch.bool)``."""
    import torch

    from .specs import TensorSpec

    dims_text, _, dtype_text = text.partition(":")
    dims: list[Any] = []
    for part in dims_text.split(","):
        part = part.strip()
        if not part:
            raise SpecError(f"--input {text!r}: empty dim; write e.g. --input B,N,6")
        dims.append(int(part) if part.lstrip("-").isdigit() else part)
    dtype = None
    if dtype_text:
        dtype = getattr(torch, dtype_text.strip(), None)
        if not isinstance(dtype, torch.dtype):
            raise SpecError(f"--input {text!r}: unknown dtype {dtype_text!r}; use e.g. float32, bool, int64")
    return TensorSpec(tuple(dims), dtype=dtype)


def parse_assignments(text: str | None, what: str, literal: bool = False) -> dict[str, Any]:
    """``"B=4,N=500"`` -> ``{"B": 4, "N": 500}``."""
    out: dict[str, Any] = {}
    if not text:
        return out
    for item in _split_top_level(text):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise SpecError(f"{what} {text!r}: expected NAME=VALUE pairs separated by commas")
        try:
            out[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            if literal:
                out[name.strip()] = value.strip()
            else:
                raise SpecError(f"{what} {text!r}: {value.strip()!r} is not a number") from None
    return out


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def load_model(target: str, init: dict[str, Any]) -> Any:
    """``path/to/file.py:Name`` or ``package.module:Name`` -> an nn.Module (a class or factory is
    called with ``init``)."""
    import torch

    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise SpecError(f"model {target!r}: expected path/to/file.py:ClassOrFactory or package.module:ClassOrFactory")
    module = _load_file(target, where) if _looks_like_file(where) else _load_module(target, where)
    obj = getattr(module, name, None)
    if obj is None:
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.nn.Module))
        raise SpecError(f"model {target!r}: {where} has no {name!r}; modules defined there: {found}")
    if isinstance(obj, torch.nn.Module):
        return obj
    if callable(obj):
        try:
            model = obj(**init)
        except TypeError as exc:  # missing or unknown constructor arguments
            raise SpecError(f"model {target!r}: {name}(**{init!r}) failed: {exc}; pass its arguments with "
                            f"--init NAME=VALUE,...") from None
        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"model {target!r}: calling {name} returned {type(model).__name__}, not an nn.Module")
        return model
    raise SpecError(f"model {target!r}: {name} is a {type(obj).__name__}, not a Module, class or factory")


def _looks_like_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where or os.path.exists(where)


def _load_file(target: str, path: str) -> Any:
    if not os.path.exists(path):
        raise SpecError(f"model {target!r}: file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"fxmem_cli_{os.path.basename(path).replace('.', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def _load_module(target: str, name: str) -> Any:
    sys.path.insert(0, os.getcwd())  # as `python -m` would: modules of the current folder
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise SpecError(f"model {target!r}: no file {name!r} and no importable module {name!r} ({exc}); "
                        f"give path/to/file.py:Class or an installed package.module:Class") from None
    finally:
        sys.path.pop(0)


OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


def make_optimizer(name: str) -> Any:
    """The optimizer factory ``--optimizer NAME`` stands for (lr=1e-3)."""
    import torch

    return {
        "sgd": lambda p: torch.optim.SGD(p, lr=1e-3),
        "momentum": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    }[name]


def _common(a: argparse.ArgumentParser) -> None:
    a.add_argument("model", help="the model: path/to/file.py:ClassOrFactory or package.module:ClassOrFactory "
                                 "(e.g. torch.nn:Linear with --init in_features=6,out_features=128)")
    a.add_argument("--input", action="append", default=[], metavar="DIMS[:DTYPE]",
                   help="one per forward argument, in order: dims as ints or names, e.g. B,N,6 or B,N,N:bool")
    a.add_argument("--hints", metavar="NAME=INT,...",
                   help="example sizes to analyse at (default: distinct primes near 100), e.g. N=512")
    a.add_argument("--init", metavar="NAME=VALUE,...",
                   help="constructor/factory keyword arguments as Python literals, e.g. dim=512,num_heads=8")
    a.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="dtype of the model's floating parameters and buffers and of inputs without one "
                        "(default float32); the model is converted, as model.to(dtype) would")
    a.add_argument("--mode", default="graph", choices=["graph", "eager"],
                   help="graph: the traced module, which frees each value after its last use (default); "
                        "eager: the original forward, line by line (locals live until it returns)")
    a.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="also analyse one steady-state training step with this optimizer (lr=1e-3)")
    a.add_argument("--eval", action="store_true", help="put the model in eval mode first (dropout off, ...)")
    a.add_argument("--json", action="store_true", help="print the whole report as JSON on stdout")
    a.add_argument("--quiet", action="store_true", help="no progress messages on stderr")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="fxmem", description="Exact memory formulas for PyTorch models, in the "
                                "sizes you name (B, N, ...): peak, retained, saved for backward, per node.")
    p.add_argument("--version", action="version", version=f"fxmem {__version__} (torch {_torch_version()})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    a = sub.add_parser("analyze", help="print memory formulas of one forward (and training step)",
                       description="Print the memory formulas (bytes) of one forward (and, with --optimizer, "
                                   "one training step) and the per-node table.")
    _common(a)
    a.add_argument("--dims", metavar="NAME=INT,...", help="also give numbers at these sizes, e.g. B=4,N=500")
    a.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="whose memory to predict: cpu (default) or cuda (CUDA code paths and 512-byte "
                        "allocator blocks; needs a CUDA build of torch, not a GPU)")
    a.add_argument("--no-grad", action="store_true", help="inference memory (no autograd recording)")
    a.add_argument("--lines", action="store_true", help="print the per-line table instead of the per-node one")
    a.add_argument("--modules", action="store_true",
                   help="print the per-module table (parameters, output shapes, activations kept) instead "
                        "of the per-node one")
    a.add_argument("--diagram", metavar="PATH", help="write the liveness diagram (.svg, .png, .pdf); numbers at --dims")
    a.add_argument("--timeline", metavar="PATH",
                   help="write the memory timeline (.svg, .png, .pdf); needs --dims and matplotlib")
    a.add_argument("--group", choices=["module"], help="--diagram: one box per module (blocks.3) instead of per node")
    v = sub.add_parser("validate", help="run for real and compare with the prediction (exit 1 if off)",
                       description="Run the model for real at --dims and print fxmem's prediction next to "
                                   "the measurement; exit 1 if they differ by more than --tolerance.")
    _common(v)
    v.add_argument("--dims", required=True, metavar="NAME=INT,...", help="sizes to measure at, e.g. B=4,N=500")
    v.add_argument("--device", default="cuda", choices=["cpu", "cuda"],
                   help="where to run: cuda (default; needs a GPU) or cpu")
    v.add_argument("--tolerance", type=float, default=0.01, help="allowed relative difference (default 0.01)")
    return p


def _torch_version() -> str:
    """The installed torch's version, without importing it (``--version`` stays fast)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


class _Progress(logging.Handler):
    """Progress on stderr: ``fxmem: [2.1 s] tracing Attention with torch.fx``."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__(logging.INFO)
        self.start = time.perf_counter()
        self.enabled = enabled

    def emit(self, record: logging.LogRecord) -> None:
        if self.enabled:
            print(f"fxmem: [{time.perf_counter() - self.start:4.1f} s] {record.getMessage()}", file=sys.stderr, flush=True)

    def say(self, message: str) -> None:
        self.emit(logging.makeLogRecord({"msg": message}))


def _prepare(args: argparse.Namespace, progress: _Progress) -> tuple[Any, list, dict]:
    import torch

    dtype = getattr(torch, args.dtype)
    progress.say(f"loading {args.model}")
    model = load_model(args.model, parse_assignments(args.init, "--init", literal=True))
    if dtype != torch.float32:
        model = model.to(dtype)  # a model the CLI built itself: converting it changes nobody's model
    if args.eval:
        model.eval()
    kw = {"dtype": dtype, "hints": parse_assignments(args.hints, "--hints") or None, "mode": args.mode}
    if args.optimizer:
        kw["optimizer"] = make_optimizer(args.optimizer)
    return model, [parse_input(t) for t in args.input], kw


def _analyze(args: argparse.Namespace, progress: _Progress) -> int:
    import json

    progress.say("importing torch")
    from .views import output_format

    for path in (args.diagram, args.timeline):
        if path:
            output_format(path)  # a bad extension fails before the analysis, not after
    if args.timeline and not args.dims:
        raise SpecError("--timeline draws bytes at concrete sizes: give them with --dims, e.g. --dims B=4,N=500")
    dims = parse_assignments(args.dims, "--dims") or None
    model, specs, kw = _prepare(args, progress)
    from .analyze import analyze

    report = analyze(model, *specs, device=args.device, grad=not args.no_grad, **kw)
    if dims:
        progress.say(f"evaluating at {args.dims}")
    if args.json:
        data = report.to_dict()
        if dims:
            data["evaluated"] = {"dims": dims, "bytes": dict(report.evaluate(**dims))}
        print(json.dumps(data, indent=2))
    else:
        print(report.summary(dims))
        print()
        if args.lines:
            from .views import format_lines

            print(format_lines(report.by_line(dims)))
        elif args.modules:
            print(report.modules(dims))
        else:
            print(report.table(dims))
    # after the text, and on stderr: --json keeps stdout pure JSON
    if args.diagram:
        progress.say(f"drawing {args.diagram}")
        print(f"fxmem: wrote {report.render(args.diagram, 'diagram', dims, group=args.group)}", file=sys.stderr)
    if args.timeline:
        progress.say(f"drawing {args.timeline}")
        print(f"fxmem: wrote {report.render(args.timeline, 'timeline', dims)}", file=sys.stderr)
    return 0


def _validate(args: argparse.Namespace, progress: _Progress) -> int:
    import json

    progress.say("importing torch")
    model, specs, kw = _prepare(args, progress)
    from .validate import validate

    result = validate(model, *specs, dims=parse_assignments(args.dims, "--dims"), device=args.device,
                      tolerance=args.tolerance, **kw)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = _Progress(enabled=not args.quiet)
    logger = logging.getLogger("fxmem")
    level = logger.level
    logger.addHandler(progress)
    logger.setLevel(logging.INFO)
    try:
        import warnings

        with warnings.catch_warnings():
            # torch says so when numpy is missing; fxmem never converts to numpy
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
            return _analyze(args, progress) if args.command == "analyze" else _validate(args, progress)
    except FxMemError as exc:
        print(f"fxmem: error: {exc}", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(progress)
        logger.setLevel(level)


if __name__ == "__main__":
    raise SystemExit(main())
