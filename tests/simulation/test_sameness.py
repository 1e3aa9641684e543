"""Layers that carry behaviour objects made per layer - a kernel module in a dict (Hugging Face's hub
kernels), a closure, a ``functools.partial``, a method bound to a helper - are alike when those
objects run the same code on the same settings (fxmem/simulation/sameness.py), and not alike when
a captured setting changes what they allocate.

The evidence: the repeated-blocks recording equals simulating every block (``repeats=False``), and
the predictions equal real training steps on the CPU allocator at sizes the analysis did not see.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from conftest import check_training_against_real_run
from fxmem.simulation.repeats import find_module_chain
from fxmem.simulation.sameness import same
from test_eager_repeats import hf_llama
from test_repeats import REPEATED, assert_same, both

ADAMW = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731


class Kernel(nn.Module):
    """A stateless module that only carries a function (as hub kernels' ``Func``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class Registry:
    """A plain object holding functions by name (a kernel registry)."""

    def __init__(self, widen: int):
        self.widen = widen
        self.table = {"gate": torch.tanh}

    def act(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h] * self.widen, -1).relu()[..., :16]


def make_scale(k: float):
    return lambda h: h * k


class Carrier(nn.Module):
    """A layer holding behaviour objects made for it alone."""

    def __init__(self, widen: int = 2):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self._kernel_funcs = {"act": Kernel()}  # not a registered child: a dict attribute
        self.scale = make_scale(0.5)  # a closure per layer
        self.mix = functools.partial(torch.lerp, weight=0.25)
        self.registry = Registry(widen)
        self.act = self.registry.act  # a method bound to this layer's own helper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._kernel_funcs["act"](self.lin(x))
        h = self.registry.table["gate"](self.act(self.scale(h)))
        return self.mix(x, h)


class Stack(nn.Module):
    def __init__(self, widths: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(Carrier(w) for w in widths)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_layers_carrying_behaviour_objects_made_per_layer_are_alike():
    torch.manual_seed(0)
    model = Stack([2] * 6)
    chain = find_module_chain(model)
    assert chain is not None and chain.count == 6
    fast, slow = both(model, ("B", "L", 16), optimizer=ADAMW, mode="eager")
    assert_same(fast, slow, 6)
    check_training_against_real_run(model, (("B", "L", 16),), [{"B": 2, "L": 5}, {"B": 3, "L": 11}], ADAMW,
                                    mode="eager")


def test_a_captured_setting_that_changes_memory_keeps_layers_apart():
    """One layer's helper concatenates four copies where the others concatenate two: not alike,
    every block simulated, and the prediction still equals real steps."""
    torch.manual_seed(0)
    model = Stack([2, 2, 4, 2, 2, 2])
    assert find_module_chain(model) is None
    report = check_training_against_real_run(model, (("B", "L", 16),), [{"B": 2, "L": 5}, {"B": 3, "L": 11}],
                                             ADAMW, mode="eager")
    assert not any(REPEATED in n for n in report.notes)


@pytest.mark.parametrize("a, b, alike", [
    (make_scale(0.5), make_scale(0.5), True),
    (make_scale(0.5), make_scale(2.0), False),  # the same code, another captured value
    (functools.partial(torch.lerp, weight=0.25), functools.partial(torch.lerp, weight=0.5), False),
    (Registry(2).act, Registry(2).act, True),
    (Registry(2).act, Registry(3).act, False),
    ({"act": Kernel()}, {"act": Kernel()}, True),
    (torch.zeros(2, 3), torch.ones(2, 3), True),  # values do not change bytes
    (torch.zeros(2, 3), torch.zeros(3, 2), False),
    (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64), False),
    (torch.Generator(), torch.Generator(), False),  # nothing to look into: taken as different
    (float("nan"), float("nan"), True),
])
def test_same_compares_what_an_object_runs(a, b, alike):
    assert same(a, b) is alike


def test_hub_kernels_on_hf_layers_leave_them_alike():
    """transformers 5 with the ``kernels`` package gives each attention module a kernel module of its
    own; the layers are still one chain."""
    pytest.importorskip("kernels")
    model = hf_llama(6)
    assert any("_kernel_funcs" in vars(m) for m in model.modules()), "the case this test is about"
    chain = find_module_chain(model)
    assert chain is not None and chain.prefix == "model.layers" and chain.count == 6


def test_peft_lora_layers_naming_their_own_path_are_alike():
    """peft keeps each adapter's ``target_name`` (``model.layers.3.self_attn.q_proj``) in the layer's
    ``kwargs``: a path that says where a layer sits, not what it runs. The layers are one chain, and
    the recording equals simulating every layer; a real step agrees at an unseen size."""
    peft = pytest.importorskip("peft")
    from conftest import check_steps_against_report
    from test_repeats import TOKENS

    model = peft.get_peft_model(hf_llama(6), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).base_model.model
    assert any("model.layers.3." in str(getattr(m, "kwargs", "")) for m in model.modules()), "the case this test is about"
    chain = find_module_chain(model)
    assert chain is not None and chain.prefix == "model.layers" and chain.count == 6
    fast, slow = both(model, TOKENS, optimizer=ADAMW)
    assert_same(fast, slow, 6)
    check_steps_against_report(model, fast, [{"B": 3, "L": 11}], ADAMW,
                               makers={"input_ids": lambda shape, sizes: torch.randint(0, 100, shape)})
