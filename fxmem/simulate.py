"""Run a traced model on fake tensors with symbolic sizes and record every storage it allocates.

This is the measurement behind every formula. The model really runs - real autograd, real
composite decompositions, the GraphModule's own order of frees - only on fake tensors whose sizes
are sympy symbols. A dispatch mode sees each aten op (including the internal copies ``matmul``
makes), a weak reference per storage says exactly when it dies, and autograd's saved-tensor hook
says what is kept for backward. The result is a ledger: storages (with symbolic byte sizes) and
steps (one per allocating aten op), from which :mod:`fxmem.memory_plan` computes live bytes.

>>> rec = simulate(gm, specs, symbols, hints, device="cpu", grad=True)   # doctest: +SKIP
>>> rec.steps[0].op, rec.storages[rec.steps[0].allocs[0]].nbytes          # doctest: +SKIP
('aten.mm', 512*B*N)
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Sequence

import torch
import torch.fx

from . import _torch_compat as tc
from .errors import DeviceError, FxMemError, ShapeError
from .graph_runner import GraphRunner
from .hparams import Blueprint
from .ledger import Ledger, NodeRecord, Recorder, Recording
from .line_runner import LineRunner
from .real_paths import RealPaths
from .specs import InputSpec
from .tracing import model_files, trace
from .training import Training

class _Phases:
    """The training step after the forward, as pseudo-nodes so tables and replays can show it."""

    def __init__(self, ledger: Ledger, nodes: list):
        self.ledger = ledger
        self.nodes = nodes

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        self.ledger.node = name
        self.ledger.phase = name
        first = len(self.ledger.steps)
        yield
        self.ledger.end_node()
        self.nodes.append(NodeRecord(name, "phase", name, "", None, [], first, len(self.ledger.steps)))
        self.ledger.events.append(("node", len(self.nodes) - 1))


def _watch_engine(loss: torch.Tensor, ledger: Ledger) -> None:
    """Tell the ledger when the autograd engine is between nodes (where it accumulates grads).

    A post-hook on every node (but AccumulateGrad, whose refcount-based choice to steal the
    gradient a hook would change) sets the flag; a pre-hook on every node clears it.
    """
    seen: set = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        stack.extend(nxt for nxt, _ in fn.next_functions)
        if type(fn).__name__ == "AccumulateGrad":
            continue

        def enter(*_: Any) -> None:
            ledger.engine_gap = False

        def leave(*_: Any) -> None:
            ledger.engine_gap = True

        fn.register_prehook(enter)
        fn.register_hook(leave)


def _fake_tensor_like(t: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device,
                               requires_grad=requires_grad)


def _fake_module_copy(module: torch.nn.Module, device: str, grad: bool, memo: dict) -> torch.nn.Module:
    """A structural copy of ``module`` whose tensors are fake; the user's module is not touched."""
    if id(module) in memo:
        return memo[id(module)]
    new = object.__new__(type(module))
    memo[id(module)] = new
    new.__dict__.update(module.__dict__)

    def fake(t: torch.Tensor | None, trainable: bool) -> torch.Tensor | None:
        if t is None:
            return None
        key = ("t", id(t))
        if key not in memo:  # shared (tied) tensors stay shared
            memo[key] = _fake_tensor_like(t, device, trainable and t.requires_grad and grad)
        return memo[key]

    new.__dict__["_parameters"] = {k: fake(v, True) for k, v in module._parameters.items()}
    new.__dict__["_buffers"] = {k: fake(v, False) for k, v in module._buffers.items()}
    new.__dict__["_modules"] = {k: (_fake_module_copy(v, device, grad, memo) if v is not None else None)
                                for k, v in module._modules.items()}
    for k, v in list(new.__dict__.items()):
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            new.__dict__[k] = fake(v, False)
    return new


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise DeviceError(f"device={device!r} is not supported; use 'cpu' or 'cuda'")
    if device == "cuda":
        ok, why = tc.fake_cuda_is_safe()
        if not ok:
            raise DeviceError(
                f"device='cuda' cannot be simulated: {why}. Install a CUDA build of torch (it simulates "
                f"CUDA without a GPU), or analyse with device='cpu'."
            )


