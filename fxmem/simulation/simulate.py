"""Run a model once on fake tensors with symbolic sizes and record every storage it allocates.

This is the measurement behind every formula. The model really runs - real autograd, real
composite decompositions, the GraphModule's own order of frees - only on fake tensors whose sizes
are ShapeEnv symbols named after the user's dims. The :class:`~.recorder.Recorder` sees each aten
call, the :class:`~.storages.StorageTable` sees each storage die, :class:`~.autograd.Autograd`
sees what is saved for backward; the result is a :class:`~fxmem.records.Recording`.

>>> opts = AnalysisOptions.of(device="cpu", mode="graph", hints={"B": 97, "N": 101})
>>> rec = simulate(gm, specs, opts, symbols)                               # doctest: +SKIP
>>> rec.steps[0].op, rec.storages[rec.steps[0].allocs[0]].bytes           # doctest: +SKIP
('aten.mm', 512*s0*s1)
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any, Iterator, Sequence

import sympy
import torch
import torch.fx

from ..isolation import isolated
from ..progress import phased
from .. import _torch_compat as tc
from ..caches import cached_tensors, private_caches
from ..capture import model_files, private_copy, trace
from ..capture.source import raised_at
from ..errors import DeviceError, FxMemError, ModelError, NothingToTrainError, SpecError, UnsupportedOpError
from ..hparams import Blueprint
from ..kernels import REGISTRY, RealPaths, calibrate, environment
from ..options import AnalysisOptions
from ..records import Node, Phase, Recording, Role
from ..specs import InputSpec
from ..training import StepHooks, Training, train_step, user_step
from .autograd import Autograd
from .data_dims import DataDims
from . import first_calls
from .events import EventLog
from .failures import SPARSE_GRADS, failure, first_line, optimizer_failure, renamer
from .graph_runner import GraphRunner
from .line_runner import LineRunner
from .module_stack import ModuleStack
from .recorder import Recorder
from .repeats import find_chain, find_module_chain, shorten, shorten_module
from .unroll import unroll
from .storages import StorageTable
from ..distributed import pipeline
from .user_step import Router, kept_alive, objects_kept, register_leftovers, step_guards, values_read
from .outside import outside_dispatch
from .values import tracing_checks

_log = logging.getLogger(__name__)

# what the training step's phases are called in error messages
_PHASE_TEXT = {Phase.LOSS: "the loss", Phase.BACKWARD: "backward()", Phase.STEP: "optimizer.step()"}


def check_device(device: str, backward: bool = False) -> None:
    """Refuse, before anything slow, a device this torch cannot simulate (``backward``: the
    analysis runs a backward pass, i.e. a training step)."""
    if device not in ("cpu", "cuda"):
        raise DeviceError(f"device={device!r} is not supported; use 'cpu' or 'cuda'")
    if device == "cuda":
        ok, why = tc.fake_cuda_is_safe()
        if not ok:
            raise DeviceError(
                f"device='cuda' cannot be simulated: {why}. Install a CUDA build of torch (it simulates "
                f"CUDA without a GPU), or analyse with device='cpu'.")
        if backward and not tc.fake_cuda_backward_possible():
            raise DeviceError(
                "the training step (optimizer=) on device='cuda' needs a GPU in this process: torch's "
                "autograd engine starts the device's context to run backward, even on fake tensors (here it "
                "fails with 'hasPrimaryContext expects a valid device index' - torch's limit, not your "
                "model or shapes). The forward on device='cuda' (no optimizer=) is simulated without a GPU; "
                "for the training step run the analysis where a GPU is visible, or use device='cpu'.")


class _Run(StepHooks):
    """One simulated call (or training step): the recorder's parts and the runner of the forward."""

    def __init__(self, recorder: Recorder, run_forward: Any, named_params: list):
        self.recorder, self.log = recorder, recorder.log
        self.run_forward = run_forward
        self.named_params = named_params
        self.forward_end = -1
        self.optimizer: torch.optim.Optimizer | None = None  # a training step's, its state not yet in the table
        self.stepping: torch.optim.Optimizer | None = None  # the one whose step() runs (named in its errors)
        self.eager_state: set[int] = set()  # ids of parameters whose state the optimizer made when built

    def forward(self, module: Any, inputs: tuple) -> Any:
        with self.log.at(self.log.node, Phase.FORWARD):  # a user's step calls it from its own code
            out = self.run_forward(list(inputs))
        table = self.recorder.table
        self.recorder.end_node()
        for t in tc.tree_leaves(out):
            if isinstance(t, torch.Tensor) and table.counts(t):
                index = table.lookup(t)
                if index is not None:
                    table.storages[index].is_output = True
        self.recorder.poll()
        if self.forward_end < 0:  # the forward formulas are of the first call (a user's step may make more)
            self.forward_end = self.log.mark()
        return out

    @contextlib.contextmanager
    def user_step(self, module: Any, optimizer: torch.optim.Optimizer) -> Iterator[Any]:
        with Router(self).routing(module, optimizer) as model:
            yield model

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        first = self.log.next_step
        stepping = self.stepping if phase == Phase.STEP else None  # (one that reads its own values is named)
        named = optimizer_errors(stepping) if stepping is not None else contextlib.nullcontext()
        with self.log.at(phase.value, phase), failures(_PHASE_TEXT.get(phase), self.recorder.rename), named:
            yield
            if phase == Phase.BACKWARD:
                self._mark_gradients()
                self._keep_state_of_trained()
            self.recorder.end_node()
        self.log.ended(Node(phase.value, "phase", phase.value, "", None, [], [], [], first, self.log.next_step))

    def check_loss(self, loss: Any) -> None:
        try:
            super().check_loss(loss)
        except SpecError as exc:
            raise SpecError(self.recorder.rename(str(exc))) from None

    def before_backward(self, loss: torch.Tensor) -> None:
        self.recorder.autograd.watch_engine(loss)

    def _keep_state_of_trained(self) -> None:
        """The optimizer's state, as torch.optim keeps it: made lazily by ``step()`` for the parameters
        whose ``.grad`` is not None after backward (an output the loss does not read - a pooler - trains
        nothing, so its parameters have no state), plus what the optimizer made when built (Adagrad)."""
        if self.optimizer is None:
            return
        optimizer, self.optimizer = self.optimizer, None
        self.stepping = optimizer
        name_of = {id(p): qual for qual, p in self.named_params}
        for p in list(optimizer.state):
            if p.grad is None and id(p) not in self.eager_state:
                del optimizer.state[p]  # never created in a real run: the step skips p as it would
                continue
            for key, value in optimizer.state[p].items():
                if isinstance(value, torch.Tensor):
                    self.recorder.table.add(tc.local_tensor(value), Role.OPTIMIZER_STATE,
                                            f"{name_of.get(id(p), '?')}.{key}")

    def _mark_gradients(self) -> None:
        table = self.recorder.table
        for _, p in self.named_params:
            g = tc.local_tensor(p.grad) if p.grad is not None else None
            index = table.lookup(g) if g is not None and table.counts(g) else None
            if index is not None:
                table.storages[index].role = Role.GRADIENT


