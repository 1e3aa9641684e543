"""Fake kernels that read sizes as numbers, and how to compute those ops with the sizes kept symbolic.

A fake (meta) kernel written in C++ that calls ``self.sizes()`` turns every symbolic size of its
input into a number, and PyTorch then fixes the user's dims at their example sizes for good:
the formulas would hold at one size only (``Report.region`` says so, and ``evaluate`` elsewhere
re-analyses). For the ops below fxmem computes the result on the fake tensors itself, with the
same allocations as the real kernel (one output, in the layout the real kernel picks), so the
dims stay free. ``tests/kernels/test_kernels.py`` checks each against real runs.

A SYMBOLIC rule is ``fn(*args, **kwargs)`` called instead of the op on fake tensors (the
recorder still records the call as the op itself).

>>> symbolic_rule(torch.ops.aten.constant_pad_nd.default).why          # doctest: +SKIP
'constant_pad_nd: ...'
"""
from __future__ import annotations

from typing import Any

import torch

from .. import _torch_compat as tc
from .registry import ANY, Kind, require_args, rule

aten = torch.ops.aten
require_args(aten.constant_pad_nd.default, "self", "pad", "value")


@rule(Kind.SYMBOLIC, aten.constant_pad_nd.default, device=ANY)
def _constant_pad_nd(x: torch.Tensor, pad: Any, value: Any = 0) -> torch.Tensor:
    """constant_pad_nd (F.pad's constant mode): one output in the input's suggested memory format,
    filled with the value, the (narrowed) input copied in; the fake kernel reads sizes as numbers."""
    n = len(pad) // 2
    shape = list(x.shape)
    src, starts = x, []
    for i in range(n):
        dim = x.dim() - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        shape[dim] = shape[dim] + before + after
        # negative padding crops the input (a view), positive padding offsets it in the output
        lo = -before if _negative(before) else 0
        hi = -after if _negative(after) else 0
        if lo or hi:
            src = src.narrow(dim, lo, src.shape[dim] - lo - hi)
        starts.append((dim, before if not _negative(before) else 0))
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=tc.suggest_memory_format(x))
    out.fill_(value)
    dst = out
    for dim, start in starts:
        dst = dst.narrow(dim, start, src.shape[dim])
    dst.copy_(src)
    return out


def _negative(p: Any) -> bool:
    return bool(p < 0)


require_args(aten._trilinear.default, "i1", "i2", "i3", "expand1", "expand2", "expand3", "sumdim", "unroll_dim")


@rule(Kind.SYMBOLIC, aten._trilinear.default, device=ANY)
def _trilinear(i1: torch.Tensor, i2: torch.Tensor, i3: torch.Tensor, expand1: Any, expand2: Any, expand3: Any,
               sumdim: Any, unroll_dim: int = 1) -> torch.Tensor:
    """_trilinear (nn.Bilinear): one zero-filled output, the summed dims squeezed away (a
    metadata change); its fake kernel hits an internal assert on symbolic sizes (torch 2.13).
    The per-slice scratch of the CPU kernel is :func:`fxmem.kernels.cpu._trilinear_scratch`."""
    total = i1.dim() + len(expand1)
    ops = [i1, i2, i3]
    for k, expand in enumerate((expand1, expand2, expand3)):
        for d in sorted(expand):
            ops[k] = ops[k].unsqueeze(d)
    shape = []
    for d in range(total):
        if d in sumdim:
            continue
        expanded = [d in e for e in (expand1, expand2, expand3)]
        shape.append(next(t.shape[d] for t, e in zip(ops, expanded) if not e))
    out = torch.empty(shape, dtype=i1.dtype, device=i1.device)
    out.zero_()
    return out


@rule(Kind.SYMBOLIC, aten._grouped_mm.default, device="cpu")
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
    """_grouped_mm (F.grouped_mm: transformers' MoE experts) on CPU: one contiguous output, no
    scratch (measured: float32 runs on CPU); its fake kernel demands bfloat16, as the CUDA kernel
    does. Row groups (2-D x 3-D: (M, K) @ (E, K, N) -> (M, N)), batched (3-D x 3-D -> (E, M, N)) and
    the weight gradient's (2-D x 2-D, K grouped: (K, M) @ (M, N) -> (E, K, N)); others go to the
    fake kernel. Which rows go to which expert is data (offs): the output's size is not."""
    dtype = out_dtype or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[2])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    else:
        return aten._grouped_mm.default(a, b, offs, bias, out_dtype)
    return torch.empty(shape, dtype=dtype, device=a.device)


# --- mixed precision normalisation ----------------------------------------------------------------
_HALF = (torch.bfloat16, torch.float16)


