"""On a real GPU: fxmem's CUDA predictions against torch.cuda.max_memory_allocated, for the models
of tests/ and examples/. Skipped where there is no CUDA device (CI has none)."""
from __future__ import annotations

import pytest
import torch

import fxmem
from conftest import load_example
from test_exactness import CASES

pytestmark = pytest.mark.gpu

# Kernels whose workspace the CUDA libraries choose at run time (documented in the README):
# cuDNN convolutions. Their rows are reported, not required to match exactly.
WORKSPACE = {"conv-pool"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_predictions_match_the_gpu(name):
    factory, specs, sizes, kw = CASES[name]
    torch.manual_seed(0)
    dims = sizes[0]
    inputs = None
    if "makers" in kw:
        from conftest import real_inputs

        report = fxmem.analyze(factory(), *specs)
        inputs = real_inputs(report, dims, kw["makers"])
    v = fxmem.validate(factory().train(), *specs, dims=dims, device="cuda", inputs=inputs,
                       optimizer=lambda p: torch.optim.Adam(p))
    print(v)
    if name in WORKSPACE:
        assert v.rows[1].diff == 0, str(v)  # retained: tensors only
    else:
        assert all(r.diff == 0 for r in v.rows), str(v)


def test_seed_gat_at_the_seeds_sizes():
    gat = load_example("seed_gat")
    v = fxmem.validate(gat.GraphAttentionLayerFixed(6, 128), ("B", "N", 6), ("B", "N", "N"), dims=dict(B=4, N=500),
                       device="cuda")
    print(v)
    assert v.ok, str(v)
