"""fxmem: how much memory a PyTorch model takes, as a formula in its sizes.

The analysis runs capture -> simulation -> accounting -> report: :mod:`fxmem.capture` (fx
tracing), :mod:`fxmem.simulation` (one run on fake tensors with symbolic sizes, every storage
recorded), :mod:`fxmem.kernels` (what real kernels do that fake ones do not), :mod:`fxmem.accounting`
(formulas and exact numbers), :class:`Report` and :mod:`fxmem.views`. The rewrites are
:mod:`fxmem.passes` (``fxmem.optimize``, verified); :func:`validate` checks a prediction on a
real run.

>>> import torch, fxmem
>>> report = fxmem.analyze(torch.nn.Linear(6, 128), ("B", "N", 6))
>>> report.peak
536*B*N + 3584
"""
from ._layout import ensure_passes

ensure_passes()

from . import kernels  # noqa: E402
from .analyze import analyze  # noqa: E402
from .errors import (DeviceError, FxMemError, KernelError, ModelError, ShapeError, SpecError,  # noqa: E402
                     TraceError, UnsupportedOpError)
from .passes import optimize  # noqa: E402
from .report import Report, format_bytes  # noqa: E402
from .specs import TensorSpec  # noqa: E402
from .validate import validate  # noqa: E402

__all__ = [
    "analyze", "optimize", "validate", "Report", "TensorSpec", "format_bytes", "kernels",
    "FxMemError", "SpecError", "TraceError", "ShapeError", "UnsupportedOpError", "DeviceError", "ModelError",
    "KernelError",
]
__version__ = "0.1.0"
