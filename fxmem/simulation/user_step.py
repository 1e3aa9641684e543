"""The user's own training step (``step=fn``), run on fake tensors with each part attributed.

``fn(model, optimizer, *inputs)`` is plain Python: fxmem does not parse it, it runs it. What it
calls is routed, for the call's duration, so the recording knows where it is:

* ``model(...)`` - the recorded forward (graph or eager mode, as analysed), phase ``forward``;
* ``tensor.backward(...)`` - phase ``backward`` (with the engine watched, as the default step does);
* ``optimizer.step()`` (also from ``GradScaler.step``) - phase ``optimizer.step``;
* ``optimizer.zero_grad()`` / ``model.zero_grad()`` - phase ``zero_grad``;
* everything else the step does (losses, clipping, scaling, slicing micro-batches) - phase
  ``loss``, "the step's own code".

The routing is undone when the step returns (under fxmem's lock, so no other analysis sees it).

>>> def step(model, opt, x):                       # doctest: +SKIP
...     for xb in x.chunk(2):
...         model(xb).sum().backward()
...     opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator

import torch

from .. import _torch_compat as tc
from ..errors import SpecError
from ..records import Phase, Role


class Router:
    """Routes one step's calls to phases; ``hooks`` is the simulation's :class:`~fxmem.training.StepHooks`."""

    def __init__(self, hooks: Any) -> None:
        self.hooks = hooks
        self._code: contextlib.ExitStack | None = None  # the open "step's own code" phase
        self._inside = 0  # > 0 while a routed call runs (the model's own calls then go straight through)

    def _open_code(self) -> None:
        self._code = contextlib.ExitStack()
        self._code.enter_context(self.hooks.phase(Phase.LOSS))

    def _close_code(self) -> None:
        if self._code is not None:
            code, self._code = self._code, None
            code.close()

    @contextlib.contextmanager
    def call(self) -> Iterator[bool]:
        """Around a routed call: yields False when already inside one (run it as it is)."""
        if self._inside:
            yield False
            return
        self._close_code()
        self._inside += 1
        try:
            yield True
        finally:
            self._inside -= 1
            self._open_code()

    @contextlib.contextmanager
    def routing(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Module]:
        router, hooks = self, self.hooks
        cls = type(module)
        original_call, original_zero = cls.__call__, cls.zero_grad

        def model_call(model: Any, *args: Any, **kwargs: Any) -> Any:
            with router.call() as routed:
                if not routed:
                    return original_call(model, *args, **kwargs)
                if kwargs:
                    raise SpecError(f"step=: call the model with positional arguments, as its input specs are "
                                    f"given (got keyword(s) {', '.join(kwargs)})")
                return hooks.forward(model, args)

        def model_zero_grad(model: Any, *args: Any, **kwargs: Any) -> Any:
            with router.call() as routed, (hooks.phase(Phase.ZERO_GRAD) if routed else contextlib.nullcontext()):
                return original_zero(model, *args, **kwargs)

        def wrap(phase: Phase, fn: Callable) -> Callable:
            def routed_call(*args: Any, **kwargs: Any) -> Any:
                with router.call() as routed, (hooks.phase(phase) if routed else contextlib.nullcontext()):
                    return fn(*args, **kwargs)
            return routed_call

        original_backward = torch.Tensor.backward

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with router.call() as routed:
                if not routed:
                    return original_backward(tensor, *args, **kwargs)
                hooks.before_backward(tensor)
                with hooks.phase(Phase.BACKWARD):
                    return original_backward(tensor, *args, **kwargs)

        # the model's class for this call only: a subclass whose __call__ and zero_grad are routed
        routed_cls = type(cls.__name__, (cls,), {"__call__": model_call, "zero_grad": model_zero_grad,
                                                 "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        module.__class__ = routed_cls
        optimizer.step = wrap(Phase.STEP, optimizer.step)  # instance attributes: GradScaler.step calls these
        optimizer.zero_grad = wrap(Phase.ZERO_GRAD, optimizer.zero_grad)
        torch.Tensor.backward = backward
        self._open_code()
        try:
            yield module
        finally:
            self._close_code()
            torch.Tensor.backward = original_backward
            del optimizer.step, optimizer.zero_grad
            module.__class__ = cls


def register_leftovers(table: Any, named_params: list, optimizer: torch.optim.Optimizer,
                       fake_mode: Any) -> list[str]:
    """After the quiet first call of the user's step: what it left behind is resident in the
    steady state - kept gradients (``zero_grad(set_to_none=False)``, accumulation) as gradients,
    the optimizer's state, and any other tensor still alive (a GradScaler's scale) as step state.
    Returns what was found, for the notes."""
    found = []
    for qual, p in named_params:
        if p.grad is not None and table.counts(p.grad) and table.lookup(p.grad) is None:
            table.add(p.grad, Role.GRADIENT, f"{qual}.grad")
            found.append(f"{qual}.grad")
    name_of = {id(p): qual for qual, p in named_params}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and table.lookup(value) is None:
                table.add(value, Role.OPTIMIZER_STATE, f"{name_of.get(id(p), '?')}.{key}")
    gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), tc.FakeTensor) and obj.fake_mode is fake_mode and table.counts(obj) \
                and table.lookup(obj) is None:  # type(), not isinstance: no lazy attribute of any object runs
            table.add(obj, Role.OPTIMIZER_STATE, f"step state {tuple(obj.shape)}")
            found.append(f"a {obj.dtype} tensor {tuple(obj.shape)} the step keeps")
    return found


@contextlib.contextmanager
def objects_kept(step: Callable) -> Iterator[None]:
    """Put back, after the simulation, the attributes of the objects ``step`` reaches directly (its
    closure, defaults, ``functools.partial`` arguments, the globals it names): a ``GradScaler`` the
    step uses must not keep the fake scale the simulation gave it (the user's real loop uses it next)."""
    import copy
    import functools
    import inspect

    roots: list = []
    fn: Any = step
    while isinstance(fn, functools.partial):
        roots += list(fn.args) + list(fn.keywords.values())
        fn = fn.func
    fn = getattr(fn, "__func__", fn)  # a bound method: its function (its self is a root too)
    roots.append(getattr(step, "__self__", None))
    if inspect.isfunction(fn):
        roots += [c.cell_contents for c in fn.__closure__ or () if _filled(c)]
        roots += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
        roots += [fn.__globals__[n] for n in fn.__code__.co_names if n in fn.__globals__]
    saved = []
    for obj in roots:
        if obj is None or isinstance(obj, (type, torch.Tensor, torch.nn.Module)) or inspect.ismodule(obj) \
                or inspect.isroutine(obj) or not hasattr(obj, "__dict__"):
            continue
        try:
            state = {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v for k, v in vars(obj).items()}
        except TypeError:  # a __dict__ that is not a plain mapping
            continue
        saved.append((obj, state))
    try:
        yield
    finally:
        for obj, state in saved:
            vars(obj).clear()
            vars(obj).update(state)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later)
        return False
    return True
