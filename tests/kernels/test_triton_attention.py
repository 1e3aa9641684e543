"""The Triton kernels of the fused GAT attention (``fxmem.ops.attention_triton``) and their CUDA rules.

No GPU is needed: Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors, and
their results must be the PyTorch kernel's (``fxmem.ops.attention``, the reference) on the same
tensors - out, top, ds, dt, dh and an additive mask's gradient - for every mask form, a mask per
group or one shared, one head or two, sizes that are not multiples of the blocks, rows whose every
score is replaced, scores replaced by a fill close enough to get weight, operands read through odd
strides, float32, and float16 / bfloat16 to their precision. What the wrappers allocate (the CPU
allocator, with the launches left out: on a GPU a Triton kernel allocates nothing) must be the CUDA
rule's program in ``fxmem.kernels.fused``, byte for byte and in order.

Runs in the CUDA-build phase of CI (conftest skips it elsewhere) and where Triton is installed.
"""
from __future__ import annotations

import os
import subprocess
import sys

from triton_interpreter import triton_interpreter  # noqa: F401 - first: it sets TRITON_INTERPRET=1

import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = [pytest.mark.cuda_sim, pytest.mark.usefixtures("triton_interpreter")]
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fxmem.kernels.registry import OUT, REGISTRY, Call, Kind, Unknown  # noqa: E402
from fxmem.measure import allocator_events, cpu_memory_profile  # noqa: E402
from fxmem.ops import attention as reference  # noqa: E402
from fxmem.ops import attention_triton as kernels  # noqa: E402

FORWARD, BACKWARD = torch.ops.fxmem.masked_attention.default, torch.ops.fxmem.masked_attention_backward.default
SLOPE, THRESHOLD, BLOCK_BYTES = 0.2, 1.0, 4 * 2**20
COMPARISONS = {"gt": float.__gt__, "ge": float.__ge__, "lt": float.__lt__, "le": float.__le__, "eq": float.__eq__,
               "ne": float.__ne__}


def test_triton_runs_interpreted(triton_interpreter):
    assert triton_interpreter, "Triton was imported before tests/kernels/triton_interpreter.py set TRITON_INTERPRET"


