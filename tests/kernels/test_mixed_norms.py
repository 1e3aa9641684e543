"""Half-precision activations through float32-weight norms (what autocast does to BatchNorm and
LayerNorm, or a cast in forward): CPU kernels keep the statistics in float32, which fake kernels do
not; checked against real forward and training steps."""
from __future__ import annotations

import pytest
import torch

import fxmem
from conftest import check_against_real_run, check_training_against_real_run


class HalfNorm(torch.nn.Module):
    def __init__(self, norm: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.norm = torch.nn.BatchNorm1d(6) if norm == "batch" else torch.nn.LayerNorm(6)
        self.scale = torch.nn.Parameter(torch.ones(6))

    def forward(self, x):
        h = self.norm((x * self.scale).to(self.dtype))  # a half-precision input, float32 weights
        return h.float().relu()


CASES = [(n, d) for n in ("batch", "layer") for d in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("norm, dtype", CASES, ids=[f"{n}-{d}".replace("torch.", "") for n, d in CASES])
def test_half_input_float_weight_norms_match_real_runs(norm, dtype):
    model = HalfNorm(norm, dtype)
    check_against_real_run(model, (("B", 6),), [{"B": 5}, {"B": 33}])
    check_training_against_real_run(model, (("B", 6),), [{"B": 7}], lambda p: torch.optim.SGD(p, lr=0.1))


def test_autocast_batchnorm_training_is_analysed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    report = fxmem.analyze(model, ("B", 4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), autocast=torch.bfloat16)
    assert report.train_peak is not None  # the real step runs, so the analysis does too (it refused before)