@isolated
@phased("simulation")
def simulate(model: torch.nn.Module | Blueprint, specs: Sequence[InputSpec], options: AnalysisOptions,
             symbols: dict, *, training: Training | None = None, concrete_args: dict | None = None,
             parallel: Any = None) -> Recording:
    """Run ``model`` once on fake inputs described by ``specs`` and record its memory behaviour.

    ``options``: the analysis' :class:`~fxmem.AnalysisOptions`, resolved by the caller for this
    simulation - ``mode`` is ``"graph"`` or ``"eager"`` (not ``"auto"``) and ``hints`` gives an
    example size for every dim in ``symbols`` (the user's dim names -> their sympy symbols).
    ``mode="graph"``: ``model`` is a traced GraphModule (or is traced here, with
    ``options.leaf_modules`` and ``concrete_args``, if it is a :class:`~fxmem.hparams.Blueprint`),
    run node by node. ``mode="eager"``: the module's own ``forward`` runs, memory attributed to
    source lines. ``options.kernels``: the user's rules for their own ops (see
    :func:`fxmem.kernels.register`); ``options.autocast``: the forward runs under
    ``torch.autocast(device, dtype=autocast)``, loss and backward outside it.

    With ``training``, the run is one steady-state training step (see :mod:`fxmem.training`):
    the optimizer's state is created first (quietly, from placeholder gradients), then forward,
    loss, backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` are recorded.

    ``options.repeats``: a graph with a chain of four or more identical blocks (a transformer's
    layers) is simulated with three of them and the middle one's events repeated for the rest (see
    :mod:`.repeats`, :mod:`.unroll`); where the three do not match event by event, the whole graph
    is simulated.
    """
    given = dict(training=training, concrete_args=concrete_args, parallel=parallel)
    user_loop = training is not None and training.step is not None  # may call the model several times
    if options.repeats and options.mode == "graph" and isinstance(model, torch.fx.GraphModule) and not user_loop:
        chain = find_chain(model)
        if chain is not None:
            short = simulate_once(shorten(model, chain), specs, options, symbols, **given)
            whole = unroll(short, chain, model)
            if isinstance(whole, Recording):
                return whole
            _log.info("simulating all %d blocks of %s: %s", chain.count, chain.prefix, whole)
    elif options.repeats and options.mode == "eager" and isinstance(model, torch.nn.Module) and not user_loop \
            and parallel is None:
        chain = find_module_chain(model)
        if chain is not None:
            whole = _eager_shortcut(model, chain, specs, options, symbols, **given)
            if isinstance(whole, Recording):
                return whole
            _log.info("simulating all %d blocks of %s: %s", chain.count, chain.prefix, whole)
    return simulate_once(model, specs, options, symbols, **given)


