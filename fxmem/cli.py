"""Command line: ``fxmem analyze path/to/file.py:ModelOrFactory --input B,N,6 --input B,N,N``.

    fxmem analyze examples/seed_gat.py:GraphAttentionLayer --input B,N,6 --input B,N,N --dims B=4,N=500
    fxmem analyze torch.nn:Linear --init in_features=6,out_features=128 --input B,6 --modules
    fxmem analyze examples/seed_gat.py:GraphAttentionLayer --input B,N,6 --input B,N,N --diagram gat.svg --timeline t.png

The model is an nn.Module class or instance, or a factory function written in the file named;
nothing else is ever called (``os:system`` is refused before it runs).

An input is comma-separated dims (ints or names), optionally ``:dtype`` (``B,N,N:bool``,
``2,E:int64``). ``--init`` passes constructor/factory keyword arguments as Python literals.

torch is imported only after the arguments are parsed (``fxmem --help`` answers at once); the
steps that take seconds (importing torch, tracing, simulating, calibrating real kernels) are
reported on stderr as they start, so stdout stays the result alone.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import re
import sys
import time
from typing import Any, Iterator, Sequence

from .errors import FxMemError, SpecError
from .progress import phased

DTYPES = ("float32", "float64", "bfloat16", "float16")


def parse_input(text: str) -> Any:
    """``"B,N,N:bool"`` -> ``TensorSpec(("B", "N", "N"), dtype=torch.bool)`` (dims are read by
    :mod:`fxmem.parsing` when the spec is parsed: names, integers, + - * // and parentheses)."""
    import torch

    from .specs import TensorSpec

    dims_text, _, dtype_text = text.partition(":")
    dims: list[Any] = []
    for part in dims_text.split(","):
        part = part.strip()
        if not part:
            raise SpecError(f"--input {text!r}: empty dim; write e.g. --input B,N,6")
        dims.append(int(part) if part.isdigit() and len(part) < 20 else part)
    dtype = None
    if dtype_text:
        name = dtype_text.strip()
        dtype = getattr(torch, name, None) if name.isidentifier() and not name.startswith("_") else None
        if not isinstance(dtype, torch.dtype):
            raise SpecError(f"--input {text!r}: unknown dtype {dtype_text!r}; use e.g. float32, bool, int64")
    return TensorSpec(tuple(dims), dtype=dtype)


def parse_assignments(text: str | None, what: str, literal: bool = False, minimum: int = 1) -> dict[str, Any]:
    """``"B=4,N=500"`` -> ``{"B": 4, "N": 500}``; with ``literal``, Python literals (``--init``)."""
    from .parsing import parse_assignments as parse

    if not text:
        return {}
    return parse(text, what, values="literal" if literal else "int", minimum=minimum)


@phased("model loading")
def load_model(target: str, init: dict[str, Any]) -> Any:
    """``path/to/file.py:Name`` or ``package.module:Name`` -> an nn.Module (a class or factory is
    called with ``init``).

    Nothing is called before it is known to be a model: ``Name`` must be an ``nn.Module`` (used as
    it is), an ``nn.Module`` subclass, or a function written in the file given as
    ``path/to/file.py``. Anything else (``os:system``, ``shutil:rmtree``, ``builtins:exit``, a
    function imported into the file) is refused without being called."""
    import torch

    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise SpecError(f"model {target!r}: expected path/to/file.py:ClassOrFactory or package.module:ClassOrFactory")
    if not name.isidentifier():
        raise SpecError(f"model {target!r}: {name!r} is not a Python name; give the class or factory defined there")
    from_file = _looks_like_file(where)
    module = _load_file(target, where) if from_file else _load_module(target, where)
    obj = getattr(module, name, None)
    if obj is None:
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.nn.Module))
        raise SpecError(f"model {target!r}: {where} has no {name!r}; modules defined there: {found}")
    if isinstance(obj, torch.nn.Module):
        return obj
    _refuse_unless_model_maker(target, where, name, obj, module if from_file else None)
    try:
        model = obj(**init)
    except TypeError as exc:  # missing or unknown constructor arguments
        raise SpecError(f"model {target!r}: {name}(**{init!r}) failed: {exc}; pass its arguments with "
                        f"--init NAME=VALUE,...") from None
    except Exception as exc:  # the constructor's own error
        raise SpecError(f"model {target!r}: {name}(**{init!r}) failed{_where(exc)}: {type(exc).__name__}: "
                        f"{exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise SpecError(f"model {target!r}: calling {name} returned {type(model).__name__}, not an nn.Module")
    return model


def _refuse_unless_model_maker(target: str, where: str, name: str, obj: Any, user_file: Any) -> None:
    """Refuse, before calling it, anything that is neither an ``nn.Module`` subclass nor a plain
    function written in the user's own file (``user_file``, the module loaded from the path given)."""
    import inspect

    import torch

    if isinstance(obj, type):
        if issubclass(obj, torch.nn.Module):
            return
        raise SpecError(f"model {target!r}: {name} is a class but not an nn.Module subclass; fxmem only "
                        f"constructs torch.nn.Module classes")
    if user_file is not None and inspect.isfunction(obj) and not inspect.isgeneratorfunction(obj) \
            and getattr(obj, "__module__", None) == user_file.__name__ \
            and os.path.abspath(obj.__code__.co_filename) == os.path.abspath(where):
        return
    if inspect.isgeneratorfunction(obj):
        raise SpecError(f"model {target!r}: {name} is a generator function; a factory must return the model "
                        f"(return Model(...), not yield)")
    what = "a function" if inspect.isfunction(obj) or inspect.isbuiltin(obj) else f"a {type(obj).__name__}"
    origin = "" if user_file is None else f" not written in {where}"
    raise SpecError(f"model {target!r}: {name} is {what}{origin}; fxmem calls only nn.Module classes, and "
                    f"factory functions written in the file you name (path/to/file.py:make_model), so nothing "
                    f"else is ever run. Wrap it in a function in your own file: def make_model(): return ...")


def _looks_like_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where or os.path.exists(where)


def _load_file(target: str, path: str) -> Any:
    if not os.path.isfile(path):
        raise SpecError(f"model {target!r}: file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"fxmem_cli_{os.path.basename(path).replace('.', '_')}", path)
    if spec is None or spec.loader is None:
        raise SpecError(f"model {target!r}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise SpecError(f"model {target!r}: {path} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:  # the file's own code failed while it was imported
        raise SpecError(f"model {target!r}: importing {path} failed{_where(exc)}: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.pop(0)
    return module


def _where(exc: BaseException) -> str:
    """`` at file.py:12`` - the innermost frame of the user's file in ``exc``'s traceback."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "fxmem" not in f.filename]
    return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def _load_module(target: str, name: str) -> Any:
    sys.path.insert(0, os.getcwd())  # as `python -m` would: modules of the current folder
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise SpecError(f"model {target!r}: no file {name!r} and no importable module {name!r} ({exc}); "
                        f"give path/to/file.py:Class or an installed package.module:Class") from None
    except Exception as exc:  # the module's own code failed while it was imported
        raise SpecError(f"model {target!r}: importing {name} failed{_where(exc)}: {type(exc).__name__}: {exc}") from None
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
    a.add_argument("--mode", default="auto", choices=["auto", "graph", "eager"],
                   help="graph: the traced module, which frees each value after its last use; "
                        "eager: the original forward, line by line (locals live until it returns); "
                        "auto (default): graph where torch.fx can trace the model, else eager (the summary says why)")
    a.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="also analyse one steady-state training step with this optimizer (lr=1e-3)")
    a.add_argument("--eval", action="store_true", help="put the model in eval mode first (dropout off, ...)")
    a.add_argument("--json", action="store_true", help="print the whole report as JSON on stdout")
    a.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    _timeout_option(a)


def _timeout_option(a: argparse.ArgumentParser) -> None:
    a.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="stop after this many seconds with an error naming the phase it was in (default: no limit)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0 (e.g. 600)")
    return value


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
    a.add_argument("--snapshot", metavar="PATH",
                   help="write the predicted run as a PyTorch memory snapshot (a .pickle for pytorch.org/memory_viz "
                        "or torch.cuda._memory_viz); numbers at --dims; the training step with --optimizer")
    a.add_argument("--group", choices=["auto", "module", "none"], default="auto",
                   help="--diagram: module = one box per module (blocks.3); none = every node; auto (default) = "
                        "modules for graphs of more than 60 nodes, the peak's module open")
    v = sub.add_parser("validate", help="run for real and compare with the prediction (exit 1 if off)",
                       description="Run the model for real at --dims and print fxmem's prediction next to "
                                   "the measurement; exit 1 if they differ by more than --tolerance.")
    _common(v)
    v.add_argument("--dims", required=True, metavar="NAME=INT,...", help="sizes to measure at, e.g. B=4,N=500")
    v.add_argument("--device", default="cuda", choices=["cpu", "cuda"],
                   help="where to run: cuda (default; needs a GPU) or cpu")
    v.add_argument("--snapshot", metavar="DIR",
                   help="write the predicted and the real run side by side as PyTorch memory snapshots in DIR "
                        "(forward and training step; pickles for pytorch.org/memory_viz)")
    v.add_argument("--tolerance", type=_tolerance, default=0.01,
                   help="allowed relative difference, a number >= 0 (default 0.01, i.e. 1 %%)")
    m = sub.add_parser("llm", help="a Hugging Face config.json: parameters, model states, training-step peak, "
                                   "largest batch and sequence length for a GPU",
                       description="Build the causal LM a Hugging Face config.json describes on the meta device "
                                   "(no weights, nothing downloaded) and analyse one training step "
                                   "(model(input_ids, labels=input_ids).loss, backward, optimizer step).")
    m.add_argument("config", help="a config.json (or the folder holding one)")
    m.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    m.add_argument("--seq", type=int, help="sequence length of the training step, e.g. 4096")
    m.add_argument("--dtype", default=None, choices=DTYPES, help="parameters' dtype (default: the config's); "
                                                               "without --recipe, trained pure in that dtype")
    m.add_argument("--recipe", default=None, metavar="NAME", choices=_recipe_names(),
                   help="training recipe: " + ", ".join(_recipe_names()) + " (default: pure training in the "
                        "parameters' dtype; amp-bf16: float32 master weights, bfloat16 autocast; see fxmem.recipes)")
    m.add_argument("--train", default="adamw", choices=["adamw", "adam", "sgd"], help="optimizer (default adamw)")
    m.add_argument("--gpu", metavar="BYTES", help="memory to fit, e.g. 80GiB: prints the largest batch and sequence")
    m.add_argument("--lora", metavar="r=16,...", help="LoRA adapters (peft.LoraConfig arguments); the base is frozen")
    m.add_argument("--checkpointing", action="store_true", help="Hugging Face gradient checkpointing")
    m.add_argument("--fsdp", type=_ranks, metavar="W", help="FSDP2 over W ranks (every decoder layer, then the "
                                                           "root): per-rank numbers; a letter (--fsdp W) makes it a "
                                                           "symbol: with --gpu, the fewest ranks that fit")
    m.add_argument("--tp", type=int, metavar="T", help="tensor parallelism over T ranks by the model's own plan "
                                                      "(its config's base_model_tp_plan); with --fsdp W, a W x T "
                                                      "mesh: per-rank numbers")
    m.add_argument("--pp", type=int, metavar="P", help="pipeline parallelism: the decoder layers split into P stages "
                                                      "(1F1B unless --schedule), every stage analysed; with --fsdp/"
                                                      "--tp, a P x W x T mesh: per-rank numbers of the stage that "
                                                      "peaks highest")
    m.add_argument("--schedule", metavar="NAME", help="--pp: the pipeline schedule, torchtitan's names: 1F1B "
                                                     "(default), GPipe, Interleaved1F1B, LoopedBFS, "
                                                     "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV (the last five "
                                                     "run 2 stages a rank)")
    m.add_argument("--microbatches", type=int, metavar="M", help="--pp: micro-batches per step (default: one per "
                                                                "stage, P, or 2P for a schedule of 2 a rank); the "
                                                                "batch must split into M equal ones")
    m.add_argument("--layouts", nargs="+", metavar="LAYOUT", help="compare parallel layouts, a row each: dims and "
                                                                 "sizes joined by x, e.g. dp8 dp4xtp2 pp2xdp4 "
                                                                 "(dp: FSDP2, tp: tensor, pp: pipeline parallelism)")
    m.add_argument("--serve", action="store_true",
                   help="the memory of generate() (prefill and --new-tokens decode steps with a KV cache) "
                        "instead of a training step")
    m.add_argument("--prompt", type=int, help="--serve: prompt length")
    m.add_argument("--new-tokens", type=int, help="--serve: tokens generated")
    m.add_argument("--cache", default="dynamic", choices=["dynamic", "static"],
                   help="--serve: transformers' KV cache (default dynamic; static: sized for all tokens up front)")
    m.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    _timeout_option(m)
    return p


def _llm(args: argparse.Namespace, progress: Any) -> int:
    if args.gpu is not None:  # before building the model: a bad --gpu fails at once, naming the option
        _check_gpu(args.gpu)
    progress.say("importing torch")
    import torch

    from .llm import from_config, llm_answer

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.recipe is not None:
        dtype = _recipe_dtype(args, dtype)
    progress.say(f"building {args.config} on the meta device")
    model = from_config(args.config, dtype=dtype)
    if args.serve:
        from .generation import serve_summary

        if not args.prompt or not args.new_tokens:
            raise SpecError("fxmem llm --serve needs --prompt P and --new-tokens T")
        progress.say(f"analysing generate() at batch {args.batch}, prompt {args.prompt}: the prefill, then "
                     f"{args.new_tokens} decode steps ({args.cache} KV cache; from 3 short calls where the steps grow "
                     f"by fixed bytes per token)")
        print(serve_summary(model, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens, dtype=dtype,
                            gpu=args.gpu, cache=args.cache))
        return 0
    if not args.seq:
        raise SpecError("fxmem llm needs --seq L (the training step's sequence length), or --serve")
    if args.layouts:
        from .llm_layouts import llm_layouts

        if args.fsdp or args.tp or args.pp:
            raise SpecError("fxmem llm --layouts takes the parallelism in its layouts (dp4xtp2, ...): drop --fsdp, "
                            "--tp and --pp")
        progress.say(f"analysing one training step on each of {len(args.layouts)} layouts")
        print(llm_layouts(model, batch=args.batch, seq=args.seq, layouts=args.layouts, optimizer=args.train,
                          gpu=args.gpu, lora=args.lora, checkpointing=args.checkpointing, recipe=args.recipe,
                          microbatches=args.microbatches, schedule=args.schedule))
        return 0
    progress.say("analysing one training step" if not args.pp else
                 f"analysing one training step of each of the {args.pp} pipeline stages")
    answer = llm_answer(model, batch=args.batch, seq=args.seq, optimizer=args.train, gpu=args.gpu, lora=args.lora,
                        checkpointing=args.checkpointing, fsdp=args.fsdp, recipe=args.recipe, tp=args.tp, pp=args.pp,
                        microbatches=args.microbatches, schedule=args.schedule)
    print(answer)
    return 0


def _ranks(text: str) -> int | str:
    """``--fsdp``: a number of ranks, or a dim name (the number of ranks as a symbol)."""
    return int(text) if text.strip().lstrip("-").isdigit() else text


def _recipe_names() -> tuple[str, ...]:
    """The names ``--recipe`` takes (those fxmem refuses too, so that their refusal says why)."""
    from .recipes import NAMES

    return NAMES


def _recipe_dtype(args: argparse.Namespace, dtype: Any) -> Any:
    """The dtype to build the model in for ``--recipe``: the recipe's parameter dtype. A ``--dtype``
    that says otherwise is refused (``--recipe amp-bf16 --dtype bfloat16`` would ask for float32 and
    bfloat16 parameters at once); ``--serve`` has no training recipe."""
    from .recipes import get

    if args.serve:
        raise SpecError("--recipe names a training recipe; --serve analyses generate(): give --dtype instead")
    recipe = get(args.recipe)  # a name fxmem cannot simulate is refused here, before anything is built
    if args.dtype is not None and args.dtype != recipe.parameters:
        want = recipe.parameters
        raise SpecError(f"--dtype {args.dtype} contradicts --recipe {args.recipe}, whose parameters are {want} "
                        f"({recipe.description}); drop --dtype, or give --dtype {want}")
    return recipe.dtype("parameters")


def _check_gpu(text: str) -> None:
    """Refuse a --gpu that is not a positive amount of memory, naming the option."""
    from .units import parse_bytes

    try:
        parse_bytes(text)
    except SpecError:
        raise SpecError(f"--gpu {text}: give the GPU's memory as a positive number of bytes, with a unit "
                        f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. --gpu 80GiB") from None


# options whose value may start with '-' (argparse reads '--gpu -1GiB' as two options; the value is then
# refused by the option's own check, with a message naming it)
_VALUE_OPTIONS = ("--gpu",)


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    """``["--gpu", "-1GiB"]`` -> ``["--gpu=-1GiB"]``: a value that looks like a negative amount."""
    out, items = [], list(argv)
    i = 0
    while i < len(items):
        if items[i] in _VALUE_OPTIONS and i + 1 < len(items) and re.match(r"-[\d.]", items[i + 1]):
            out.append(f"{items[i]}={items[i + 1]}")
            i += 2
            continue
        out.append(items[i])
        i += 1
    return out


@contextlib.contextmanager
def _libraries_quiet(quiet: bool) -> Iterator[None]:
    """Under --quiet, the libraries fxmem loads say nothing either: Python warnings (transformers'
    deprecations) are ignored and transformers' logging shows errors only, until the command ends."""
    if not quiet:
        yield
        return
    import warnings

    previous = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers sets up its logging
    library = logging.getLogger("transformers")  # and if it already has
    level = library.level
    library.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        library.setLevel(level)
        if previous is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = previous


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0 (e.g. 0.01 for 1 %)")
    return value


def _writable(path: str, option: str) -> None:
    """Fail before the analysis, not after it, if ``path`` cannot be written."""
    from .views.figure import check_writable

    check_writable(path, option)


def _check_dims_names(dims: dict | None, specs: list, hints: dict | None) -> None:
    """--dims and --hints name exactly the dims the --input specs use (checked before analysing)."""
    from .specs import spec_symbols

    known = spec_symbols(specs, {})
    for option, given in (("--dims", dims), ("--hints", hints)):
        unknown = sorted(set(given or {}) - set(known))
        if unknown:
            raise SpecError(f"{option}: unknown dim(s) {unknown}; the --input specs use {sorted(known)}")
    missing = sorted(set(known) - set(dims or {})) if dims else []
    if missing:
        raise SpecError(f"--dims: missing dim(s) {missing}; give a size for each of {sorted(known)}")


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
    init = parse_assignments(args.init, "--init", literal=True)
    hints = parse_assignments(args.hints, "--hints", minimum=0) or None
    specs = [parse_input(t) for t in args.input]
    _check_dims_names(parse_assignments(args.dims, "--dims") or None, specs, hints)
    progress.say(f"loading {args.model}")
    model = load_model(args.model, init)
    if dtype != torch.float32:
        model = model.to(dtype)  # a model the CLI built itself: converting it changes nobody's model
    if args.eval:
        model.eval()
    kw = {"dtype": dtype, "hints": hints, "mode": args.mode}
    if args.optimizer:
        kw["optimizer"] = make_optimizer(args.optimizer)
    return model, specs, kw


def _analyze(args: argparse.Namespace, progress: _Progress) -> int:
    import json

    progress.say("importing torch")
    from .views import output_format

    for option, path in (("--diagram", args.diagram), ("--timeline", args.timeline)):
        if path:
            output_format(path)  # a bad extension or place fails before the analysis, not after
            _writable(path, option)
    if args.snapshot:
        _writable(args.snapshot, "--snapshot")
    if args.timeline and not args.dims:
        raise SpecError("--timeline draws bytes at concrete sizes: give them with --dims, e.g. --dims B=4,N=500")
    if args.snapshot and not args.dims:  # (else it would be of fxmem's example sizes, which no one asked for)
        raise SpecError("--snapshot writes the predicted run at concrete sizes: give them with --dims, e.g. "
                        "--dims B=4,N=500")
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
        print(f"fxmem: wrote {report.render(args.diagram, 'diagram', dims, group=None if args.group == 'none' else args.group)}", file=sys.stderr)
    if args.timeline:
        progress.say(f"drawing {args.timeline}")
        print(f"fxmem: wrote {report.render(args.timeline, 'timeline', dims)}", file=sys.stderr)
    if args.snapshot:
        progress.say(f"writing {args.snapshot}")
        report.snapshot(dims, path=args.snapshot, train=report.training)
        print(f"fxmem: wrote {args.snapshot}", file=sys.stderr)
    return 0


def _validate(args: argparse.Namespace, progress: _Progress) -> int:
    import json

    progress.say("importing torch")
    model, specs, kw = _prepare(args, progress)
    from .validate import validate

    result = validate(model, *specs, dims=parse_assignments(args.dims, "--dims"), device=args.device,
                      tolerance=args.tolerance, snapshot=args.snapshot, **kw)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_join_dash_values(sys.argv[1:] if argv is None else argv))
    progress = _Progress(enabled=not args.quiet)
    logger = logging.getLogger("fxmem")
    level = logger.level
    logger.addHandler(progress)
    logger.setLevel(logging.INFO)
    try:
        import warnings

        with warnings.catch_warnings():
            # torch says so when numpy is missing, as it is imported; fxmem never converts to numpy
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
            from .isolation import isolation
            from .timeout import ctrl_c, deadline

            # the model is built here (its initialisation draws from torch's generator): main() called in
            # the user's process leaves torch's global state as it found it, as every entry point does
            # --timeout: the whole command, loading the model included (a file may loop as it is imported)
            with _libraries_quiet(args.quiet), ctrl_c(), isolation(), deadline(args.timeout):
                run = {"analyze": _analyze, "validate": _validate, "llm": _llm}[args.command]
                return run(args, progress)
    except FxMemError as exc:
        print(f"fxmem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the analysis unwound (global state restored); one line, no traceback
        print("fxmem: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except Exception as exc:  # never a raw traceback; FXMEM_TRACEBACK=1 shows it (for a bug report)
        if os.environ.get("FXMEM_TRACEBACK"):
            raise
        print(f"fxmem: error: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n"
              f"  (not an error fxmem expected: if it comes from your model, fix it there; otherwise please "
              f"report it with the output of FXMEM_TRACEBACK=1 fxmem ...)", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(progress)
        logger.setLevel(level)


if __name__ == "__main__":
    raise SystemExit(main())
