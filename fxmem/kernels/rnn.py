"""nn.LSTM on the CPU: oneDNN's RNN primitive, its workspace and scratch measured on a real run.

ATen runs ``nn.LSTM`` through oneDNN (``aten.mkldnn_rnn_layer`` per layer and direction, and
``mkldnn_rnn_layer_backward``). The real kernel returns a *workspace* (kept for backward) whose
size oneDNN decides, and allocates scratch around it; the fake kernel returns an empty workspace
and no scratch (an LSTM(4, 8) on (3, 5, 4): 48,392 B real peak, 1,296 B fake). Neither size has a
formula in PyTorch, and oneDNN pads both to pages and picks them per CPU. So:

* the sizes are fixed where the LSTM runs, as ATen itself does for ``nn.GRU`` and ``nn.RNN`` (its
  C++ reads them as numbers; for the LSTM it raises on symbolic sizes instead): the report says
  "PyTorch fixed dim T at 101", and ``evaluate()`` elsewhere re-analyses there, exactly;
* at those sizes the op runs once for real, on stand-ins laid out like the fake arguments: its
  hidden program (:data:`~fxmem.kernels.registry.OUT` where the outputs appear) is the HIDDEN
  rule, the workspace's real bytes the OUTPUT_STORAGE rule. The backward's stand-ins come from a
  real forward (a workspace of the right size and contents, never random bytes oneDNN would read);
* a run too large to make (:data:`MAX_MACS` multiply-adds) leaves the workspace unknown: the
  report says it is not exact;
* while any of ATen's recurrent layers runs (:func:`inside_aten_rnn`), the input projection's bias
  is added in place, as ``at::linear`` does for real tensors (kernels/engine.py): for fake ones it
  adds out of place, one more (T, B, gates) buffer.

>>> fxmem.analyze(nn.LSTM(16, 32), ("T", "B", 16)).exact     # doctest: +SKIP
True
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .. import _torch_compat as tc
from .calibrate import _freeze, _real_arg, run_and_read  # stand-ins laid out like the fake arguments
from .registry import Call, Kind, Unknown, hidden, require_args, rule

aten = torch.ops.aten
MAX_MACS = 2 ** 31  # multiply-adds of the real run that measures one layer at the analysed sizes

_FORWARD = getattr(getattr(aten, "mkldnn_rnn_layer", None), "default", None)
_BACKWARD = getattr(getattr(aten, "mkldnn_rnn_layer_backward", None), "default", None)
_FORWARD_ARGS = ("input", "weight0", "weight1", "weight2", "weight3", "hx_", "cx_", "reverse", "batch_sizes",
                 "mode", "hidden_size", "num_layers", "has_biases", "bidirectional", "batch_first", "train")


_INSIDE = [0]  # how deep the simulation is inside ATen's recurrent layers (analyses take turns)


def inside_aten_rnn() -> bool:
    """Whether the running aten calls come from ATen's own recurrent-layer code (C++), where real
    and fake tensors part ways in ``at::linear`` (see kernels/engine.py)."""
    return _INSIDE[0] > 0


@rule(Kind.REAL_PATH, torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu, device="cpu")
def _aten_rnn(func: Callable, ctx: Any, *args: Any, **kwargs: Any) -> Any:
    """ATen's recurrent layers, marked as running (see :func:`inside_aten_rnn`). The LSTM with its
    sizes fixed at the example sizes: ATen's ``use_mkldnn`` reads ``input.numel()`` as a number and
    raises on symbolic sizes (GRU and RNN fix theirs by themselves). Each tensor is viewed with the
    same sizes as plain numbers: no memory."""
    if func is torch.lstm and any(_symbolic(a) for a in tc.tree_leaves((args, kwargs))):
        def fixed(a: Any) -> Any:
            if not _symbolic(a):
                return a
            tc.pin_symbols([*a.shape, *a.stride()])
            sizes = [int(d) for d in a.shape]
            # a view into sizes equal to its own keeps its SymInts; through a flat view the strides
            # are worked out again, from the sizes alone
            return a.view(-1).view(sizes) if a.is_contiguous() else a.view(sizes)

        leaves, spec = tc.tree_flatten((args, kwargs))
        args, kwargs = tc.tree_unflatten([fixed(a) for a in leaves], spec)
    _INSIDE[0] += 1
    try:
        return func(*args, **kwargs)
    finally:
        _INSIDE[0] -= 1


def _symbolic(a: Any) -> bool:
    # strides too: an earlier layer may have fixed the sizes and left strides over the symbols
    return isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*a.shape, *a.stride()))


def _concrete(call: Call) -> bool:
    return not any(_symbolic(t) for t in tc.tree_leaves(list(call.bound.values())))


def _macs(call: Call) -> int:
    """Multiply-adds of one layer's forward: T*B rows through the input and hidden weights."""
    x, w_ih = call.arg("input"), call.bound.get("weight0", call.bound.get("weight1"))
    w_hh = call.bound.get("weight1") if "weight0" in call.bound else call.bound.get("weight2")
    rows = int(x.numel()) // max(1, int(w_ih.shape[1]))
    return rows * int(w_ih.shape[0]) * (int(w_ih.shape[1]) + int(w_hh.shape[1]))


