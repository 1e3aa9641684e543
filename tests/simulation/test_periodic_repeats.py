"""Layers that alternate kinds are repeated as groups (fxmem/simulation/repeats.py: ``period``).

Gemma-2 alternates sliding-window and full-attention layers, hybrid models repeat a pattern of
several kinds: no two neighbouring layers are alike, so no chain of single layers exists, but every
group of ``period`` consecutive layers is alike. fxmem simulates four groups and repeats the
second's events for the inner ones. The evidence is independent of the reuse: the recording equals
simulating every layer (``repeats=False``) event by event and storage by storage, and the
predictions equal real training steps on the CPU allocator at sizes the analysis did not see -
with a tail of layers after the last whole group, in graph mode and in eager mode (Hugging Face).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import check_steps_against_report, check_training_against_real_run
from fxmem.capture import trace
from fxmem.simulation.repeats import find_chain, find_module_chain
from test_repeats import REPEATED, TOKENS, assert_same, both

ADAMW = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731


class Narrow(nn.Module):
    """One kind of layer: a residual MLP through a narrow width."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, width), nn.Linear(width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Mixer(nn.Module):
    """Another kind: a softmax over the sequence, then a projection (an attention without heads)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj((x @ x.transpose(1, 2)).softmax(-1) @ x)


class Hybrid(nn.Module):
    """``layers`` layers repeating ``pattern`` (e.g. "nm": Narrow, Mixer, Narrow, Mixer, ...)."""

    def __init__(self, layers: int = 13, pattern: str = "nm", dim: int = 16, vocab: int = 50):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        kinds = {"n": lambda: Narrow(dim, 3 * dim), "w": lambda: Narrow(dim, 5 * dim), "m": lambda: Mixer(dim)}
        self.layers = nn.ModuleList(kinds[pattern[i % len(pattern)]]() for i in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("layers, pattern, period, groups", [(13, "nm", 2, 6), (20, "nmw", 3, 6)])
def test_graph_mode_groups_equal_every_layer_simulated_and_real_steps(layers, pattern, period, groups):
    torch.manual_seed(0)
    model = Hybrid(layers, pattern)
    chain = find_chain(trace(model))
    assert (chain.period, chain.count, chain.prefix) == (period, groups, "layers")
    fast, slow = both(model, TOKENS, optimizer=ADAMW)
    assert fast.mode == "graph"
    assert_same(fast, slow, groups)
    check_training_against_real_run(model, (TOKENS,), [{"B": 2, "L": 9}, {"B": 3, "L": 21}], ADAMW,
                                    makers={"tokens": lambda shape, sizes: torch.randint(0, 50, shape)})


def test_alike_layers_are_still_one_layer_per_block():
    chain = find_chain(trace(Hybrid(8, "n")))
    assert (chain.period, chain.count) == (1, 8)
    assert find_chain(trace(Hybrid(8, "nm"))) is None  # 4 groups of two: too few to gain


def gemma2(layers: int):
    pytest.importorskip("transformers")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8)
    return Gemma2ForCausalLM(config).train()


def test_gemma2_alternating_layers_in_eager_mode():
    model = gemma2(11)  # 5 groups of a sliding and a full layer, then one sliding layer
    chain = find_module_chain(model)
    assert (chain.period, chain.count, chain.prefix) == (2, 5, "model.layers")
    fast, slow = both(model, TOKENS, optimizer=ADAMW)
    assert fast.mode == "eager"
    assert_same(fast, slow, 5)
    assert {"model.layers.5.self_attn", "model.layers.10.mlp"} <= {row.path for row in fast.modules()}
    # past the sliding window (8) and below it, on the allocator
    check_steps_against_report(model, fast, [{"B": 2, "L": 5}, {"B": 3, "L": 19}], ADAMW,
                               makers={"input_ids": lambda shape, sizes: torch.randint(0, 100, shape)})
    assert any(REPEATED in n for n in fast.notes)
