"""Allocations that real kernels make but fake tensors cannot see.

A fake (meta) kernel allocates exactly the op's outputs. A real kernel may allocate more through
the same allocator: a Python number becomes an 8-byte 0-dim tensor (and TensorIterator copies it
to the op's dtype), CPU ``repeat`` builds small index tensors, CPU batch norm keeps per-channel
temporaries. Each rule here describes one such kernel as a *program*: the signed byte deltas it
makes, in order, with ``OUT`` where the op's outputs appear. Programs are net zero (everything
hidden is freed before the op returns); the simulator turns each one into peak candidates.

Rules are data: ``(op packet, device type) -> fn(call) -> program or None``, registered once, one
small function per op family. Each was read off a real run with the profiler (see
``tests/test_kernels.py``, which re-checks every rule against a real run at several sizes).

>>> program_for(torch.ops.aten.mul.Tensor, (x, 0.5), {}, (), "cpu")   # doctest: +SKIP
[8, 4, OUT, -4, -8]
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from . import _torch_compat as tc

OUT = "OUT"
Program = list  # list[int | SymInt | OUT | Keep]


@dataclasses.dataclass(frozen=True)
class Keep:
    """A hidden allocation that outlives the op: autograd keeps it for backward.

    Autograd saves a wrapped Python number (``x * 0.125`` saves the 0-dim tensor for ``0.125``)
    without calling saved-tensor hooks, so it cannot be seen being saved; the rule says so instead.
    """

    nbytes: int
    dtype: torch.dtype
    why: str


@dataclasses.dataclass
class Call:
    """One aten call as a rule sees it."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: tuple  # tensor outputs, in order
    device: str
    grad_enabled: bool = False
    phase: str = "forward"

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        return self.args[i] if i < len(self.args) else self.kwargs.get(name, default)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [a for a in torch.utils._pytree.tree_leaves((self.args, self.kwargs)) if isinstance(a, torch.Tensor)]


@dataclasses.dataclass(frozen=True)
class Unknown:
    """A rule's admission that it cannot describe this call's hidden allocations."""

    op: str
    why: str


Rule = Callable[[Call], "Program | Unknown | None"]
_RULES: dict[tuple[str, str], Rule] = {}


def rule(*packets: str, device: str) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the hidden-allocation rule of ``packets`` on ``device`` (once each)."""

    def register(fn: Rule) -> Rule:
        for p in packets:
            key = (p, device)
            if key in _RULES:
                raise ValueError(f"a hidden-allocation rule for {p} on {device} is already registered")
            _RULES[key] = fn
        return fn

    return register


# ------------------------------------------------------------------------------------------------
# Python numbers that become tensors, and CPU TensorIterator's dtype casts of operands (on CUDA the
# wrapped scalar lives in host memory and kernels cast on the fly, so neither costs device memory).
# ------------------------------------------------------------------------------------------------
_WRAPPED_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}

# Ops whose autograd formula saves the ``other`` operand (derivatives.yaml: mul, div).
_SAVES_OTHER = {"aten.mul", "aten.div", "aten.mul_", "aten.div_"}

# Binary TensorIterator ops: their Scalar overloads wrap ``other`` into a tensor and run the Tensor
# kernel, and on CPU every operand whose dtype differs from the common dtype is copied first.
_WRAPS_SCALAR_SLOT = {
    "aten.add", "aten.sub", "aten.mul", "aten.div", "aten.rsub", "aten.remainder", "aten.fmod",
    "aten.eq", "aten.ne", "aten.lt", "aten.le", "aten.gt", "aten.ge",
    "aten.bitwise_and", "aten.bitwise_or", "aten.bitwise_xor",
    "aten.add_", "aten.sub_", "aten.mul_", "aten.div_", "aten.remainder_", "aten.fmod_",
    "aten.eq_", "aten.ne_", "aten.lt_", "aten.le_", "aten.gt_", "aten.ge_",
}


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    # ATen's combine_categories (None = undefined): a lower-priority participant only matters
    # when it is of a higher category.
    if higher is not None and higher.is_complex:
        return higher
    if lower is not None and lower.is_complex:
        if higher is not None and higher.is_floating_point:
            return torch.promote_types(higher, torch.complex64)
        return lower
    if higher is not None and higher.is_floating_point:
        return higher
    if higher == torch.bool or (lower is not None and lower.is_floating_point):
        if higher is None or lower is None:
            return higher if lower is None else lower
        return torch.promote_types(higher, lower)
    return higher if higher is not None else lower


def result_dtype(tensors: list[torch.Tensor], numbers: list[Any]) -> torch.dtype:
    """PyTorch's type promotion: dim>0 tensors, then 0-dim tensors, then Python numbers."""
    dim = zero = wrapped = None
    for t in tensors:
        if t.dim() > 0:
            dim = t.dtype if dim is None else torch.promote_types(dim, t.dtype)
        else:
            zero = t.dtype if zero is None else torch.promote_types(zero, t.dtype)
    for n in numbers:
        d = (torch.bool if isinstance(n, bool) else torch.int64 if isinstance(n, int)
             else torch.get_default_dtype() if isinstance(n, float) else torch.complex64)
        wrapped = d if wrapped is None else torch.promote_types(wrapped, d)
    out = _combine(dim, _combine(zero, wrapped))
    return out if out is not None else torch.get_default_dtype()