def _eager_shortcut(model: torch.nn.Module, chain: Any, *args: Any, **given: Any) -> Recording | str:
    """Eager mode's repeated blocks: the model with only the first three and the last simulated,
    unrolled (see :mod:`.unroll`); or why not. A failure of the shortened model (code that counts
    its blocks, say) is a reason to simulate the whole one, not the user's error."""
    try:
        short = simulate_once(shorten_module(model, chain), *args, **given)
    except FxMemError as exc:
        return f"the model with four of its blocks failed ({type(exc).__name__}: {first_line(str(exc))})"
    return unroll(short, chain, None)


def simulate_once(
    model: torch.nn.Module | Blueprint,
    specs: Sequence[InputSpec],
    options: AnalysisOptions,
    symbols: dict,
    *,
    training: Training | None = None,
    concrete_args: dict | None = None,
    parallel: Any = None,
    steady: bool = False,
) -> Recording | None:
    """One simulation of all of ``model`` (see :func:`simulate`, which says what it reads of ``options``).

    ``parallel``: a :class:`fxmem.distributed.Parallel` - the fake copy is parallelised by the
    user's function in torch's fake process group, and one rank's step is recorded (eager mode).

    A forward that stores tensors on its modules is simulated again with ``steady``: a quiet first
    call, then the recorded one. Where the second call keeps what the first stored (a cache, see
    :mod:`.first_calls`), that is the analysis; where it replaces it (None returned then), the
    first call's stands, with a note."""
    given = model  # (a Blueprint is built below: the steady run builds its own)
    device, grad, mode, hints = options.device, options.grad, options.mode, options.hints
    if mode not in ("graph", "eager") or not set(symbols) <= set(hints or ()):
        raise ValueError(f"simulate takes the options resolved for one simulation: mode 'graph' or 'eager' (got "
                         f"{mode!r}), hints with a size for each of {sorted(symbols)} (got {hints!r})")
    check_device(device, backward=training is not None)
    if training is not None and not grad:
        raise FxMemError("a training step needs grad=True")
    fake_mode, env = tc.new_fake_mode()
    env_symbols = {name: tc.make_dim_symbol(env, name, hints[name]) for name in symbols}
    to_env = {symbols[name]: s for name, s in env_symbols.items()}  # s is a number if specialised
    hint_of = {symbols[name]: hints[name] for name in symbols}

    def symint(expr: Any) -> Any:
        return tc.make_symint(env, expr.xreplace(to_env), int(expr.xreplace(hint_of)))

    rename = renamer({str(s): name for name, s in env_symbols.items() if isinstance(s, sympy.Symbol)})
    if isinstance(model, Blueprint):
        with fake_mode:
            try:
                model = model.build(symint)
            except ModelError as exc:
                raise ModelError(rename(str(exc))) from exc.__cause__
        if mode == "graph":
            with warnings.catch_warnings():  # fx notes SymInt hyperparameters baked into the graph
                warnings.filterwarnings("ignore", message="Raw Sym")
                model = trace(model, options.leaf_modules, concrete_args)
    table, log = StorageTable(env, device), EventLog()
    table.data_dims = DataDims(set(symbols), device)
    names = {str(s): name for name, s in env_symbols.items() if isinstance(s, sympy.Symbol)}
    recorder = Recorder(table, log, Autograd(table, log), device)
    # torch's symbols in messages as the user's dims, and as the names of sizes the data decides
    recorder.rename = lambda text: renamer({**names, **{str(s): d for d, s in table.data_dims.named().items()}})(text)
    table.rename = recorder.rename
    world = parallel.world(device) if parallel is not None else contextlib.nullcontext()
    with world as mesh, fake_mode, REGISTRY.scoped(options.kernels, device), tc.quiet_torch_logs(), \
            table.data_dims.active(), contextlib.ExitStack() as wrapped:
        inputs = [torch.empty([symint(d) for d in spec.dims], dtype=spec.dtype, device=device,
                              requires_grad=spec.requires_grad and grad) for spec in specs]
        for spec, t in zip(specs, inputs):
            if spec.fill is not None:  # the user stated the values: the real run's path follows them
                recorder.values.set(t, spec.fill)
        _refuse_sparse(model)
        if training is not None:
            _refuse_sparse_grads(model)
        source = model if isinstance(model, torch.fx.GraphModule) else private_copy(model)  # its state is ours
        # the lru caches of the model's code are fxmem's own while it runs: fake tensors never reach
        # the user's (see fxmem.caches)
        caches = wrapped.enter_context(private_caches([source])) if mode == "eager" else []
        # parameters keep the user's requires_grad also for grad=False: a forward under no_grad sees
        # them so, and kernels decide by it (matmul folds a batched input into one mm when the
        # weight requires grad: nn.GRU's input projection, 2.8 MB of bmm at B=97, T=101 otherwise)
        fake_model = _fake_copy(source, device)
        warm, held, schedule, sent, microbatches, shard_layout = None, [], None, [], 0, []
        if parallel is not None:
            fake_model, held = parallel.apply(fake_model, mesh)
            shard_layout = ([s for stage in tc.schedule_stages(fake_model) for s in tc.dtensor_shards(stage.submod)]
                            if pipeline.is_pipeline(fake_model) else tc.dtensor_shards(fake_model))
            if pipeline.is_pipeline(fake_model):  # the stage's module is what this rank trains
                pipeline.check(training)
                schedule, fake_model = fake_model, pipeline.stage_model(fake_model)
                microbatches = tc.schedule_microbatches(schedule)
            tensor_parallel = parallel.tensor_parallel(fake_model)
            wrapped.enter_context(parallel.reads(fake_model, held))  # DDP's used-parameter map
            # lazy set-up (FSDP2's, DDP's bucket rebuild) and optimizer state; a step= of the user's
            # makes its own warm-up call (_warm_user_step), with the optimizers it is handed
            if training is not None and training.step is None:
                warm = _warm_up(fake_model, inputs, training, recorder)
            elif training is not None:  # the step's warm-up call comes after the parameters are read
                with recorder, recorder.quiet():
                    tc.fsdp2_lazy_init(fake_model)
            elif tc.fsdp2_managed(fake_model):
                _warm_forward(fake_model, inputs, grad, recorder)
                held += kept_alive(fake_mode, "kept between forwards (FSDP2: the root's unsharded parameters)")
        for spec, t in zip(specs, inputs):
            table.add(t, Role.INPUT, spec.arg)
        named_params = list(fake_model.named_parameters(remove_duplicate=True))
        for qual, p in named_params:
            table.add(tc.local_tensor(p), Role.PARAMETER, qual)
        for qual, b in fake_model.named_buffers(remove_duplicate=True):
            table.add(b, Role.BUFFER, qual)
        for qual, t in tc.tensor_attributes(fake_model):
            table.add(t, Role.CONSTANT, qual)
        for name, t in held:  # what the wrapper keeps (DDP's buckets): resident from the start
            if table.lookup(t) is None:
                table.add(t, Role.CONSTANT, name)
        del held
        real_paths = RealPaths(device, recorder.quiet, log.note)
        module_stack = None
        if mode == "graph":
            runner = GraphRunner(fake_model, recorder, specs, name_backward=training is not None)
            run_forward = lambda xs: runner.run(*xs)  # noqa: E731
        else:
            line_runner = LineRunner(recorder, model_files(model), name_backward=training is not None)
            module_stack = ModuleStack(fake_model, env)  # which module allocates (report.modules())
            table.module_now = line_runner.module_now = module_stack.now

            def run_forward(xs: list) -> Any:
                with module_stack:
                    return line_runner.run(fake_model, xs)
        if options.autocast is not None:
            run_forward = _under_autocast(run_forward, device, options.autocast)
        hooks = _Run(recorder, run_forward, named_params)
        grad_ctx = torch.enable_grad() if grad else torch.no_grad()  # not the caller's ambient mode
        saved = contextlib.ExitStack()
        if grad:
            saved.enter_context(tc.saved_tensor_hooks(recorder.saved))
            saved.enter_context(tc.backward_calls(recorder.autograd.keeping))
        optimizers = tc.optimizers_treat_fake_as_real() if training else contextlib.nullcontext()
        sharded = contextlib.ExitStack()
        if parallel is not None:  # FSDP2 resizes storages in place; DTensor probes shapes on fakes
            sharded.enter_context(tc.dtensor_propagation_quiet(recorder.quiet))
            sharded.enter_context(tc.on_storage_resize(recorder.resized))
        fits = wrapped.enter_context(calibrate.recording_fits())  # fitted kernel programs, checked when asked
        with grad_ctx, saved, optimizers, real_paths, tracing_checks(recorder.values), outside_dispatch(recorder), \
                sharded, recorder:
            # first-call caches (see fxmem.caches, .first_calls); a user's step warms them up itself
            eager = mode == "eager" and (training is None or training.step is None)
            stored = first_calls.attribute_tensors(fake_model) if eager else {}
            warm_filled = None
            if eager and (caches or steady):
                with recorder.quiet():  # the first call's inputs are not the recorded call's
                    again = [torch.empty([symint(d) for d in spec.dims], dtype=spec.dtype, device=device,
                                         requires_grad=spec.requires_grad and grad) for spec in specs]
                for spec, t in zip(specs, again):
                    if spec.fill is not None:
                        recorder.values.set(t, spec.fill)
                stored, warm_filled = _warm_caches(fake_model, again, caches, recorder, log, warmed=warm is not None)
                del again
            if training is None:
                out = hooks.forward(fake_model, tuple(inputs))
                recorder.autograd.close()  # the forward has returned: what its graph frees later is not part of it
                del out
            elif training.step is not None:
                step, starting = training.step, contextlib.nullcontext()
                if schedule is not None:  # the step is handed the schedule; its stage's messages answered
                    step = pipeline.handed(schedule, training.step)
                    starting = _pipeline_started(parallel, source, training, specs, symint, recorder, device)
                with objects_kept(training.step), starting, step_guards(training.step, fake_model):
                    # a schedule's receive buffers, made by the warm-up step's start-up: named before what
                    # else the step left behind is
                    buffers = (lambda: pipeline.name_buffers(recorder.table, schedule)) if schedule is not None \
                        else None
                    optimizer = _warm_user_step(dataclasses.replace(training, step=step), fake_model, named_params,
                                                specs, recorder, fake_mode, symint, device, log, buffers)
                    sending = contextlib.nullcontext()
                    if schedule is not None:  # what the recorded step sends: gloo may hold each until sent
                        sending = tc.pipeline_sends(lambda t: sent.append(table.lookup(t)))
                    with sending:
                        user_step(fake_model, tuple(inputs), optimizer, step, hooks)
            else:
                if warm is not None:  # a real step made its state already: all of it is kept
                    optimizer = hooks.optimizer = warm
                    hooks.eager_state = {id(p) for p in warm.state}
                else:
                    optimizer = _steady_state_optimizer(training, named_params, recorder, hooks)
                train_step(fake_model, tuple(inputs), optimizer, training.loss_fn, hooks)
            now = first_calls.attribute_tensors(fake_model) if eager else {}
            # a first call that stored tensors (analysed again, steady); or what a steady run's second
            # call replaced or stored anew (then not a cache: each call stores its own)
            per_call = [*first_calls.replaced(warm_filled, now), *first_calls.filled(stored, now)] \
                if warm_filled is not None else []
            first_stored = first_calls.filled(stored, now) if warm_filled is None else {}
        del inputs, fake_model, warm
    recorder.autograd.close()
    if parallel is not None:
        sent_bytes = [table.storages[i].bytes for i in sorted(set(sent) - {None})] if schedule is not None else None
        for text in parallel.notes(table.storages, device, tensor_parallel, sent_bytes):
            log.note(text)
    facts = {**environment(device), **({"autocast": str(options.autocast)} if options.autocast else {}),
             # a pipeline splits its inputs' first dim into micro-batches: its sizes are multiples of their number
             **({"microbatches": microbatches} if microbatches else {}),
             "kernel_rules": sorted({r.name for r in recorder.used | real_paths.used}),
             "user_rules": sorted({r.name for r in recorder.used if r.user})}
    _note_versions(recorder.used | real_paths.used, log)
    data = {d.name: d for d in table.data_dims.dims.values()}
    for d in data.values():
        log.note(d.describe(recorder.rename))
    if steady and per_call:
        return None
    if first_stored and not steady:
        try:
            again = simulate_once(given, specs, options, symbols, training=training, concrete_args=concrete_args,
                                  parallel=parallel, steady=True)
        except FxMemError as exc:  # the first call's analysis stands, and says why it is a first call's
            log.note(f"the forward stores {first_calls.names(first_stored)} on its modules, and a second call could "
                     f"not be simulated ({type(exc).__name__}: {first_line(str(exc))}): analysed is a first call")
            again, first_stored = None, {}
        if again is not None:
            return again
        per_call = list(first_stored)
    if per_call:
        log.note(f"the forward stores {first_calls.names(dict.fromkeys(per_call))} anew on every call: analysed is a "
                 f"first call (a later one starts with the previous value held and frees it when it stores the new)")
    return Recording(list(table.storages), list(log.steps), list(log.nodes), list(log.events), list(log.notes), env,
                     {**env_symbols, **{name: d.symbol for name, d in data.items()}}, device,
                     hooks.forward_end, training is not None, model if isinstance(model, torch.fx.GraphModule) else None,
                     facts, data, module_calls=dict(module_stack.calls) if module_stack is not None else None,
                     fits=list(fits), sharded=shard_layout)


