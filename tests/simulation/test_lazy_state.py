"""torch.optim creates a parameter's state lazily, in ``step()``, and only where ``.grad`` is not
None after backward: parameters the loss does not reach (a pooler whose output the loss ignores, a
weight used through ``.detach()``, a module never called) have no state. Checked against real
steady-state steps (the allocator's counters and the real optimizer's state) at unseen sizes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import check_training_against_real_run

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),  # makes its state when built: kept for all
}


class Pooled(nn.Module):
    """An encoder returning ``(h, pooler(h[:, 0]))``, as Hugging Face's do."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, c)
        self.norm = nn.LayerNorm(c)
        self.pooler = nn.Linear(c, c)

    def forward(self, x):
        h = self.norm(self.embed(x))
        return h, torch.tanh(self.pooler(h[:, 0]))


class Detached(nn.Module):
    """A weight read through ``.detach()`` (a frozen teacher projection) gets no gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 12)
        self.teacher = nn.Linear(8, 12)

    def forward(self, x):
        return self.a(x) * nn.functional.linear(x, self.teacher.weight.detach(), self.teacher.bias.detach())


class Unused(nn.Module):
    """A head built but never called in forward."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 10)
        self.head = nn.Linear(10, 300)

    def forward(self, x):
        return torch.relu(self.body(x))


CASES = {
    "pooler": (Pooled, (("B", "L", 8),), [dict(B=3, L=5), dict(B=2, L=11)], lambda o: o[0].sum()),
    "pooler-both": (Pooled, (("B", "L", 8),), [dict(B=3, L=5)], None),
    "detached": (Detached, (("B", 8),), [dict(B=5), dict(B=9)], None),
    "unused": (Unused, (("B", 8),), [dict(B=5), dict(B=9)], None),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_state_only_for_parameters_with_a_gradient(name, opt):
    factory, specs, sizes, loss = CASES[name]
    torch.manual_seed(0)
    kw = {"loss": loss} if loss is not None else {}
    check_training_against_real_run(factory().train(), specs, sizes, OPTIMIZERS[opt], **kw)


def test_pooler_state_is_dropped_from_the_formulas():
    """The state of the pooler the loss does not read is not in ``optimizer_state`` or ``train_resident``."""
    model = Pooled()
    both = fxmem.analyze(model, ("B", "L", 8), optimizer=OPTIMIZERS["adamw"])
    first = fxmem.analyze(model, ("B", "L", 8), optimizer=OPTIMIZERS["adamw"], loss=lambda o: o[0].sum())
    pooler = sum(p.numel() * p.element_size() for p in model.pooler.parameters())
    assert both.optimizer_state - first.optimizer_state == 2 * pooler + 2 * 4  # exp_avg, exp_avg_sq, step
    assert both.train_resident - first.train_resident == 2 * pooler + 2 * 4


def test_hf_encoder_whose_pooler_the_loss_does_not_read():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.BertModel(config).train()
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    check_training_against_real_run(model, (ids,), [dict(B=2, L=9)], OPTIMIZERS["adamw"],
                                    loss=lambda o: o[0].sum())
