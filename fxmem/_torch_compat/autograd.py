"""Autograd internals: the saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks`` and the
stack of them in ``torch._C._autograd``), the backward node running now
(``torch._C._current_autograd_node``), whether the running ``backward()`` / ``autograd.grad()`` keeps
its graph (``torch.autograd._engine_run_backward``), a tensor's own gradient hooks, its view metadata
and the C++ use count of its TensorImpl, and the autograd profiler's flag.

On a torch upgrade, what breaks here: ``_engine_run_backward`` (its third argument is retain_graph),
``_top_saved_tensors_default_hooks`` (its argument changed
between releases), ``BackwardCFunction``, the ``_backward_hooks`` / ``_post_accumulate_grad_hooks``
tables of a tensor, ``Tensor._is_view`` / ``_base`` / ``_use_count``, ``torch._C._autograd._profiler_enabled``.

Imports none of the package's other modules.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def in_python_backward() -> bool:
    """Whether autograd is running a backward written in Python now (a custom ``autograd.Function``'s):
    its ``x * 0.5`` wraps the number afresh, where a C++ formula passes the wrapped number it saved."""
    node = torch._C._current_autograd_node()
    return isinstance(node, torch.autograd.function.BackwardCFunction)


@contextlib.contextmanager
def backward_calls(keeping: list) -> Iterator[None]:
    """While the block runs, ``keeping`` says, innermost call last, whether each ``backward()`` or
    ``autograd.grad()`` running now keeps its graph (``retain_graph=True``): the engine then frees
    no node's saved values after the node ran, only when the node itself dies. (Both calls go
    through ``torch.autograd._engine_run_backward``; a torch without it leaves ``keeping`` empty.)"""
    import torch.autograd as autograd

    original = vars(autograd).get("_engine_run_backward")
    if original is None:
        yield
        return

    def run(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        # backward() and grad() both call it as (outputs, grads, retain_graph, create_graph, inputs, ...)
        keeping.append(bool(args[1] if len(args) > 1 else kwargs.get("retain_graph", False)))
        try:
            return original(outputs, *args, **kwargs)
        finally:
            keeping.pop()

    autograd._engine_run_backward = run
    try:
        yield
    finally:
        autograd._engine_run_backward = original


@contextlib.contextmanager
def saved_tensor_hooks(pack: Any) -> Iterator[None]:
    """Call ``pack(t)`` for every tensor autograd saves; what it returns is what gets saved.

    With hooks, autograd hands a saved *output* to the pack hook with its ``grad_fn`` attached;
    keeping it as is would make a reference cycle (output -> grad_fn -> saved output) that no
    refcount breaks, so a graph nothing can reach any more (after ``.detach()`` or ``argmax``)
    would keep its saved tensors alive. Autograd's own packing saves outputs without their
    ``grad_fn``: ``pack`` should return a detached alias (same storage, same version counter).
    """

    def _pack(t: torch.Tensor) -> torch.Tensor:
        return pack(t)

    with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
        yield


def saved_tensor_hooks_in_effect() -> Any:
    """The innermost ``saved_tensors_hooks`` pair in effect (None when there is none): what
    ``torch.utils.checkpoint`` (non-reentrant) and ``save_on_cpu`` install around their code.
    Returns the string ``"unknown"`` on a torch that cannot tell."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return "unknown"
    try:
        return top(False)
    except TypeError:  # releases whose function takes no argument
        return top()


def tensor_hooks(t: torch.Tensor) -> list[tuple[str, Any]]:
    """``(kind, hook)`` of a tensor's own gradient hooks (``register_hook``, post-accumulate-grad)."""
    found = []
    for kind, attr in (("gradient", "_backward_hooks"), ("post-accumulate-grad", "_post_accumulate_grad_hooks")):
        table = getattr(t, attr, None)
        found += [(kind, fn) for fn in (table.values() if isinstance(table, dict) else ())]
    return found


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (autograd's view metadata)."""
    return bool(t._is_view())


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``Tensor._base``), or None when it is not a view."""
    return t._base if t._is_view() else None


def write_count(t: torch.Tensor) -> int:
    """How many times ``t`` was written in place (autograd's version counter): equal before and
    after a run, the run did not change it."""
    return int(t._version)


def tensor_use_count(t: torch.Tensor) -> int:
    """How many C++ owners ``t``'s TensorImpl has (the engine's ``use_count()``; a Python object
    counts once however many Python names it has). Only differences between two tensors passed
    the same way mean something: the dispatcher's own references are in it."""
    return int(t._use_count())


def profiler_active() -> bool:
    """Is a ``torch.profiler`` / autograd profiler session recording in this process?"""
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except AttributeError:  # an older build: the Python flag torch.profiler keeps
        return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))
