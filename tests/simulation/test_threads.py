"""Analyses from several threads at once are independent and exact: each thread gets the very
formulas a single-threaded analysis of its model gives (fxmem serialises analyses with one
process-wide lock, :mod:`fxmem.isolation`)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import fxmem


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


class Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Conv1d(3, 6, 3)
        self.norm = torch.nn.BatchNorm1d(6)

    def forward(self, x):
        return torch.relu(self.norm(self.c(x))).mean(-1)


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v


CASES = {
    "mlp adam": (MLP, (("B", 8),), lambda p: torch.optim.Adam(p, lr=1e-3), {"B": 5}),
    "conv sgd": (Conv, (("B", 3, "L"),), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {"B": 3, "L": 20}),
    "attention adamw": (Attention, (("B", "L", 16),), lambda p: torch.optim.AdamW(p), {"B": 2, "L": 7}),
    "mlp forward": (MLP, (("B", 8),), None, {"B": 1}),  # B=1: outside the region, evaluate re-analyses
}


def analyse(name: str) -> tuple:
    make, specs, optimizer, dims = CASES[name]
    torch.manual_seed(0)
    report = fxmem.analyze(make(), *specs, optimizer=optimizer) if optimizer else fxmem.analyze(make(), *specs)
    return ({k: str(v) for k, v in report.formulas().items()}, dict(report.evaluate(**dims)), report.exact)


def test_concurrent_analyses_equal_single_threaded_ones():
    alone = {name: analyse(name) for name in CASES}
    names = list(CASES) * 2
    start = threading.Barrier(len(names))

    def job(name: str) -> tuple:
        start.wait()  # all at once
        return name, analyse(name)

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        results = list(pool.map(job, names))
    for name, got in results:
        assert got == alone[name], name