def _tensor_iterator(call: Call) -> Program:
    """Wrapped Python numbers, and the dtype-cast copies CPU TensorIterator makes of operands."""
    packet = tc.op_packet_name(call.func)
    in_tensor_slot = tc.python_number_in_tensor_slot(call.func, call.args, call.kwargs)
    binary = packet in _WRAPS_SCALAR_SLOT
    numbers = list(in_tensor_slot) + (tc.scalar_args(call.func, call.args, call.kwargs) if binary else [])
    inputs = call.tensors
    if not numbers and not binary:
        return []
    common = result_dtype(inputs, numbers) if binary else None
    # x * 0.5 with x requiring grad: MulBackward0 keeps the wrapped 0.5 until backward
    saved = (call.grad_enabled and packet in _SAVES_OTHER and bool(in_tensor_slot)
             and any(t.requires_grad for t in inputs))
    before: list = []
    after: list = []
    for k, n in enumerate(numbers):
        wrapped = _WRAPPED_DTYPE[type(n)]
        if call.phase == "backward" and k < len(in_tensor_slot):
            continue  # a backward formula's number in a Tensor slot is the wrapped tensor it saved
        if saved and k == 0:
            before.append(Keep(wrapped.itemsize, wrapped, f"{packet} saves the wrapped number {n!r} for backward"))
        else:
            before.append(wrapped.itemsize)
            after.append(-wrapped.itemsize)
    casts = []
    if binary:
        for n in numbers:
            if _WRAPPED_DTYPE[type(n)] != common:
                casts.append(common.itemsize)
        outputs = {id(o) for o in call.outputs}
        for t in inputs:
            if t.dtype != common and id(t) not in outputs:
                casts.append(t.numel() * common.itemsize)
    return before + casts + [OUT] + [-c for c in reversed(casts)] + after


# ------------------------------------------------------------------------------------------------
# Per-op rules.
# ------------------------------------------------------------------------------------------------
@rule("aten.repeat", device="cpu")
def _repeat_cpu(call: Call) -> Program:
    # The CPU kernel builds int64 index/permutation tensors of length ndim and 2*ndim.
    n = call.outputs[0].dim()
    return [OUT, 8 * n, 8, 8 * n, -8, 16 * n, -8 * n, -8 * n, -16 * n]


@rule("aten.convolution", "aten.convolution_backward", "aten.native_batch_norm", "aten.native_batch_norm_backward",
      device="cpu")
def _calibrated_cpu(call: Call) -> Program | Unknown | None:
    # oneDNN's blocked-layout reorders and batch norm's per-thread/per-channel temporaries are not
    # described anywhere in PyTorch: measured and fitted on small real runs (see fxmem.calibrate).
    from .calibrate import ADAPTERS, program_for_call

    if call.func not in ADAPTERS:
        return None
    program = program_for_call(call.func, call.args, call.outputs)
    if program is None:
        return Unknown(tc.op_name(call.func), "its kernel's workspace could not be fitted at small sizes")
    return program


def _flash_splits(q: torch.Tensor, k: torch.Tensor) -> tuple[Any, Any, int]:
    """ATen's CPU flash-attention block sizes for this query/key length (comparisons become guards)."""
    L, S = q.shape[-2], k.shape[-2]
    q_split = 256 if L >= 768 else (64 if L >= 192 else 32)
    qs = L if L < q_split else q_split
    kvs = S if S < 512 else 512
    acc = 4 if q.dtype in (torch.float32, torch.float16, torch.bfloat16) else q.element_size()
    return qs, kvs, acc


@rule("aten._scaled_dot_product_flash_attention_for_cpu", device="cpu")
def _sdpa_flash_cpu(call: Call) -> Program:
    # cpu_flash_attention: one float buffer per thread holding a (qSplit x kvSplit) score block,
    # its row max and sum, and a (qSplit x headSize) accumulator.
    q, k = call.args[0], call.args[1]
    qs, kvs, acc = _flash_splits(q, k)
    threads = torch.get_num_threads()
    buf = threads * (qs * kvs + 2 * qs + qs * q.shape[-1]) * acc
    reduced = threads * qs * kvs * q.element_size() if q.dtype in (torch.float16, torch.bfloat16) else 0
    return [OUT, buf, reduced, -reduced, -buf] if reduced else [OUT, buf, -buf]


