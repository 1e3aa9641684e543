"""``fxmem.analyze``: exact memory formulas of one forward, in the user's dim names.

>>> import torch, fxmem
>>> report = fxmem.analyze(torch.nn.Linear(6, 128), ("B", "N", 6))
>>> report.peak
512*B*N + 24*B*N + 3584
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from .errors import ModelError, SpecError
from .memory_plan import MemoryPlan
from .report import Report
from .simulate import simulate
from .specs import choose_hints, parse_specs
from .tracing import forward_arguments, trace
from .training import OptimizerFactory, Training


def analyze(
    model: torch.nn.Module,
    *input_specs: Any,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    grad: bool = True,
    hints: Mapping[str, int] | None = None,
    leaf_modules: Sequence[type] = (),
    optimizer: OptimizerFactory | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> Report:
    """Trace ``model`` and return its memory (bytes) as formulas in the dims named by the specs.

    Args:
        model: an ``nn.Module``; it is traced with ``torch.fx`` and never modified.
        *input_specs: one per positional ``forward`` argument - a tuple of ints and dim names
            (``("B", "N", 6)``), a :class:`fxmem.TensorSpec`, or a real tensor (a concrete input).
        device: whose memory to predict, ``"cpu"`` or ``"cuda"`` (CUDA code paths, 512-byte blocks).
        dtype: dtype of input specs that do not name one.
        grad: ``True`` records autograd as in training; ``False`` gives inference memory.
        hints: example sizes to analyse at (default: distinct primes near 100). The formulas hold
            wherever PyTorch would take the same code path (``Report.region``); ``evaluate`` outside
            it re-analyses.
        leaf_modules: module classes fx should not trace into.
        optimizer: ``lambda params: torch.optim.Adam(params, lr=1e-3)`` - also analyse one
            steady-state training step with this optimizer (``train_peak``, ``grads``, ...).
        loss: ``loss(output) -> scalar`` for the training step (default: ``output.sum()``).
    """
    if not isinstance(model, torch.nn.Module):
        raise ModelError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; wrap a function in a Module "
            f"whose forward calls it"
        )
    if not isinstance(dtype, torch.dtype):
        raise SpecError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    if not isinstance(grad, bool):
        raise SpecError(f"grad must be True or False, got {grad!r}")
    if loss is not None and optimizer is None:
        raise SpecError("loss= describes a training step; pass optimizer= as well")
    if optimizer is not None and not callable(optimizer):
        raise SpecError("optimizer= must be a function of the parameters, e.g. lambda p: torch.optim.Adam(p)")
    training = Training(optimizer, loss) if optimizer is not None else None
    name = type(model).__name__
    gm = trace(model, leaf_modules)
    arg_names, required = forward_arguments(gm)
    specs, symbols = parse_specs(input_specs, arg_names, required, dtype, name)
    chosen = choose_hints(symbols, hints)

    def run(at: Mapping[str, int]) -> Report:
        rec = simulate(gm, specs, symbols, dict(at), device=device, grad=grad, training=training)
        plan = MemoryPlan(rec, dict(at))
        return Report(plan, model_name=name, specs=specs, device=device, grad=grad, dtype=dtype,
                      hints=dict(at), graph_module=gm, mode="graph", reanalyze=run)

    return run(chosen)