def _float_stats(out: Any, x: torch.Tensor, weight: Any) -> Any:
    """The CPU kernels' mixed-dtype path: a half-precision input with float32 weights (autocast leaves
    norms in the input's dtype, the module's weights stay float32) keeps mean and inverse std in
    float32; the fake kernels give them the input's dtype (half the bytes, and a backward whose
    real kernel refuses the dtypes)."""
    if x.dtype not in _HALF or not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
        return out
    y, mean, rstd = out
    return y, torch.empty_like(mean, dtype=torch.float32), torch.empty_like(rstd, dtype=torch.float32)


require_args(aten.native_batch_norm.default, "input", "weight")
require_args(aten.native_layer_norm.default, "input", "weight")


@rule(Kind.SYMBOLIC, aten.native_batch_norm.default, device="cpu")
def _batch_norm_mixed(*args: Any, **kwargs: Any) -> Any:
    """native_batch_norm on CPU: save_mean and save_invstd are float32 for a bf16/fp16 input with float32
    weights (batch_norm_cpu's mixed-type path), as :func:`_float_stats` says."""
    x, weight = (kwargs.get("input", args[0] if args else None), kwargs.get("weight", args[1] if len(args) > 1
                                                                             else None))
    return _float_stats(aten.native_batch_norm.default(*args, **kwargs), x, weight)


@rule(Kind.SYMBOLIC, aten.native_layer_norm.default, device="cpu")
def _layer_norm_mixed(*args: Any, **kwargs: Any) -> Any:
    """native_layer_norm on CPU: mean and rstd are float32 for a bf16/fp16 input with float32 weights
    (layer_norm_cpu's mixed-type path), as :func:`_float_stats` says."""
    x, weight = (kwargs.get("input", args[0] if args else None), kwargs.get("weight", args[2] if len(args) > 2
                                                                             else None))
    return _float_stats(aten.native_layer_norm.default(*args, **kwargs), x, weight)


# --- upsampling with symbolic sizes -----------------------------------------------------------------
# The fake kernels of the linear and cubic modes run ATen's Python decomposition (its index
# broadcast calls ``expand`` with a C++ int list) and most backward meta kernels take ``int[]``: with
# symbolic sizes both raise, or with the sizes made numbers they fix the user's dims. The real
# kernels allocate one output (the scratch is fxmem.kernels.cpu's upsampling rules): forward in the
# input's suggested memory format, backward a zero-filled grad_input in grad_output's - contiguous
# for the kernels that have no channels-last backward (measured on real CPU runs).
_UPSAMPLE_FORWARD = [getattr(aten, n).default for n in ("upsample_linear1d", "upsample_bilinear2d",
                                                         "upsample_trilinear3d", "upsample_bicubic2d")
                     if hasattr(aten, n)]
_UPSAMPLE_BACKWARD_LAYOUT = {  # backward op -> whether grad_input follows grad_output's memory format
    "upsample_nearest1d_backward": True, "upsample_nearest3d_backward": False,
    "_upsample_nearest_exact1d_backward": True, "_upsample_nearest_exact3d_backward": False,
    "upsample_linear1d_backward": True, "upsample_bilinear2d_backward": True,
    "upsample_trilinear3d_backward": True, "upsample_bicubic2d_backward": False,
    "_upsample_bicubic2d_aa_backward": False,
}
_UPSAMPLE_BACKWARD = {getattr(aten, n).default: follows for n, follows in _UPSAMPLE_BACKWARD_LAYOUT.items()
                      if hasattr(aten, n)}
for _op in _UPSAMPLE_FORWARD:
    require_args(_op, "self", "output_size")
for _op in _UPSAMPLE_BACKWARD:
    require_args(_op, "grad_output", "output_size", "input_size")


@rule(Kind.SYMBOLIC, *_UPSAMPLE_FORWARD, device="cpu")
def _upsample(x: torch.Tensor, output_size: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Linear and cubic upsampling: one output (N, C, *output_size) in the input's suggested memory
    format; the fake kernel's decomposition refuses symbolic sizes (torch 2.13)."""
    shape = (*x.shape[:2], *output_size)
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=tc.suggest_memory_format(x))


def _upsample_backward_rule(follows: bool) -> Any:
    """The SYMBOLIC rule of one upsampling backward: grad_input laid out after grad_output or not."""

    def backward(g: torch.Tensor, output_size: Any, input_size: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Upsampling's backward: a zero-filled grad_input of ``input_size``, in grad_output's suggested
        memory format or contiguous (kernels without a channels-last backward); the meta kernels take
        ``int[]`` and refuse symbolic sizes (torch 2.13)."""
        fmt = tc.suggest_memory_format(g) if follows else torch.contiguous_format
        return torch.empty(tuple(input_size), dtype=g.dtype, device=g.device, memory_format=fmt).zero_()

    return backward


for _op, _follows in _UPSAMPLE_BACKWARD.items():
    rule(Kind.SYMBOLIC, _op, device="cpu")(_upsample_backward_rule(_follows))
