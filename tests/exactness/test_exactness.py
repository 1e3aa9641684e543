"""fxmem's numbers equal a real CPU run, byte for byte, at sizes the analysis never saw.

For each model: analyse once (at the default example sizes, primes near 100), then run the traced
GraphModule for real at three other sizes and compare peak-above-start and retained bytes with
what the CPU allocator itself reported (see ``fxmem.measure``), and resident bytes with the real
parameters and inputs.
"""
from __future__ import annotations

import pytest
import torch

from conftest import check_against_real_run
from zoo.cases import CASES, gat

@pytest.mark.parametrize("name", sorted(CASES))
def test_training_forward_matches_real_run(name):
    factory, specs, sizes, kw = CASES[name]
    torch.manual_seed(0)
    model = factory().train()
    check_against_real_run(model, specs, sizes, **kw)


@pytest.mark.parametrize("name", ["seed000-layer-as-written", "seed002-attention", "conv-pool", "batchnorm", "transformer"])
def test_inference_matches_real_run(name):
    factory, specs, sizes, kw = CASES[name]
    torch.manual_seed(0)
    model = factory().eval()
    check_against_real_run(model, specs, sizes, grad=False, **kw)


def test_outside_region_reanalyses_and_stays_exact():
    """N=1 is special to PyTorch (broadcasting, contiguity), so the formulas do not cover it;
    evaluate() re-analyses there and still matches the real run."""
    model = gat.GraphAttentionLayerFixed(6, 16, dropout=0.0)
    report = check_against_real_run(model, (("B", "N", 6), ("B", "N", "N")), [dict(B=1, N=1), dict(B=1, N=9)])
    assert report.region == ["B >= 2", "N >= 5"]  # 16*N**2 >= 400 (a kernel path), said as a bound


def test_all_concrete_sizes_evaluate_without_dims():
    """A model analysed at concrete sizes has no dims: evaluate() takes none and matches a real run."""
    torch.manual_seed(0)
    model = gat.GraphAttentionLayerFixed(6, 16, dropout=0.0)
    report = check_against_real_run(model, ((3, 7, 6), (3, 7, 7)), [{}])
    assert report.symbols == {} and report.peak.is_Integer
