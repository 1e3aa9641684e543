"""Progress of slow steps, visible from Python: fxmem logs it on the ``fxmem`` logger (INFO:
tracing, simulating, calibrating kernels, re-analysing outside the formulas' region), and
``verbose=True`` (an :class:`~fxmem.AnalysisOptions` field) prints those records to stderr.

>>> import logging; logging.getLogger("fxmem").setLevel(logging.INFO)     # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Iterator

_SHOWING = threading.local()  # a handler is already printing this thread's progress (nested analyses)


@contextlib.contextmanager
def progress_to_stderr() -> Iterator[None]:
    """Print the ``fxmem`` logger's INFO records (progress) to stderr while the block runs
    (``verbose=True``); the logger's level and handlers are as they were afterwards."""
    logger = logging.getLogger("fxmem")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("fxmem: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    outer = showing()
    _SHOWING.on = True
    try:
        yield
    finally:
        _SHOWING.on = outer
        logger.removeHandler(handler)
        logger.setLevel(level)


def showing() -> bool:
    """Whether :func:`progress_to_stderr` is already active on this thread."""
    return getattr(_SHOWING, "on", False)