def simulate(
    model: torch.nn.Module | Blueprint,
    specs: Sequence[InputSpec],
    symbols: dict,
    hints: dict,
    device: str = "cpu",
    grad: bool = True,
    training: Training | None = None,
    mode: str = "graph",
    leaf_modules: Sequence[type] = (),
) -> Recording:
    """Run ``model`` once on fake inputs described by ``specs`` and record its memory behaviour.

    ``mode="graph"``: ``model`` is a traced GraphModule (or is traced here if it is a
    :class:`~fxmem.hparams.Blueprint`), run node by node. ``mode="eager"``: the module's own
    ``forward`` runs, memory attributed to source lines. ``model`` may be a Blueprint, built here
    with symbolic hyperparameters.

    With ``training``, the run is one steady-state training step (see :mod:`fxmem.training`):
    the optimizer's state is created first (quietly, from placeholder gradients), then forward,
    loss, backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` are recorded.
    """
    _check_device(device)
    if training is not None and not grad:
        raise FxMemError("a training step needs grad=True")
    fake_mode, env = tc.new_fake_mode()
    env_symbols = {name: tc.make_dim_symbol(env, name, hints[name]) for name in symbols}
    to_env = {symbols[name]: s for name, s in env_symbols.items()}  # s is a number if specialised
    hint_of = {symbols[name]: hints[name] for name in symbols}

    def symint(expr: Any) -> Any:
        return tc.make_symint(env, expr.xreplace(to_env), int(expr.xreplace(hint_of)))

    if isinstance(model, Blueprint):
        with fake_mode:
            model = model.build(symint)
        if mode == "graph":
            with warnings.catch_warnings():  # fx notes SymInt hyperparameters baked into the graph
                warnings.filterwarnings("ignore", message="Raw Sym")
                model = trace(model, leaf_modules)
    ledger = Ledger(env, device)
    with fake_mode:
        inputs = [torch.empty([symint(d) for d in spec.dims], dtype=spec.dtype, device=device,
                              requires_grad=spec.requires_grad and grad) for spec in specs]
        fake_model = _fake_module_copy(model, device, grad, {})
        for spec, t in zip(specs, inputs):
            ledger.add(t, "input", spec.arg)
        named_params = list(fake_model.named_parameters(remove_duplicate=True))
        for qual, p in named_params:
            ledger.add(p, "parameter", qual)
        for qual, b in fake_model.named_buffers(remove_duplicate=True):
            ledger.add(b, "buffer", qual)
        for mod_name, m in fake_model.named_modules():
            for k, v in m.__dict__.items():
                if isinstance(v, torch.Tensor):
                    ledger.add(v, "constant", f"{mod_name}.{k}" if mod_name else k)
        real_paths = RealPaths(device, ledger.quiet, ledger.note)
        if mode == "graph":
            runner = GraphRunner(fake_model, ledger, specs, name_backward=training is not None)
            runner.real_paths = real_paths
            records, run = runner.node_records, runner.run_graph
        else:
            line_runner = LineRunner(ledger, model_files(model))
            records, run = line_runner.records, functools.partial(line_runner.run, fake_model)
        grad_ctx = contextlib.nullcontext() if grad else torch.no_grad()
        hooks = tc.saved_tensor_hooks(ledger.mark_saved) if grad else contextlib.nullcontext()
        optimizer_ctx = tc.optimizers_treat_fake_as_real() if training else contextlib.nullcontext()
        with grad_ctx, hooks, optimizer_ctx, real_paths, Recorder(ledger):
            optimizer = _steady_state_optimizer(training, named_params, ledger) if training else None
            out = run(inputs)
            ledger.end_node()
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and ledger._counts(t):
                    idx = ledger.lookup(t)
                    if idx is not None:
                        ledger.storages[idx].is_output = True
            ledger.poll()
            forward_end = len(ledger.events)
            if training is not None:
                phases = _Phases(ledger, records)
                with phase_errors("the loss"), phases.phase("loss"):
                    loss = training.loss_fn(out)
                _watch_engine(loss, ledger)
                with phase_errors("backward()"), phases.phase("backward"):
                    loss.backward()
                    for _, p in named_params:
                        idx = ledger.lookup(p.grad) if p.grad is not None and ledger._counts(p.grad) else None
                        if idx is not None:
                            ledger.storages[idx].role = "gradient"
                with phase_errors("optimizer.step()"), phases.phase("optimizer.step"):
                    optimizer.step()
                with phases.phase("zero_grad"):
                    optimizer.zero_grad(set_to_none=True)
                with phases.phase("return"):  # the step's locals (output, loss) die here
                    del loss, out
                    for t in inputs:
                        t.grad = None
                out = None
        del out, inputs, fake_model
    return Recording(ledger.storages, ledger.steps, records, ledger.events, ledger.notes, env,
                     env_symbols, device, forward_end, training is not None,
                     model if isinstance(model, torch.fx.GraphModule) else None)


def _steady_state_optimizer(training: Training, named_params: list, ledger: Ledger) -> torch.optim.Optimizer:
    """Build the optimizer and let it create its state (as after a first step), quietly."""
    params = [p for _, p in named_params if p.requires_grad]
    if not params:
        raise FxMemError("no parameter requires grad, so there is nothing to train")
    with ledger.quiet(), phase_errors("creating the optimizer's state"):
        optimizer = training.make_optimizer(params)  # some (Adagrad) create state here already
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    name_of = {id(p): qual for qual, p in named_params}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                idx = ledger.add(value, "optimizer_state", f"{name_of.get(id(p), '?')}.{key}")
                if idx is not None:
                    ledger.storages[idx].role = "optimizer_state"
    return optimizer


@contextlib.contextmanager
def phase_errors(what: str) -> Any:
    """Errors raised by the training step's phases, named after the phase."""
    try:
        yield
    except FxMemError:
        raise
    except Exception as exc:
        raise ShapeError(f"{what} failed on fake tensors: {type(exc).__name__}: {exc}") from exc
