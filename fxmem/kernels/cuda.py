"""Hidden allocations of CUDA kernels, one small rule per kernel family.

Each rule was read off the caching allocator's recorded history on an NVIDIA H100 (compute
capability 9.0, 132 SMs) with torch 2.11 (``benchmarks/results/cuda_kernels.md``), over a sweep of
dtypes, head sizes, sequence lengths, batch x heads and layouts, and is re-checked there by
``tests/gpu/test_gpu_kernels.py``. Where a kernel's scratch depends on something the sweep did not
cover (another GPU generation, dropout, an attention bias, head sizes above 128), the rule says so
(:class:`Unknown`) instead of guessing: the report is then marked not exact, naming the op.

>>> REGISTRY.lookup(Kind.HIDDEN, aten._softmax_backward_data.default, "cuda").why   # doctest: +SKIP
'softmax_backward_cuda_out multiplies grad by output into a temporary first (tmp = grad * output).'
"""
from __future__ import annotations

from typing import Any

import torch

from .registry import OUT, Call, Kind, OutAt, Unknown, hidden, require_args, rule

aten = torch.ops.aten

# The torch release of the GPU machine these rules were read and checked on.
GPU_CHECKED = ("2.11",)


def _ceil_div(a: Any, b: int) -> Any:
    return -(-a // b)


def _round_up(a: Any, b: int) -> Any:
    return _ceil_div(a, b) * b


def _gpu() -> tuple[int, int] | None:
    """(compute capability major, SM count) of the visible GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.major, props.multi_processor_count


# --- softmax ----------------------------------------------------------------------------------------
require_args(aten._softmax_backward_data.default, "grad_output", "output")


@hidden(aten._softmax_backward_data, device="cuda", verified=GPU_CHECKED)
def _softmax_backward_cuda(call: Call) -> list:
    """softmax_backward_cuda_out multiplies grad by output into a temporary first (tmp = grad * output)."""
    grad, out = call.arg("grad_output"), call.arg("output")
    tmp = grad.numel() * torch.promote_types(grad.dtype, out.dtype).itemsize
    return [OUT, tmp, -tmp]


# --- cuBLAS operands --------------------------------------------------------------------------------
def _matrix_copy(m: torch.Tensor) -> Any:
    """prepare_matrix_for_cublas: a matrix whose strides cuBLAS cannot take (an expanded gradient with
    zero strides, a column-strided slice) is cloned contiguous for the call."""
    if m.dim() != 2:
        return 0
    rows, cols = m.shape
    s_row, s_col = m.stride()
    if (s_col == 1 and s_row >= (cols if cols > 1 else 1)) or (s_row == 1 and s_col >= (rows if rows > 1 else 1)):
        return 0
    return m.numel() * m.element_size()


def _batch_copy(t: torch.Tensor) -> Any:
    """prepare_batch_matrix_for_cublas: each item must be row- or column-major with a valid leading
    dimension (the batch stride is free: an expanded batch is fine), or the tensor contiguous;
    anything else (zero strides inside an item, a strided slice) is cloned contiguous."""
    if t.dim() != 3:
        return 0
    _, rows, cols = t.shape
    _, s_row, s_col = t.stride()
    if (s_col == 1 and s_row >= (cols if cols > 1 else 1)) or (s_row == 1 and s_col >= (rows if rows > 1 else 1)):
        return 0
    if t.is_contiguous() and s_row != 0 and s_col != 0:
        return 0
    return t.numel() * t.element_size()


def _copies_around_output(copies: list) -> list | None:
    copies = [c for c in copies if not (isinstance(c, int) and c == 0)]
    return [OUT, *copies, *[-c for c in reversed(copies)]] if copies else None


for _op in (aten.mm.default, aten.bmm.default):
    require_args(_op, "self", "mat2")
for _op in (aten.addmm.default, aten.baddbmm.default):
    require_args(_op, "mat1" if _op is aten.addmm.default else "batch1")


@hidden(aten.mm, device="cuda", verified=GPU_CHECKED)
def _mm_cuda(call: Call) -> list | None:
    """cuBLAS takes a matrix as is when one stride is 1 and the other a valid leading dimension;
    any other operand is cloned contiguous after the output is allocated, freed on return."""
    return _copies_around_output([_matrix_copy(call.arg("self")), _matrix_copy(call.arg("mat2"))])


@hidden(aten.addmm, device="cuda", verified=GPU_CHECKED)
def _addmm_cuda(call: Call) -> list | None:
    """addmm: mat1 and mat2 as for mm (the bias is copied into the output, no allocation)."""
    return _copies_around_output([_matrix_copy(call.arg("mat1")), _matrix_copy(call.arg("mat2"))])


@hidden(aten.bmm, device="cuda", verified=GPU_CHECKED)
def _bmm_cuda(call: Call) -> list | None:
    """Batched cuBLAS: an operand whose items are neither row- nor column-major (zero strides, strided
    slices) is cloned contiguous after the output is allocated, freed on return."""
    return _copies_around_output([_batch_copy(call.arg("self")), _batch_copy(call.arg("mat2"))])


@hidden(aten.baddbmm, device="cuda", verified=GPU_CHECKED)
def _baddbmm_cuda(call: Call) -> list | None:
    """baddbmm: batch1 and batch2 as for bmm."""
    return _copies_around_output([_batch_copy(call.arg("batch1")), _batch_copy(call.arg("batch2"))])


# --- memory-efficient attention (CUTLASS) -----------------------------------------------------------
_EFF = aten._scaled_dot_product_efficient_attention
_EFF_BACKWARD = aten._scaled_dot_product_efficient_attention_backward
require_args(_EFF.default, "query", "attn_bias", "dropout_p")
require_args(_EFF_BACKWARD.default, "grad_out_", "query", "key", "value", "attn_bias", "out", "dropout_p")


@rule(Kind.OUTPUT_STORAGE, _EFF, device="cuda", verified=GPU_CHECKED)
def _efficient_seeds_on_host(call: Call) -> dict:
    """Without dropout the philox seed and offset the kernel returns are host tensors; the fake
    kernel puts them on the device."""
    if call.arg("dropout_p", 0.0) != 0.0 or len(call.outputs) < 4:
        return {}
    return {2: 0, 3: 0}


@hidden(_EFF, device="cuda", verified=GPU_CHECKED)
def _efficient_forward(call: Call) -> list | Unknown | None:
    """The forward allocates its output and logsumexp only (measured without dropout)."""
    if call.arg("dropout_p", 0.0) != 0.0:
        return Unknown(call.op, "with dropout the memory-efficient kernel's RNG state was not measured on a GPU")
    return None


def _efficient_workspace(call: Call, q: torch.Tensor, v: torch.Tensor) -> Any:
    """The CUTLASS backward's gradQ staging area: per (batch, head) and per block of queries
    16,400 B (head size <= 64, 64-query blocks) or 65,568 B (float32) / 65,552 B (half precision)
    (head size <= 128, 128-query blocks); read off an H100 (sm 9.0) at 3 dtypes, head sizes 16, 64,
    80, 128, 5 lengths, 3 batch x heads, 2 layouts, causal or not. Other cases: None."""
    gpu = _gpu()
    head = max(q.shape[-1], v.shape[-1])
    if gpu is None or gpu[0] != 9 or call.arg("attn_bias") is not None or call.arg("dropout_p", 0.0) != 0.0 \
            or head > 128 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    b, h, m = q.shape[0], q.shape[1], q.shape[2]
    if head <= 64:
        return b * h * _ceil_div(m, 64) * 16400
    return b * h * _ceil_div(m, 128) * (65568 if q.dtype == torch.float32 else 65552)


@hidden(_EFF_BACKWARD, device="cuda", verified=GPU_CHECKED)
def _efficient_backward(call: Call) -> list:
    """grad_out in (B, L, H, D) order (a contiguous copy when it is not), the gradients, then delta:
    float32 computes ``(grad_out * out).sum(-1)`` (a product, the sum and, with several heads, its
    transposed contiguous copy); half precision lets the kernel compute it into (B, H, L) floats;
    then the kernel's workspace (see _efficient_workspace)."""
    grad, q, v = call.arg("grad_out_"), call.arg("query"), call.arg("value")
    b, h, m = q.shape[0], q.shape[1], q.shape[2]
    copy = [] if grad.transpose(1, 2).is_contiguous() else [grad.numel() * grad.element_size()]
    rows = b * h * m * 4
    if q.dtype == torch.float32:
        product = grad.numel() * 4
        if h == 1 or m == 1:  # (B, L, H) transposed is already contiguous: the sum is delta
            delta = [product, rows, -product]
        else:
            delta = [product, rows, rows, -rows, -product]
    else:
        delta = [rows]
    ws = _efficient_workspace(call, q, v)
    if ws is None:
        return [*copy, OUT, *delta, -rows, *[-c for c in copy],
                Unknown(call.op, "the memory-efficient backward's workspace was measured on an sm 9.0 GPU without "
                                 "dropout or an attention bias, head size <= 128")]
    return [*copy, OUT, *delta, ws, -rows, -ws, *[-c for c in copy]]


# --- flash attention (FlashAttention-2) -------------------------------------------------------------
_FLASH = aten._scaled_dot_product_flash_attention
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward
require_args(_FLASH.default, "query", "key", "dropout_p")
require_args(_FLASH_BACKWARD.default, "grad_out", "query", "key", "value", "dropout_p")


def _splits(work: int, sms: int, n_blocks: int) -> int:
    """FlashAttention-2's num_splits_heuristic: split the keys when the (batch x heads x query
    blocks) do not fill the GPU, choosing the fewest splits within 85 % of the best wave efficiency."""
    if work >= 0.8 * sms:
        return 1
    most = min(128, sms, n_blocks)
    eligible = [s == 1 or _ceil_div(n_blocks, s) != _ceil_div(n_blocks, s - 1) for s in range(1, most + 1)]
    eff = []
    for s, ok in zip(range(1, most + 1), eligible):
        waves = work * s / sms
        eff.append(waves / -(-waves // 1) if ok else 0.0)
    best = max(eff, default=0.0)
    for s, ok in zip(range(1, most + 1), eligible):
        if ok and eff[s - 1] >= 0.85 * best:
            return s
    return 1


@hidden(_FLASH, device="cuda", verified=GPU_CHECKED)
def _flash_forward(call: Call) -> list | Unknown | None:
    """Without dropout, when batch x heads x 64-query blocks do not fill twice the SMs, the keys are
    split: float partial outputs (splits x B x H x L x D rounded to 32) and their logsumexps, after
    the output and logsumexp, freed on return."""
    q, k = call.arg("query"), call.arg("key")
    if call.arg("dropout_p", 0.0) != 0.0 or q.shape[-1] > 128:
        return Unknown(call.op, "flash attention was measured without dropout, head size <= 128")
    gpu = _gpu()
    if gpu is None:
        return Unknown(call.op, "flash attention's key splits depend on the GPU's SM count (none is visible)")
    b, h, m, d = q.shape
    lk = k.shape[2]
    work = b * h * _ceil_div(m, 64)
    sms = 2 * gpu[1]
    if work >= 0.8 * sms:
        return None
    block_n = 256 if d <= 64 else 128
    # the host reads these sizes as numbers (as torch does for a size it branches on: the analysis
    # holds at these values, and elsewhere re-analyses)
    splits = _splits(int(work), sms, int(_ceil_div(lk, block_n)))
    if splits == 1:
        return None
    rounded = _round_up(d, 32)
    lse, acc = splits * b * h * m * 4, splits * b * h * m * rounded * 4
    return [OutAt(0), OutAt(1), lse, acc, OUT, -lse, -acc]


@hidden(_FLASH_BACKWARD, device="cuda", verified=GPU_CHECKED)
def _flash_backward(call: Call) -> list:
    """After the gradients, softmax_d (B x H x L rounded to 128, float) and the float dq accumulator
    (B x L rounded to 128 x H x D rounded to 32), freed on return; measured for q, k, v laid out
    (B, L, H, D) with as many key as query heads, without dropout."""
    q, k, v = call.arg("query"), call.arg("key"), call.arg("value")
    b, h, m, d = q.shape
    rows = _round_up(m, 128)
    softmax_d = b * h * rows * 4
    dq_accum = b * rows * h * _round_up(d, 32) * 4
    program: list = [OUT, softmax_d, dq_accum, -dq_accum, -softmax_d]
    blhd = all(t.transpose(1, 2).is_contiguous() for t in (q, k, v))
    if not blhd or k.shape[1] != h or call.arg("dropout_p", 0.0) != 0.0 or d > 128:
        program.append(Unknown(call.op, "flash attention's backward was measured for q, k, v laid out (B, L, H, D), "
                                        "as many key as query heads, no dropout, head size <= 128; here it may "
                                        "allocate more"))
    return program


# --- SDPA's math path ---------------------------------------------------------------------------------
if hasattr(aten, "_safe_softmax"):
    from .cpu import _safe_softmax_cpu

    @hidden(aten._safe_softmax, device="cuda", verified=GPU_CHECKED)
    def _safe_softmax_cuda(call: Call) -> list:
        """The same composite as on CPU (read off generate() on a GPU): softmax, isneginf (a bool per
        element), all over dim (a bool per row), a 0-d zero; where writes into the output."""
        return _safe_softmax_cpu(call)


# --- convolutions -------------------------------------------------------------------------------------
@hidden(aten.convolution, aten.convolution_backward, device="cuda", verified=GPU_CHECKED)
def _convolution_cuda(call: Call) -> Unknown:
    """cuDNN picks a convolution algorithm at run time (by heuristics or benchmarking) and takes that
    algorithm's workspace from the caching allocator: measured +3,072 B in a positional conv's step on
    an H100, 0 B in others; its size is not a formula in the shapes."""
    return Unknown(call.op, "cuDNN chooses the convolution's algorithm and its workspace at run time")


# --- cuDNN attention -----------------------------------------------------------------------------------
_CUDNN_ATTENTION = tuple(getattr(aten, name) for name in ("_scaled_dot_product_cudnn_attention",
                                                          "_scaled_dot_product_cudnn_attention_backward")
                         if hasattr(aten, name))


@hidden(*_CUDNN_ATTENTION, device="cuda", verified=GPU_CHECKED)
def _cudnn_attention(call: Call) -> Unknown:
    """cuDNN's attention takes a workspace cuDNN sizes at run time (measured: 256 B in a forward,
    416,256 B in a backward at B=2, H=4, L=200, head 64); not modelled."""
    return Unknown(call.op, "cuDNN's attention takes a workspace cuDNN sizes at run time")
