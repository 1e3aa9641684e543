"""``fxmem.analyze``: exact memory formulas of one forward (and training step), in the user's dims.

>>> import torch, fxmem
>>> report = fxmem.analyze(torch.nn.Linear(6, 128), ("B", "N", 6))
>>> report.peak
536*B*N + 3584
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

import torch

from .isolation import ambient_grad_note, hooks_note, isolated
from .accounting import MemoryPlan
from .capture import forward_parameters, trace
from .capture import Capture, fallback
from .errors import FxMemError, InternalError, ModelError, ShapeError, SpecError, TraceError, UserCodeError
from .hparams import Blueprint, blueprint
from .report import Report
from .simulation import check_device, simulate
from .specs import SPECIALISED_SIZES, check_input_sizes, choose_hints, parse_specs, spec_symbols
from .options import WORLD_SIZE_AND_PARALLELIZE, AnalysisOptions
from .progress import progress_to_stderr, showing
from .timeout import timed
from .distributed import Parallel, adopt, adopted_parallel, refuse_wrapped
from .distributed.world_symbol import analyze_over_world, symbolic_world
from .training import Training
log = logging.getLogger(__name__)  # progress of the steps that take seconds (the CLI shows it)


@isolated
@timed("option_values")
def analyze(
    model: torch.nn.Module | type | Callable[..., torch.nn.Module],
    *input_specs: Any,
    options: AnalysisOptions | None = None,
    **option_values: Any,
) -> Report:
    """Return the memory (bytes) of ``model`` as formulas in the dims named by the specs.

    Args:
        model: an ``nn.Module`` (never modified), or its class / a factory with ``hparams``.
        *input_specs: one per positional ``forward`` argument - a tuple of ints and dim names
            (``("B", "N", 6)``), a :class:`fxmem.TensorSpec`, or a real tensor (a concrete input).
        options: an :class:`fxmem.AnalysisOptions` (e.g. ``report.options`` of an earlier
            analysis); keyword options below change it.
        **option_values: the options, by name - ``device``, ``dtype``, ``grad``, ``hints``,
            ``leaf_modules``, ``optimizer``, ``loss``, ``mode``, ``hparams``, ``init``, ``kernels``,
            ``autocast``, ``repeats``, ``world_size``, ``parallelize``, ``rank``, ``step``, ``verbose``, ``check``,
            ``timeout``: each is
            documented once, on :class:`fxmem.AnalysisOptions`.
            ``optimizer=lambda p: torch.optim.Adam(p)`` also analyses a steady-state training step;
            ``step=fn`` makes it your own ``fn(model, optimizer, *inputs)``.

    The report keeps the options (``report.options``): whatever re-analyses it later (a region
    outside the formulas, recomputation planning) uses the same ones.
    """
    opts = AnalysisOptions.of(options, **option_values)
    if opts.verbose and not showing():
        with progress_to_stderr():
            return analyze(model, *input_specs, options=opts)
    if symbolic_world(opts) is not None:  # world_size="W": formulas in W too, from three world sizes
        return analyze_over_world(analyze, model, input_specs, opts)
    # before anything slow: a CPU-only torch cannot simulate CUDA, nor a CUDA build without a GPU backward
    check_device(opts.device, backward=opts.optimizer is not None or opts.step is not None)
    if not isinstance(model, torch.nn.Module) and not (opts.hparams is not None or opts.init is not None):
        if isinstance(model, type) or not callable(model):
            raise ModelError(
                f"model must be a torch.nn.Module, got {getattr(model, '__name__', type(model).__name__)}; "
                f"pass an instance, or its class with hparams=/init= to build it")
        raise ModelError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; wrap a function in a Module whose "
            f"forward calls it, or pass a factory with hparams=/init=")
    training = Training(opts.optimizer, opts.loss, opts.step) if opts.optimizer is not None else None
    parallel = Parallel.of(opts) if opts.parallelize is not None else None
    if isinstance(model, torch.nn.Module):
        check_runnable(model)
        adopted = adopt(model) if parallel is None else None
        if adopted is not None:  # the user's own wrapping, applied again to fxmem's copy in a group of its own
            model, parallel = adopted.model, adopted_parallel(adopted, opts)
            # the report's options say what was analysed (a re-analysis then needs no wrapper)
            opts = dataclasses.replace(opts, world_size=parallel.world_size, rank=parallel.rank,
                                       parallelize=parallel.fn)
        refuse_wrapped(model)
    if parallel is None and (opts.world_size is not None or opts.rank not in (None, 0)):
        raise SpecError(WORLD_SIZE_AND_PARALLELIZE if opts.world_size is not None else
                        f"rank={opts.rank!r} needs world_size= and parallelize= (or a model you wrapped already)")

    symbols: dict = {}
    target: torch.nn.Module | Blueprint
    if isinstance(model, torch.nn.Module):
        if opts.hparams is not None or opts.init is not None:
            blueprint(model, opts.hparams, opts.init, symbols)  # raises: hparams need a class or factory
        example: torch.nn.Module = model
        target = model
    else:
        target = blueprint(model, opts.hparams, opts.init, symbols)
        example = None  # built below, once the hints are known
    name = target.name if isinstance(target, Blueprint) else type(model).__name__

    if example is None:  # names come from a concrete instance on the meta device (no memory)
        all_symbols = spec_symbols(input_specs, dict(symbols))
        at = choose_hints(all_symbols, opts.hints)
        example = target.example({all_symbols[k]: v for k, v in at.items()})
    params = forward_parameters(example)
    specs, named = parse_specs(input_specs, params, opts.dtype, name)
    omitted = {n: params.defaults[n] for n in params.names[len(specs):]}  # they keep their defaults
    for k, v in named.items():
        symbols.setdefault(k, v)
    chosen = choose_hints(symbols, opts.hints)
    check_input_sizes(specs, chosen, symbols, advice="; pass hints= with example sizes the model accepts")
    mode = opts.mode
    capture = Capture(mode, "the original forward" if mode == "eager" else "the GraphModule as given"
                      if isinstance(example, torch.fx.GraphModule) else "torch.fx symbolic trace")
    if parallel is not None:  # FSDP2's and DDP's hooks work through the modules' own calls
        capture = Capture("eager", f"the original forward, parallelised by {parallel.how} over "
                                   f"{parallel.world_size} ranks (rank {parallel.rank})")
        mode = "eager"
    if isinstance(target, torch.nn.Module) and mode != "eager":
        log.info("tracing %s with torch.fx", name)
        try:
            target = trace(example, opts.leaf_modules, omitted)
        except TraceError as exc:
            if mode == "graph":
                raise
            capture = fallback(exc)
        capture = Capture("graph", capture.how) if capture.mode == "auto" else capture

    def run(at: Mapping[str, int]) -> Report:
        nonlocal capture, target
        log.info("simulating %s on fake tensors at %s", name, ", ".join(f"{k}={v}" for k, v in sorted(at.items())))
        try:
            # the options, with the mode this simulation runs in and the sizes it runs at (derived
            # values, not re-checked: a model you wrapped has parallelize= without the checks' limits)
            rec = simulate(target, specs, dataclasses.replace(opts, mode=capture.run_mode, hints=dict(at)), symbols,
                           training=training, concrete_args=omitted, parallel=parallel)
        except TraceError as exc:  # a model built from hparams is traced inside the simulation
            if capture.mode == "auto":
                capture = fallback(exc)
                return run(at)
            if mode == "auto" and capture.mode == "graph" and training is not None and training.step is not None \
                    and example is not None and not isinstance(example, torch.fx.GraphModule):
                # the step calls a part of the model the graph has no code for (a GAN's discriminator)
                target, capture = example, Capture("eager", "the original forward (locals live until it returns)",
                                                   str(exc).splitlines()[0])
                return run(at)
            raise
        # a size the data decides has no example value: any positive one orders the Max's candidates
        # (the formulas hold for every value); evaluate() asks the user for it
        data = {name: int(at.get(name, d.example)) for name, d in rec.data_dims.items()}
        plan = MemoryPlan(rec, {**dict(at), **data})
        report = Report(plan, model_name=name, specs=specs, options=opts, input_specs=input_specs,
                        model=model if isinstance(model, torch.nn.Module) else None,
                        hints={**dict(at), **data}, graph_module=rec.graph_module, mode=capture.run_mode,
                        reanalyze=rerun, capture=capture)
        report._check = checked  # each other piece of this simulation is checked as this one is
        return report

    def checked(report: Report) -> Report:
        """``report`` with its self-check made (or said to be off)."""
        if opts.check:
            from .selfcheck import self_check
            report.checked = self_check(report, model)
        else:
            report.checked = "not checked against a real run (check=False)"
        return report

    def rerun(at: Mapping[str, int]) -> Report:
        """evaluate() outside the formulas' region: a new analysis at those sizes, checked against a
        real run there like the first one (the sizes the user asks about, not fxmem's examples)."""
        return checked(run(at))

    def at_sizes(chosen: dict) -> Report:
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

    report = _within_the_domain(at_sizes, chosen, dict(opts.hints or {}))
    for note in (ambient_grad_note(opts.grad), hooks_note()):
        if note:
            report.notes.insert(0, note)
    return checked(report)


# other example sizes for the dims the user gave no hint for, tried in turn when the defaults fail:
# powers of two (UNets halve and double sizes), then small primes (a position table of 77 entries)
_OTHER_EXAMPLES = ((32, 64, 16, 128, 8, 256, 4, 512, 1024, 2048), (17, 19, 23, 29, 31, 37, 41, 43, 47, 53))


def _within_the_domain(at_sizes: Callable[[dict], Report], chosen: dict, given: dict) -> Report:
    """``at_sizes(chosen)``; where fxmem's own example sizes are outside the model's domain (a
    ShapeError or InternalError there), the same analysis at other example sizes, with a note.
    A failure at every size tried names the sizes and ``hints=``."""
    try:
        return at_sizes(chosen)
    except (ShapeError, InternalError, UserCodeError) as exc:
        if isinstance(exc, UserCodeError) and exc.party != "forward":
            raise  # a loss, optimizer factory or step= that raised itself does so at any sizes
        first = exc
    tried = [chosen]
    free = [k for k in chosen if k not in given]
    for values in _OTHER_EXAMPLES if free else ():
        pool = iter(v for v in values if v not in given.values())
        other = {**chosen, **{k: next(pool) for k in free}}
        log.info("the example sizes %s fail; trying %s", _sizes(chosen), _sizes(other))
        try:
            report = at_sizes(other)
        except (ShapeError, InternalError, UserCodeError):  # (a forward's own check of its sizes, too)
            tried.append(other)
            continue
        reason = str(first).splitlines()[0]
        report.notes.insert(0, f"fxmem's example sizes {_sizes(chosen)} are outside what the model accepts "
                               f"({reason[:200]}{'...' if len(reason) > 200 else ''}); the formulas were made at "
                               f"{_sizes(other)} instead (pass hints= to choose the example sizes)")
        return report
    which = "the example sizes" if not free else "fxmem's example sizes"
    raise type(first)(f"{first}\n  {which} tried: {'; '.join(_sizes(t) for t in tried)}; if the model accepts "
                      f"only some sizes, pass hints= with sizes it accepts (e.g. hints={{{', '.join(f'{k!r}: ...' for k in chosen)}}})") from first


def _sizes(values: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items()) or "(none)"


def check_runnable(model: torch.nn.Module) -> None:
    """Refuse models whose ``forward`` is not Python code that runs when called: a TorchScript
    module (compiled code fx and the fake-tensor simulation cannot run), and a generator or
    ``async`` forward (calling it runs nothing, so a number for it would describe nothing)."""
    import inspect

    name = type(model).__name__
    if isinstance(model, torch.jit.ScriptModule):
        raise ModelError(f"{name} is a TorchScript module (torch.jit.script / torch.jit.trace): its forward is "
                         f"compiled code fxmem cannot run on fake tensors; analyse the original nn.Module instead")
    forward = getattr(type(model), "forward", None)
    if inspect.isgeneratorfunction(forward) or inspect.isasyncgenfunction(forward) \
            or inspect.iscoroutinefunction(forward):
        kind = "a generator (it yields)" if inspect.isgeneratorfunction(forward) else "async"
        raise ModelError(f"{name}.forward is {kind}: calling it runs none of its code until it is iterated or "
                         f"awaited, so it has no memory fxmem could state; make forward compute and return its "
                         f"tensors (a list instead of yield)")
