"""fxmem.validate on CPU (the GPU version is tests/gpu/): the table agrees with the allocator."""
from __future__ import annotations

import pytest
import torch

import fxmem
from conftest import load_example

gat = load_example("seed_gat")
attention = load_example("seed_attention")


def test_validate_on_cpu_is_exact():
    v = fxmem.validate(gat.GraphAttentionLayerFixed(6, 16), ("B", "N", 6), ("B", "N", "N"), dims=dict(B=3, N=11),
                       device="cpu", optimizer=lambda p: torch.optim.Adam(p))
    assert v.ok and all(r.diff == 0 for r in v.rows), str(v)
    assert {r.what for r in v.rows} >= {"forward: peak above resident", "training step: peak above resident",
                                        "optimizer state"}
    text = str(v)
    assert "predicted" in text and "all within 1.0%: yes" in text
    assert v.to_dict()["rows"][0]["percent"] == 0


def test_validate_eager_mode_and_model_untouched():
    model = attention.Attention(64, 8)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    v = fxmem.validate(model, ("B", "L", 64), dims=dict(B=2, L=9), device="cpu", mode="eager")
    assert v.ok, str(v)
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())  # a copy was trained


def test_validate_errors():
    with pytest.raises(fxmem.SpecError, match="dims="):
        fxmem.validate(torch.nn.Linear(2, 2), ("B", 2), dims={}, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(fxmem.DeviceError, match="needs a CUDA GPU"):
            fxmem.validate(torch.nn.Linear(2, 2), ("B", 2), dims=dict(B=2), device="cuda")
