"""summary(dims) reads as the formula does at the user's sizes: a Max of candidates shows the one
that decides there (its value is evaluate()'s number; the full Max stays in report.peak and
summary(full=True)); sizes outside the formulas' region are re-analysed and the summary says so."""
from __future__ import annotations


import sympy
import torch
from torch import nn

import fxmem
from fxmem.kernels.measured import MeasuredBytes


def _report():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    return fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=torch.optim.AdamW)


def _line(text: str, key: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(key + " "))


def test_binding_candidate_and_reanalysis_note():
    report = _report()
    dims = dict(B=1, H=32, W=32)  # outside the region the analysis made (batch 1, which PyTorch treats apart)
    text = report.summary(dims)
    at, evaluation = report._at(dims, check=True)
    assert at is not report and "re-analysed at B=1, H=32, W=32" in text
    for key in ("peak", "train_peak"):
        full = getattr(at, key)
        line = _line(text, key)
        # a measured kernel's terms print as ws<k>_up<i>(dims): read back as the same functions
        measured = {str(m).split("(")[0]: (lambda *dims, m=m: MeasuredBytes(*m.args[:3], *dims))
                    for m in full.atoms(MeasuredBytes)}
        shown = sympy.sympify(line.split("=", 1)[1].split("->")[0], locals={**at.symbols, **measured})
        values = {at.symbols[k]: v for k, v in dims.items()}
        if full.has(sympy.Max):
            assert "deciding at these sizes" in line and not shown.has(sympy.Max)
        assert int(shown.xreplace(values)) == evaluation[key]  # the candidate's value is evaluate()'s number
        assert f"{evaluation[key]:,} B" in line
    whole = report.summary(dims, full=True)
    assert "deciding" not in whole and str(at.train_peak) in _line(whole, "train_peak")


def test_no_dims_keeps_the_full_formulas():
    report = _report()
    text = report.summary()
    assert str(report.train_peak) in _line(text, "train_peak") and "re-analysed at" not in text
