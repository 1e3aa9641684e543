"""fxmem.optimize on public implementations (tests/public_impls.py, restated from their published
form): the rewrites they get, verified against the original; and what a TorchDynamo capture must
keep of the model's behaviour (its dtype after ``.double()`` and under autocast).

The large-size figures (Cora, GPT-2 small) are in benchmarks/public_code.py's results.
"""
from __future__ import annotations

import pytest
import torch

import fxmem
import public_impls as P
from equivalence import assert_same_in_every_mode

EDGES = fxmem.TensorSpec((2, "E"), dtype=torch.int64)


def _graph(n: int = 9, e: int = 30, f: int = 16, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, f, generator=g), torch.randint(0, n, (2, e), generator=g)


def _applied(opt) -> list[str]:
    return sorted({e["rule"] for e in opt.meta["fxmem"] if e["status"] == "applied"})


def test_a_dynamo_captured_graph_follows_the_models_dtype():
    """The tutorial's edge-list GAT makes ``torch.zeros(n, H, dtype=scores.dtype)`` with n from
    ``x.shape[0]``: fx cannot trace it, Dynamo's graph wrote float32 into the zeros, and optimize's
    float64 verification raised a raw RuntimeError. The graph now reads the dtype from the tensor."""
    torch.manual_seed(0)
    model = P.TutorialGATEdges(16)
    opt = fxmem.optimize(model, ("N", 16), EDGES)
    assert "TorchDynamo" in str(opt.meta.get("fxmem_capture", "")) or "fused-message-passing" in _applied(opt)
    assert "fused-message-passing" in _applied(opt), opt.meta["fxmem"]
    x, ei = _graph(n=9, e=40)
    assert_same_in_every_mode(model, opt, [x, ei])
    model.eval(), opt.eval()
    xd = x.double()
    a, b = model.double()(xd, ei), opt.double()(xd, ei)
    assert b.dtype == torch.float64 and torch.allclose(a, b)
    model.float(), opt.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = model(x, ei), opt(x, ei)
    assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("build, specs, rule", [
    (lambda: P.PyGAT2017Layer(16, 8), (("N", 16), ("N", "N")), "fused-attention"),
    (lambda: P.HandGCN(16), (("N", 16), EDGES, ("E",)), "fused-message-passing"),
    (lambda: P.TimmAttention(32, 4), (("B", "L", 32),), "sdpa"),
], ids=["pyGAT-2017", "hand-GCN", "timm-attention"])
def test_public_implementations_get_their_rewrite_without_hints(build, specs, rule):
    torch.manual_seed(0)
    model = build()
    opt = fxmem.optimize(model, *specs)
    assert rule in _applied(opt), opt.meta["fxmem"]
    if rule == "sdpa":
        xs = [torch.randn(2, 5, 32)]
    elif rule == "fused-message-passing":
        x, ei = _graph(n=6, e=30)
        xs = [x, ei, torch.rand(30)]
    else:
        x, _ = _graph(n=7)
        xs = [x, (torch.rand(7, 7) > 0.5).float() + torch.eye(7)]
    assert_same_in_every_mode(model, opt, xs)
