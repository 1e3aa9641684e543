"""Models that do not fit in memory: built under torch.device("meta"), analysed all the same.

The evidence: the same architecture built for real gives the same formulas, and those match the
allocator on real runs at sizes the analysis never saw.
"""
from __future__ import annotations

import torch

import fxmem
from conftest import check_against_real_run, load_example

llama = load_example("llama")
TOKENS = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)


def test_a_meta_llama_has_the_formulas_of_the_real_one():
    torch.manual_seed(0)
    real = llama.Llama(llama.TINY)
    with torch.device("meta"):
        meta = llama.Llama(llama.TINY)
    assert all(p.device.type == "meta" for p in meta.parameters())
    on_meta = fxmem.analyze(meta, TOKENS)
    for_real = check_against_real_run(real, (TOKENS,), [dict(B=2, L=40), dict(B=3, L=57)],
                                      makers={"tokens": lambda shape, sizes: torch.randint(0, llama.TINY.vocab, shape)})
    assert on_meta.formulas() == for_real.formulas()
    assert on_meta.evaluate(B=3, L=57) == for_real.evaluate(B=3, L=57)


def test_a_meta_llama_training_step_and_bfloat16():
    with torch.device("meta"):
        meta = llama.Llama(llama.TINY).to(torch.bfloat16)
    report = fxmem.analyze(meta, TOKENS, dtype=torch.bfloat16, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    params = sum(p.numel() for p in meta.parameters())
    assert report.grads == 2 * params  # bfloat16 gradients
    assert report.optimizer_state == 2 * 2 * params + 4 * len(list(meta.parameters()))  # exp_avg(_sq), float32 steps
    assert report.train_peak.free_symbols == {report.symbols["B"], report.symbols["L"]}