def _refuse_sparse_grads(model: torch.nn.Module) -> None:
    """A training step with sparse gradients is not modelled (see ``SPARSE_GRADS``)."""
    for qual, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            raise UnsupportedOpError(f"'{qual or type(m).__name__}' is {type(m).__name__}(sparse=True): {SPARSE_GRADS}")


def _refuse_sparse(model: torch.nn.Module) -> None:
    """Sparse parameters and buffers have several storages (indices, values); not modelled."""
    for qual, t in [*model.named_parameters(), *model.named_buffers(), *tc.tensor_attributes(model)]:
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise ModelError(f"'{qual}' is a {t.layout} tensor; fxmem models strided (dense) tensors only, and "
                             f"counting it as dense would be wrong. Analyse a copy of the model with it dense "
                             f"(.to_dense()) if that is what you want to know")


def _under_autocast(run_forward: Any, device: str, dtype: torch.dtype) -> Any:
    """The forward as a mixed-precision step runs it: inside ``torch.autocast``, whose exit frees
    its cache of casted weights (as leaving a real ``with torch.autocast(...)`` block does)."""
    def run(xs: list) -> Any:
        with torch.autocast(device_type=device, dtype=dtype):
            return run_forward(xs)
    return run


def _steady_state_optimizer(training: Training, named_params: list, recorder: Recorder,
                            hooks: _Run) -> torch.optim.Optimizer:
    """Build the optimizer and let it create its state (as after a first step), quietly, for every
    parameter; ``hooks`` keeps (and puts in the table) only the state a real run has, once backward
    has said which parameters get a gradient."""
    params = [p for _, p in named_params if p.requires_grad]
    if not params:
        raise NothingToTrainError("no parameter requires grad, so there is nothing to train")
    with recorder.quiet(), failures("creating the optimizer's state", recorder.rename):
        optimizer = training.make_optimizer(params)  # some (Adagrad) create state here already
        hooks.eager_state = {id(p) for p, state in optimizer.state.items() if state}
        with optimizer_errors(optimizer):
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    hooks.optimizer = optimizer
    return optimizer


