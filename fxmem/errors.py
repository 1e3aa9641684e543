"""The errors fxmem raises. Each message names what is wrong, where, and what to do."""
from __future__ import annotations


class FxMemError(Exception):
    """Base class of every error fxmem raises on purpose."""


class SpecError(FxMemError, ValueError):
    """An input spec (or a dims mapping) is malformed or does not fit the model."""


class NothingToTrainError(FxMemError):
    """A training step was asked of a model with nothing to train: no parameter requires grad, or
    none reaches the output."""


class TraceError(FxMemError):
    """``torch.fx`` could not trace the model."""


class ShapeError(FxMemError):
    """Running the traced graph on the given shapes failed at an fx node."""


class UnsupportedOpError(FxMemError):
    """An op has no meta/fake kernel, or its output size depends on data."""


class DeviceError(FxMemError):
    """The requested device cannot be simulated with this torch build."""


class ModelError(FxMemError, TypeError):
    """The thing given as a model is not something fxmem can analyse."""


class UserCodeError(ModelError):
    """The user's own code raised: their forward, optimizer factory, loss or ``step=`` function
    (``party`` says which), at the file:line the message names - not fxmem, not PyTorch."""

    def __init__(self, message: str, party: str = "forward"):
        super().__init__(message)
        self.party = party


class InternalError(FxMemError):
    """A failure inside PyTorch (an internal assert, a fake kernel that rejects what the real kernel
    accepts), a library or fxmem itself while simulating - not a problem of the user's input."""


class KernelError(FxMemError):
    """The model cannot run: a real kernel rejects a call its fake kernel accepted (a dtype or
    layout the kernel does not implement, operands of different dtypes)."""


class AnalysisTimeout(FxMemError, TimeoutError):
    """An analysis ran past its ``timeout=`` (``--timeout``): the message names the phase it was in
    (capture, simulation, self-check, verification, measurement ...) and what to do. Also a
    ``TimeoutError``."""


class MeasureError(FxMemError):
    """A size at which a kernel's workspace, measured by one real run of that kernel alone (oneDNN
    scratch no formula describes, :mod:`fxmem.kernels.measured`), would need a run larger than fxmem
    makes: refused, never guessed."""


class ProfilerBusyError(FxMemError):
    """fxmem measures the CPU allocator through ``torch.profiler``, one session per process, and the
    user's own profiler session is recording: a session of fxmem's would end theirs."""


def recursion_limit_error() -> ModelError:
    """What a RecursionError anywhere in an analysis means (never a problem of the input shapes)."""
    import sys

    return ModelError(
        f"Python's recursion limit ({sys.getrecursionlimit()}) was exceeded: the model is nested too deeply "
        f"(modules inside modules, thousands deep), its code recurses without end, or a size expression grew "
        f"too deep for PyTorch's symbolic shapes (sympy); flatten the nesting (an nn.Sequential of the layers), "
        f"or raise the limit with sys.setrecursionlimit; your input shapes are not the problem")
