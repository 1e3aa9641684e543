"""Where a real tensor takes another code path than a fake one, and how to follow the real one.

ATen composites sometimes branch on ``isTensorSubclassLike``, and fake tensors are subclass-like:

* ``linear`` on a non-contiguous 3-D input runs ``matmul`` then adds the bias *in place* for a
  real tensor, out of place (one more output-sized buffer) for a fake one;
* ``max_pool1d`` on a CPU tensor that needs no grad runs a kernel that allocates only the values
  (plus a contiguous copy of a non-contiguous input); a fake tensor goes through
  ``max_pool1d_with_indices`` and allocates int64 indices too.

A REAL_PATH rule is ``fn(func, ctx, *args, **kwargs)``: the result along the real path, or
``NotImplemented`` when the real and fake paths agree. :class:`RealPaths` is a
``TorchFunctionMode`` that applies them while a model is simulated - scoped to the simulation, so
nothing of torch is patched - and notes the functions whose CUDA kernel is picked by asking the GPU
when CUDA is simulated without one.

>>> with RealPaths("cpu", quiet, note): model(x)        # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _torch_compat as tc
from .registry import ANY, REGISTRY, Kind, rule


@dataclasses.dataclass
class AsIs:
    """A rule's result that is what the function itself returned (the real and fake paths agreed),
    so the rule did not shape the numbers."""

    value: Any


@dataclasses.dataclass
class Context:
    device: str
    quiet: Callable[[], Any]  # context in which fake computations are not recorded (shape probes)
    note: Callable[[str], None]

    @property
    def gpu(self) -> bool:
        return self.device == "cuda" and torch.cuda.is_available()


@rule(Kind.REAL_PATH, F.linear, device=ANY)
def _linear(func: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
    """ATen's linear: a 2-D or contiguous input takes the fused addmm; otherwise matmul, then the bias
    is added in place for real tensors (out of place only for subclass-like ones)."""
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if bias is None or x.dim() == 2 or x.is_contiguous():
        return NotImplemented
    return torch.matmul(x, weight.t()).add_(bias)


@rule(Kind.REAL_PATH, torch.max_pool1d, F.max_pool1d, device="cpu")
def _max_pool1d(func: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
    """max_pool1d_impl on CPU without grad: one contiguous output, no indices (plus a contiguous copy
    of a non-contiguous input, freed on return)."""
    x = args[0] if args else kwargs["input"]
    if (x.requires_grad and torch.is_grad_enabled()) or x.is_quantized:
        return NotImplemented
    if kwargs.get("return_indices") or (len(args) > 6 and args[6]):
        return NotImplemented
    with ctx.quiet(), torch.no_grad():  # its shape is what the indices path gives
        shape = torch.ops.aten.max_pool1d_with_indices.default(*_pool_args(args, kwargs))[0].shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if not x.is_contiguous():
        torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out


@rule(Kind.REAL_PATH, F.one_hot, device="cpu")
def _one_hot(func: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
    """ATen's one_hot on a real CPU tensor checks the classes' range (``aminmax``: two 8-byte
    results, freed together) and scatters ones into a contiguous int64 zeros. A fake tensor
    takes ``eq(x[..., None], arange(C)).to(long)`` instead: an arange, a bool tensor the output's
    size and an output laid out by the broadcast. ``num_classes=-1`` reads the data: left as is."""
    x = args[0] if args else kwargs["input"]
    classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if not isinstance(classes, int) or classes < 1 or x.dtype != torch.long or x.is_quantized:
        return NotImplemented
    numel = x.numel()
    if isinstance(numel, int) and numel == 0:
        return NotImplemented
    lo, hi = torch.aminmax(x)  # both alive together, as ATen's range check holds them
    del lo, hi
    out = torch.zeros((*x.shape, classes), dtype=torch.long, device=x.device)
    return out.scatter_(-1, x.unsqueeze(-1), 1)


def _pool_args(args: tuple, kwargs: dict) -> tuple:
    names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
    vals = list(args[:6]) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(vals) > 2 and vals[2] is None:  # F.max_pool1d's stride=None means stride = kernel_size
        vals[2] = []
    return tuple(vals)


@rule(Kind.REAL_PATH, torch.Tensor.__getitem__, device=ANY)
def _getitem(func: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
    """Indexing skips a full slice (``x[:, :1]`` slices dim 1 only) when it can see that the slice
    ends at the dim's size; with a symbolic size it cannot, so the fake run would slice dim 0 too and
    its backward would allocate one more gradient. The full slice, ended at the dim's own size, is
    skipped as in the real run."""
    if len(args) != 2 or kwargs:
        return NotImplemented
    x, index = args
    entries = index if isinstance(index, tuple) else (index,)
    if not any(_is_full(e) for e in entries):
        return NotImplemented
    if any(not (e is None or e is Ellipsis or isinstance(e, (int, slice)) and not isinstance(e, bool))
           for e in entries):
        return NotImplemented  # advanced indexing: leave it to PyTorch
    consuming = sum(1 for e in entries if e is not None and e is not Ellipsis)
    rebuilt, dim = [], 0
    for e in entries:
        if e is Ellipsis:
            rebuilt.append(e)
            dim += x.dim() - consuming
        elif e is None:
            rebuilt.append(e)
        else:
            rebuilt.append(slice(None, x.shape[dim], None) if _is_full(e) and dim < x.dim() else e)
            dim += 1
    return func(x, tuple(rebuilt) if isinstance(index, tuple) else rebuilt[0])


def _is_full(e: Any) -> bool:
    return isinstance(e, slice) and e.start in (None, 0) and e.stop is None and e.step in (None, 1)


@rule(Kind.REAL_PATH, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, device=ANY)
def _matmul(func: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
    """ATen's matmul folds an N-d @ 2-d product into one ``mm``; before the fix of its folded path
    for symbolic sizes (torch 2.11 and older) that path calls ``numel()``, which symbolic sizes do
    not have. Where it does, ATen's own Python decomposition of the same algorithm (the same
    reshape copies and products, so the same allocations) is followed instead."""
    try:
        return AsIs(func(*args, **kwargs))
    except RuntimeError as exc:
        decomposition = tc.matmul_decomposition()
        if "Cannot call numel() on tensor with symbolic sizes" not in str(exc) or kwargs or decomposition is None:
            raise
        return decomposition(*args)


# --- F.interpolate at symbolic sizes --------------------------------------------------------------
# ``F.interpolate(x, size=y.shape[-2:])`` (DeepLabV3's head, FPN necks) and ``scale_factor=`` call an
# upsampling op's ``.vec`` overload, a C++ composite that reads the sizes as numbers - it refuses a
# symbolic output size and fixes the user's dims for good from a scale - and then calls the op's
# default overload with the output size and per-dim scales. fxmem calls that default overload
# itself with the sizes kept symbolic, so the same kernel runs with the same allocations.
_UPSAMPLE_BINDINGS = tc.upsample_bindings()


def _upsample_to_size(func: Callable, ctx: Context | None, *args: Any, **kwargs: Any) -> Any:
    """An upsampling binding (``torch._C._nn.upsample_bilinear2d`` ...): the op's default overload with
    the output size the ``.vec`` composite computes (given, or ``int(size * scale)`` per spatial dim)
    and its scales, as the composite calls it."""
    packet = _UPSAMPLE_BINDINGS[func]
    bound = tc.bind_arguments(packet.vec, args, kwargs)
    x, size, scales = bound["input"], bound.get("output_size"), bound.get("scale_factors")
    if (size is None) == (scales is None):
        return NotImplemented  # the composite refuses it: its own error
    if size is None:
        size = _scaled_size(x, scales)
        if size is None:
            return NotImplemented  # a scale whose product a float rounds: left to the composite
    corners = [bound["align_corners"]] if "align_corners" in bound else []
    per_dim = list(scales) if scales is not None else [None] * len(size)
    return packet.default(x, list(size), *corners, *per_dim)


def _scaled_size(x: torch.Tensor, scales: Any) -> list | None:
    """ATen's output size for scale factors, ``int64(double(size) * scale)`` per spatial dim, as exact
    integer arithmetic: ``size * p // q`` for a scale ``p / q`` (a double's ratio: ``q`` a power of
    two) with ``p, q < 2**12`` (2, 0.5, 1.5: the double product is then exact at every size below
    2**40). None for other scales (0.1, 1/3), whose double product rounds and may land on the next
    integer: there the composite computes it, fixing the dims at their example sizes."""
    out = []
    for dim, scale in zip(x.shape[2:], scales):
        p, q = float(scale).as_integer_ratio()
        if p <= 0 or p >= 2 ** 12 or q >= 2 ** 12:
            return None
        out.append(dim * p // q)
    return out


# CPU only: the fake kernels of the linear modes refuse symbolic sizes, and fxmem computes them on CPU
# (fxmem.kernels.symbolic's upsampling rules, layouts measured on CPU runs)
rule(Kind.REAL_PATH, *_UPSAMPLE_BINDINGS, device="cpu")(_upsample_to_size)


# F.interpolate's upsampling binding by (mode, spatial dims, antialias), as its body picks it; the
# modes it computes otherwise ("area": adaptive average pooling) are left to it.
_INTERPOLATE_OPS = {
    **{("nearest", d, False): f"upsample_nearest{d}d" for d in (1, 2, 3)},
    **{("nearest-exact", d, False): f"_upsample_nearest_exact{d}d" for d in (1, 2, 3)},
    ("linear", 1, False): "upsample_linear1d", ("bilinear", 2, False): "upsample_bilinear2d",
    ("trilinear", 3, False): "upsample_trilinear3d", ("bicubic", 2, False): "upsample_bicubic2d",
    ("bilinear", 2, True): "_upsample_bilinear2d_aa", ("bicubic", 2, True): "_upsample_bicubic2d_aa",
}
_BINDING_BY_NAME = {getattr(f, "__name__", ""): f for f in _UPSAMPLE_BINDINGS}
_INTERPOLATE_ARGS = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")


@rule(Kind.REAL_PATH, F.interpolate, device="cpu")
def _interpolate(func: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
    """F.interpolate on CPU to a symbolic ``size=`` or by a ``scale_factor=``: its upsampling op's
    ``.vec`` composite reads the sizes as numbers; the default overload it then calls is called
    directly (the same kernel, the same allocations), as :func:`_upsample_to_size` says. A call
    F.interpolate refuses is left to it, so that its own error is raised."""
    bound = {**dict(zip(_INTERPOLATE_ARGS, args)), **kwargs}
    x, mode, corners = bound["input"], bound.get("mode", "nearest"), bound.get("align_corners")
    name = _INTERPOLATE_OPS.get((mode, x.dim() - 2, bool(bound.get("antialias"))))
    if name not in _BINDING_BY_NAME or (corners is not None and mode.startswith("nearest")):
        return NotImplemented
    size, scale = bound.get("size"), bound.get("scale_factor")
    if (size is None) == (scale is None):
        return NotImplemented  # F.interpolate refuses it: its own error
    if size is not None or bound.get("recompute_scale_factor"):
        size, scales = _interpolated_size(x, size, scale, bound.get("recompute_scale_factor")), None
    else:
        size, scales = None, list(scale) if isinstance(scale, (list, tuple)) else [scale] * (x.dim() - 2)
    if size is None and (scales is None or len(scales) != x.dim() - 2):
        return NotImplemented
    extra = () if mode.startswith("nearest") else (bool(corners),)
    return _upsample_to_size(_BINDING_BY_NAME[name], ctx, x, size, *extra, scales)


def _interpolated_size(x: torch.Tensor, size: Any, scale: Any, recompute: Any) -> list | None:
    """The output size F.interpolate passes on (spatial dims only); None where it passes scales, or
    where it refuses the arguments (it then raises its own error)."""
    spatial = x.dim() - 2
    if (size is None) == (scale is None):
        return None
    if size is not None:
        sizes = list(size) if isinstance(size, (list, tuple)) else [size] * spatial
        ok = not recompute and len(sizes) == spatial and all(isinstance(s, (int, torch.SymInt)) for s in sizes)
        return sizes if ok else None
    scales = list(scale) if isinstance(scale, (list, tuple)) else [scale] * spatial
    if not recompute or len(scales) != spatial:
        return None
    # F.interpolate's own sym_int(size * scale), as exact integers where the scale allows
    return _scaled_size(x, scales) or [torch.sym_int(x.shape[i + 2] * s) for i, s in enumerate(scales)]


def _gpu_choice(why: str) -> Callable:
    def note(func: Callable, ctx: Context, *args: Any, **kwargs: Any) -> Any:
        if not ctx.gpu:
            ctx.note(f"simulated CUDA without a GPU: {why}; check with fxmem.validate on a GPU")
        return NotImplemented

    note.__doc__ = f"On a GPU {why}."
    return note


# Functions whose CUDA kernel is chosen by querying the GPU. Without one, fake CUDA tensors take a
# fallback (SDPA's math path, ATen's own convolution and batch norm instead of cuDNN's).
rule(Kind.REAL_PATH, F.scaled_dot_product_attention, device="cuda")(_gpu_choice(
    "scaled_dot_product_attention picks flash/memory-efficient kernels on a GPU; without one the math path is "
    "simulated"))
rule(Kind.REAL_PATH, F.conv1d, F.conv2d, F.conv3d, device="cuda")(_gpu_choice(
    "cuDNN convolutions may take workspace from the allocator"))
rule(Kind.REAL_PATH, F.batch_norm, torch.batch_norm, device="cuda")(_gpu_choice(
    "cuDNN batch norm is chosen on a GPU; without one ATen's kernel is simulated"))


class RealPaths(TorchFunctionMode):
    """While active, the functions with a REAL_PATH rule follow the real device's code path."""

    def __init__(self, device: str, quiet: Callable[[], Any], note: Callable[[str], None] = lambda s: None):
        super().__init__()
        self.ctx = Context(device, quiet, note)
        self.used: set = set()  # the rules that changed a result

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        found = REGISTRY.lookup(Kind.REAL_PATH, func, self.ctx.device) if _hashable(func) else None
        if found is not None:
            result = found.fn(func, self.ctx, *args, **kwargs)
            if isinstance(result, AsIs):
                return result.value
            if result is not NotImplemented:
                self.used.add(found)
                return result
        return func(*args, **kwargs)


def _hashable(func: Any) -> bool:
    try:
        hash(func)
    except TypeError:
        return False
    return True
