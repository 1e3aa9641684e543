"""ResNet-18 (torchvision's architecture, tests/zoo/resnet.py, at width 16 to keep the real steps
short) trained with AdamW, analysed once with symbolic ``("B", 3, "H", "W")``: exact against real
training steps at 11 sizes the analysis never saw - batch 1 to 6, images from 7x9 to 128x96 - on
every CPU. Before issue 44's measured workspaces its training analysis hit the recursion limit (its
pinned convolution dims nested the size expressions), and its forward held at one batch only."""
from __future__ import annotations

import torch

import fxmem
from fxmem.kernels.measured import StructureChanged
from conftest import check_steps_against_report
from zoo.resnet import SIZES, ResNet18


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def test_resnet18_training_step_is_exact_from_batch_1_and_tiny_to_large_images():
    torch.manual_seed(0)
    model = ResNet18(width=16, num_classes=10).train()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw)
    assert report.exact, report.notes
    assert {str(s) for s in report.formulas()["train_peak"].free_symbols} == {"B", "H", "W"}
    check_steps_against_report(model, report, SIZES, adamw)
    # every size on the first analysis' side of the model's own guards (a batch of 1, a last map of
    # 1x1) is answered from its formulas: oneDNN's buffers are measured there, never re-simulated
    same = [d for d in SIZES if d["B"] >= 2 and min(d["H"], d["W"]) >= 33]
    assert len(same) >= 6
    for d in same:
        try:
            report._plan.evaluate({report.symbols[k]: v for k, v in d.items()})
        except StructureChanged:  # this CPU's oneDNN orders a kernel's outputs otherwise there: analysed there
            continue
        assert report._at(d)[0] is report, (d, report.regions())
