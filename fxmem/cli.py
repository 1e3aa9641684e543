"""Command line: ``fxmem analyze path/to/file.py:ModelOrFactory --input B,N,6 --input B,N,N``.

    fxmem analyze examples/seed_gat.py:GraphAttentionLayer --input B,N,6 --input B,N,N --dims B=4,N=500
    fxmem analyze model.py:Attention --init dim=512 --input B,L,512 --device cuda --json
    fxmem analyze examples/seed_gat.py:GraphAttentionLayer --input B,N,6 --input B,N,N --diagram gat.svg --timeline t.png

An input is comma-separated dims (ints or names), optionally ``:dtype`` (``B,N,N:bool``,
``2,E:int64``). ``--init`` passes constructor/factory keyword arguments as Python literals.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
from typing import Any, Sequence

import torch

from .analyze import analyze
from .errors import FxMemError, SpecError
from .specs import TensorSpec
from .views import format_lines, output_format


def parse_input(text: str) -> TensorSpec:
    """``"B,N,N:bool"`` -> ``TensorSpec(("B", "N", "N"), dtype=torch.bool)``."""
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


def load_model(target: str, init: dict[str, Any]) -> torch.nn.Module:
    """``path/to/file.py:Name`` -> an nn.Module (a class or factory is called with ``init``)."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise SpecError(f"model {target!r}: expected path/to/file.py:ClassOrFactory")
    if not os.path.exists(path):
        raise SpecError(f"model {target!r}: file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"fxmem_cli_{os.path.basename(path).replace('.', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    obj = getattr(module, name, None)
    if obj is None:
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.nn.Module))
        raise SpecError(f"model {target!r}: {path} has no {name!r}; modules defined there: {found}")
    if isinstance(obj, torch.nn.Module):
        return obj
    if callable(obj):
        model = obj(**init)
        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"model {target!r}: calling {name} returned {type(model).__name__}, not an nn.Module")
        return model
    raise SpecError(f"model {target!r}: {name} is a {type(obj).__name__}, not a Module, class or factory")


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-3),
    "momentum": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
}


def _common(a: argparse.ArgumentParser) -> None:
    a.add_argument("model", help="path/to/file.py:ClassOrFactory")
    a.add_argument("--input", action="append", default=[], metavar="DIMS[:DTYPE]",
                   help="one per forward argument, e.g. B,N,6 or B,N,N:bool")
    a.add_argument("--hints", help="example sizes to analyse at, e.g. N=512")
    a.add_argument("--init", help="constructor/factory keyword arguments, e.g. dim=512,num_heads=8")
    a.add_argument("--dtype", default="float32", help="dtype of inputs without one (default float32)")
    a.add_argument("--mode", default="graph", choices=["graph", "eager"],
                   help="graph: the traced module; eager: the original forward, line by line")
    a.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="also analyse a training step with it")
    a.add_argument("--eval", action="store_true", help="put the model in eval mode first")
    a.add_argument("--json", action="store_true", help="print JSON")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxmem", description="Exact memory formulas for PyTorch models.")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("analyze", help="print memory formulas of one forward (and training step)")
    _common(a)
    a.add_argument("--dims", help="evaluate at these sizes, e.g. B=4,N=500")
    a.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a.add_argument("--no-grad", action="store_true", help="inference memory (no autograd recording)")
    a.add_argument("--lines", action="store_true", help="print the per-line table instead of the per-node one")
    a.add_argument("--diagram", metavar="PATH", help="write the liveness diagram (.svg, .png, .pdf); numbers at --dims")
    a.add_argument("--timeline", metavar="PATH", help="write the liveness timeline (.svg, .png, .pdf); numbers at --dims")
    a.add_argument("--group", choices=["module"], help="--diagram: one box per module (blocks.3) instead of per node")
    v = sub.add_parser("validate", help="run for real and compare with the prediction (exit 1 if off)")
    _common(v)
    v.add_argument("--dims", required=True, help="sizes to measure at, e.g. B=4,N=500")
    v.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    v.add_argument("--tolerance", type=float, default=0.01, help="allowed relative difference (default 0.01)")
    return p


def _prepare(args: argparse.Namespace) -> tuple[torch.nn.Module, list, dict]:
    model = load_model(args.model, parse_assignments(args.init, "--init", literal=True))
    if args.eval:
        model.eval()
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise SpecError(f"--dtype {args.dtype!r} is not a torch dtype")
    kw = {"dtype": dtype, "hints": parse_assignments(args.hints, "--hints") or None, "mode": args.mode}
    if args.optimizer:
        kw["optimizer"] = OPTIMIZERS[args.optimizer]
    return model, [parse_input(t) for t in args.input], kw


def _analyze(args: argparse.Namespace) -> int:
    import json

    model, specs, kw = _prepare(args)
    for path in (args.diagram, args.timeline):
        if path:
            output_format(path)  # a bad extension fails before the analysis, not after
    report = analyze(model, *specs, device=args.device, grad=not args.no_grad, **kw)
    dims = parse_assignments(args.dims, "--dims") or None
    if args.json:
        data = report.to_dict()
        if dims:
            data["evaluated"] = {"dims": dims, "bytes": dict(report.evaluate(**dims))}
        print(json.dumps(data, indent=2))
    else:
        print(report.summary(dims))
        print()
        print(format_lines(report.by_line(dims)) if args.lines else report.table(dims))
    # after the text, and on stderr: --json keeps stdout pure JSON
    if args.diagram:
        print(f"fxmem: wrote {report.render(args.diagram, 'diagram', dims, group=args.group)}", file=sys.stderr)
    if args.timeline:
        print(f"fxmem: wrote {report.render(args.timeline, 'timeline', dims)}", file=sys.stderr)
    return 0


def _validate(args: argparse.Namespace) -> int:
    import json

    from .validate import validate

    model, specs, kw = _prepare(args)
    result = validate(model, *specs, dims=parse_assignments(args.dims, "--dims"), device=args.device,
                      tolerance=args.tolerance, **kw)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _analyze(args) if args.command == "analyze" else _validate(args)
    except FxMemError as exc:
        print(f"fxmem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