def _fake_copy(source: torch.nn.Module, device: str) -> torch.nn.Module:
    """A copy of ``source`` with fake parameters and buffers on ``device`` (the same shapes, strides,
    dtypes; ``requires_grad`` as the user's where trainable), in the active fake mode."""
    return tc.fake_module_copy(source, lambda t, trainable: torch.empty_strided(
        tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device, requires_grad=trainable and t.requires_grad))


@contextlib.contextmanager
def _pipeline_started(parallel: Any, source: torch.nn.Module, training: Training, specs: Sequence[InputSpec],
                      symint: Any, recorder: Recorder, device: str) -> Iterator[None]:
    """While the block runs, this rank's pipeline stage gets the start-up messages the other ranks
    send it: each rank's stage built on a fake copy of ``source`` and its step run, quietly, in
    turn (see :func:`fxmem.distributed.pipeline.start_up`)."""
    def run_rank(rank: int, mailbox: Any) -> None:
        with contextlib.ExitStack() as world:
            with tc.real_mode():  # a DeviceMesh reads its ranks tensor: made outside the fake mode, as rank's own
                mesh = world.enter_context(tc.fake_process_group(parallel.world_size, rank, device, parallel.mesh))
            copy = _fake_copy(source, device)
            schedule, _ = parallel.apply(copy, mesh)
            params = [p for p in pipeline.stage_model(schedule).parameters() if p.requires_grad]
            handed, _ = training.make_for_step(params)
            inputs = [torch.empty([symint(d) for d in spec.dims], dtype=spec.dtype, device=device,
                                  requires_grad=spec.requires_grad) for spec in specs]
            training.step(schedule, handed, *inputs)

    mailbox = pipeline.Mailbox(parallel.world_size)
    with tc.pipeline_messages(mailbox):
        with recorder.quiet(), failures("your parallelize= and step= on the other ranks (the pipeline's start-up)",
                                        recorder.rename):
            pipeline.start_up(mailbox, run_rank)
        mailbox.rank = parallel.rank
        yield


