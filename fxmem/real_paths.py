"""Where a real tensor takes another code path than a fake one, and how to follow the real one.

ATen composites sometimes branch on ``isTensorSubclassLike``, and fake tensors are subclass-like:

* ``linear`` on a non-contiguous 3-D input runs ``matmul`` then adds the bias *in place* for a
  real tensor, out of place (one more output-sized buffer) for a fake one;
* ``max_pool1d`` on a CPU tensor that needs no grad runs a kernel that allocates only the values
  (plus a contiguous copy of a non-contiguous input); a fake tensor goes through
  ``max_pool1d_with_indices`` and allocates int64 indices too.

While a model is simulated, these functions are replaced (module attributes, so calls nested
inside other functionals are caught too, and the targets of traced ``call_function`` nodes) by
wrappers that do what the real path does; values are irrelevant under fake tensors.

Rules are data: ``(owner, attribute) -> fn(original, ctx, *args, **kwargs)`` returning the result,
or ``NotImplemented`` when the real and fake paths agree. The same table notes the functions whose
CUDA kernel is picked by querying the GPU, for simulated CUDA without one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Context:
    device: str
    quiet: Callable[[], Any]  # context in which fake computations are not recorded (shape probes)
    note: Callable[[str], None]

    @property
    def gpu(self) -> bool:
        return self.device == "cuda" and torch.cuda.is_available()


_RULES: dict[tuple[Any, str], Callable[..., Any]] = {}


def rule(*targets: tuple[Any, str]) -> Callable:
    def register(fn: Callable) -> Callable:
        for target in targets:
            if target in _RULES:
                raise ValueError(f"a real-path rule for {target[1]} is already registered")
            _RULES[target] = fn
        return fn

    return register


@rule((F, "linear"))
def _linear(original: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
    # ATen's linear: 2-D or contiguous input -> fused addmm; otherwise matmul, then the bias is
    # added in place for real tensors (out of place only for subclass-like ones).
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if bias is None or x.dim() == 2 or x.is_contiguous():
        return NotImplemented
    return torch.matmul(x, weight.t()).add_(bias)


@rule((torch, "max_pool1d"), (F, "max_pool1d"))
def _max_pool1d(original: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
    x = args[0] if args else kwargs["input"]
    if ctx.device != "cpu" or (x.requires_grad and torch.is_grad_enabled()) or x.is_quantized:
        return NotImplemented
    if kwargs.get("return_indices") or (len(args) > 6 and args[6]):
        return NotImplemented
    # max_pool1d_impl: one contiguous output, no indices. Its shape is what the indices path gives.
    with ctx.quiet(), torch.no_grad():
        shape = torch.ops.aten.max_pool1d_with_indices.default(*_pool_args(args, kwargs))[0].shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if not x.is_contiguous():  # the kernel works on a contiguous copy of its input, freed on return
        torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out


def _pool_args(args: tuple, kwargs: dict) -> tuple:
    names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
    vals = list(args[:6]) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(vals) > 2 and vals[2] is None:  # F.max_pool1d's stride=None means stride = kernel_size
        vals[2] = []
    return tuple(vals)


# Functions whose CUDA kernel is chosen by querying the GPU. Without one, fake CUDA tensors take a
# fallback (SDPA's math path, ATen's own convolution and batch norm instead of cuDNN's), so the
# prediction may differ from a GPU run: the report says so.
_NEEDS_A_GPU = {
    (F, "scaled_dot_product_attention"): "scaled_dot_product_attention picks flash/memory-efficient kernels "
                                         "on a GPU; without one the math path is simulated",
    (F, "conv1d"): "cuDNN convolutions may take workspace from the allocator",
    (F, "conv2d"): "cuDNN convolutions may take workspace from the allocator",
    (F, "conv3d"): "cuDNN convolutions may take workspace from the allocator",
    (torch, "batch_norm"): "cuDNN batch norm is chosen on a GPU; without one ATen's kernel is simulated",
}


class RealPaths:
    """Context manager: while active, the functions above follow the real device's code path."""

    def __init__(self, device: str, quiet: Callable[[], Any], note: Callable[[str], None] = lambda s: None):
        self.ctx = Context(device, quiet, note)
        self._saved: list[tuple[Any, str, Any]] = []
        self._by_original: dict[int, Callable] = {}

    def _wrap(self, original: Callable, fn: Callable | None, gpu_note: str | None) -> Callable:
        ctx = self.ctx

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if gpu_note and ctx.device == "cuda" and not ctx.gpu:
                ctx.note(f"simulated CUDA without a GPU: {gpu_note}; check with fxmem.validate on a GPU")
            if fn is not None:
                result = fn(original, ctx, *args, **kwargs)
                if result is not NotImplemented:
                    return result
            return original(*args, **kwargs)

        return wrapper

    def replacement(self, target: Any) -> Callable | None:
        """The wrapper standing for ``target`` (a traced node's function), if there is one."""
        return self._by_original.get(id(target))

    def __enter__(self) -> "RealPaths":
        targets = set(_RULES) | set(_NEEDS_A_GPU)
        wrappers: dict[int, Callable] = {}
        for owner, name in targets:
            original = getattr(owner, name)
            if id(original) not in wrappers:  # F.conv2d is torch.conv2d: wrap each function once
                wrappers[id(original)] = self._wrap(original, _RULES.get((owner, name)), _NEEDS_A_GPU.get((owner, name)))
            self._saved.append((owner, name, original))
            setattr(owner, name, wrappers[id(original)])
            self._by_original[id(original)] = wrappers[id(original)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        self._by_original.clear()
