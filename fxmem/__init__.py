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

The public names are loaded on first use, so ``import fxmem`` (and ``fxmem --help``) does not
import torch until something needs it.
"""
from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

from ._layout import ensure_passes
from .errors import (AnalysisTimeout, DeviceError, FxMemError, InternalError, KernelError, ModelError,  # noqa: F401
                     NothingToTrainError, ShapeError, SpecError, TraceError, UnsupportedOpError,
                     UserCodeError, ProfilerBusyError, MeasureError)

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "analyze": ".analyze", "optimize": ".passes", "validate": ".validate", "Report": ".report",
    "TensorSpec": ".specs", "format_bytes": ".report", "precisions": ".precisions", "kernels": None,
    "backend": ".backend", "AnalysisOptions": ".options", "world_sizes": ".distributed.world_sizes",
    "passes": None, "from_config": ".llm", "llm_answer": ".llm", "llm_layouts": ".llm_layouts",
    "generation": ".generation",
}

__all__ = [
    "analyze", "optimize", "validate", "precisions", "backend", "Report", "AnalysisOptions", "TensorSpec",
    "format_bytes", "kernels", "passes", "world_sizes", "from_config", "llm_answer", "llm_layouts", "generation",
    "FxMemError", "SpecError", "TraceError", "ShapeError", "UnsupportedOpError", "DeviceError", "ModelError",
    "KernelError", "InternalError", "NothingToTrainError", "UserCodeError", "ProfilerBusyError", "MeasureError",
    "AnalysisTimeout",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fxmem' has no attribute {name!r}")
    with warnings.catch_warnings():
        # torch warns "Failed to initialize NumPy" when its fake-tensor modules are first imported
        # without numpy; fxmem never converts to numpy, so the warning only confuses
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        importlib.import_module(".kernels", __name__)  # the kernel registry fills itself on import
        module = importlib.import_module(_LAZY[name] or "." + name, __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # the public API only (not the modules and helpers this file imports for itself)
    return sorted(set(__all__) | {"__version__"})


class _Package(types.ModuleType):
    """The import system binds a submodule to its package's attribute when it is first imported
    (``fxmem.analyze`` the module, by ``from .analyze import analyze`` anywhere); the function of
    the same name must win, as it did when ``__init__`` imported it eagerly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and _LAZY[name] == "." + name and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
# last: loading the passes from a source checkout imports fxmem.analyze (the module), which must
# not replace the function of that name (_Package guards the attribute from here on)
ensure_passes()
