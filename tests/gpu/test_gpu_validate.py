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


def test_validate_writes_the_allocators_own_history_beside_the_prediction(tmp_path):
    import pickle

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    v = fxmem.validate(model, ("B", 64), dims=dict(B=37), device="cuda", snapshot=tmp_path)
    for name in ("forward", "step"):
        with open(tmp_path / f"real_{name}.pickle", "rb") as f:
            real = pickle.load(f)
        assert real["device_traces"] and any(e["action"] == "alloc" for trace in real["device_traces"] for e in trace)
        assert (tmp_path / f"predicted_{name}.pickle").exists()
    assert v.rows
