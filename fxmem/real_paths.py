"""Where a real tensor takes another code path than a fake one, and how to follow the real one.

ATen composites sometimes branch on ``isTensorSubclassLike``, and fake tensors are subclass-like:
``max_pool1d`` on a CPU tensor that needs no grad runs a kernel that allocates only the values,
but a fake tensor is routed through ``max_pool1d_with_indices`` and allocates int64 indices too.
A torch-function mode intercepts such calls and, when the real tensor would take the cheap path,
allocates exactly what that path allocates (values are irrelevant under fake tensors).

Rules are data: ``function -> fn(args, kwargs, device, quiet) -> result or None`` (None: the
paths agree). ``quiet()`` is a context in which fake computations are not recorded, for working out
shapes.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_RULES: dict[Any, Callable[..., Any]] = {}


def rule(func: Any) -> Callable:
    def register(fn: Callable) -> Callable:
        if func in _RULES:
            raise ValueError(f"a real-path rule for {func} is already registered")
        _RULES[func] = fn
        return fn

    return register


def _max_pool1d(args: tuple, kwargs: dict, device: str, quiet: Callable[[], Any]) -> Any:
    x = args[0]
    if device != "cpu" or (x.requires_grad and torch.is_grad_enabled()) or x.is_quantized:
        return None
    if kwargs.get("return_indices") or (len(args) > 6 and args[6]):
        return None
    # max_pool1d_impl: one contiguous output, no indices. Its shape is what the indices path gives.
    with quiet(), torch.no_grad():
        shape = torch.ops.aten.max_pool1d_with_indices.default(*_pool_args(args, kwargs))[0].shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if not x.is_contiguous():  # the kernel then works on a contiguous copy of its input
        copy = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        del copy
    return out


def _pool_args(args: tuple, kwargs: dict) -> tuple:
    names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
    vals = list(args[:6]) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(vals) > 2 and vals[2] is None:  # F.max_pool1d's stride=None means stride = kernel_size
        vals[2] = []
    return tuple(vals)


# torch.max_pool1d is what modules call; F.max_pool1d (a boolean dispatcher) reaches the mode
# as itself, and runs torch.max_pool1d with the mode disabled.
rule(torch.max_pool1d)(_max_pool1d)
rule(torch.nn.functional.max_pool1d)(_max_pool1d)


# Functions whose CUDA kernel is chosen by querying the GPU. Without one, fake CUDA tensors take a
# fallback (SDPA's math path, ATen's own convolution and batch norm instead of cuDNN's), so the
# prediction may differ from a GPU run: the report says so.
_NEEDS_A_GPU = {
    torch.nn.functional.scaled_dot_product_attention: "scaled_dot_product_attention picks flash/memory-efficient "
                                                      "kernels on a GPU; without one the math path is simulated",
    torch.conv1d: "cuDNN convolutions may take workspace from the allocator",
    torch.conv2d: "cuDNN convolutions may take workspace from the allocator",
    torch.conv3d: "cuDNN convolutions may take workspace from the allocator",
    torch.batch_norm: "cuDNN batch norm is chosen on a GPU; without one ATen's kernel is simulated",
}


class RealPaths(TorchFunctionMode):
    """Follow the real device's code path for the functions registered above."""

    def __init__(self, device: str, quiet: Callable[[], Any], note: Callable[[str], None] = lambda s: None):
        super().__init__()
        self.device = device
        self.quiet = quiet  # context in which the recorder ignores allocations
        self.note = note
        self.gpu = device == "cuda" and torch.cuda.is_available()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.device == "cuda" and not self.gpu and func in _NEEDS_A_GPU:
            self.note(f"simulated CUDA without a GPU: {_NEEDS_A_GPU[func]}; check with fxmem.validate on a GPU")
        fn = _RULES.get(func)
        if fn is not None:
            result = fn(args, kwargs, self.device, self.quiet)
            if result is not None:
                return result
        return func(*args, **kwargs)
