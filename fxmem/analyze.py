"""``fxmem.analyze``: exact memory formulas of one forward (and training step), in the user's dims.

>>> import torch, fxmem
>>> report = fxmem.analyze(torch.nn.Linear(6, 128), ("B", "N", 6))
>>> report.peak
536*B*N + 3584
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch

from .accounting import MemoryPlan
from .capture import check_leaf_modules, forward_parameters, trace
from .capture import Capture, fallback
from .errors import FxMemError, ModelError, SpecError, TraceError
from .hparams import Blueprint, blueprint
from .report import Report
from .simulation import check_device, simulate
from .specs import SPECIALISED_SIZES, check_input_sizes, choose_hints, parse_specs, spec_symbols
from .training import OptimizerFactory, Training

MODES = ("auto", "graph", "eager")
log = logging.getLogger(__name__)  # progress of the steps that take seconds (the CLI shows it)


def analyze(
    model: torch.nn.Module | type | Callable[..., torch.nn.Module],
    *input_specs: Any,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    grad: bool = True,
    hints: Mapping[str, int] | None = None,
    leaf_modules: Sequence[type] = (),
    optimizer: OptimizerFactory | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    mode: str = "auto",
    hparams: Mapping[str, Any] | None = None,
    init: Mapping[str, Any] | None = None,
    kernels: Mapping[Any, Callable] | None = None,
    autocast: torch.dtype | None = None,
    repeats: bool = True,
) -> Report:
    """Return the memory (bytes) of ``model`` as formulas in the dims named by the specs.

    Args:
        model: an ``nn.Module`` (never modified), or its class / a factory with ``hparams``.
        *input_specs: one per positional ``forward`` argument - a tuple of ints and dim names
            (``("B", "N", 6)``), a :class:`fxmem.TensorSpec`, or a real tensor (a concrete input).
        device: whose memory to predict, ``"cpu"`` or ``"cuda"`` (CUDA code paths, 512-byte blocks).
        dtype: dtype of input specs that do not name one.
        grad: ``True`` records autograd as in training; ``False`` gives inference memory.
        hints: example sizes to analyse at (default: distinct primes near 100). The formulas hold
            wherever PyTorch would take the same code path (``Report.region``); ``evaluate`` outside
            it re-analyses. A hint of 0 or 1, which PyTorch specialises, is analysed at a general
            size instead (the notes say so); a dim some op fixes at its hint shows as ``B == 97``
            in the region, and every other size is re-analysed.
        leaf_modules: module classes fx should not trace into.
        optimizer: ``lambda params: torch.optim.Adam(params, lr=1e-3)`` - also analyse one
            steady-state training step with this optimizer (``train_peak``, ``grads``, ...).
        loss: ``loss(output) -> scalar`` for the training step (default: ``output.sum()``).
        mode: ``"auto"`` (default) - graph mode where ``torch.fx`` can trace the model, else eager
            mode, the reason in ``report.capture``; ``"graph"`` - the fx-traced module, which frees
            each value after its last use (a :class:`TraceError` where fx cannot trace);
            ``"eager"`` - the original ``forward``, whose locals live until it returns (no tracing,
            so it also works where fx cannot trace); ``report.by_line()`` then has every line.
        hparams: ``{"dim": "H*D", "num_heads": "H"}`` - build ``model`` (a class or factory) with
            these constructor arguments as dims, so formulas hold in them too (see
            :mod:`fxmem.hparams`).
        init: concrete constructor arguments for a class or factory.
        kernels: ``{op: fn}`` - what your own ops' real kernels allocate beyond their outputs, for
            this analysis (``fn(call)`` returns a program; see :func:`fxmem.kernels.register`).
        autocast: ``torch.bfloat16`` or ``torch.float16`` - run the forward under
            ``torch.autocast(device, dtype=...)`` (mixed precision): the casts autocast makes, and
            the half-precision tensors autograd keeps, are counted exactly. Weights keep their dtype.
        repeats: a traced model whose layers form a chain of identical blocks (same code, shapes,
            dtypes; a transformer's ``layers.0`` ... ``layers.31``) is simulated with four of them,
            and the inner blocks' memory events are the second's, repeated (the second and third
            are checked to match event by event; where they do not, every block is simulated).
            ``False`` simulates every block: the same numbers, slower.
    """
    if mode not in MODES:
        raise SpecError(f"mode={mode!r}: use 'auto' (graph where torch.fx can trace the model, else eager), "
                        f"'graph' (the traced module) or 'eager' (the original forward)")
    if not isinstance(dtype, torch.dtype):
        raise SpecError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    if not isinstance(grad, bool):
        raise SpecError(f"grad must be True or False, got {grad!r}")
    if not isinstance(repeats, bool):
        raise SpecError(f"repeats must be True or False, got {repeats!r}")
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise SpecError(f"autocast={autocast!r}: use torch.bfloat16 or torch.float16 (or None)")
    if loss is not None and optimizer is None:
        raise SpecError("loss= describes a training step; pass optimizer= as well")
    if loss is not None and not callable(loss):
        raise SpecError("loss= must be a function of the model's output, e.g. loss=lambda out: out.pow(2).mean()")
    if optimizer is not None and not callable(optimizer):
        raise SpecError("optimizer= must be a function of the parameters, e.g. lambda p: torch.optim.Adam(p)")
    check_device(device)  # before anything slow: a CPU-only torch cannot simulate CUDA
    for arg, value in (("hints", hints), ("hparams", hparams), ("init", init), ("kernels", kernels)):
        if value is not None and not isinstance(value, Mapping):
            raise SpecError(f"{arg}= must be a dict, got {type(value).__name__} {value!r:.60}")
    leaf_modules = check_leaf_modules(leaf_modules)
    if not isinstance(model, torch.nn.Module) and not (hparams is not None or init is not None):
        if isinstance(model, type) or not callable(model):
            raise ModelError(
                f"model must be a torch.nn.Module, got {getattr(model, '__name__', type(model).__name__)}; "
                f"pass an instance, or its class with hparams=/init= to build it")
        raise ModelError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; wrap a function in a Module whose "
            f"forward calls it, or pass a factory with hparams=/init=")
    training = Training(optimizer, loss) if optimizer is not None else None

    symbols: dict = {}
    target: torch.nn.Module | Blueprint
    if isinstance(model, torch.nn.Module):
        if hparams is not None or init is not None:
            blueprint(model, hparams, init, symbols)  # raises: hparams need a class or factory
        example: torch.nn.Module = model
        target = model
    else:
        target = blueprint(model, hparams, init, symbols)
        example = None  # built below, once the hints are known
    name = target.name if isinstance(target, Blueprint) else type(model).__name__

    if example is None:  # names come from a concrete instance on the meta device (no memory)
        all_symbols = spec_symbols(input_specs, dict(symbols))
        at = choose_hints(all_symbols, hints)
        example = target.example({all_symbols[k]: v for k, v in at.items()})
    params = forward_parameters(example)
    specs, named = parse_specs(input_specs, params, dtype, name)
    omitted = {n: params.defaults[n] for n in params.names[len(specs):]}  # they keep their defaults
    for k, v in named.items():
        symbols.setdefault(k, v)
    chosen = choose_hints(symbols, hints)
    check_input_sizes(specs, chosen, symbols, advice="; pass hints= with example sizes the model accepts")
    capture = Capture(mode, "the original forward" if mode == "eager" else "the GraphModule as given"
                      if isinstance(example, torch.fx.GraphModule) else "torch.fx symbolic trace")
    if isinstance(target, torch.nn.Module) and mode != "eager":
        log.info("tracing %s with torch.fx", name)
        try:
            target = trace(example, leaf_modules, omitted)
        except TraceError as exc:
            if mode == "graph":
                raise
            capture = fallback(exc)
        capture = Capture("graph", capture.how) if capture.mode == "auto" else capture

    def run(at: Mapping[str, int]) -> Report:
        nonlocal capture
        log.info("simulating %s on fake tensors at %s", name, ", ".join(f"{k}={v}" for k, v in sorted(at.items())))
        try:
            rec = simulate(target, specs, symbols, dict(at), device=device, grad=grad, training=training,
                           mode=capture.run_mode, leaf_modules=leaf_modules, kernels=kernels, concrete_args=omitted,
                           autocast=autocast, repeats=repeats)
        except TraceError as exc:  # a model built from hparams is traced inside the simulation
            if capture.mode != "auto":
                raise
            capture = fallback(exc)
            return run(at)
        # a size the data decides has no example value: any positive one orders the Max's candidates
        # (the formulas hold for every value); evaluate() asks the user for it
        data = {name: int(at.get(name, d.example)) for name, d in rec.data_dims.items()}
        plan = MemoryPlan(rec, {**dict(at), **data})
        report = Report(plan, model_name=name, specs=specs, device=device, grad=grad, dtype=dtype,
                        hints={**dict(at), **data}, graph_module=rec.graph_module, mode=capture.run_mode,
                        reanalyze=run, capture=capture)
        if isinstance(model, torch.nn.Module):  # what a rewrite (recomputation) re-analyses
            report.source = (model, input_specs, dict(device=device, dtype=dtype, grad=grad, hints=hints,
                                                      leaf_modules=leaf_modules, optimizer=optimizer, loss=loss))
        return report

    special = {k: v for k, v in chosen.items() if v in SPECIALISED_SIZES}
    if not special:
        return run(chosen)
    # PyTorch fixes a dim whose example size is 0 or 1 for good: formulas made there hold at that
    # size only. Analyse at general sizes instead (evaluate() at the special size re-analyses
    # there); only a model that runs at nothing but the special size is analysed at it (pinned).
    general = choose_hints(symbols, {k: v for k, v in chosen.items() if k not in special})
    try:
        report = run(general)
    except FxMemError:
        return run(chosen)
    given = ", ".join(f"{k}={v}" for k, v in special.items())
    report.notes.insert(0, f"hints {given}: PyTorch treats sizes 0 and 1 specially and would fix the dim there, so "
                           f"the formulas were made at {', '.join(f'{k}={general[k]}' for k in special)} "
                           f"(region: {', '.join(report.region) or 'every size'}); evaluate() at {given} "
                           f"re-analyses at those sizes")
    return report