@rule("aten._scaled_dot_product_flash_attention_for_cpu_backward", device="cpu")
def _sdpa_flash_cpu_backward(call: Call) -> Program:
    # flash_attention_backward_kernel_impl: grad_out.contiguous() in (B, L, H, D) layout, then a
    # per-thread (attn, grad_attn) block buffer, then inside the parallel loop each worker thread
    # allocates a qSplit-long row sum ``dsum`` (only the calling thread's is visible to the CPU
    # profiler; all of them are real).
    grad_out, q, k = call.args[0], call.args[1], call.args[2]
    qs, kvs, acc = _flash_splits(q, k)
    threads = torch.get_num_threads()
    copy = 0 if grad_out.transpose(1, 2).is_contiguous() else grad_out.numel() * grad_out.element_size()
    buf = threads * 2 * qs * kvs * acc
    reduced = threads * 2 * qs * kvs * q.element_size() if q.dtype in (torch.float16, torch.bfloat16) else 0
    work = q.shape[0] * q.shape[1]
    workers = work if work < threads else threads
    dsum = workers * qs * acc
    return [OUT, copy, buf, reduced, dsum, -dsum, -reduced, -buf, -copy]


# Kernels that work on a contiguous copy of some operands (``x.expect_contiguous()`` inside),
# made before or after the op's outputs are allocated. Gradients often arrive expanded (zero
# strides) from a sum or mean; saved inputs are often transposed views.
_CONTIGUOUS_OPERANDS = {
    "aten._softmax_backward_data": ((0, "after"),),
    "aten._log_softmax_backward_data": ((0, "after"),),
    "aten.gelu_backward": ((0, "after"),),
    "aten.native_layer_norm": ((0, "before"),),
    "aten.native_layer_norm_backward": ((1, "before"), (0, "after")),
    # torch >= 2.14 makes group norm's operands contiguous inside the kernels (2.13 did it in the
    # group_norm composite, which fake tensors see as a clone)
    "aten.native_group_norm": ((0, "after"),),
}


def _copy_if_strided(t: Any) -> Any:
    return 0 if not isinstance(t, torch.Tensor) or t.is_contiguous() else t.numel() * t.element_size()


@rule(*_CONTIGUOUS_OPERANDS, device="cpu")
def _contiguous_copies(call: Call) -> Program | None:
    before, after = [], []
    for index, when in _CONTIGUOUS_OPERANDS[tc.op_packet_name(call.func)]:
        copy = _copy_if_strided(call.args[index] if index < len(call.args) else None)
        if not (isinstance(copy, int) and copy == 0):
            (before if when == "before" else after).append(copy)
    if not before and not after:
        return None
    return [*before, OUT, *after, *[-c for c in reversed(before + after)]]


def _blas_copy(m: torch.Tensor) -> Any:
    # ATen's gemm takes a matrix as is when one of its last two strides is 1 and the other a valid
    # leading dimension; anything else (an expanded gradient with zero strides) is copied first.
    if m.dim() < 2:
        return 0
    rows, cols = m.shape[-2], m.shape[-1]
    s_row, s_col = m.stride()[-2], m.stride()[-1]
    one = 1
    if (s_col == 1 and s_row >= (cols if cols > one else one)) or (s_row == 1 and s_col >= (rows if rows > one else one)):
        return 0
    return m.numel() * m.element_size()


def _nonzero(values: list) -> list:
    return [c for c in values if not (isinstance(c, int) and c == 0)]


@rule("aten.mm", device="cpu")
def _mm_copies(call: Call) -> Program | None:
    copies = _nonzero([_blas_copy(call.args[0]), _blas_copy(call.args[1])])
    return [OUT, *copies, *[-c for c in reversed(copies)]] if copies else None


def _item_gemm_ready(t: torch.Tensor) -> bool:
    # bmm's batch_items_contiguous_or_transposed (a size-1 dim's stride does not matter)
    size, stride = t.shape, t.stride()
    return bool((stride[2] == 1 and (size[1] == 1 or stride[1] >= size[2]))
                or (stride[1] == 1 and (size[2] == 1 or stride[2] >= size[1])))


