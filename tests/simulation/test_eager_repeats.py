"""Eager mode's repeated blocks (a Hugging Face model's decoder layers): the first three blocks and
the last are simulated, the second's events repeated for the rest (fxmem/simulation/repeats.py:
find_module_chain, shorten_module; unroll.py: run_eager).

The evidence is independent of the reuse: the recording is compared, event by event and storage
by storage, with simulating every block (``repeats=False``), and the prediction with real training
steps on the CPU allocator at sizes the analysis did not see.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.measure import measure
from fxmem.simulation.repeats import find_module_chain
from fxmem.training import default_loss, train_step
from conftest import real_inputs, real_resident
from test_repeats import GPT, REPEATED, TOKENS, assert_same, both, canonical

ADAMW = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731


def hf_llama(layers: int = 6) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    return LlamaForCausalLM(config).train()


def test_hf_llama_training_step_equals_every_block_simulated_and_real_steps():
    model = hf_llama(6)
    fast, slow = both(model, TOKENS, optimizer=ADAMW)
    assert fast.mode == "eager"
    assert_same(fast, slow, 6)
    # the per-module table knows every layer (the ones not simulated too)
    assert list(fast.modules()) == list(slow.modules())
    assert {"model.layers.3.mlp", "model.layers.4.self_attn"} <= {row.path for row in fast.modules()}
    for dims in ({"B": 2, "L": 7}, {"B": 3, "L": 19}):  # sizes the analysis did not see, on the allocator
        torch.manual_seed(0)
        xs = real_inputs(fast, dims, {"input_ids": lambda shape, sizes: torch.randint(0, 100, shape)})
        opt = ADAMW(model.parameters())
        train_step(model, xs, opt, default_loss)
        m = measure(lambda: train_step(model, xs, opt, default_loss))
        pred = fast.evaluate(**dims)
        assert (m.peak_above_start, m.retained) == (pred["train_peak"] - pred["train_resident"],
                                                    pred["train_retained"]), dims
        state = sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor))
        assert pred["train_resident"] == real_resident(model, xs) + state


class Block(nn.Module):
    """A layer that knows its index (as Hugging Face layers keep ``layer_idx``) and branches on it."""

    def __init__(self, idx: int, n: int, branch: str):
        super().__init__()
        self.idx, self.n, self.branch = idx, n, branch
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).relu()
        if self.branch == "last" and self.idx == self.n - 1:  # the last layer keeps a wider tensor
            h = torch.cat([h, h], -1).sigmoid()[..., :16] * 2
        if self.branch == "odd" and self.idx % 2:
            h = h * h.sigmoid()
        return torch.tanh(x + h)  # a new gradient per block (a bare residual passes one down the chain)


class Stack(nn.Module):
    def __init__(self, branch: str, n: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(Block(i, n, branch) for i in range(n))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_last_block_is_simulated_as_itself():
    """The shortened model runs the real last block: code that treats the last layer apart is seen."""
    fast, slow = both(Stack("last"), ("B", "L", 16), optimizer=ADAMW, mode="eager")
    assert_same(fast, slow, 6)


def test_blocks_that_branch_on_their_index_differently_are_simulated_whole():
    model = Stack("odd")
    assert find_module_chain(model) is not None  # alike modules: only their events tell them apart
    fast, slow = both(model, ("B", "L", 16), optimizer=ADAMW, mode="eager")
    assert not any(REPEATED in n for n in fast.notes)
    assert canonical(fast._plan.rec) == canonical(slow._plan.rec)


class Typed(Stack):
    def __init__(self):
        super().__init__("none")
        for i, layer in enumerate(self.layers):  # Gemma-like: a sliding window every other layer
            layer.window = 4 if i % 2 else None


def test_blocks_with_other_settings_are_not_a_chain():
    assert find_module_chain(Typed()) is None
    assert find_module_chain(Stack("none")) is not None


@pytest.mark.slow
def test_gpt_in_eager_mode_with_dropout_in_training_and_inference():
    model = GPT(6).train()
    assert_same(*both(model, TOKENS, optimizer=lambda p: torch.optim.Adam(p), mode="eager"), 6)
    assert_same(*both(model, TOKENS, grad=False, mode="eager"), 6)


@pytest.mark.slow
def test_hf_llama_forward_equals_every_block_simulated():
    assert_same(*both(hf_llama(6), TOKENS), 6)


def test_generate_with_a_kv_cache_equals_every_block_simulated():
    """generate() runs the forward once per token: each run's layers repeat, the KV cache each
    layer keeps from run to run is that layer's (tests/llm/test_generation.py: exact against real calls)."""
    model = hf_llama(6).eval()
    fast = fxmem.generation(model, ("B", "P"), new_tokens=3)
    slow = fxmem.generation(model, ("B", "P"), new_tokens=3, options=fxmem.AnalysisOptions(repeats=False))
    assert any(REPEATED in n and "the 6 blocks" in n for n in fast.notes), fast.notes
    assert canonical(fast._plan.rec) == canonical(slow._plan.rec)
    assert fast.formulas() == slow.formulas()
