"""A library check that asks "is this tensor traced?" only to decide whether to log a warning
(transformers' ``warn_if_padding_and_no_attention_mask``, reached by DeBERTa-v2) does not make the
report inexact: its real path reads two token columns and changes neither peak nor retained bytes.
A check that decides on an allocation (the attention mask) still flags the report.
"""
from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem.measure import measure

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("grad", [False, True])
def test_deberta_v2_is_exact_and_not_flagged_for_its_padding_warning(grad):
    config = transformers.DebertaV2Config(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(config).eval()
    report = fxmem.analyze(model, fxmem.TensorSpec(("B", "L"), dtype=torch.int64), grad=grad)
    assert report.exact, report.notes
    assert any("warn_if_padding_and_no_attention_mask" in n and "peak and retained are unchanged" in n
               for n in report.notes)
    for b, length in ((1, 9), (3, 20)):
        ids = torch.randint(0, 100, (b, length))
        ids[:, 0] = 0  # a pad token in the first column: the real run takes the warning's branch
        with torch.set_grad_enabled(grad):
            real = measure(lambda: model(ids) if report.mode == "eager" else report.graph_module(ids))
        at = report.evaluate(B=b, L=length)
        assert (at["peak_above_resident"], at["retained"]) == (real.peak_above_start, real.retained), (b, length)


def test_a_check_that_decides_an_allocation_still_flags_the_report():
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                                      attn_implementation="sdpa")
    model = transformers.LlamaModel(config).eval()
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    report = fxmem.analyze(model, ids, ids, grad=False)  # input_ids, attention_mask of unknown values
    assert not report.exact and any("asked whether a tensor" in n and "may not be exact" in n for n in report.notes)
