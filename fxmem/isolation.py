"""Every public entry point runs *isolated*: one analysis at a time, and torch's global state as it found it.

Two promises, kept in one place:

* **No global state changes.** An analysis runs the model (on fake tensors, and sometimes real
  kernels on small probes), builds optimizers, enters autocast; ``validate`` runs the model for
  real. Whatever of that touches process-wide state - the CPU and CUDA random generators, Python's
  and numpy's ``random``, the default dtype, the number of threads, the deterministic-algorithms
  flags, grad / inference mode, autocast - is saved on entry and put back on exit, so a seeded
  training run gives the same numbers with or without an analysis before it.
* **Threads.** The simulation patches torch while it runs (tracer hooks, dispatch modes, the
  optimizers' view of fake tensors, the kernel calibration cache), which other threads would see.
  So analyses are serialised by one process-wide lock (re-entrant: ``optimize`` analyses inside
  itself): several threads may call fxmem at once and each gets exactly its own answer; they just
  take turns.

* **The user's model as it was.** Every real run fxmem makes on the user's behalf (TorchDynamo's
  capture, the self-check, optimize's verification, ``validate``) runs on tensors of fxmem's own;
  on top of that, the modules an entry point is given are given back as they were found: their
  attributes (what a forward sets on ``self``), the tables of their parameters, buffers and
  submodules, ``requires_grad`` and ``.grad``, and the values of their parameters and buffers
  (snapshotted when they take at most :data:`SNAPSHOT_LIMIT` bytes; above it a changed one is an
  error, never silent). The user's **hooks** (module and global forward/backward hooks whose
  function is not torch's own: FSDP's and the like stay) are taken off for the call: they would be
  called with fx Proxies and fake tensors, and a hook that keeps what it sees would keep fxmem's
  tensors. The analysis is of the model without them; the report says which were left out.
* **The caches of the model's code.** ``functools.lru_cache`` functions reachable from the model's
  classes (transformers' BEiT keeps its relative position index in one) are process-wide: for the
  call they are replaced by private ones, so nothing fxmem computes (a fake tensor, a Proxy) is ever
  returned to the user's next call (see :mod:`fxmem.caches`).

The ambient grad mode is *not* inherited: ``analyze(grad=True)`` inside ``torch.no_grad()`` or
``torch.inference_mode()`` still models a training forward (autograd records), as ``grad=`` says,
and says so in the report's notes; ``grad=False`` gives inference memory.

>>> import torch
>>> @isolated
... def noisy():
...     torch.rand(3)
...     torch.set_default_dtype(torch.float64)
>>> before = torch.get_rng_state()
>>> noisy()
>>> torch.equal(before, torch.get_rng_state()), torch.get_default_dtype()
(True, torch.float32)
"""
from __future__ import annotations

import contextlib
import functools
import random
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

import torch

__all__ = ["isolated", "ambient_grad_note", "hooks_note", "LOCK", "SNAPSHOT_LIMIT"]

F = TypeVar("F", bound=Callable[..., Any])

LOCK = threading.RLock()  # one analysis at a time in this process (see the module docstring)
_DEPTH = threading.local()  # how deep this thread is in isolated calls (state is saved at the outermost)
SNAPSHOT_LIMIT = 2**30  # bytes: the user's parameters and buffers up to this are copied on entry, to put back


def _autocast_state(device: str) -> Any:
    try:
        return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    except (TypeError, RuntimeError, AttributeError):  # a device type this build does not know
        return None


def _set_autocast(device: str, state: Any) -> None:
    if state is None:
        return
    try:
        torch.set_autocast_enabled(device, state[0])
        torch.set_autocast_dtype(device, state[1])
    except (TypeError, RuntimeError, AttributeError):
        pass


class _GlobalState:
    """A snapshot of torch's (and Python's) process-wide state that fxmem could touch."""

    def __init__(self) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        self.py_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.np_rng = numpy.random.get_state() if numpy is not None and hasattr(numpy, "random") else None
        self.grad = torch.is_grad_enabled()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.autocast = {d: _autocast_state(d) for d in ("cpu", "cuda")}

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            sys.modules["numpy"].random.set_state(self.np_rng)
        torch.set_grad_enabled(self.grad)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self.deterministic != (torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled()):
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        for device, state in self.autocast.items():
            if _autocast_state(device) != state:
                _set_autocast(device, state)


