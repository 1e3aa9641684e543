"""fxmem.analyze, optimize and validate leave the user's model exactly as they found it: parameters
(the same objects, the same values, no .grad), buffers, Python attributes (even those forward sets
while it runs), hooks and the training flag - including for models whose forward has side effects."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import load_example


class SideEffects(nn.Module):
    """A forward that counts its calls, caches its input, bumps a buffer and appends to a list."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("steps", torch.zeros(()))
        self.calls = 0
        self.history: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last_input = x
        self.history.append(x.shape[0])
        self.steps.add_(1)
        return self.drop(torch.relu(self.lin(x)))


def _hooked() -> nn.Module:
    model = SideEffects()
    model.register_forward_hook(lambda mod, args, out: out * 2)
    model.lin.register_forward_pre_hook(lambda mod, args: None)
    return model


def snapshot(model: nn.Module) -> dict:
    """Everything a user could notice about a model."""
    return {
        "params": [(n, id(p), p.detach().clone(), p.requires_grad, p.grad) for n, p in model.named_parameters()],
        "buffers": [(n, id(b), b.clone()) for n, b in model.named_buffers()],
        "attrs": {name: {k: copy.copy(v) for k, v in vars(m).items() if not k.startswith("_")}
                  for name, m in model.named_modules()},
        "modes": [(name, m.training) for name, m in model.named_modules()],
        "hooks": [(name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))  # noqa: SLF001
                  for name, m in model.named_modules()],
    }


def same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return x == y

    return eq(a, b)


SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
ACTIONS = {
    "analyze graph": lambda m: fxmem.analyze(m, ("B", 6)),
    "analyze eager": lambda m: fxmem.analyze(m, ("B", 6), mode="eager"),
    "analyze training step": lambda m: fxmem.analyze(m, ("B", 6), optimizer=SGD),
    "analyze eager training step": lambda m: fxmem.analyze(m, ("B", 6), optimizer=SGD, mode="eager"),
    "evaluate outside the region": lambda m: fxmem.analyze(m, ("B", 6)).evaluate(B=1),
    "diagram and timeline": lambda m: (fxmem.analyze(m, ("B", 6)).diagram({"B": 3}).source,
                                       fxmem.analyze(m, ("B", 6)).timeline({"B": 4})),
    "optimize": lambda m: fxmem.optimize(m, ("B", 6)),
    "validate": lambda m: fxmem.validate(m, ("B", 6), dims={"B": 3}, device="cpu"),
    "validate eager": lambda m: fxmem.validate(m, ("B", 6), dims={"B": 3}, device="cpu", mode="eager"),
}


@pytest.mark.parametrize("factory", [SideEffects, _hooked], ids=["side-effects", "hooked"])
@pytest.mark.parametrize("action", sorted(ACTIONS))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_model_is_left_as_it_was(factory, action, mode):
    torch.manual_seed(0)
    model = getattr(factory(), mode)()
    before = snapshot(model)
    ACTIONS[action](model)
    after = snapshot(model)
    assert same(before, after), action


def test_a_failed_analysis_leaves_the_model_too():
    model = SideEffects()
    before = snapshot(model)
    with pytest.raises(fxmem.ShapeError):
        fxmem.analyze(model, ("B", 5))
    assert same(before, snapshot(model))


def test_what_forward_does_to_buffers_is_in_the_graph_not_done_to_the_model():
    model = SideEffects().eval()
    report = fxmem.analyze(model, ("B", 6))
    assert model.steps.item() == 0
    report.graph_module(torch.randn(2, 6))  # running the traced module updates the buffer it shares
    assert model.steps.item() == 1


def test_optimize_keeps_the_models_hooks():
    gat = load_example("seed_gat")
    layer = gat.GraphAttentionLayerFixed(6, 16, dropout=0.0).eval()
    layer.register_forward_hook(lambda mod, args, out: out + 1)
    opt = fxmem.optimize(layer, ("B", "N", 6), ("B", "N", "N"))
    x, adj = torch.randn(2, 5, 6), torch.rand(2, 5, 5) > 0.5
    assert torch.allclose(opt(x, adj), layer(x, adj), atol=1e-5)