def operands(compare: str, keep: bool, gm: int, gh: int, am: int, n: int, m: int, f: int,
             dtype: torch.dtype = torch.float32, strided: bool = False, seed: int = 0) -> tuple:
    """(s, t, h, adj, grad): adj with row 2 replaced throughout (an additive mask: -inf but for one
    entry); ``strided``: h a transposed view, the gradient expanded over the heads, one mask
    expanded over the groups - read through their strides."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(gm, gh, n, generator=gen).to(dtype)
    t = torch.randn(gm, gh, m, generator=gen).to(dtype)
    h = torch.randn(gm, gh, m, f, generator=gen).to(dtype)
    grad = torch.randn(gm, gh, n, f, generator=gen).to(dtype)
    if compare == "true":
        adj = torch.rand(am, n, m, generator=gen) > 0.5
        adj[:, 2] = not keep
    elif compare == "add":
        adj = torch.randn(am, n, m, generator=gen)
        adj[:, 2] = float("-inf")
        adj[:, 2, 3] = 0.5
    else:
        adj = torch.randint(0, 3, (am, n, m), generator=gen).float()
        # a value whose every entry the mask replaces
        adj[:, 2] = next(v for v in (0.0, 1.0, 2.0) if COMPARISONS[compare](v, THRESHOLD) != keep)
    if strided:
        h = torch.randn(gm, gh, f, m, generator=gen).to(dtype).transpose(-1, -2)
        grad = torch.randn(gm, 1, n, f, generator=gen).to(dtype).expand(gm, gh, n, f)
        adj = adj[:1].expand(gm, n, m) if am == gm else adj
    return s, t, h, adj, grad


def close(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    """Equal to ``tolerance`` relative to the reference's largest magnitude (NaN where it has NaN)."""
    scale = max(1.0, want.float().nan_to_num(0.0, 0.0, 0.0).abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance * scale, rtol=tolerance, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def check(compare, keep, gm, gh, am, n, m, f, dtype=torch.float32, fill=-9e15, strided=False, tolerance=1e-5):
    s, t, h, adj, grad = operands(compare, keep, gm, gh, am, n, m, f, dtype, strided)
    options = (compare, THRESHOLD, keep, fill, SLOPE)
    need_adj = compare == "add"
    out, top = kernels.masked_attention_forward(s, t, h, adj, *options)
    want_out, want_top = reference.masked_attention_op(s, t, h, adj, *options, BLOCK_BYTES)
    got = kernels.masked_attention_backward(grad, s, t, h, adj, top, *options, need_adj)
    want = reference.masked_attention_backward_op(grad, s, t, h, adj, want_top, *options, BLOCK_BYTES, need_adj)
    assert out.dtype == want_out.dtype and out.shape == want_out.shape and top.shape == want_top.shape
    close(out, want_out, tolerance, "out")
    close(top, want_top, tolerance, "top")
    for name, a, b in zip(("ds", "dt", "dh", "dadj"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        close(a, b, tolerance, name)


@pytest.mark.parametrize("compare,keep,gm,gh,am,n,m,f", [
    ("gt", True, 2, 2, 2, 37, 35, 20),  # two blocks of rows and of columns, both partial
    ("ge", False, 1, 2, 1, 33, 40, 8),
    ("lt", True, 2, 1, 1, 20, 36, 8),  # one row block; one mask for both groups
    ("le", False, 2, 2, 2, 35, 17, 20),
    ("eq", True, 1, 1, 1, 40, 34, 8),
    ("ne", False, 2, 1, 2, 34, 33, 20),
    ("true", True, 2, 2, 1, 37, 35, 8),  # a bool adj: what stays
    ("true", False, 1, 2, 1, 36, 38, 20),  # ... what goes
    ("add", True, 2, 2, 2, 37, 35, 20),  # an additive mask and its gradient, summed over the heads
    ("add", True, 2, 2, 1, 35, 37, 8),  # ... and over the groups, one mask for all
])
def test_kernels_compute_what_the_pytorch_kernel_computes(compare, keep, gm, gh, am, n, m, f):
    check(compare, keep, gm, gh, am, n, m, f)


def test_a_fill_close_enough_to_get_weight_and_operands_read_through_their_strides():
    check("gt", True, 2, 2, 2, 37, 35, 20, fill=-2.0, strided=True)  # replaced scores' dE is 0 nonetheless
    check("add", True, 2, 2, 2, 21, 34, 8, strided=True)  # one mask expanded over the groups


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # that 0 / 0, in numpy
def test_a_row_masked_to_minus_infinity_is_nan_as_in_torch():
    s, t, h, adj, grad = operands("add", True, 1, 2, 1, 18, 20, 8)
    adj[:, 5] = float("-inf")  # softmax over -inf only: NaN (0 / 0), in the kernels as in torch.softmax
    out, top = kernels.masked_attention_forward(s, t, h, adj, "add", 0.0, True, -9e15, SLOPE)
    want_out, want_top = reference.masked_attention_op(s, t, h, adj, "add", 0.0, True, -9e15, SLOPE, BLOCK_BYTES)
    assert out[:, :, 5].isnan().all() and not out[:, :, :5].isnan().any()
    close(out, want_out, 1e-5, "out")
    close(top, want_top, 1e-5, "top")
    got = kernels.masked_attention_backward(grad, s, t, h, adj, top, "add", 0.0, True, -9e15, SLOPE, True)
    want = reference.masked_attention_backward_op(grad, s, t, h, adj, want_top, "add", 0.0, True, -9e15, SLOPE,
                                                  BLOCK_BYTES, True)
    for name, a, b in zip(("ds", "dt", "dh", "dadj"), got, want):
        close(a, b, 1e-5, name)  # NaN where torch's are: the row's, and every column's sum over the rows


def _product(a_ptr, o_ptr):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    tl.store(o_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, a))


def interpreter_multiplies(dtype: torch.dtype) -> bool:
    """Whether Triton's interpreter gets tl.dot of ``dtype`` operands right (Triton 3.8's gets bfloat16
    wrong: numbers ~1e10 from operands ~1; loads and conversions of bfloat16 are right)."""
    a = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = torch.empty(16, 16)
    triton.jit(_product)[(1,)](a, out)
    return torch.allclose(out, a.float() @ a.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float16, 1e-2), (torch.bfloat16, 4e-2)])
