"""The Triton kernels of the edge-list GAT attention (``fxmem.ops.edge_attention_triton``) and their CUDA rules.

No GPU is needed: Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors, and
their results must be those of ``edge_attention``'s PyTorch path (the reference; autograd gives its
gradients) on the same tensors - out, ds, dt, dh - on random sparse adjacencies (~10% edges) with a
row without an edge, a row and a column of edges longer than one tile, a fill close enough to the
scores to get weight, one adjacency for two groups, one head or two, N != M, operands read through
odd strides, float32, and float16 to its precision. What the wrappers allocate (the CPU allocator,
with the launches and torch.sort's insides left out) must be the CUDA rule's program in
``fxmem.kernels.edge_fused``, byte for byte and in order.

Runs in the CUDA-build phase of CI (conftest skips it elsewhere) and where Triton is installed.
"""
from __future__ import annotations

from triton_interpreter import triton_interpreter  # noqa: F401 - first: it sets TRITON_INTERPRET=1

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

pytestmark = [pytest.mark.cuda_sim, pytest.mark.usefixtures("triton_interpreter")]
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fxmem import data_paths  # noqa: E402
from fxmem.kernels.registry import OUT, REGISTRY, Call, Kind, Unknown  # noqa: E402
from fxmem.measure import allocator_events, cpu_memory_profile  # noqa: E402
from fxmem.ops import edge_attention_triton as kernels  # noqa: E402
from fxmem.ops.edge_attention import edge_attention, kept_edges  # noqa: E402

FORWARD = torch.ops.fxmem.edge_attention_fused.default
BACKWARD = torch.ops.fxmem.edge_attention_fused_backward.default
SLOPE = 0.2


