"""The budget solver returns the exact largest size: it fits, the next one does not."""
from __future__ import annotations

import pytest
import torch

import fxmem
from conftest import load_example
from fxmem.units import parse_bytes

gat = load_example("seed_gat")


def test_parse_bytes():
    assert parse_bytes("32GiB") == 32 * 2**30 and parse_bytes("32 GB") == 32 * 10**9
    assert parse_bytes("1.5MiB") == 1536 * 1024 and parse_bytes(4096) == 4096
    for bad in ("32 parsecs", "-1GB", 0, True, "GiB"):
        with pytest.raises(fxmem.SpecError):
            parse_bytes(bad)


def test_largest_batch_is_exact():
    report = fxmem.analyze(gat.GraphAttentionLayerFixed(6, 128), ("B", "N", 6), ("B", "N", "N"),
                           optimizer=lambda p: torch.optim.Adam(p))
    for train in (False, True):
        key = "train_peak" if train else "peak"
        b = report.max_size("B", budget="32GiB", train=train, N=500)
        assert report.evaluate(B=b, N=500)[key] <= 32 * 2**30 < report.evaluate(B=b + 1, N=500)[key]
    n = report.max_size("N", budget="8GiB", B=4)
    assert report.evaluate(B=4, N=n)["peak"] <= 8 * 2**30 < report.evaluate(B=4, N=n + 1)["peak"]
    assert report.max_size("B", budget=1000, N=500) == 0  # not even one sample fits 1000 bytes


def test_budget_errors():
    report = fxmem.analyze(gat.GraphAttentionLayerFixed(6, 16), ("B", "N", 6), ("B", "N", "N"))
    with pytest.raises(fxmem.SpecError, match="not a dim"):
        report.max_size("Q", budget="1GiB", N=5)
    with pytest.raises(fxmem.SpecError, match="optimizer="):
        report.max_size("B", budget="1GiB", train=True, N=5)
    with pytest.raises(fxmem.SpecError, match="missing dim"):
        report.max_size("B", budget="1GiB")
