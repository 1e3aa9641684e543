"""The user's own training step (``step=fn``), run on fake tensors with each part attributed.

``fn(model, optimizer, *inputs)`` is plain Python: fxmem does not parse it, it runs it. What it
calls is routed, for the call's duration, so the recording knows where it is:

* ``model(...)`` - the recorded forward (graph or eager mode, as analysed), phase ``forward``;
* ``tensor.backward(...)`` - phase ``backward`` (with the engine watched, as the default step does);
* any optimizer's ``step()`` (also from ``GradScaler.step``, or through an LR scheduler's wrapper;
  those ``optimizer=`` returned and those the step builds itself) - phase ``optimizer.step``;
* ``optimizer.zero_grad()`` / ``model.zero_grad()`` - phase ``zero_grad``;
* everything else the step does (losses, clipping, scaling, slicing micro-batches, schedulers'
  ``step()``) - phase ``loss``, "the step's own code".

The routing is undone when the step returns (under fxmem's lock, so no other analysis sees it).
``optimizer=`` may return several optimizers and LR schedulers (a tuple, list or dict): the step
receives them as returned. What would make the simulated step differ from the real one is
refused (:func:`step_guards`): ``torch.compile``, and in graph mode a call of a submodule the
forward does not run (``mode="auto"`` then analyses in eager mode).

>>> def step(model, opt, x):                       # doctest: +SKIP
...     for xb in x.chunk(2):
...         model(xb).sum().backward()
...     opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import sys
import threading
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import _torch_compat as tc
from ..errors import ModelError, SpecError, TraceError, UnsupportedOpError
from ..records import Phase, Role
from .patching import patched


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
    def routing(self, module: torch.nn.Module, optimizer: Any = None) -> Iterator[torch.nn.Module]:
        """Route, while the step runs, the calls of ``module`` (the model handed to the step) and of
        every optimizer's ``step()`` / ``zero_grad()``. ``optimizer``: what the step is handed (not
        needed: the routing covers each optimizer, those the step builds itself included)."""
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
        torch.Tensor.backward = backward
        self._open_code()
        try:
            with self._optimizers_routed():
                yield module
        finally:
            self._close_code()
            torch.Tensor.backward = original_backward
            module.__class__ = cls

    @contextlib.contextmanager
    def _optimizers_routed(self) -> Iterator[None]:
        """Every optimizer's ``step()`` (also from ``GradScaler.step``) as phase ``optimizer.step`` and
        ``zero_grad()`` as phase ``zero_grad``, by torch's global optimizer-step hooks and on the
        ``Optimizer`` class: never an attribute of the optimizer itself, which an LR scheduler wraps
        (``StepLR(opt)`` reads ``opt.step.__func__``) and which must stay the scheduler's."""
        router, owner, opened = self, threading.get_ident(), []

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            if threading.get_ident() != owner:  # another thread's optimizer: not this step's
                return
            stack = contextlib.ExitStack()
            if stack.enter_context(router.call()):
                stack.enter_context(router.hooks.phase(Phase.STEP))
            opened.append(stack)

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            if threading.get_ident() == owner and opened:
                opened.pop().close()

        base = torch.optim.Optimizer
        original_zero = base.__dict__["zero_grad"]

        def zero_grad(opt: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return original_zero(opt, *args, **kwargs)
            with router.call() as routed, (router.hooks.phase(Phase.ZERO_GRAD) if routed
                                           else contextlib.nullcontext()):
                return original_zero(opt, *args, **kwargs)

        handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        base.zero_grad = zero_grad
        try:
            yield
        finally:
            base.zero_grad = original_zero
            for handle in handles:
                handle.remove()
            while opened:  # a step() that raised: its phase ends with the error (which names it)
                opened.pop().__exit__(*sys.exc_info())


@contextlib.contextmanager
def step_guards(step: Callable, module: torch.nn.Module) -> Iterator[None]:
    """Around both calls of the user's step (warm-up and recorded): refuse what would make the
    simulated step not the step the user runs - ``torch.compile`` (Inductor's fused kernels free
    and save other tensors than the eager ops fxmem runs) - and, in graph mode, calls of the
    parts of the model the traced graph has no code for (see :func:`_placeholders_refused`)."""
    fn = step
    while isinstance(fn, functools.partial):
        fn = fn.func
    if tc.is_compiled_function(fn):
        raise SpecError(f"step= is a torch.compile'd function ({_name(step)}): fxmem runs the step op by op "
                        f"on fake tensors, and a compiled step frees and saves other tensors (Inductor fuses "
                        f"kernels), so its numbers would not be the compiled step's; pass the function "
                        f"without torch.compile (the numbers are then of the eager step)")
    with _compile_refused(step), _pipelines_refused(step), _placeholders_refused(module):
        yield


@contextlib.contextmanager
def values_read(step: Callable) -> Iterator[None]:
    """Name a value read by the step's own code (``loss.item()`` to log it, ``float(loss)``, a
    ``ReduceLROnPlateau.step(loss)``) as such: fake tensors have no values. One raised inside an
    optimizer's ``step()`` is left to the optimizer's own error (see ``optimizer_failure``)."""
    try:
        yield
    except tc.DATA_DEPENDENT_ERRORS as exc:
        if _raised_in_optimizer_step(exc):
            raise
        raise UnsupportedOpError(
            f"step= ({_name(step)}) reads the value of a tensor (loss.item(), float(loss), print(loss), a "
            f"ReduceLROnPlateau's step(loss), an early-stopping test): fxmem runs the step on fake tensors, which "
            f"have sizes but no values. What to do: pass fxmem a step without the value reads (logging and "
            f"schedulers that read the loss allocate no tensor memory), unless the step's tensors depend on them") \
            from None


def _raised_in_optimizer_step(exc: BaseException) -> bool:
    """Whether ``exc`` came from inside an ``Optimizer.step`` (torch/optim/optimizer.py's wrapper is
    on its traceback), rather than from the step's own code or an LR scheduler."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/optim/optimizer.py"):
            return True
        tb = tb.tb_next
    return False


def _name(step: Any) -> str:
    return getattr(step, "__qualname__", type(step).__name__)


@contextlib.contextmanager
def _compile_refused(step: Callable) -> Iterator[None]:
    """``torch.compile`` / ``Module.compile`` called by the step raise a :class:`SpecError` (the
    compiled model's memory is not the eager one fxmem simulates; see :func:`step_guards`)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise SpecError(f"step= ({_name(step)}) calls torch.compile (or model.compile()): fxmem simulates "
                        f"the step op by op on fake tensors and cannot predict what Inductor's fused kernels "
                        f"allocate, so it refuses rather than give the eager numbers; analyse a step without "
                        f"torch.compile (the numbers are then of the eager step), or measure the compiled "
                        f"step with fxmem.measure")
    with patched([(torch, "compile", refuse), (torch.nn.Module, "compile", refuse)]):
        yield


@contextlib.contextmanager
def _pipelines_refused(step: Callable) -> Iterator[None]:
    """A pipeline stage built by the step (``torch.distributed.pipelining``) raises a
    :class:`ModelError`: a stage is built once, by ``parallelize=`` (see the message)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ModelError(
            f"step= ({_name(step)}) builds a pipeline stage (torch.distributed.pipelining) on every call, which fxmem "
            f"does not model: a script builds its stage once. What to do: build the stage and its schedule in "
            f"parallelize=fn(model, mesh) and return the schedule; your step= then gets it, step(schedule, optimizer, "
            f"*inputs) (see fxmem.distributed.pipeline; ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B "
            f"are modelled)")
    with patched([(cls, "__init__", refuse) for cls in tc.pipeline_stage_types()]):
        yield


@contextlib.contextmanager
def _placeholders_refused(module: torch.nn.Module) -> Iterator[None]:
    """In graph mode, the submodules of the traced model that hold tensors but no code (fx keeps
    only the code the forward runs; the rest of the model's tensors sit on plain ``nn.Module``
    placeholders): calling one from the step - a GAN's discriminator - raises a :class:`TraceError`,
    which ``mode="auto"`` answers by analysing in eager mode (the model's own modules)."""
    found = []
    if isinstance(module, torch.fx.GraphModule):
        for qual, m in module.named_modules():
            if qual and type(m) is torch.nn.Module and "forward" not in vars(m):
                object.__setattr__(m, "forward", _no_code(qual))
                found.append(m)
    try:
        yield
    finally:
        for m in found:
            del m.forward


def _no_code(qual: str) -> Callable:
    def forward(*args: Any, **kwargs: Any) -> Any:
        raise TraceError(f"your step= calls model.{qual}, a submodule the model's forward does not run, so the "
                         f"fx graph of the forward has no code for it\n"
                         f"  what to do: analyse with mode='eager' (mode='auto', the default, does so itself)")
    return forward


def register_leftovers(table: Any, named_params: list, optimizers: list[torch.optim.Optimizer],
                       fake_mode: Any) -> list[str]:
    """After the quiet first call of the user's step: what it left behind is resident in the
    steady state - kept gradients (``zero_grad(set_to_none=False)``, accumulation) as gradients,
    the optimizer's state, and any other tensor still alive (a GradScaler's scale) as step state.
    Returns what was found, for the notes."""
    found = []
    # a DTensor (FSDP2, tensor parallelism) is counted by its local shard, as parameters are: the
    # scan below then finds that shard known, not a second tensor
    for qual, p in named_params:
        grad = tc.local_tensor(p.grad) if p.grad is not None else None
        if grad is not None and table.counts(grad) and table.lookup(grad) is None:
            table.add(grad, Role.GRADIENT, f"{qual}.grad")
            found.append(f"{qual}.grad")
    name_of = {id(p): qual for qual, p in named_params}
    for p, state in [item for optimizer in optimizers for item in optimizer.state.items()]:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and table.lookup(tc.local_tensor(value)) is None:
                table.add(tc.local_tensor(value), Role.OPTIMIZER_STATE, f"{name_of.get(id(p), '?')}.{key}")
    for _, obj in kept_alive(fake_mode, "step state"):
        if table.counts(obj) and table.lookup(obj) is None:
            shape = table.rename(str(tuple(obj.shape)))  # in the user's dims, not torch's s41
            table.add(obj, Role.OPTIMIZER_STATE, f"step state {shape}")
            found.append(f"a {obj.dtype} tensor {shape} the step keeps")
    return found


def kept_alive(fake_mode: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """``(name + shape, tensor)`` of every tensor of ``fake_mode`` alive now (after a collection)
    with bytes in its storage: after a quiet warm-up call, what the loop keeps between calls.
    (A storage of no bytes - FSDP2's unsharded parameters between all-gathers, resized to 0 -
    holds nothing.)"""
    gc.collect()
    # type(), not isinstance: no lazy attribute of any object runs; only a number is compared with 0
    # (a symbolic size compared would be a guard, or a data-dependent error)
    return [(f"{name} {tuple(obj.shape)}", obj) for obj in gc.get_objects()
            if issubclass(type(obj), tc.FakeTensor) and obj.fake_mode is fake_mode
            and not (isinstance(n := tc.storage_nbytes(obj), int) and n == 0)]


@contextlib.contextmanager
def objects_kept(step: Callable) -> Iterator[None]:
    """Put back, after the simulation, the attributes of the objects ``step`` reaches directly (its
    closure, defaults, ``functools.partial`` arguments, the globals it names), and the contents of
    the lists, dicts, sets and deques among them and their attributes - in place, so that every
    reference the user holds sees them as they were: a ``GradScaler`` the step uses must not keep
    the fake scale the simulation gave it, nor a list the step logs its outputs into a fake tensor
    (the user's real loop uses them next)."""
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
    saved, contents = [], {}
    for obj in roots:
        if isinstance(obj, _CONTAINERS):  # a global, closure cell or argument: alive whatever the step does
            contents.setdefault(id(obj), (obj, _copy(obj)))
            continue
        if obj is None or isinstance(obj, (type, torch.Tensor, torch.nn.Module)) or inspect.ismodule(obj) \
                or inspect.isroutine(obj) or not hasattr(obj, "__dict__"):
            continue
        try:
            # a container attribute by its id and a copy, never itself: one the step drops (GradScaler's
            # update() makes a new dict of per-optimizer states) must die with what the step put in it
            state = {k: _Kept(id(v), copy.copy(v)) if isinstance(v, _CONTAINERS) else v for k, v in vars(obj).items()}
        except TypeError:  # a __dict__ that is not a plain mapping
            continue
        saved.append((obj, state))
    try:
        yield
    finally:
        for obj, state in saved:
            now = dict(vars(obj))
            vars(obj).clear()
            for k, v in state.items():
                if isinstance(v, _Kept):
                    current = now.get(k)
                    if id(current) == v.ident and type(current) is type(v.copy):  # the same one: back in place
                        _put_back(current, _copy(v.copy))
                        v = current
                    else:  # the step put another there: the copy of the one it had
                        v = v.copy
                vars(obj)[k] = v
        for container, items in contents.values():
            _put_back(container, items)


@dataclasses.dataclass(frozen=True)
class _Kept:
    ident: int  # id() of the container the attribute held
    copy: Any  # a shallow copy of it, made before the step ran


_CONTAINERS = (list, dict, set, collections.deque)


def _copy(container: Any) -> list:
    return list(container.items()) if isinstance(container, dict) else list(container)


def _put_back(container: Any, items: list) -> None:
    """``container``'s contents made ``items`` again, in place (the same object, its type's own methods)."""
    if isinstance(container, dict):
        dict.clear(container)
        dict.update(container, items)
    elif isinstance(container, list):
        list.__setitem__(container, slice(None), items)
    elif isinstance(container, set):
        set.clear(container)
        set.update(container, items)
    else:
        container.clear()
        container.extend(items)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later)
        return False
    return True
