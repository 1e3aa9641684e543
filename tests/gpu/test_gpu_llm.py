"""On a real GPU: LLM answers against the GPU's own counters (``torch.cuda.max_memory_allocated``)
- an HF config's training step (``llm_answer(device="cuda")``, AdamW, bf16 and fp32) and
``fxmem.generation`` (prefill and decode with the KV cache, both cache kinds) - at sizes the
analysis did not see. Skipped where there is no CUDA device (CI has none)."""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.generation import Generate, _token
from fxmem.llm import OPTIMIZERS, llm_answer, training_module
from fxmem.measure import measure
from fxmem.training import train_step

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}
QWEN2 = {**LLAMA, "model_type": "qwen2", "num_key_value_heads": 1}


def _real(config: dict, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                                      if k != "model_type"})
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)


@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=["llama", "qwen2-gqa"])
def test_hf_training_step_matches_the_gpu(config):
    answer = llm_answer(fxmem.from_config(config), batch=2, seq=48, device="cuda")
    report = answer.report
    for b, l in ((3, 37), (2, 70)):
        at = report.evaluate(B=b, L=l)
        step = training_module(_real(config)).cuda()
        x = torch.randint(3, 90, (b, l), device="cuda")
        mask = torch.ones(b, l, dtype=torch.long, device="cuda")
        opt = OPTIMIZERS["adamw"](step.parameters())
        loss = lambda out: out  # noqa: E731 - the model returns its loss
        train_step(step, [x, mask], opt, loss)  # AdamW's state and cuBLAS's workspaces now exist
        m = measure(lambda: train_step(step, [x, mask], opt, loss), device="cuda", warmup=0)
        assert (m.peak_above_start, m.retained) == (at["train_peak"] - at["train_resident"], at["train_retained"]), \
            (b, l, report.notes)


@pytest.mark.parametrize("config, cache", [(LLAMA, "dynamic"), (QWEN2, "dynamic"), (LLAMA, "static")],
                         ids=["llama-dynamic", "qwen2-dynamic", "llama-static"])
def test_generation_matches_the_gpu(config, cache):
    model = _real(config).eval()
    report = fxmem.generation(model, ("B", "P"), new_tokens=3, cache=cache,
                              options=fxmem.AnalysisOptions(device="cuda"))
    real = Generate(copy.deepcopy(model).cuda(), 3, cache, {})
    if cache == "static":  # measured 66,560 B above the prediction at B=3, P=37: said, not hidden
        assert not report.exact and any("static KV cache on CUDA" in n for n in report.notes)
        return
    assert report.exact, report.notes
    for b, p in ((3, 37), (2, 70)):
        ids = torch.full((b, p), _token(model), device="cuda")
        mask = torch.ones(b, p, dtype=torch.long, device="cuda")
        with torch.no_grad():
            m = measure(lambda: real(ids, mask), device="cuda", warmup=1)
        at = report.evaluate(B=b, P=p)
        assert (m.peak_above_start, m.retained) == (at["peak_above_resident"], at["retained"]), (b, p, report.notes)
