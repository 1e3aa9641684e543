"""Recurrent layers on the CPU (fxmem/kernels/rnn.py): nn.LSTM runs oneDNN's RNN primitive, whose
workspace (kept for backward) and scratch only a real run shows; nn.GRU and nn.RNN run ATen's own
loops. PyTorch fixes the sequence and batch sizes where they run, so each size is its own analysis
(``evaluate()`` re-analyses). Evidence: the allocator's counters on real forwards (with and without
grad) and real Adam training steps, at sizes the analysis did not run at.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import check_against_real_run, check_training_against_real_run


class Tagger(nn.Module):
    """A recurrent layer, then a linear head on every step (batch first)."""

    def __init__(self, cell=nn.LSTM, **kw):
        super().__init__()
        self.rnn = cell(16, 24, batch_first=True, **kw)
        self.head = nn.Linear(24 * (2 if kw.get("bidirectional") else 1), 5)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y)


class Encoder(nn.Module):
    """Sequence first, its own initial state, the last hidden state out."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 12, num_layers=2)

    def forward(self, x, h0, c0):
        _, (h, c) = self.rnn(x, (h0, c0))
        return h[-1] + c[-1]


class Projected(nn.Module):
    """An LSTM with a projection (oneDNN does not take it: ATen's own loop runs)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 24, proj_size=8, batch_first=True)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


class OverFlattenedBatches(nn.Module):
    """An LSTM over (B*N) sequences: PyTorch fixes the product's size, so fxmem fixes B and N too
    (the input's strides are over both; it was refused: "Cannot call numel() ... symbolic")."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 4, batch_first=True)

    def forward(self, x):
        return self.rnn(torch.nn.functional.dropout(x.flatten(0, 1), 0.5, self.training))[0]


MODELS = {
    "lstm": (lambda: Tagger(), (("B", "T", 16),)),
    "lstm-2-layer-bidirectional": (lambda: Tagger(num_layers=2, bidirectional=True), (("B", "T", 16),)),
    "lstm-initial-state": (lambda: Encoder(), (("T", "B", 8), (2, "B", 12), (2, "B", 12))),
    "gru": (lambda: Tagger(nn.GRU), (("B", "T", 16),)),
    "rnn-relu": (lambda: Tagger(nn.RNN, nonlinearity="relu"), (("B", "T", 16),)),
    "lstm-projected": (lambda: Projected(), (("B", "T", 16),)),  # not oneDNN: ATen's own loop
    "lstm-over-flattened-batches": (lambda: OverFlattenedBatches(), (("B", 2, "T", 16),)),
}
SIZES = [dict(B=3, T=7), dict(B=2, T=19)]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_forward_is_exact_against_real_runs(name, grad):
    # nn.GRU without grad was 940,512 B high at B=97, T=101: inside ATen's GRU, at::linear adds the
    # input projection's bias in place for real tensors, out of place for fake ones
    torch.manual_seed(0)
    build, specs = MODELS[name]
    report = check_against_real_run(build(), specs, SIZES, grad=grad)
    assert report.exact, report.notes


@pytest.mark.parametrize("name", sorted(MODELS))
def test_adam_training_step_is_exact_against_real_steps(name):
    torch.manual_seed(0)
    build, specs = MODELS[name]
    report = check_training_against_real_run(build(), specs, SIZES, torch.optim.Adam)
    assert report.exact, report.notes


def test_the_oneDNN_workspace_is_counted_and_kept_for_backward():
    # the fake kernel's workspace is empty; the real one holds every step's gates (and more): it is
    # what the training forward keeps beyond the outputs, and a forward without grad has none
    torch.manual_seed(0)
    model = Tagger()
    train = fxmem.analyze(model, ("B", "T", 16))
    infer = fxmem.analyze(model, ("B", "T", 16), grad=False)
    at_train, at_infer = train.evaluate(B=4, T=9), infer.evaluate(B=4, T=9)
    gates = 4 * 9 * 4 * 24 * 4  # B*T rows of 4 gates of 24 floats
    assert at_train["saved"] > gates and at_infer["saved"] == 0