@rule("aten.bmm", device="cpu")
def _bmm_copies(call: Call) -> Program | None:
    # bmm_out_or_baddbmm_: a naive strided loop for small items, batched GEMM when both operands'
    # items are GEMM-ready (and the result contiguous), else one mm per item, which copies an
    # item that BLAS cannot take - one item at a time.
    a, b, out = call.args[0], call.args[1], call.outputs[0]
    if a.shape[2] * a.shape[1] * b.shape[2] < 400:
        return None
    if a.is_floating_point() and _item_gemm_ready(a) and _item_gemm_ready(b) and out.is_contiguous():
        return None
    copies = _nonzero([_blas_copy(a[0]), _blas_copy(b[0])])
    return [OUT, *copies, *[-c for c in reversed(copies)]] if copies else None


@rule("aten.native_group_norm_backward", device="cpu")
def _group_norm_backward_cpu(call: Call) -> Program:
    # Contiguous copies of a strided gradient and input (torch >= 2.14 makes them in here), then
    # GroupNormBackwardKernelImpl's per-(sample, channel) ds and db buffers (accumulate type).
    grad, x = call.args[0], call.args[1]
    copies = _nonzero([_copy_if_strided(grad), _copy_if_strided(x)])
    n, c = x.shape[0], x.shape[1]
    acc = 4 if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else x.element_size()
    ds = n * c * acc
    return [*copies, OUT, ds, ds, -ds, -ds, *[-k for k in reversed(copies)]]


@rule("aten.mse_loss", "aten.smooth_l1_loss", device="cpu")
def _pointwise_loss_cpu(call: Call) -> Program | None:
    # The elementwise loss, then a result allocated input-sized and reduced in place: the 0-dim
    # output keeps that input-sized storage (see output_storage below).
    reduction = call.arg(2, "reduction", 1)
    if reduction == 0:  # 'none'
        return None
    x = call.args[0]
    size = x.numel() * x.element_size()
    tail = [8, x.element_size(), -x.element_size(), -8] if reduction == 1 else []  # mean divides by numel
    return [size, OUT, *tail, -size]


def output_storage(func: Any, args: tuple, kwargs: dict, outputs: tuple, device: str) -> dict:
    """Outputs whose real storage is larger than the fake one: {output index: bytes}."""
    if device != "cpu" or tc.op_packet_name(func) not in ("aten.mse_loss", "aten.smooth_l1_loss"):
        return {}
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    if reduction == 0:
        return {}
    return {0: args[0].numel() * args[0].element_size()}


@rule("aten.mean", device="cpu")
def _mean_cpu(call: Call) -> Program | None:
    # sum then div_ by the element count: an int64 wrapped scalar copied to the result dtype.
    out = call.outputs[0]
    if not out.dtype.is_floating_point:
        return None
    return [OUT, 8, out.element_size(), -out.element_size(), -8]


_FOREACH_WRAPPING = {f"aten._foreach_{op}{inplace}" for op in ("add", "sub", "mul", "div") for inplace in ("", "_")}


def _foreach_scalars(call: Call) -> Program:
    # CPU runs _foreach ops as a loop of per-tensor ops; each add/sub/mul/div by a Python number
    # wraps the number (and casts it to the tensor's dtype) again, one tensor at a time.
    schema = getattr(call.func, "_schema", None)
    if schema is None or tc.op_packet_name(call.func) not in _FOREACH_WRAPPING:
        return []
    scalar = None
    for i, arg in enumerate(schema.arguments):
        value = call.args[i] if i < len(call.args) else call.kwargs.get(arg.name)
        if isinstance(value, tc._NUMBERS):
            scalar = tc.plain_number(value)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], tc._NUMBERS):
            scalar = tc.plain_number(value[0])
    tensors = call.tensors
    if scalar is None or not tensors:
        return []
    wrapped = _WRAPPED_DTYPE[type(scalar)]
    common = result_dtype([tensors[0]], [scalar])
    cast = common.itemsize if common != wrapped else 0
    return [wrapped.itemsize, cast, OUT, -cast, -wrapped.itemsize] if cast else [wrapped.itemsize, OUT, -wrapped.itemsize]


def program_for(func: Any, args: tuple, kwargs: dict, outputs: tuple, device: str, grad_enabled: bool = False,
                phase: str = "forward") -> Program:
    """The hidden-allocation program of one aten call ([] when the kernel hides nothing)."""
    if device != "cpu":
        return []
    call = Call(func, args, kwargs, outputs, device, grad_enabled, phase)
    program = _tensor_iterator(call) or _foreach_scalars(call)
    fn = _RULES.get((tc.op_packet_name(func), device))
    extra = fn(call) if fn is not None else None
    if isinstance(extra, Unknown):
        return program + [extra] if program else [extra]
    if not extra:
        return program
    if not program:
        return extra
    # wrapped scalars exist for the whole call: around the op's own program
    i = program.index(OUT)
    return program[:i] + extra + program[i + 1:]