def test_half_precision_to_its_precision(dtype, tolerance):
    if not interpreter_multiplies(dtype):
        pytest.skip(f"this Triton's interpreter computes tl.dot of {dtype} operands wrongly (a GPU computes them)")
    check("gt", True, 2, 2, 1, 37, 35, 20, dtype=dtype, fill=-1e4, tolerance=tolerance)


# --- what the wrappers allocate, against the CUDA rules ---------------------------------------------------

def events(program: list, outputs: tuple) -> list[int]:
    """A rule's program as allocator events: the outputs' bytes at OUT, zero-byte ones left out."""
    flat = []
    for p in program:
        flat += [o.untyped_storage().nbytes() for o in outputs] if p is OUT else [p]
    return [int(b) for b in flat if b]


def allocated(fn) -> tuple:
    """(fn's result, the CPU allocator's events during it, in bytes: negative a free)."""
    with cpu_memory_profile() as prof:
        result = fn()
    return result, [b for _, b in allocator_events(prof) if b]


@pytest.mark.parametrize("compare,am,strided", [("gt", 2, False), ("add", 1, False), ("add", 2, True)])
def test_the_wrappers_allocate_what_the_cuda_rules_say(monkeypatch, compare, am, strided):
    s, t, h, adj, grad = operands(compare, True, 2, 3, am, 37, 35, 20, strided=strided)
    options = (compare, THRESHOLD, True, -9e15, SLOPE)
    top = torch.zeros(2, 3, 37, 1)
    monkeypatch.setenv("FXMEM_TRITON_ATTENTION", "1")  # opted in: the rules are the kernels'
    monkeypatch.setattr(kernels, "_launch", lambda *a, **k: None)  # the wrappers' own allocations only
    kernels._kernels()  # Triton's first import and the jitting outside the profile

    outs, seen = allocated(lambda: kernels.masked_attention_forward(s, t, h, adj, *options))
    args = (s, t, h, adj, *options, BLOCK_BYTES)
    program = REGISTRY.lookup(Kind.HIDDEN, FORWARD, "cuda").fn(Call(FORWARD, args, {}, outs, "cuda"))
    assert program == [OUT] and seen == events(program, outs)

    for need_adj in (False, True):
        outs, seen = allocated(lambda: kernels.masked_attention_backward(grad, s, t, h, adj, top, *options, need_adj))
        args = (grad, s, t, h, adj, top, *options, BLOCK_BYTES, need_adj)
        program = REGISTRY.lookup(Kind.HIDDEN, BACKWARD, "cuda").fn(Call(BACKWARD, args, {}, outs, "cuda"))
        assert seen == events(program, outs), (need_adj, seen, program)
        assert seen[-2:] == [8 * 6 * 37, -8 * 6 * 37]  # the float32 row statistics, freed on return


def test_float64_keeps_the_row_blocks_and_their_rule(monkeypatch):
    monkeypatch.setenv("FXMEM_TRITON_ATTENTION", "1")
    s, t, h, adj, grad = (x.double() for x in operands("gt", True, 1, 2, 1, 9, 7, 8))
    assert kernels.registered() and not kernels.handles(s, t, h, adj, THRESHOLD)
    outs = FORWARD(s, t, h, adj, "gt", THRESHOLD, True, -9e15, SLOPE, BLOCK_BYTES)
    args = (s, t, h, adj, "gt", THRESHOLD, True, -9e15, SLOPE, BLOCK_BYTES)
    program = REGISTRY.lookup(Kind.HIDDEN, FORWARD, "cuda").fn(Call(FORWARD, args, {}, outs, "cuda"))
    assert len(program) > 1 and isinstance(program[-1], Unknown)  # the PyTorch blocks, not checked on a GPU
    # a float64 mask with a threshold float32 holds exactly is taken; one it does not hold is not
    assert kernels.handles(s.float(), t.float(), h.float(), adj.double(), 0.5)
    assert not kernels.handles(s.float(), t.float(), h.float(), adj.double(), 0.1)


