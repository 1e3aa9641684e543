"""Mixture-of-experts decoders with transformers' default experts kernel (F.grouped_mm), whose fake
kernel demands bfloat16 where the CPU kernel runs float32: analysed exactly (fxmem's symbolic rule
for aten._grouped_mm), against real runs. Routing is data: it decides which rows each expert's
matmul takes (``offs``), never a size - every token's top-k rows are sorted and multiplied once.
"""
from __future__ import annotations

import pytest
import torch

import fxmem
from conftest import check_training_against_real_run
from fxmem.measure import measure

transformers = pytest.importorskip("transformers")
if not hasattr(torch.nn.functional, "grouped_mm"):
    pytest.skip("F.grouped_mm needs a newer torch", allow_module_level=True)

SPEC = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
_SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              num_experts_per_tok=2, max_position_embeddings=256)


def mixtral():
    config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **_SMALL)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def qwen2_moe():
    config = transformers.Qwen2MoeConfig(intermediate_size=32, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=16, num_experts=4, **_SMALL)
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(config)


@pytest.mark.parametrize("make", [mixtral, qwen2_moe])
@pytest.mark.parametrize("grad", [False, True])
def test_moe_decoder_forward_is_exact(make, grad):
    model = make().eval()
    report = fxmem.analyze(model, SPEC, grad=grad)
    assert report.exact
    for b, length in ((2, 40), (3, 77)):
        ids = torch.randint(0, 64, (b, length))
        with torch.set_grad_enabled(grad):
            real = measure(lambda: model(ids) if report.mode == "eager" else report.graph_module(ids))
        at = report.evaluate(B=b, L=length)
        assert (at["peak_above_resident"], at["retained"]) == (real.peak_above_start, real.retained), (b, length)


def test_moe_decoder_training_step_is_exact():
    # the backward's grouped_mm calls take transposed operands: the real-kernel probe builds its
    # stand-ins with the call's strides (contiguous ones were refused: "strides should be multiple of 16 bytes")
    report = check_training_against_real_run(mixtral(), (SPEC,), [dict(B=2, L=40)], lambda p: torch.optim.AdamW(p),
                                             loss=lambda out: out.logits.sum())
    assert report.exact
