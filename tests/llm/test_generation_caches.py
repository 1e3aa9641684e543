"""fxmem.generation.kv_cache_bytes and generation() on sliding-window and hybrid caches (issue 45):
Mistral and Phi-3 (a `sliding_window`, no `layer_types`: transformers 5 builds
DynamicSlidingWindowLayer / StaticSlidingWindowLayer caches), Gemma-2 (sliding and full layers
alternating), a Qwen2 whose `max_window_layers` makes some layers sliding. The evidence is
independent of fxmem: the bytes of the storages a real greedy generate() leaves in its cache, on
random-weight tiny configs with 2+ layers, prompt + tokens past the window, both caches."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.errors import ModelError, SpecError
from fxmem.generation import Generate, _token, cache_layers, kv_cache_bytes
from fxmem.measure import measure

transformers = pytest.importorskip("transformers")

WINDOW = 8
SMALL = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=128, eos_token_id=2, pad_token_id=0, bos_token_id=1)


def _configs() -> dict:
    return {
        "mistral": transformers.MistralConfig(sliding_window=WINDOW, **SMALL),
        "phi3": transformers.Phi3Config(sliding_window=WINDOW, **SMALL),
        "gemma2": transformers.Gemma2Config(sliding_window=WINDOW, head_dim=16, **SMALL),
        "qwen2-window": transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                                 **SMALL),
    }


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_configs()[name]).eval()


def _real_cache_bytes(model, B: int, P: int, T: int, cache: str) -> int:
    """Bytes of the storages the cache of a real greedy generate() holds at its end. A fresh copy of
    the model per call: transformers sizes a static cache for the largest call the model made so far."""
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (B, P))
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.no_grad():
        out = copy.deepcopy(model).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                            min_new_tokens=T, max_new_tokens=T, return_dict_in_generate=True,
                                            pad_token_id=0, **kw)
    assert out.sequences.shape == (B, P + T)
    storages = {}
    for layer in out.past_key_values.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


# sizes below, at and past the window (P + T - 1 > 8), and T = 1 (the prefill alone)
SIZES = [(1, 5, 3), (2, 11, 4), (3, 4, 9), (2, 11, 1), (1, 7, 2), (2, 20, 6)]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["mistral", "phi3", "gemma2", "qwen2-window"])
def test_kv_cache_bytes_follows_the_cache_transformers_builds(name, cache):
    model = _model(name)
    formula = kv_cache_bytes(model.config, cache=cache)
    for B, P, T in SIZES:
        real = _real_cache_bytes(model, B, P, T, cache)
        sizes = {"B": B, "P": P, "T": T}
        assert int(formula.subs({s: sizes[s.name] for s in formula.free_symbols})) == real, (B, P, T)
        assert kv_cache_bytes(model.config, B, P, T, cache=cache) == real, (B, P, T)


def test_the_window_bounds_the_formula():
    config = _configs()["mistral"]
    formula = kv_cache_bytes(config, cache="static")
    assert formula.has(__import__("sympy").Min)
    # past the window the cache stops growing: 1000 positions cost what 8 do
    assert kv_cache_bytes(config, 2, 1000, 5) == kv_cache_bytes(config, 2, 8, 5) == kv_cache_bytes(config, 2, 4, 5)
    assert cache_layers(_configs()["gemma2"]) == [WINDOW, None, WINDOW]
    assert cache_layers(_configs()["qwen2-window"]) == [None, WINDOW, WINDOW]  # layers >= max_window_layers
    assert cache_layers(transformers.LlamaConfig(**SMALL), "static") == [None] * 3


def test_what_stays_refused_is_refused_clearly():
    with pytest.raises(ModelError, match="num_attention_heads"):
        kv_cache_bytes(transformers.MambaConfig(num_hidden_layers=2, hidden_size=32))
    with pytest.raises(ModelError, match="encoder-decoder"):
        kv_cache_bytes(transformers.T5Config(num_layers=2, d_model=32, num_heads=2))
    with pytest.raises(ModelError, match="offloaded"):
        kv_cache_bytes(_configs()["mistral"], cache="offloaded")
    with pytest.raises(SpecError, match="cache="):
        kv_cache_bytes(_configs()["mistral"], cache="paged")


# --- the full simulation: generation() against real generate() calls past the window -------------
def _real(model, b: int, p: int, new_tokens: int, cache: str) -> tuple:
    ids = torch.full((b, p), _token(model))
    mask = torch.ones(b, p, dtype=torch.long)
    run = Generate(copy.deepcopy(model), new_tokens, cache, {})
    with torch.no_grad():
        out = run(ids, mask)
        assert out.shape == (b, p + new_tokens)
        m = measure(lambda: run(ids, mask))
    return m.peak_above_start, m.retained


@pytest.mark.parametrize("name, cache", [("mistral", "dynamic"), ("phi3", "dynamic"), ("gemma2", "dynamic"),
                                         ("mistral", "static"), ("gemma2", "static")])
def test_generate_is_exact_against_real_calls_past_the_window(name, cache):
    model = _model(name)
    report = fxmem.generation(model, ("B", "P"), new_tokens=4, cache=cache)
    for b, p in ((3, 13), (2, 21)):  # P + 3 past the window of 8
        at = report.evaluate(B=b, P=p)
        assert (at["peak_above_resident"], at["retained"]) == _real(model, b, p, 4, cache), (name, cache, b, p)