def _warm_user_step(training: Training, fake_model: torch.nn.Module, named_params: list, specs: Sequence[InputSpec],
                    recorder: Recorder, fake_mode: Any, symint: Any, device: str, log: EventLog,
                    known: Any = None) -> Any:
    """Build the optimizer(s) and call the user's step once, quietly, on inputs of its own: the
    recorded call that follows is the loop's steady state (see :func:`fxmem.training.user_step`).
    Returns what the step is handed (what ``optimizer=`` returned: one optimizer, or several).
    ``known()``: names what the step left behind that is known already (a pipeline stage's
    buffers), before the rest is found."""
    params = [p for _, p in named_params if p.requires_grad]
    if not params:
        raise NothingToTrainError("no parameter requires grad, so there is nothing to train")
    with recorder.quiet(), failures("your step= function (its first, warm-up call)", recorder.rename):
        handed, optimizers = training.make_for_step(params)  # several: a GAN's, or with LR schedulers
        warm = [torch.empty([symint(d) for d in spec.dims], dtype=spec.dtype, device=device,
                            requires_grad=spec.requires_grad) for spec in specs]
        for i, spec in enumerate(specs):
            if spec.fill is not None:
                recorder.values.set(warm[i], spec.fill)
        with optimizer_errors(optimizers[0]), values_read(training.step):
            result = training.step(fake_model, handed, *warm)
        del warm  # the next call's inputs are fresh
    if result is not None and not isinstance(result, (torch.Tensor, float, int)) and hasattr(result, "__next__"):
        raise SpecError("step= is a generator function: it must run the step when called (no yield)")
    del result
    if known is not None:
        known()
    kept = register_leftovers(recorder.table, named_params, optimizers, fake_mode)
    if kept:
        log.note(f"your step keeps between calls: {', '.join(kept[:6])}{' ...' if len(kept) > 6 else ''} "
                 f"(resident in the steady state, counted in train_resident)")
    return handed