def operands(gm, gh, am, n, m, f, dtype=torch.float32, strided=False, seed=0):
    """(s, t, h, grad, edges): ~10% edges; row 2 without an edge, row 5 and column 4 with every
    entry an edge (more than one tile of BLOCK_EDGES); ``strided``: h a transposed view and the
    gradient expanded over the heads."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(gm, gh, n, generator=gen).to(dtype)
    t = torch.randn(gm, gh, m, generator=gen).to(dtype)
    h = torch.randn(gm, gh, m, f, generator=gen).to(dtype)
    grad = torch.randn(gm, gh, n, f, generator=gen).to(dtype)
    if strided:
        h = torch.randn(gm, gh, f, m, generator=gen).to(dtype).transpose(-1, -2)
        grad = torch.randn(gm, 1, n, f, generator=gen).to(dtype).expand(gm, gh, n, f)
    adj = (torch.rand(am, n, m, generator=gen) < 0.1).float()
    adj[:, :, 4] = 1.0
    adj[:, 5] = 1.0
    adj[:, 2] = 0.0
    with data_paths.forced(True):
        edges = kept_edges(adj, "gt", 0.0, True)
    return s, t, h, grad, edges


def csr(edges, am, n):
    row, col = edges[0], edges[1]
    return torch.searchsorted(row, torch.arange(am * n + 1)), row, col


def close(got, want, tolerance, what):
    scale = max(1.0, want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance * scale, rtol=tolerance,
                               msg=lambda msg: f"{what}: {msg}")


def check(gm, gh, am, n, m, f, fill, dtype=torch.float32, strided=False, tolerance=1e-5):
    s, t, h, grad, edges = operands(gm, gh, am, n, m, f, dtype, strided)
    rowptr, row, col = csr(edges, am, n)
    out, top, norm = kernels.forward(s, t, h, rowptr, row, col, n, m, fill, SLOPE)
    got = kernels.backward(grad, s, t, h, rowptr, row, col, top, norm, n, m, fill, SLOPE)
    leaves = [x.detach().clone().requires_grad_(True) for x in (s, t, h)]
    want = edge_attention(*leaves, edges, mask_groups=am, fill=fill, slope=SLOPE)
    want_grads = torch.autograd.grad(want, leaves, grad)
    assert out.shape == want.shape and out.dtype == want.dtype
    close(out, want, tolerance, "out")
    for name, a, b in zip(("ds", "dt", "dh"), got, want_grads):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        close(a, b, tolerance, name)
    _, want_top, want_norm = kernels.reference(s, t, h, rowptr, row, col, n, m, fill, SLOPE)
    close(top, want_top, tolerance, "top")
    close(norm, want_norm, tolerance, "norm")


@pytest.mark.parametrize("gm,gh,am,n,m,f,fill", [
    (1, 1, 1, 37, 35, 8, -9e15),   # pyGAT: masked entries get no weight
    (2, 2, 2, 36, 34, 20, -2.0),   # a fill close to the scores: masked entries keep weight
    (2, 1, 1, 40, 33, 8, -9e15),   # one adjacency for both groups
    (2, 2, 1, 33, 38, 20, 0.5),    # ... two heads, a fill above many scores
])
def test_kernels_compute_what_edge_attention_computes(gm, gh, am, n, m, f, fill):
    check(gm, gh, am, n, m, f, fill)


def test_operands_read_through_their_strides():
    check(2, 2, 1, 34, 35, 20, -2.0, strided=True)


def test_float16_to_its_precision():
    check(2, 2, 1, 34, 36, 20, -1e4, dtype=torch.float16, tolerance=1e-2)


def test_the_op_runs_on_cpu_without_triton_and_differentiates():
    """The op's CPU kernel (its PyTorch reference) and autograd: edge_attention's values and gradients."""
    s, t, h, grad, edges = operands(2, 2, 1, 12, 11, 4, dtype=torch.float64)
    rowptr, row, col = csr(edges, 1, 12)
    leaves = [x.clone().requires_grad_(True) for x in (s, t, h)]
    out = torch.ops.fxmem.edge_attention_fused(*leaves, rowptr, row, col, 12, 11, -2.0, SLOPE)[0]
    got = torch.autograd.grad(out, leaves, grad)
    want = edge_attention(*leaves, edges, mask_groups=1, fill=-2.0, slope=SLOPE)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, torch.autograd.grad(want, leaves, grad)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    torch.library.opcheck(torch.ops.fxmem.edge_attention_fused, (*leaves, rowptr, row, col, 12, 11, -2.0, SLOPE),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("opt_in,dropout", [(True, 0.0), (False, 0.0), (True, 0.5)])
def test_edge_attention_routes_cuda_calls_to_the_op_when_opted_in(monkeypatch, opt_in, dropout):
    if opt_in:
        monkeypatch.setenv("FXMEM_TRITON_ATTENTION", "1")
    else:
        monkeypatch.delenv("FXMEM_TRITON_ATTENTION", raising=False)
    with FakeTensorMode(allow_non_fake_inputs=False):
        s, t = torch.empty(1, 2, 9, device="cuda"), torch.empty(1, 2, 7, device="cuda")
        h = torch.empty(1, 2, 7, 4, device="cuda")
        edges = torch.zeros(2, 5, dtype=torch.int64, device="cuda")
        with _Ops() as ops:
            out = edge_attention(s, t, h, edges, mask_groups=1, fill=-9e15, slope=SLOPE)
    assert out.shape == (1, 2, 9, 4)
    assert ("fxmem.edge_attention_fused.default" in ops.seen) == opt_in


# --- what the wrappers allocate, against the CUDA rules ---------------------------------------------------

def events(program, outputs):
    """A rule's program as allocator events: the outputs' bytes at OUT, zero-byte ones and notes left out."""
    flat = []
    for p in program:
        if isinstance(p, Unknown):
            continue
        flat += [o.untyped_storage().nbytes() for o in outputs] if p is OUT else [p]
    return [int(b) for b in flat if b]


def allocated(fn):
    with cpu_memory_profile() as prof:
        result = fn()
    return result, [b for _, b in allocator_events(prof) if b]


def _sort(x, stable=False):
    """torch.sort's outputs only: its insides are the device's (CPU: an arange; CUDA: cub's workspace, Unknown)."""
    return torch.empty_like(x), torch.empty_like(x)


@pytest.mark.parametrize("gm,gh,am", [(2, 3, 2), (2, 1, 1)])
def test_the_wrappers_allocate_what_the_cuda_rules_say(monkeypatch, gm, gh, am):
    n, m, f = 37, 35, 20
    s, t, h, grad, edges = operands(gm, gh, am, n, m, f, strided=True)
    rowptr, row, col = csr(edges, am, n)
    top, norm = torch.zeros(gm, gh, n), torch.ones(gm, gh, n)
    monkeypatch.setenv("FXMEM_TRITON_ATTENTION", "1")  # opted in: the rules are the kernels'
    monkeypatch.setattr(kernels, "_launch", lambda *a, **k: None)  # the wrappers' own allocations only
    monkeypatch.setattr(torch, "sort", _sort)
    kernels._kernels()  # Triton's first import and the jitting outside the profile
    options = (n, m, -9e15, SLOPE)

    outs, seen = allocated(lambda: kernels.forward(s, t, h, rowptr, row, col, *options))
    args = (s, t, h, rowptr, row, col, *options)
    program = REGISTRY.lookup(Kind.HIDDEN, FORWARD, "cuda").fn(Call(FORWARD, args, {}, outs, "cuda"))
    assert seen == events(program, outs), (seen, program)
    assert seen[-2:] == [4 * gm * gh * f, -4 * gm * gh * f]

    outs, seen = allocated(lambda: kernels.backward(grad, s, t, h, rowptr, row, col, top, norm, *options))
    args = (grad, s, t, h, rowptr, row, col, top, norm, *options)
    program = REGISTRY.lookup(Kind.HIDDEN, BACKWARD, "cuda").fn(Call(BACKWARD, args, {}, outs, "cuda"))
    assert seen == events(program, outs), (seen, program)
    assert sum(isinstance(p, Unknown) for p in program) == 1  # torch.sort's workspace on CUDA


def test_without_the_opt_in_the_rules_say_unknown(monkeypatch):
    monkeypatch.delenv("FXMEM_TRITON_ATTENTION", raising=False)
    s, t, h, grad, edges = operands(1, 2, 1, 9, 7, 4)
    rowptr, row, col = csr(edges, 1, 9)
    args = (s, t, h, rowptr, row, col, 9, 7, -9e15, SLOPE)
    for device in ("cuda", "cpu"):
        program = REGISTRY.lookup(Kind.HIDDEN, FORWARD, device).fn(Call(FORWARD, args, {}, (), device))
        assert isinstance(program, Unknown)
