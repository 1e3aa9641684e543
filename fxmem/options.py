"""``AnalysisOptions``: every choice an analysis takes, defined once, checked once, carried as one value.

``fxmem.analyze``, ``fxmem.optimize``, ``fxmem.validate``, ``fxmem.precisions`` and the CLI build
one of these from their keyword arguments (or take one as ``options=``), and the
:class:`~fxmem.Report` keeps it (``report.options``), so whatever re-analyses later - a region
outside the formulas, recomputation planning in :mod:`fxmem.passes` - analyses with exactly the
options the user asked for (``autocast``, ``kernels``, ``mode`` ... included).

>>> import torch
>>> from fxmem.options import AnalysisOptions
>>> opts = AnalysisOptions.of(dtype=torch.float64, hints={"B": 8})
>>> opts.replace(grad=False).grad, opts.hints
(False, {'B': 8})
>>> AnalysisOptions.of(optimiser=None)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
fxmem.errors.SpecError: unknown option optimiser=; did you mean optimizer=? (the options are ...)

A new option is one field here (with its check in ``_checked``); every entry point then accepts it,
and the simulation (:func:`fxmem.simulation.simulate`, handed these options as one value) reads it
where it is used.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Mapping

import torch

from .capture.trace import check_leaf_modules
from .errors import SpecError

__all__ = ["AnalysisOptions", "MODES"]

MODES = ("auto", "graph", "eager")


WORLD_SIZE_AND_PARALLELIZE = (
    "world_size= and parallelize= go together: parallelize=fn shards the model over world_size ranks (fn(model, "
    "mesh) calls fully_shard or wraps in DistributedDataParallel); a model you wrapped already needs neither")


@dataclasses.dataclass(frozen=True)
class AnalysisOptions:
    """The options of one analysis (bytes are always what is reported; these say of what).

    Attributes:
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
            Eager mode (Hugging Face models) does the same for a ``ModuleList`` of alike layers
            (same classes, tensor shapes and settings but a layer index): it simulates the first
            three and the real last one. It cannot read the code of the layers it does not run:
            a forward that branches on its index by arithmetic (``if self.layer_idx % 4 == 3``)
            needs ``repeats=False``; a different attribute per layer (a sliding window, a MoE
            flag) is seen and every layer simulated.
            ``False`` simulates every block: the same numbers, slower.
        world_size: the number of ranks (GPUs) ``parallelize`` shards the model over; the report
            is one rank's memory (bytes per rank). See :mod:`fxmem.distributed`.
            A model you wrapped already (``DistributedDataParallel``, ``fully_shard``) needs neither:
            fxmem reads the wrapping and your group's size (``world_size=`` then asks about another
            number of ranks). See :mod:`fxmem.distributed.adopt`.
            A dim name (``world_size="W"``) makes it a symbol of the formulas, from three world
            sizes that divide the sharded sizes evenly (:mod:`fxmem.distributed.world_symbol`).
        parallelize: ``fn(model, mesh)`` - your training script's code that applies
            ``fully_shard`` (FSDP2, per block and on the root), ``parallelize_module`` (tensor
            parallelism) or both, or wraps the model in ``DistributedDataParallel``, returning the
            model to run. fxmem calls it on its own fake copy, with a ``DeviceMesh`` over torch's
            fake process group of ``world_size`` ranks (1-D, or ``mesh=``'s) (the original forward
            runs: eager mode).
        mesh: the ``DeviceMesh`` ``parallelize`` is given, as ``{dim name: size}`` in order:
            ``{"dp": 2, "tp": 4}`` is torchtitan's 2-D mesh for FSDP2 with tensor parallelism
            (``fully_shard(..., mesh=mesh["dp"])``, ``parallelize_module(..., mesh["tp"], plan)``),
            ``{"replicate": 2, "shard": 4}`` HSDP's. The sizes multiply to ``world_size``; default a
            1-D mesh of ``world_size`` ranks. One size may be a dim name (``{"dp": "D", "tp": 2}``,
            without ``world_size=``): a symbol of the formulas, as ``world_size="W"`` is.
        rank: which rank's memory to report (default 0; for a model you wrapped already, this
            process's rank in its group).
        step: ``fn(model, optimizer, *inputs)`` - your own training step (micro-batches with
            gradient accumulation, clipping, a GradScaler, ``zero_grad(set_to_none=False)``, several
            losses ...), with ``optimizer=``: the training formulas are of that function's steady
            state (its second call), not of the default step (``out = model(*inputs)``, ``loss =
            loss_fn(out)``, ``loss.backward()``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``,
            with ``out`` and ``loss`` held until it returns). With ``parallelize=`` it is handed the
            parallelised model (gradient accumulation under FSDP2's ``set_requires_gradient_sync`` or
            DDP's ``no_sync``). See :mod:`fxmem.training`.
        verbose: ``True`` prints progress to stderr as the analysis goes (tracing, simulating,
            calibrating kernels, re-analysing outside the region) - the ``fxmem`` logger's INFO
            records, which any ``logging`` handler can also receive.
        check: ``True`` (default) runs the forward once for real at the analysed sizes where the
            model has real weights on the CPU, and compares the allocator's events with the
            simulation's (``report.checked`` says the outcome; a difference makes the report
            inexact, with a note saying where the two first part). ``False`` skips it. See
            :mod:`fxmem.selfcheck`.
        timeout: seconds the whole call may take (default None: no limit). Past them fxmem stops
            the analysis wherever it is - in your forward too (a Python loop, ``time.sleep``) - and
            raises :class:`fxmem.AnalysisTimeout` naming the phase it was in (capture,
            simulation, self-check, verification ...); torch's global state is as it was. See
            :mod:`fxmem.timeout`.
    """

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    grad: bool = True
    hints: Mapping[str, int] | None = None
    leaf_modules: tuple = ()
    optimizer: Callable[..., torch.optim.Optimizer] | None = None
    loss: Callable[[Any], torch.Tensor] | None = None
    mode: str = "auto"
    hparams: Mapping[str, Any] | None = None
    init: Mapping[str, Any] | None = None
    kernels: Mapping[Any, Callable] | None = None
    autocast: torch.dtype | None = None
    repeats: bool = True
    world_size: int | str | None = None
    parallelize: Callable[..., torch.nn.Module] | None = None
    mesh: Mapping[str, int | str] | None = None
    rank: int | None = None
    step: Callable[..., Any] | None = None
    verbose: bool = False
    check: bool = True
    timeout: float | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, in the order they are documented."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, options: "AnalysisOptions | None" = None, /, **changes: Any) -> "AnalysisOptions":
        """``options`` (default: the defaults) with ``changes``, checked; unknown names are refused."""
        if options is not None and not isinstance(options, AnalysisOptions):
            raise SpecError(f"options= must be an fxmem.AnalysisOptions, got {type(options).__name__}")
        base = options if options is not None else cls()
        return base.replace(**changes) if changes else _checked(base)

    def replace(self, **changes: Any) -> "AnalysisOptions":
        """A copy with ``changes`` (checked): ``opts.replace(grad=False)``."""
        unknown = [k for k in changes if k not in self.names()]
        if unknown:
            name = unknown[0]
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f"; did you mean {close[0]}=?" if close else ""
            raise SpecError(f"unknown option {name}={hint} (the options are {', '.join(self.names())})")
        return _checked(dataclasses.replace(self, **changes))


def _checked(opts: AnalysisOptions) -> AnalysisOptions:
    """Refuse options that cannot mean anything, before anything slow runs (the argument named)."""
    if opts.mode not in MODES:
        raise SpecError(f"mode={opts.mode!r}: use 'auto' (graph where torch.fx can trace the model, else eager), "
                        f"'graph' (the traced module) or 'eager' (the original forward)")
    if not isinstance(opts.dtype, torch.dtype):
        raise SpecError(f"dtype must be a torch.dtype (e.g. torch.float32), got {opts.dtype!r}")
    for name in ("grad", "repeats", "verbose", "check"):
        if not isinstance(getattr(opts, name), bool):
            raise SpecError(f"{name} must be True or False, got {getattr(opts, name)!r}")
    if opts.timeout is not None and (isinstance(opts.timeout, bool) or not isinstance(opts.timeout, (int, float))
                                     or not 0 < opts.timeout < float("inf")):
        raise SpecError(f"timeout={opts.timeout!r}: give the seconds the analysis may take, a number > 0 "
                        f"(e.g. timeout=600), or None for no limit")
    if opts.autocast is not None and opts.autocast not in (torch.bfloat16, torch.float16):
        raise SpecError(f"autocast={opts.autocast!r}: use torch.bfloat16 or torch.float16 (or None)")
    if opts.loss is not None and opts.optimizer is None:
        raise SpecError("loss= describes a training step; pass optimizer= as well")
    if opts.loss is not None and not callable(opts.loss):
        raise SpecError("loss= must be a function of the model's output, e.g. loss=lambda out: out.pow(2).mean()")
    if opts.step is not None:
        if not callable(opts.step):
            raise SpecError("step= must be your training step, a function fn(model, optimizer, *inputs)")
        if opts.optimizer is None:
            raise SpecError("step= is a training step: pass optimizer= as well (fxmem builds the optimizer your "
                            "step receives)")
        if opts.loss is not None:
            raise SpecError("step= computes its own loss: pass loss= or step=, not both")
        if not opts.grad:
            raise SpecError("step= is a training step: it needs grad=True")
        import inspect

        if inspect.isgeneratorfunction(opts.step) or inspect.iscoroutinefunction(opts.step):
            raise SpecError("step= must run the step when called: a generator or async function runs nothing")
    if opts.optimizer is not None and not callable(opts.optimizer):
        raise SpecError("optimizer= must be a function of the parameters, e.g. lambda p: torch.optim.Adam(p)")
    for name in ("hints", "hparams", "init", "kernels"):
        value = getattr(opts, name)
        if value is not None and not isinstance(value, Mapping):
            raise SpecError(f"{name}= must be a dict, got {type(value).__name__} {value!r:.60}")
    from .distributed.world_option import stand_in, symbolic_world
    symbolic = symbolic_world(opts)
    if opts.parallelize is not None and opts.world_size is None and symbolic is None:
        raise SpecError(WORLD_SIZE_AND_PARALLELIZE)
    if opts.mesh is not None and opts.parallelize is None:
        raise SpecError("mesh= is the DeviceMesh parallelize= is given: pass parallelize=fn and world_size= too")
    if opts.parallelize is not None:
        from .distributed import Parallel
        Parallel.of(stand_in(opts) if symbolic is not None else opts).check()
        if opts.device not in ("cpu", "cuda"):
            raise SpecError(f"device={opts.device!r} with parallelize=: use 'cpu' or 'cuda'")
        if opts.mode == "graph":
            raise SpecError("mode='graph' with parallelize=: FSDP2 and DDP work through the module's own call "
                            "(hooks), so the original forward runs; use mode='auto' or 'eager'")
    leaves = check_leaf_modules(opts.leaf_modules)
    if leaves != opts.leaf_modules:
        opts = dataclasses.replace(opts, leaf_modules=leaves)
    return opts
