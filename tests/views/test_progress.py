"""Progress is visible from Python: the ``fxmem`` logger's INFO records (tracing, simulating,
re-analysing outside the region), printed to stderr with ``verbose=True``; the logger is left as
it was."""
from __future__ import annotations

import logging

import torch

import fxmem


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def test_verbose_prints_progress_and_restores_the_logger(capsys):
    logger = logging.getLogger("fxmem")
    before = (logger.level, list(logger.handlers))
    report = fxmem.analyze(_model(), ("B", "N", 8), verbose=True)
    err = capsys.readouterr().err
    assert "fxmem: simulating" in err
    assert (logger.level, list(logger.handlers)) == before
    report.evaluate(B=4, N=1)  # outside the region (N >= 2): re-analysed, and said so
    err = capsys.readouterr().err
    assert "re-analysing at B=4, N=1" in err and "fxmem: simulating" in err
    assert report.options.verbose


def test_quiet_by_default_and_the_logger_hears_it(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="fxmem"):
        report = fxmem.analyze(_model(), ("B", "N", 8))
        report.evaluate(B=4, N=1)
    assert capsys.readouterr().err == ""
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("simulating") for m in messages)
    assert any(m.startswith("re-analysing at B=4, N=1") for m in messages)