@functools.lru_cache(maxsize=128)
def _measured(op: Any, frozen_items: tuple, grad: bool) -> tuple[tuple, tuple]:
    """(hidden program, real output bytes) of one real run of ``op`` with these arguments, in the
    call's grad mode (the kernel keeps its workspace only where autograd records)."""
    frozen = dict(frozen_items)
    with tc.real_mode(), torch.set_grad_enabled(grad):
        if op is _FORWARD:
            args = {name: _real_arg(frozen[name]) for name in _FORWARD_ARGS}
            run = lambda: op(**args)  # noqa: E731
        else:
            run = _backward_run(frozen)
        program, out = run_and_read(run)
        nbytes = tuple(t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0
                       for t in (out if isinstance(out, (tuple, list)) else (out,)))
        del out
    return program, nbytes


def _backward_run(frozen: dict) -> Callable[[], Any]:
    """The backward at these arguments, its forward's results made by a real forward (oneDNN reads
    the workspace: it must be the one its forward wrote, at its real size)."""
    real = {name: _real_arg(f) for name, f in frozen.items()}
    with torch.enable_grad():  # the forward keeps its workspace only where autograd records
        output, hy, cy, workspace = _FORWARD(
            real["input"], real["weight1"], real["weight2"], real["weight3"], real["weight4"], real["hx_"],
            real["cx_tmp"], real["reverse"], real["batch_sizes"], real["mode"], real["hidden_size"],
            real["num_layers"], real["has_biases"], real["bidirectional"], real["batch_first"], True)
    real.update(output=output, hy_=hy, cy_=cy, workspace=workspace)
    return lambda: _BACKWARD(**real)


def _run_of(call: Call) -> tuple[tuple, tuple] | Unknown:
    what = "oneDNN's LSTM kernel (nn.LSTM on CPU) keeps a workspace and scratch whose sizes oneDNN decides"
    if not _concrete(call):
        return Unknown(call.op, f"{what}; measured only at fixed sizes")
    if _macs(call) > MAX_MACS:
        return Unknown(call.op, f"{what}; measured by one real run at the analysed sizes, which would take over "
                                f"{MAX_MACS:,} multiply-adds here: give smaller example sizes (hints=) for exact numbers")
    frozen = tuple((name, _freeze(v)) for name, v in call.bound.items())
    return _measured(call.func, frozen, bool(call.grad_enabled))


if _FORWARD is not None and _BACKWARD is not None:
    require_args(_FORWARD, *_FORWARD_ARGS)
    require_args(_BACKWARD, "input", "weight1", "weight2", "weight3", "weight4", "hx_", "cx_tmp", "output", "hy_",
                 "cy_", "reverse", "batch_sizes", "mode", "hidden_size", "num_layers", "has_biases", "bidirectional",
                 "batch_first", "workspace")

    @hidden(_FORWARD, _BACKWARD, device="cpu")
    def _onednn_rnn(call: Call) -> list | Unknown:
        """The real kernel's scratch around its outputs, measured at the call's (fixed) sizes."""
        run = _run_of(call)
        return run if isinstance(run, Unknown) else list(run[0])

    @rule(Kind.OUTPUT_STORAGE, _FORWARD, _BACKWARD, device="cpu")
    def _onednn_rnn_outputs(call: Call) -> dict:
        """Outputs whose real storage is larger than the fake one's: the workspace above all."""
        run = _run_of(call)
        if isinstance(run, Unknown):
            return {}
        return {i: n for i, (n, t) in enumerate(zip(run[1], call.outputs))
                if isinstance(t, torch.Tensor) and n > t.untyped_storage().nbytes()}