class _UserModules:
    """What an entry point must give back as it found it of the modules it was given (see the
    module docstring): attributes, tensor tables, flags, gradients, tensor values; hooks off."""

    def __init__(self, roots: list) -> None:
        from . import _torch_compat as tc  # not at import: the CLI imports this module before torch's warnings are set

        seen: dict[int, tuple[str, torch.nn.Module]] = {}
        for root in roots:
            for path, m in root.named_modules(remove_duplicate=False):
                seen.setdefault(id(m), (path, m))
        self.modules = list(seen.values())
        self.attributes = [(m, dict(m.__dict__), {k: dict(m.__dict__[k]) for k in ("_parameters", "_buffers", "_modules")
                                                  if isinstance(m.__dict__.get(k), dict)}) for _, m in self.modules]
        tensors = {id(t): t for _, m in self.modules for t in (*m.__dict__.get("_parameters", {}).values(),
                                                               *m.__dict__.get("_buffers", {}).values())
                   if isinstance(t, torch.Tensor)}
        self.flags = [(t, t.requires_grad, t.grad) for t in tensors.values()]
        tensors.update({id(t.grad): t.grad for t in list(tensors.values()) if isinstance(t.grad, torch.Tensor)})
        # dense tensors with data (sparse ones have no single storage; fxmem never writes them)
        # a DTensor by its rank's shard: an op on DTensors (cloning, comparing) may be a collective
        # over the user's process group, which the other ranks would never join
        real = [tc.local_tensor(t) for t in tensors.values()
                if t.device.type != "meta" and not tc.is_fake(t) and t.layout == torch.strided]
        small = sum(t.untyped_storage().nbytes() for t in real) <= SNAPSHOT_LIMIT
        with torch.no_grad():
            self.values = [(t, _version(t), t.clone() if small else None) for t in real]
        self.hooks: list[tuple[dict, list]] = []
        self.left_out: list[str] = []
        self.taken: list[tuple[str, str, int, Any]] = []  # (module path, table, handle id, hook) of module hooks

    def leave_out_hooks(self) -> None:
        """Take the user's hooks off (their tables keep their identity: the user's handles still work)."""
        from . import _torch_compat as tc

        tables = [(kind, path, table) for path, m in self.modules for kind, table in tc.hook_tables(m)]
        tables += [(kind, None, table) for kind, table in tc.global_hook_tables()]
        for kind, path, table in tables:
            theirs = [(k, fn) for k, fn in table.items() if not _torch_owned(fn)]
            if not theirs:
                continue
            self.hooks.append((table, list(table.items())))
            for k, fn in theirs:
                del table[k]
                where = "every module" if path is None else (path or "the model")
                self.left_out.append(f"{_label(kind)} hook {_name(fn)} on {where}")
                if path is not None:
                    self.taken.append((path, kind, k, fn))
        # a parameter's own gradient hooks stay on it: fxmem's runs are on copies and fake tensors,
        # which do not carry them - what they would allocate is left out all the same, and said
        seen: set[int] = set()
        for path, m in self.modules:
            for name, t in m.__dict__.get("_parameters", {}).items():
                if not isinstance(t, torch.Tensor) or id(t) in seen:
                    continue
                seen.add(id(t))
                for kind, fn in tc.tensor_hooks(t):
                    if not _torch_owned(fn):
                        self.left_out.append(f"{kind} hook {_name(fn)} on {f'{path}.{name}' if path else name}")

    def restore(self) -> list[str]:
        """Put everything back; returns the tensors that changed and could not be put back."""
        for table, items in self.hooks:
            added = [(k, v) for k, v in table.items() if k not in dict(items)]  # registered meanwhile
            table.clear()
            table.update(items + added)
        for m, attributes, tables in self.attributes:
            for k in [k for k in m.__dict__ if k not in attributes]:
                del m.__dict__[k]
            for k, v in attributes.items():
                if m.__dict__.get(k, _MISSING) is not v:
                    m.__dict__[k] = v
            for k, items in tables.items():
                now = m.__dict__[k]
                if now.keys() != items.keys() or any(now[n] is not v for n, v in items.items()):
                    now.clear()
                    now.update(items)
        for t, requires_grad, grad in self.flags:
            if t.requires_grad != requires_grad and t.is_leaf:
                t.requires_grad_(requires_grad)
            if t.grad is not grad:
                t.grad = grad
        lost = []
        with torch.no_grad():
            for t, version, saved in self.values:
                if saved is not None:  # by value: kernels that write running statistics move no version
                    if not _equal(t, saved):
                        t.copy_(saved)
                elif version is None or _version(t) != version:
                    lost.append(tuple(t.shape))
        return [f"a tensor of shape {shape}" for shape in lost]


_MISSING = object()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except (RuntimeError, AttributeError):  # an inference tensor keeps no version counter
        return None


def _equal(t: torch.Tensor, saved: torch.Tensor) -> bool:
    if t.shape != saved.shape or t.dtype != saved.dtype:
        return False
    return torch.equal(t, saved) or (t.is_floating_point() or t.is_complex()) and \
        bool(torch.isclose(t, saved, rtol=0, atol=0, equal_nan=True).all())