def _warm_caches(model: torch.nn.Module, inputs: list, caches: list, recorder: Recorder, log: EventLog,
                 warmed: bool) -> tuple[dict, dict]:
    """The steady state of a model that caches tensors - in ``functools.lru_cache`` functions (see
    :mod:`fxmem.caches`) or on its modules (see :mod:`.first_calls`): one forward on ``inputs`` (of
    its own: the recorded call's are fresh, as a loop's are), quietly (``warmed``: a warm-up step
    ran already), so the recorded call finds the caches filled as every real call after the first
    does. What they hold is resident (bytes held between calls, counted in ``resident``), and a
    note says so. Returns the modules' attribute tensors after it, and those it filled."""
    before = first_calls.attribute_tensors(model)
    if not warmed:
        with recorder.quiet():
            try:
                out = model(*inputs)
            except FxMemError:
                raise
            except Exception as exc:  # named after the model's line that raised, as the recorded call's errors
                where = raised_at(exc, model_files(model)) or "a first (warm-up) forward, inside torch"
                raise failure(exc, where, advice="check the input specs against what this line expects",
                              rename=recorder.rename) from exc
            del out
    after = first_calls.attribute_tensors(model)
    filled = first_calls.filled(before, after)
    table, kept = recorder.table, {}
    held = [(f"cached by {where}", where, t) for where, t in cached_tensors(caches)]
    held += [(name, first_calls.names([key]), t) for key in filled for name, t in first_calls.tensors_of(model, [key])]
    for name, where, t in held:
        if table.counts(t) and table.lookup(t) is None:
            table.add(t, Role.CONSTANT, name)
            kept[where] = kept.get(where, 0) + 1
    if kept:
        what = "; ".join(f"{where} ({n} tensor{'s' if n > 1 else ''})" for where, n in kept.items())
        log.note(f"the model caches tensors between calls ({what}): analysed is a call after the first, as a "
                 f"loop repeats it; the first call also builds them, and what the caches hold is counted as resident")
    return after, filled


