"""What "one training step" means, in one place, for the simulation and for real runs alike.

    def train_step(module, inputs, optimizer, loss):
        out = module(*inputs)
        l = loss(out)            # default: the sum of every floating output that requires grad
        l.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

With ``step=fn`` the step is the user's own function instead, ``fn(model, optimizer, *inputs)``
(micro-batches with gradient accumulation, ``clip_grad_norm_``, a ``GradScaler``,
``zero_grad(set_to_none=False)``, several losses ...): see :func:`user_step`.

A *steady-state* step starts with the optimizer's state already created (after a first step)
and no gradients (``set_to_none=True`` freed them); ``out`` and the loss are locals, freed when
the step returns. Inputs are fresh each step (their ``.grad``, if any, is not kept).

The simulation runs this very function, on fake tensors, with :class:`StepHooks` that attribute
each phase (:class:`fxmem.records.Phase`) of the step.

>>> opt = torch.optim.Adam(model.parameters())                         # doctest: +SKIP
>>> train_step(model, (x,), opt)                                        # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator

import torch

from . import _torch_compat as tc
from .errors import FxMemError, NothingToTrainError, SpecError
from .records import Phase

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


def default_loss(out: Any) -> torch.Tensor:
    """``out.sum()``; for several outputs, the sum of the sums of those that require grad."""
    tensors = [t for t in tc.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not tensors:
        raise NothingToTrainError("the model's output does not require grad, so there is nothing to train; "
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
    step: Callable[..., Any] | None = None  # the user's own step, fn(model, optimizer, *inputs)

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = self.optimizer(params)
        if isinstance(opt, (tuple, list, dict)):
            raise SpecError(f"optimizer= returned a {type(opt).__name__}: the default training step uses one "
                            f"optimizer; for several (a GAN's two, or an optimizer with its LR scheduler) pass "
                            f"step=fn as well: fn(model, what optimizer= returns, *inputs)")
        return _checked_optimizer(opt)

    def make_for_step(self, params: list[torch.Tensor]) -> tuple[Any, list[torch.optim.Optimizer]]:
        """For ``step=``: what the factory returns is what the step is handed - one optimizer, or a
        tuple, list or dict of optimizers (a GAN's two) and LR schedulers. Returns it and its optimizers."""
        made = self.optimizer(params)
        if not isinstance(made, (tuple, list, dict)):
            return made, [_checked_optimizer(made)]
        parts = list(made.values()) if isinstance(made, dict) else list(made)
        schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        odd = [type(p).__name__ for p in parts if not isinstance(p, (torch.optim.Optimizer, *schedulers))]
        optimizers = [p for p in parts if isinstance(p, torch.optim.Optimizer)]
        if odd or not optimizers:
            raise SpecError(f"optimizer= returned a {type(made).__name__} holding "
                            f"{', '.join(odd) or 'no optimizer'}: it may return one torch.optim.Optimizer, or a "
                            f"tuple, list or dict of optimizers and LR schedulers (your step= receives it as returned)")
        return made, [_checked_optimizer(o) for o in optimizers]

    @property
    def loss_fn(self) -> Callable[[Any], torch.Tensor]:
        return self.loss or default_loss


def _checked_optimizer(opt: Any) -> torch.optim.Optimizer:
    """``opt`` if fxmem can simulate its ``step()``; else a :class:`FxMemError` saying why."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise FxMemError(f"optimizer= must return a torch.optim.Optimizer, got {type(opt).__name__}")
    if isinstance(opt, torch.optim.LBFGS):
        raise FxMemError("optimizers whose step() needs a closure (LBFGS) are not supported")
    return opt


def check_loss(value: Any) -> None:
    """A loss is a one-element floating tensor that requires grad (what ``backward()`` needs)."""
    if not isinstance(value, torch.Tensor):
        raise SpecError(f"loss= returned {type(value).__name__} {value!r:.60}; it must return a scalar tensor computed "
                        f"from the model's output, e.g. loss=lambda out: out.pow(2).mean()")
    if any(not isinstance(d, int) or d != 1 for d in value.shape):  # a symbolic size is never 1 everywhere
        raise SpecError(f"loss= returned a tensor of shape {tuple(value.shape)}; backward() needs one element: "
                        f"reduce it, e.g. with .sum() or .mean()")
    if not value.requires_grad:
        raise SpecError("loss= returned a tensor that does not require grad: compute it from the model's output "
                        "(a .detach() or .item() in the loss cuts it off from the parameters)")


class StepHooks:
    """What :func:`train_step` lets an observer do: run the forward its own way, and wrap each phase.

    The default runs ``module(*inputs)`` and observes nothing (a real step).
    """

    def forward(self, module: Any, inputs: tuple) -> Any:
        return module(*inputs)

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        yield

    def check_loss(self, loss: Any) -> None:
        """Refuse what ``backward()`` cannot take (see :func:`check_loss`)."""
        check_loss(loss)

    def before_backward(self, loss: torch.Tensor) -> None:
        """Called with the loss just before ``backward()``."""

    @contextlib.contextmanager
    def user_step(self, module: Any, optimizer: torch.optim.Optimizer) -> Iterator[Any]:
        """Around a user's step: yields the model to hand it (the default: ``module`` itself)."""
        yield module


def train_step(module: Any, inputs: tuple, optimizer: torch.optim.Optimizer,
               loss: Callable[[Any], torch.Tensor] = default_loss, hooks: StepHooks | None = None) -> None:
    """One training step exactly as fxmem simulates it (see the module docstring)."""
    hooks = hooks or StepHooks()
    out = hooks.forward(module, inputs)
    with hooks.phase(Phase.LOSS):
        value = loss(out)
    hooks.check_loss(value)
    hooks.before_backward(value)
    with hooks.phase(Phase.BACKWARD):
        value.backward()
    with hooks.phase(Phase.STEP):
        optimizer.step()
    with hooks.phase(Phase.ZERO_GRAD):
        optimizer.zero_grad(set_to_none=True)
    with hooks.phase(Phase.RETURN):  # the step's locals (output, loss) die as it returns
        del value, out
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None


# Said exactly: the output and the 0-d loss live until the step returns. Written as
# ``loss(model(x)).backward()`` the loss dies before ``optimizer.step()``, and that loop's peak can be its
# bytes lower (4 B for a float32 loss: seed 002's attention with Adam peaks inside the step); step= models it.
DEFAULT_STEP = ("out = model(*inputs); loss = loss_fn(out); loss.backward(); optimizer.step(); "
                "optimizer.zero_grad(set_to_none=True) - out and loss held until the step returns")


def describe(training: Training) -> str:
    """The training step a report is of, in words."""
    if training.step is None:
        return f"the default step: {DEFAULT_STEP}"
    return f"your step= function {getattr(training.step, '__qualname__', type(training.step).__name__)}"


def user_step(module: Any, inputs: tuple, optimizer: torch.optim.Optimizer, step: Callable[..., Any],
              hooks: StepHooks | None = None) -> None:
    """One call of the user's own training step ``step(module, optimizer, *inputs)`` (``optimizer``:
    what ``optimizer=`` returned - one optimizer, or several with LR schedulers, see :meth:`Training.make_for_step`).

    Its steady state is its second call: whatever the first leaves behind (optimizer state, the
    gradients ``zero_grad(set_to_none=False)`` keeps, a ``GradScaler``'s scale) is there when the
    step starts, as in the loop the user runs. The simulation calls it once quietly, then once
    recorded, with the hooks' :meth:`StepHooks.user_step` routing the model's calls, ``backward()``,
    ``optimizer.step()`` and ``zero_grad()`` to the phases of :class:`fxmem.records.Phase`.
    """
    hooks = hooks or StepHooks()
    with hooks.user_step(module, optimizer) as model:
        step(model, optimizer, *inputs)
    with hooks.phase(Phase.RETURN):
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None
