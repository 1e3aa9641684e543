"""fxmem.generation: the memory of transformers' generate() (prefill, then a decode step per new
token with the KV cache), against real generate() calls of the same model (CPU allocator) at
prompt sizes the analysis did not see: Llama, a GQA Qwen2, GPT-2, the static cache; a meta-device
model gets its numbers with no real run; `fxmem llm --serve`."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import sympy
import torch

import fxmem
from fxmem.errors import ModelError
from fxmem.generation import Generate, _token, kv_cache_bytes
from fxmem.measure import measure

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, eos_token_id=2, pad_token_id=0, bos_token_id=1)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**LLAMA, "num_key_value_heads": 1})).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()


def _real(model, b, p, new_tokens, cache):
    ids = torch.full((b, p), _token(model))
    mask = torch.ones(b, p, dtype=torch.long)
    run = Generate(copy.deepcopy(model), new_tokens, cache, {})
    with torch.no_grad():
        out = run(ids, mask)
        assert out.shape == (b, p + new_tokens)  # every sequence made all its tokens
        m = measure(lambda: run(ids, mask))
    return m.peak_above_start, m.retained


@pytest.mark.parametrize("kind, cache, new_tokens", [
    ("llama", "dynamic", 3), ("qwen2", "dynamic", 4), ("gpt2", "dynamic", 3), ("llama", "static", 3)])
def test_generate_is_exact_against_real_calls(kind, cache, new_tokens):
    model = _model(kind)
    report = fxmem.generation(model, ("B", "P"), new_tokens=new_tokens, cache=cache)
    assert report.exact, report.notes
    for b, p in ((3, 37), (2, 70)):
        at = report.evaluate(B=b, P=p)
        assert (at["peak_above_resident"], at["retained"]) == _real(model, b, p, new_tokens, cache), (b, p)


def test_max_batch_and_meta_models():
    config = transformers.LlamaConfig(**LLAMA)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config).eval()
    report = fxmem.generation(meta, ("B", "P"), new_tokens=2)
    real = fxmem.generation(_model("llama"), ("B", "P"), new_tokens=2)
    assert report.evaluate(B=3, P=40) == real.evaluate(B=3, P=40)  # no weights needed
    b = report.max_size("B", "2MiB", P=64)
    assert report.evaluate(B=b, P=64)["peak"] <= 2 * 2**20 < report.evaluate(B=b + 1, P=64)["peak"]
    with pytest.raises(fxmem.SpecError, match="new_tokens"):
        fxmem.generation(meta, ("B", "P"), new_tokens=0)
    with pytest.raises(fxmem.SpecError, match="greedy"):
        fxmem.generation(meta, ("B", "P"), new_tokens=2, do_sample=True)


def test_cli_serve(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **LLAMA}))
    out = subprocess.run([sys.executable, "-m", "fxmem", "llm", str(path), "--serve", "--batch", "2", "--prompt",
                          "64", "--new-tokens", "2", "--gpu", "2MiB", "--cache", "static", "--quiet"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    report = fxmem.generation(fxmem.from_config({"model_type": "llama", **LLAMA}), ("B", "P"), new_tokens=2,
                              cache="static")
    assert "static KV cache" in out.stdout and "(65 positions x batch 2)" in out.stdout, out.stdout
    assert fxmem.format_bytes(report.evaluate(B=2, P=64)["peak"]) in out.stdout
    assert f"largest batch       {report.max_size('B', '2MiB', P=64):,}" in out.stdout


# --- kv_cache_bytes: the cache a real greedy generate() leaves, from the config -------------------
def _configs():
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=128)
    return {
        "llama": transformers.LlamaConfig(**small),
        "qwen2-gqa": transformers.Qwen2Config(num_key_value_heads=2, **small),
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
    }


def _real_cache_bytes(model, B, P, T, cache="dynamic"):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (B, P))
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=T,
                         max_new_tokens=T, return_dict_in_generate=True, pad_token_id=0, **kw)
    cache = out.past_key_values
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("name, cache", [("llama", "dynamic"), ("qwen2-gqa", "dynamic"), ("gpt2", "dynamic"),
                                         ("llama", "static")])
def test_kv_cache_bytes_matches_real_generate(name, cache):
    config = _configs()[name]
    formula = kv_cache_bytes(config)  # the same positions in both caches
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for B, P, T in [(1, 5, 3), (3, 7, 4), (2, 11, 1)]:
        with torch.no_grad():
            real = _real_cache_bytes(copy.deepcopy(model), B, P, T, cache)  # a fresh model: see _real_cache_bytes
        sizes = {"B": B, "P": P, "T": T}
        assert formula.subs({s: sizes[s.name] for s in formula.free_symbols}) == real, (B, P, T)
        assert kv_cache_bytes(config, B, P, T) == real


def test_sliding_window_caches_are_counted_not_refused():
    """A Qwen2 with sliding layers (use_sliding_window, max_window_layers=0): the window bounds the
    cache (sympy Min); the real cache past the window agrees (more configs: test_generation_caches.py)."""
    config = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, vocab_size=128, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert kv_cache_bytes(config, cache="static").has(sympy.Min)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for cache in ("dynamic", "static"):
        with torch.no_grad():
            real = _real_cache_bytes(copy.deepcopy(model), 2, 11, 4, cache)
        assert kv_cache_bytes(config, 2, 11, 4, cache=cache) == real < kv_cache_bytes(_configs()["qwen2-gqa"], 2, 11, 4)
    with pytest.raises(ModelError, match="state-space"):
        kv_cache_bytes(transformers.MambaConfig(num_hidden_layers=2, hidden_size=32))


def test_min_new_tokens_is_modelled():
    """min_new_tokens goes to generate() as given: with no end-of-sequence token (every call makes all
    its tokens) transformers adds no logits processor for it, so the call is the same."""
    model = _model("llama")
    plain = fxmem.generation(model, ("B", "P"), new_tokens=3)
    with_min = fxmem.generation(model, ("B", "P"), new_tokens=3, min_new_tokens=3)
    assert with_min.evaluate(B=3, P=37) == plain.evaluate(B=3, P=37)
    at = with_min.evaluate(B=3, P=37)
    ids, mask = torch.full((3, 37), _token(model)), torch.ones(3, 37, dtype=torch.long)
    run = Generate(copy.deepcopy(model), 3, "dynamic", {"min_new_tokens": 3})
    with torch.no_grad():
        run(ids, mask)
        m = measure(lambda: run(ids, mask))
    assert (at["peak_above_resident"], at["retained"]) == (m.peak_above_start, m.retained)


# --- formulas in the number of new tokens ----------------------------------------------------------
@pytest.mark.parametrize("kind, cache", [("llama", "dynamic"), ("llama", "static"),
                                         pytest.param("gpt2", "dynamic", marks=pytest.mark.slow)])
def test_formulas_in_new_tokens_are_exact_against_real_calls(kind, cache):
    """new_tokens="T": 3 short analyses give the peak and the retained bytes of any number of tokens;
    checked against real generate() calls at numbers of tokens and prompt sizes none of them saw. A
    static cache is sized for all T tokens up front: every step grows with T, not only the last."""
    model = _model(kind)
    formulas = fxmem.generation(model, ("B", "P"), new_tokens="T", cache=cache)
    assert {s.name for s in formulas.peak.free_symbols} >= {"B", "P", "T"} and formulas.exact
    for b, p, t in ((3, 37, 7), (2, 70, 12)):
        assert formulas._holds(dict(B=b, P=p, T=t))  # the formulas answer, not an analysis of t tokens
        at = formulas.evaluate(B=b, P=p, T=t)
        assert (at["peak_above_resident"], at["retained"]) == _real(model, b, p, t, cache), (b, p, t)
    # where the formulas do not hold (2 tokens) the call is analysed as asked: exact too
    at = formulas.evaluate(B=3, P=37, T=2)
    assert (at["peak_above_resident"], at["retained"]) == _real(model, 3, 37, 2, cache)


def test_max_batch_for_many_tokens_and_what_is_refused():
    model = _model("llama")
    formulas = fxmem.generation(model, ("B", "P"), new_tokens="T")
    b = formulas.max_size("B", "2MiB", P=32, T=150)
    assert formulas.evaluate(B=b, P=32, T=150)["peak"] <= 2 * 2**20 < formulas.evaluate(B=b + 1, P=32, T=150)["peak"]
    # at 150 new tokens the last decode step, not the prefill, sets the peak
    assert formulas.evaluate(B=b, P=32, T=150)["peak"] > formulas.evaluate(B=b, P=32, T=30)["peak"]
    with pytest.raises(fxmem.SpecError, match="give exactly"):
        formulas.evaluate(B=2, P=64)
    # a budget the weights alone exceed: 0 at once, with the reason, and no analysis at smaller sizes
    weights = sum(p.nbytes for p in model.parameters())
    for dim, fixed in (("B", dict(P=32)), ("P", dict(B=2))):
        none = formulas.max_size(dim, weights - 1, T=150, **fixed)
        assert none == 0 and "resident alone" in none.reason
    assert formulas.reanalyses == 0 and not formulas._concrete


@pytest.mark.slow  # ~150 s: 300 decode steps analysed, and run for real
def test_past_the_regions_bound_the_tokens_are_analysed_as_asked():
    """P + T past a bound of the formulas' region (P <= 191: CPU flash attention's block sizes, which the
    guards do not tell apart from the decode steps'): re-analysed near the sizes asked, else that
    number of tokens analysed itself - exact against a real call either way."""
    model = _model("llama")
    formulas = fxmem.generation(model, ("B", "P"), new_tokens="T")
    assert not formulas._holds(dict(B=2, P=64, T=300))
    at = formulas.evaluate(B=2, P=64, T=300)
    assert (at["peak_above_resident"], at["retained"]) == _real(model, 2, 64, 300, "dynamic")


@pytest.mark.slow  # test_cli_serve prints the same summary
def test_serve_summary_at_many_tokens_uses_the_formulas_and_agrees():
    from fxmem.generation import serve_summary

    model = _model("llama")
    text = serve_summary(model, batch=2, prompt=40, new_tokens=9)
    exact = fxmem.generation(model, ("B", "P"), new_tokens=9).evaluate(B=2, P=40)["peak"]
    assert fxmem.format_bytes(exact) in text, text


def test_serve_summary_says_when_the_call_runs_past_the_models_positions():
    from fxmem.generation import serve_summary

    model = _model("llama")
    model.config.max_position_embeddings = 40
    assert "max_position_embeddings (40)" in serve_summary(model, batch=2, prompt=38, new_tokens=4)
    assert "max_position_embeddings" not in serve_summary(model, batch=2, prompt=36, new_tokens=4)


def test_formulas_in_new_tokens_are_refused_on_cuda_before_any_analysis():
    model = _model("llama")
    with pytest.raises(fxmem.SpecError, match="CPU numbers"):
        fxmem.generation(model, ("B", "P"), new_tokens="T", options=fxmem.AnalysisOptions(device="cuda"))
