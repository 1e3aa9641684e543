"""Hyperparameter dims: the model is built with symbolic constructor arguments; the formulas hold
in B, L, H, D together and match real runs of concrete constructions never sampled."""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn as nn

import fxmem
from conftest import load_example, real_resident
from fxmem.measure import measure
from fxmem.capture import trace

attention = load_example("seed_attention")
gat = load_example("seed_gat")


def test_attention_formulas_hold_in_heads_and_head_dim():
    report = fxmem.analyze(attention.Attention, ("B", "L", "H*D"), hparams={"dim": "H*D", "num_heads": "H"})
    assert set(report.symbols) == {"B", "L", "H", "D"}
    B, L, H, D = (report.symbols[k] for k in "BLHD")
    # parameters: qkv (3C x C, no bias) + proj (C x C + C), C = H*D, 4 bytes each
    assert sympy.expand(report.resident - (4 * B * L * H * D + 4 * (4 * (H * D) ** 2 + H * D))) == 0
    assert B * H * L**2 in {m for term in sympy.Add.make_args(report.retained) for m in [term.as_coeff_Mul()[1]]}
    for (H_, D_, B_, L_) in [(4, 16, 3, 9), (2, 8, 5, 4), (8, 4, 2, 33), (3, 5, 4, 7)]:  # never sampled
        model = attention.Attention(H_ * D_, H_)
        gm = trace(model)
        x = torch.randn(B_, L_, H_ * D_)
        m = measure(lambda: gm(x))
        pred = report.evaluate(B=B_, L=L_, H=H_, D=D_)
        assert (m.peak_above_start, m.retained) == (pred["peak_above_resident"], pred["retained"]), (H_, D_)
        assert pred["resident"] == real_resident(model, [x])


def test_gat_features_as_a_dim_in_eager_mode():
    report = fxmem.analyze(gat.GraphAttentionLayerFixed, ("B", "N", 6), ("B", "N", "N"),
                           hparams={"out_features": "F"}, init={"in_features": 6, "dropout": 0.0}, mode="eager")
    B, N, F = (report.symbols[k] for k in "BNF")
    pair = [s for s in report.storages if s.op == "aten.cat"][0]
    assert sympy.expand(pair.bytes - 8 * B * N**2 * F) == 0  # [B, N, N, 2F] floats
    model = gat.GraphAttentionLayerFixed(6, 24, dropout=0.0)
    x, adj = torch.randn(2, 7, 6), torch.rand(2, 7, 7) > 0.5
    m = measure(lambda: model(x, adj))
    pred = report.evaluate(B=2, N=7, F=24)
    assert (m.peak_above_start, m.retained) == (pred["peak_above_resident"], pred["retained"])


def test_hparams_errors():
    with pytest.raises(fxmem.SpecError, match="has no argument 'heads'"):
        fxmem.analyze(attention.Attention, ("B", "L", "C"), hparams={"dim": "C", "heads": "H"})
    with pytest.raises(fxmem.ModelError, match="needs the model's class or a factory"):
        fxmem.analyze(attention.Attention(8, 2), ("B", "L", 8), hparams={"dim": "C"})
    with pytest.raises(fxmem.ModelError, match="its class with hparams"):
        fxmem.analyze(attention.Attention, ("B", "L", 8))


def test_a_constructor_that_forces_a_number_is_noted_and_still_exact():
    class Fixed(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.lin = nn.Linear(int(width), 4)  # int() makes the width concrete

        def forward(self, x):
            return self.lin(x)

    report = fxmem.analyze(Fixed, ("B", "W"), hparams={"width": "W"})
    assert any("fixed dim W" in note for note in report.notes) and "W == 97" in report.region
    real = Fixed(5)
    x = torch.randn(3, 5)
    gm = trace(real)  # traced outside the measurement: tracing saves torch's RNG state (a 5,056-byte tensor)
    m = measure(lambda: gm(x))
    assert report.evaluate(B=3, W=5)["peak_above_resident"] == m.peak_above_start