def _torch_owned(fn: Any) -> bool:
    """Is ``fn`` torch's own hook (FSDP, parametrizations, ...), part of what the model computes?"""
    f = getattr(fn, "func", fn)  # functools.partial
    f = getattr(f, "__func__", f)  # a bound method
    owner = getattr(f, "__module__", None) or type(f).__module__ or ""
    return owner == "torch" or owner.startswith("torch.")


def _label(kind: str) -> str:
    """``forward_pre_hooks`` -> ``forward pre``; ``global_backward_hooks`` -> ``global backward``."""
    return kind.removesuffix("hooks").rstrip("_").replace("_", " ")


def _name(fn: Any) -> str:
    f = getattr(fn, "func", fn)
    return getattr(f, "__qualname__", None) or type(f).__qualname__


@contextlib.contextmanager
def isolation(modules: tuple = ()) -> Iterator[None]:
    """Hold the lock; at the outermost level, save the global state and the state of ``modules``
    (the user's, see the module docstring) and restore them on exit. Inside, grad mode is on and
    inference mode off: each analysis sets the mode it models itself."""
    with LOCK:
        depth = getattr(_DEPTH, "n", 0)
        users = _UserModules(list(modules)) if depth == 0 else None  # (may fail: a model nested too deep)
        _DEPTH.n = depth + 1
        state = _GlobalState() if depth == 0 else None
        failed = True
        try:
            if depth == 0:
                _DEPTH.ambient = (state.grad, torch.is_inference_mode_enabled())
                users.leave_out_hooks()
                _DEPTH.left_out, _DEPTH.users = users.left_out, users
                from .caches import private_caches  # the model code's lru caches: see fxmem.caches

                with torch.inference_mode(False), torch.enable_grad(), private_caches(m for _, m in users.modules):
                    yield
            else:
                yield
            failed = False
        finally:
            _DEPTH.n = depth
            lost = users.restore() if users is not None else []
            if state is not None:
                state.restore()
                _DEPTH.left_out, _DEPTH.users = [], None
            if lost and not failed:
                from .errors import InternalError

                raise InternalError(f"fxmem changed {', '.join(lost)} of your model in place and could not put it "
                                    f"back (over {SNAPSHOT_LIMIT:,} B of parameters and buffers: not snapshotted); "
                                    f"this is fxmem's bug, please report it")


def isolated(fn: F) -> F:
    """Decorate a public entry point: it runs under :func:`isolation`."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with isolation(tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.nn.Module))):
                return fn(*args, **kwargs)
        except RecursionError:
            from .errors import recursion_limit_error

            raise recursion_limit_error() from None
    return wrapper  # type: ignore[return-value]


def ambient_grad_note(grad: bool) -> str | None:
    """The note a report carries when the caller's grad mode differs from what ``grad=`` models."""
    was_grad, was_inference = getattr(_DEPTH, "ambient", (True, False))
    if not grad or (was_grad and not was_inference):
        return None
    where = "torch.inference_mode()" if was_inference else "torch.no_grad()"
    return (f"called under {where}: fxmem models what grad=True says (a training forward, autograd records); "
            f"pass grad=False for inference memory")


def hooks_note() -> str | None:
    """The note a report carries when the user's hooks were taken off for the analysis."""
    left_out = getattr(_DEPTH, "left_out", None)
    if not left_out:
        return None
    return (f"your hooks were left out of the analysis ({'; '.join(left_out)}): fxmem runs the model on fx Proxies "
            f"and fake tensors, which a hook would see and could keep; the memory is the model's without them "
            f"(they stay on your model)")


def carry_hooks(model: torch.nn.Module, result: torch.nn.Module, called: Callable[[str], bool]) -> list[str]:
    """Register on ``result`` (a rewrite of ``model``) the user's module hooks left out of this call,
    each on the module of the same path where ``called(path)`` says ``result`` calls that module
    (its root always), with the flags it was registered with: the user's call of the rewrite runs
    them as a call of ``model`` would. Returns the hooks it could not carry (code ``result`` runs
    inline: nothing calls their module)."""
    from . import _torch_compat as tc

    users = getattr(_DEPTH, "users", None)
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    missing = []
    for path, kind, key, fn in (users.taken if users is not None else []):
        owner = users and next((m for p, m in users.modules if p == path), None)
        if owner is None or paths.get(id(owner)) is None:
            continue  # a hook of another module the entry point was given
        rel = paths[id(owner)]
        if rel and not called(rel):
            missing.append(f"{_label(kind)} hook {_name(fn)} on {rel}")
            continue
        target = result.get_submodule(rel) if rel else result
        tc.add_hook(target, owner, kind, key, fn)
    return missing
