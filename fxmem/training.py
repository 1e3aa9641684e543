"""What "one training step" means, in one place, for the simulation and for real runs alike.

    def train_step(module, inputs, optimizer, loss):
        out = module(*inputs)
        l = loss(out)            # default: the sum of every floating output that requires grad
        l.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

A *steady-state* step starts with the optimizer's state already created (after a first step)
and no gradients (``set_to_none=True`` freed them); ``out`` and the loss are locals, freed when
the step returns. Inputs are fresh each step (their ``.grad``, if any, is not kept).

>>> opt = torch.optim.Adam(model.parameters())                         # doctest: +SKIP
>>> train_step(model, (x,), opt, default_loss)                          # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

from .errors import FxMemError

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


def default_loss(out: Any) -> torch.Tensor:
    """``out.sum()``; for several outputs, the sum of the sums of those that require grad."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not tensors:
        raise FxMemError("the model's output does not require grad, so there is nothing to train; "
                         "check that its parameters require grad (or pass loss=...)")
    total = tensors[0].sum()
    for t in tensors[1:]:
        total = total + t.sum()
    return total


@dataclasses.dataclass
class Training:
    """How to train: an optimizer factory (called with the parameters) and a loss function."""

    optimizer: OptimizerFactory
    loss: Callable[[Any], torch.Tensor] | None = None

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = self.optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise FxMemError(f"optimizer= must return a torch.optim.Optimizer, got {type(opt).__name__}")
        if isinstance(opt, torch.optim.LBFGS):
            raise FxMemError("optimizers whose step() needs a closure (LBFGS) are not supported")
        return opt

    @property
    def loss_fn(self) -> Callable[[Any], torch.Tensor]:
        return self.loss or default_loss


def train_step(module: torch.nn.Module, inputs: tuple, optimizer: torch.optim.Optimizer,
               loss: Callable[[Any], torch.Tensor] = default_loss) -> None:
    """One training step exactly as fxmem simulates it (see the module docstring)."""
    out = module(*inputs)
    value = loss(out)
    value.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
