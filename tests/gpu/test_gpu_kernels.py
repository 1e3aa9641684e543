"""On a real GPU: the CUDA kernels whose scratch fxmem models (fxmem/kernels/cuda.py) - softmax's
backward, cuBLAS operand copies, memory-efficient and flash attention forward and backward - in
small models, predicted against ``torch.cuda.max_memory_allocated`` for a forward and a
steady-state training step at sizes the analysis did not see. Skipped without a CUDA device."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem

pytestmark = pytest.mark.gpu


class SoftmaxMix(nn.Module):
    """softmax over (B, N, N) scores: its CUDA backward's grad * output temporary."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lin(x) @ x.transpose(-1, -2), -1) @ x


class ExpandedBmm(nn.Module):
    """A sum loss's expanded gradient reaches bmm's backward: cuBLAS clones it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.bmm(y, y.transpose(1, 2))


class Attention(nn.Module):
    """q, k, v projections viewed (B, L, H, D) and transposed (as transformers does), one SDPA backend."""

    def __init__(self, heads: int, head: int, dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        c = heads * head
        self.heads, self.head, self.dtype = heads, head, dtype
        self.backend = {"efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                        "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION}[backend]
        self.q, self.k, self.v = (nn.Linear(16, c, dtype=dtype) for _ in range(3))
        self.o = nn.Linear(c, 16, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        x = x.to(self.dtype)
        q, k, v = (p(x).view(b, n, self.heads, self.head).transpose(1, 2) for p in (self.q, self.k, self.v))
        with torch.nn.attention.sdpa_kernel(self.backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, n, -1)).float()


CASES = {
    "softmax": (SoftmaxMix, [dict(B=3, N=37), dict(B=2, N=70)]),
    "expanded-bmm": (ExpandedBmm, [dict(B=3, N=37), dict(B=2, N=70)]),
    "efficient-f32-d16": (lambda: Attention(4, 16, torch.float32, "efficient"), [dict(B=3, N=37), dict(B=2, N=130)]),
    "efficient-f32-d80": (lambda: Attention(2, 80, torch.float32, "efficient"), [dict(B=3, N=37), dict(B=2, N=130)]),
    "efficient-bf16-d64": (lambda: Attention(4, 64, torch.bfloat16, "efficient"), [dict(B=3, N=37), dict(B=2, N=130)]),
    "flash-bf16-d64": (lambda: Attention(4, 64, torch.bfloat16, "flash"), [dict(B=3, N=37), dict(B=2, N=130)]),
    "flash-bf16-d128-split": (lambda: Attention(2, 128, torch.bfloat16, "flash"), [dict(B=1, N=600)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_kernel_scratch_matches_the_gpu(name):
    factory, sizes = CASES[name]
    torch.manual_seed(0)
    report = fxmem.analyze(factory(), ("B", "N", 16), device="cuda", mode="eager", check=False,
                           optimizer=lambda p: torch.optim.Adam(p))
    assert report.exact, report.notes
    for dims in sizes:
        v = fxmem.validate(factory().train(), ("B", "N", 16), dims=dims, device="cuda", mode="eager",
                           optimizer=lambda p: torch.optim.Adam(p))
        print(v)
        assert all(r.diff == 0 for r in v.rows), str(v)


def test_the_caching_allocators_unsplit_blocks_stay_within_allocator_slack():
    """Tensors over 1 MiB: the measured peaks lie between fxmem's and fxmem's plus allocator_slack."""
    dims = dict(B=4, N=800)  # 10 MB score tensors
    report = fxmem.analyze(SoftmaxMix(), ("B", "N", 16), device="cuda", mode="eager", check=False,
                           optimizer=lambda p: torch.optim.Adam(p))
    at = report.evaluate(**dims)
    from fxmem.accounting.cuda_blocks import AllocatorConfig

    if AllocatorConfig.from_environment().expandable:  # every block split: nothing can be added
        assert at["allocator_slack"] == at["train_allocator_slack"] == 0
    else:
        assert at["allocator_slack"] > 0 and at["train_allocator_slack"] > 0
    v = fxmem.validate(SoftmaxMix().train(), ("B", "N", 16), dims=dims, device="cuda", mode="eager",
                       optimizer=lambda p: torch.optim.Adam(p))
    print(v, at["allocator_slack"], at["train_allocator_slack"])
    fwd, step = v.rows[0], v.rows[2]
    assert fwd.predicted <= fwd.measured <= fwd.predicted + at["allocator_slack"], str(v)
    assert step.predicted <= step.measured <= step.predicted + at["train_allocator_slack"], str(v)


@pytest.mark.parametrize("compare,am,dtype", [("gt", 1, torch.float32), ("add", 2, torch.float32),
                                              ("true", 2, torch.float16), ("gt", 2, torch.bfloat16)])
def test_triton_attention_on_the_gpu_computes_and_allocates_what_fxmem_says(monkeypatch, compare, am, dtype):
    """The fused GAT attention's Triton kernels (opted in) on CUDA tensors: the PyTorch row blocks'
    results, forward and backward; and the allocator's own counters during each wrapper are what
    the CUDA rules in fxmem/kernels/fused.py list (outputs; the backward's row statistics)."""
    from fxmem.kernels.registry import OUT, REGISTRY, Call, Kind
    from fxmem.ops import attention as plain
    from fxmem.ops import attention_triton as kernels
    if not kernels.registered():
        pytest.skip("no Triton in this CUDA build")
    monkeypatch.setenv("FXMEM_TRITON_ATTENTION", "1")
    gen = torch.Generator().manual_seed(0)
    gm, gh, n, m, f = 2, 4, 300, 260, 64
    s, t = torch.randn(gm, gh, n, generator=gen), torch.randn(gm, gh, m, generator=gen)
    h, grad = torch.randn(gm, gh, m, f, generator=gen), torch.randn(gm, gh, n, f, generator=gen)
    adj = torch.randn(am, n, m, generator=gen)
    if compare == "true":
        adj = adj > 0
    elif compare == "add":
        adj = torch.where(adj > 0, 0.0, float("-inf"))
    s, t, h, grad = (x.to("cuda", dtype) for x in (s, t, h, grad))
    adj = adj.to("cuda", dtype if adj.dtype.is_floating_point else adj.dtype)
    options = (compare, 0.0, True, -9e15, 0.2)
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype]
    ref = plain._masked_attention_rows(s, t, h, adj, *options, 4 * 2**20)
    start = torch.cuda.memory_allocated()
    got = kernels.masked_attention_forward(s, t, h, adj, *options)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - start == sum(x.untyped_storage().nbytes() for x in got)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    need_adj = compare == "add"
    ref_b = plain._masked_attention_backward_rows(grad, s, t, h, adj, ref[1], *options, 4 * 2**20, need_adj)
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    got_b = kernels.masked_attention_backward(grad, s, t, h, adj, ref[1], *options, need_adj)
    torch.cuda.synchronize()
    outs = sum(-(-x.untyped_storage().nbytes() // 512) * 512 for x in got_b)
    stats = -(-8 * gm * gh * n // 512) * 512
    assert torch.cuda.memory_allocated() - start == outs
    assert torch.cuda.max_memory_allocated() - start == outs + stats
    for a, b in zip(got_b, ref_b):
        if b.numel():
            torch.testing.assert_close(a.float(), b.float(), atol=tol * 10, rtol=tol * 10)
    args = (grad, s, t, h, adj, ref[1], *options, 4 * 2**20, need_adj)
    program = REGISTRY.lookup(Kind.HIDDEN, torch.ops.fxmem.masked_attention_backward.default, "cuda").fn(
        Call(torch.ops.fxmem.masked_attention_backward.default, args, {}, got_b, "cuda"))
    assert program == [OUT, 8 * gm * gh * n, -8 * gm * gh * n]


def test_triton_edge_attention_on_the_gpu_computes_what_the_pytorch_form_computes(monkeypatch):
    """The edge-list attention's Triton kernels (opted in) against its PyTorch form on the same CUDA
    tensors: output and the gradients of s, t and h, on a sparse graph with a row without edges."""
    from fxmem.ops import attention_triton, edge_attention as edge
    if not attention_triton.registered():
        pytest.skip("no Triton in this CUDA build")
    gen = torch.Generator().manual_seed(1)
    gm, gh, n, m, f = 2, 4, 700, 650, 32
    adj = torch.rand(1, n, m, generator=gen) < 0.05
    adj[0, 5] = False  # a row with no edge: uniform weights over all columns
    leaves = [torch.randn(*shape, generator=gen).cuda().requires_grad_()
              for shape in ((gm, gh, n), (gm, gh, m), (gm, gh, m, f))]
    edges = edge.kept_edges(adj.cuda(), "true", 0.0, True)
    grad = torch.randn(gm, gh, n, f, generator=gen).cuda()
    results = []
    for opted in ("0", "1"):
        monkeypatch.setenv("FXMEM_TRITON_ATTENTION", opted)
        out = edge.edge_attention(*leaves, edges, mask_groups=1, fill=-9e15, slope=0.2)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, grad)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
