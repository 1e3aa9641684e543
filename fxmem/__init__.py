"""fxmem: how much memory a PyTorch model takes, as a formula in its sizes.

>>> import torch, fxmem
>>> report = fxmem.analyze(torch.nn.Linear(6, 128), ("B", "N", 6))
>>> print(report.summary())                                  # doctest: +SKIP
"""
from .analyze import analyze
from .errors import DeviceError, FxMemError, ModelError, ShapeError, SpecError, TraceError, UnsupportedOpError
from .optimize import optimize
from .report import Report, format_bytes
from .specs import TensorSpec
from .validate import validate

__all__ = [
    "analyze", "optimize", "validate", "Report", "TensorSpec", "format_bytes",
    "FxMemError", "SpecError", "TraceError", "ShapeError", "UnsupportedOpError", "DeviceError", "ModelError",
]
__version__ = "0.1.0"