def test_the_kernels_are_on_the_cuda_key_and_importing_fxmem_imports_no_triton():
    assert kernels.available() and kernels.registered()
    for op in ("fxmem::masked_attention", "fxmem::masked_attention_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    for op in ("fxmem::masked_attention_dropout", "fxmem::masked_attention_dropout_backward"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    code = "import sys, fxmem, fxmem.ops.attention; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_the_opt_in_cuda_keeps_the_row_blocks_and_their_rule(monkeypatch):
    """Until the kernels are checked on a GPU they are taken only with FXMEM_TRITON_ATTENTION=1; without
    it a float32 call on CUDA is the PyTorch row blocks', rule and all."""
    monkeypatch.delenv("FXMEM_TRITON_ATTENTION", raising=False)
    s, t, h, adj, grad = operands("gt", True, 1, 2, 1, 9, 7, 8)
    assert kernels.handles(s, t, h, adj, THRESHOLD) and not kernels.enabled()
    outs = FORWARD(s, t, h, adj, "gt", THRESHOLD, True, -9e15, SLOPE, BLOCK_BYTES)
    args = (s, t, h, adj, "gt", THRESHOLD, True, -9e15, SLOPE, BLOCK_BYTES)
    program = REGISTRY.lookup(Kind.HIDDEN, FORWARD, "cuda").fn(Call(FORWARD, args, {}, outs, "cuda"))
    assert len(program) > 1 and isinstance(program[-1], Unknown)
    monkeypatch.setenv("FXMEM_TRITON_ATTENTION", "1")
    assert REGISTRY.lookup(Kind.HIDDEN, FORWARD, "cuda").fn(Call(FORWARD, args, {}, outs, "cuda")) == [OUT]


# --- compiled for real GPUs (no GPU needed: Triton compiles for a target it is told) --------------------
# In a process of its own: this one runs Triton's interpreter, whose triton.language the compiler cannot use.

_COMPILE = """
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fxmem.ops import attention_triton as k
name, dtype, width, capability = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
scope = {"_forward_kernel": "forward", "_backward_rows": "rows", "_backward_columns": "columns", "_backward_adj": "adj"}
kernel = k._kernels()[scope[name]]  # jitted for real here: no TRITON_INTERPRET in this process
params = list(inspect.signature(kernel.fn).parameters)
consts = {"COMPARE": 7, "KEEP": True, "PRECISION": "ieee" if dtype == "fp32" else "tf32", "BN": k.BLOCK_ROWS,
          "BM": k.BLOCK_COLS, "BF": width}
signature = {p: "constexpr" if p in consts else ("*fp32" if p in ("sum_ptr", "d_ptr") else "*" + dtype)
             if p.endswith("_ptr") else "fp32" if p in ("threshold", "fill", "slope") else "i64" for p in params}
source = ASTSource(fn=kernel, signature=signature, constexprs={(params.index(c),): v for c, v in consts.items()})
compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
print(json.dumps({"shared": compiled.metadata.shared,
                  "scratch": getattr(compiled.metadata, "global_scratch_size", 0)}))
"""


@pytest.mark.parametrize("dtype,width,capability", [("fp32", 128, 90),
                                                    pytest.param("bf16", 64, 80, marks=pytest.mark.slow)])
def test_the_kernels_compile_for_the_gpu_without_scratch(dtype, width, capability):
    """What the interpreter cannot say: each kernel compiles for an H100 (sm_90) or an A100 (sm_80)
    at a wide feature block, needs no global scratch (the CUDA rules count none) and less shared
    memory than an SM has (228 KiB on sm_90, 164 KiB on sm_80)."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    names = ("_forward_kernel", "_backward_rows", "_backward_columns", "_backward_adj")
    runs = {name: subprocess.Popen([sys.executable, "-c", _COMPILE, name, dtype, str(width), str(capability)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names}
    for name, run in runs.items():  # the four at once: each is one process's work
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["scratch"] == 0 and got["shared"] <= (228 if capability == 90 else 164) * 1024, (name, got)