def _warm_forward(model: torch.nn.Module, inputs: list, grad: bool, recorder: Recorder) -> None:
    """One forward, quietly, so the recorded forward is a steady-state one: FSDP2 initialises itself
    lazily in the first (it picks its root and re-creates the shards it pads) and from then on keeps
    the root's unsharded parameters between forwards (resident)."""
    with recorder, recorder.quiet(), failures("a first (warm-up) forward", recorder.rename), \
            (torch.enable_grad() if grad else torch.no_grad()):
        out = model(*inputs)
    del out


def _warm_up(model: torch.nn.Module, inputs: list, training: Training, recorder: Recorder) -> torch.optim.Optimizer:
    """One whole training step, quietly, so the recorded step is a steady-state one: FSDP2 and DDP
    set themselves up lazily in the first step (DDP rebuilds its gradient buckets in the order the
    gradients arrived), and the optimizer creates its state."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise NothingToTrainError("no parameter requires grad, so there is nothing to train")
    # in the recorder (quiet: nothing recorded) so that its symbolic kernels run here too: a fake
    # kernel that reads sizes as numbers would fix the user's dims (transformers' loss pads the
    # labels: F.pad's fake kernel took B and L as ints, and a whole FSDP2 analysis held only there)
    with recorder, recorder.quiet(), failures("a first (warm-up) training step", recorder.rename):
        optimizer = training.make_optimizer(params)
        with tc.optimizers_treat_fake_as_real():
            train_step(model, tuple(inputs), optimizer, training.loss_fn)
    return optimizer


def _note_versions(used: set, log: EventLog) -> None:
    """Say so when a kernel rule the numbers depend on was not checked on this torch release."""
    here = tc.torch_release()
    unchecked = sorted({r.name for r in used if not r.user and here not in r.verified})
    if unchecked:
        log.note(f"kernel rules for {', '.join(unchecked)} were checked against real runs on torch "
                 f"{', '.join(sorted({v for r in used for v in r.verified}))}, not on this torch ({here}): "
                 f"check these numbers with fxmem.validate")
    users = sorted({r.name for r in used if r.user})
    if users:
        log.note(f"the allocations of {', '.join(users)} are as the kernels= rules describe them (not checked by fxmem)")


@contextlib.contextmanager
def optimizer_errors(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """An optimizer that cannot run on fake tensors is named as such (not as a shape problem)."""
    try:
        yield
    except FxMemError:
        raise
    except Exception as exc:
        error = optimizer_failure(optimizer, exc)
        if error is None:
            raise
        raise error from None


@contextlib.contextmanager
def failures(what: str | None, rename: Any = lambda text: text) -> Iterator[None]:
    """Errors raised by a phase of the training step, named after the phase (None: passed on)."""
    if what is None:
        yield
        return
    try:
        yield
    except FxMemError:
        raise
    except Exception as exc:
        raise failure(exc, f"{what} on fake tensors", rename=rename, advice="check that the loss and optimizer "
                      "work on this model's outputs and parameters") from exc
