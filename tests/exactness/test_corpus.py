"""Third-party models (transformers, diffusers, PyTorch Geometric, and torch-only models of timm's and
diffusers' building blocks) built from configs with random weights,
forward and an AdamW training step, exact against the allocator at two held-out sizes including
batch 1. Entries whose package is not installed skip (torchvision and timm need a CUDA build of
torch from the registry; not part of this suite yet)."""
from __future__ import annotations

import pytest
import torch

import fxmem
from corpus.harness import compare
from corpus.models import CORPUS


# the heaviest entries (several seconds to minutes each) run in the slow set; CI keeps one model of
# each family (llama, gpt2, bert, vit, the PyG layers, the torch-only blocks)
_SLOW = {"diffusers-unet", "t5", "bart", "llama-mask", "llama-sdpa-mask-filled", "qwen2", "distilbert", "clip-text"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in sorted(CORPUS)])
def test_corpus_model_is_exact(name):
    entry = CORPUS[name]
    if not entry.available():
        pytest.skip(f"{entry.requires} is not installed")
    if name == "llama-sdpa-mask":
        pytest.skip("its mask's values decide the path: see test_a_path_decided_by_values_is_flagged_or_followed")
    rows = compare(name, entry.build, entry.specs, entry.sizes, mode=entry.mode, makers=entry.makers, data=entry.data)
    assert {dims.get("B", dims.get("N")) for dims in entry.sizes} & {1}, "a held-out size of 1"
    if entry.flagged:  # a workspace only a real run shows: never exact, never silent
        assert all(r.says_inexact for r in rows) and any(not r.exact for r in rows)
        return
    bad = [r for r in rows if not r.exact]
    assert not bad, "\n".join(f"{r.what} at {r.sizes}: predicted {r.predicted}, measured {r.measured}" for r in bad)


def test_a_path_decided_by_values_is_flagged_or_followed():
    """transformers skips building an attention mask when the mask is all ones; on fake tensors it
    cannot look. Without the values the report says its numbers may not be exact (and names the
    library function); with TensorSpec(fill=1) it follows the real path, exactly."""
    pytest.importorskip("transformers")
    unknown = CORPUS["llama-sdpa-mask"]
    report = fxmem.analyze(unknown.build(), *unknown.specs)
    assert not report.exact
    assert any("_ignore_causal_mask_sdpa" in n and "fill=1" in n for n in report.notes)
    assert "(B, L)" in " ".join(report.notes)  # the user's dim names, not PyTorch's symbols
    known = CORPUS["llama-sdpa-mask-filled"]
    rows = compare("filled", known.build, known.specs, known.sizes, makers=known.makers, train=False)
    assert all(r.exact for r in rows)
    report = fxmem.analyze(known.build(), *known.specs)
    assert report.exact and any("answered as for the real tensor" in n for n in report.notes)


def test_pyg_default_self_loops_make_a_named_dim():
    """GCNConv's default add_self_loops removes existing loops first: the number of edges kept depends
    on the edge list's values. It becomes the dim K1, bounded by E, made at PyG's line; evaluate()
    asks for it (the corpus rows check the numbers against real runs)."""
    gnn = pytest.importorskip("torch_geometric.nn")
    report = fxmem.analyze(gnn.GCNConv(16, 32), ("N", 16), fxmem.TensorSpec((2, "E"), dtype=torch.int64))
    assert set(report.symbols) == {"N", "E", "K1"} and "K1" in str(report.peak)
    assert "torch_geometric/utils/loop.py:" in report.data_dims["K1"] and "K1 <= E" in report.data_dims["K1"]
    with pytest.raises(fxmem.SpecError, match=r"give the value of K1.*loop.py"):
        report.evaluate(N=5, E=9)
    with pytest.raises(fxmem.SpecError, match=r"K1=10 is more than.*K1 <= E"):
        report.evaluate(N=5, E=9, K1=10)


def test_hugging_face_models_as_users_call_them_work_in_the_default_mode():
    """transformers wraps forward (functools.wraps), which torch.fx cannot trace ("co_varnames is too
    small"): the default mode analyses the original forward, says why, and is exact; mode="graph"
    refuses with advice that can help (mode='eager'), not leaf modules."""
    transformers = pytest.importorskip("transformers")
    from fxmem.measure import measure

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    with pytest.raises(fxmem.TraceError) as err:
        fxmem.analyze(model, ids, mode="graph")
    assert "modeling_gpt2.py:" in str(err.value) and "mode='eager'" in str(err.value)
    assert "leaf_modules" not in str(err.value)
    report = fxmem.analyze(model, ids)
    assert report.mode == "eager" and "modeling_gpt2.py:" in report.capture.reason
    assert "capture: eager mode" in report.summary()
    for dims in (dict(B=1, L=7), dict(B=3, L=12)):
        x = torch.randint(0, 100, (dims["B"], dims["L"]))
        m = measure(lambda: model(x))
        ev = report.evaluate(**dims)
        assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained), dims
