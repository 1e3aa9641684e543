"""Each kernel rule of fxmem.kernels (hidden allocations, real paths), checked
against a real run of a one-op model at three sizes. A rule that drifts from the kernel it
describes (say after a torch upgrade) fails here with the op's name."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from conftest import check_against_real_run, check_training_against_real_run


class Op(nn.Module):
    """``fn(x, weight)`` with a parameter, so that autograd records as in training."""

    def __init__(self, fn, features: int = 6):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return self.fn(x, self.w)


OPS = {
    # Python numbers wrapped into tensors: float/int/bool numbers, float/double/int tensors
    "mul-float": (lambda x, w: (x * w) * 0.5, torch.float32),
    "div-int": (lambda x, w: (x * w) / 3, torch.float32),
    "add-int": (lambda x, w: (x + w) + 1, torch.float32),
    "rsub": (lambda x, w: 1.0 - x * w, torch.float32),
    "double-mul": (lambda x, w: (x * w.double()) * 0.5, torch.float64),
    "gt-scalar": (lambda x, w: (x * w) > 0, torch.float32),
    "where-scalar": (lambda x, w: torch.where(x > 0, x * w, 0.0), torch.float32),
    "int-tensor-add": (lambda x, w: (x + 2) * w, torch.int64),
    "pow": (lambda x, w: (x * w) ** 2, torch.float32),
    "masked-fill": (lambda x, w: (x * w).masked_fill(x > 1, -1e9), torch.float32),
    # kernel-internal temporaries
    "repeat-2d": (lambda x, w: (x * w)[0].repeat(2, 3), torch.float32),
    "repeat-3d": (lambda x, w: (x * w).repeat(1, 2, 1), torch.float32),
    "repeat-4d": (lambda x, w: (x * w).unsqueeze(0).repeat(2, 1, 1, 2), torch.float32),
    "mean-dim": (lambda x, w: (x * w).mean(1), torch.float32),
    "mean-all": (lambda x, w: (x * w).mean(), torch.float32),
    "sum": (lambda x, w: (x * w).sum(-1), torch.float32),
    "softmax": (lambda x, w: (x * w).softmax(-1), torch.float32),
    "log-softmax": (lambda x, w: (x * w).log_softmax(1), torch.float32),
    "layer-norm": (lambda x, w: F.layer_norm(x, (6,), w), torch.float32),
    "gelu": (lambda x, w: F.gelu(x * w), torch.float32),
    "cat-stack": (lambda x, w: torch.cat([x * w, torch.stack([x, x], -1).sum(-1)], 1), torch.float32),
    "max-pool1d-grad": (lambda x, w: F.max_pool1d((x * w).transpose(1, 2), 2), torch.float32),
    "max-pool1d-input": (lambda x, w: F.max_pool1d(x.transpose(1, 2), 2) + w.sum(), torch.float32),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_matches_real_run(name):
    fn, dtype = OPS[name]
    model = Op(fn).to(torch.float64 if dtype == torch.float64 else torch.float32)
    spec = fxmem.TensorSpec(("B", "N", 6), dtype=dtype)
    check_against_real_run(model, (spec,), [dict(B=2, N=5), dict(B=3, N=11), dict(B=7, N=4)])


CONVS = {
    "3to8-k3-s2": dict(in_channels=3, out_channels=8, kernel_size=3, stride=2),
    "8to16-k3-p1": dict(in_channels=8, out_channels=16, kernel_size=3, padding=1),
    "17to33-k5-s2-p2": dict(in_channels=17, out_channels=33, kernel_size=5, stride=2, padding=2),
    "64to64-k1": dict(in_channels=64, out_channels=64, kernel_size=1),
    "16to16-dw": dict(in_channels=16, out_channels=16, kernel_size=3, groups=16, padding=1),
    "4to6-dilated-nobias": dict(in_channels=4, out_channels=6, kernel_size=3, dilation=2, bias=False),
}


@pytest.mark.parametrize("name", sorted(CONVS))
@pytest.mark.parametrize("grad", [True, False])
def test_conv2d_matches_real_run(name, grad):
    kw = CONVS[name]
    model = nn.Sequential(nn.Conv2d(**kw), nn.ReLU())
    spec = ("B", kw["in_channels"], "H", "W")
    check_against_real_run(model, (spec,), [dict(B=2, H=13, W=17), dict(B=3, H=24, W=9), dict(B=5, H=11, W=11)],
                           grad=grad)


@pytest.mark.parametrize("variant", ["plain", "causal", "mask", "dropout"])
@pytest.mark.parametrize("grad", [True, False])
def test_sdpa_matches_real_run(variant, grad):
    class SDPA(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, x, m):
            B, L, C = x.shape
            q, k, v = self.qkv(x).view(B, L, 3, 4, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m if variant == "mask" else None,
                                                  is_causal=variant == "causal",
                                                  dropout_p=0.1 if variant == "dropout" else 0.0)

    check_against_real_run(SDPA(), (("B", "L", 32), ("L", "L")), [dict(B=2, L=9), dict(B=3, L=40), dict(B=1, L=17)],
                           grad=grad)


class SDPAMath(nn.Module):
    """SDPA where CPU flash attention does not apply - v's head size other than q's, or 5-d operands -
    so it runs its math path (whose softmax is aten._safe_softmax)."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.qk, self.v = nn.Linear(32, 64), nn.Linear(32, 16 if variant == "value-width" else 32)

    def forward(self, x):
        B, L, C = x.shape
        q, k = self.qk(x).view(B, L, 2, 4, 8).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(B, L, 4, -1).transpose(1, 2)
        if self.variant == "five-d":
            q, k, v = (t.unflatten(1, (2, 2)) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, scale=0.3)


@pytest.mark.parametrize("variant", ["value-width", "five-d"])
@pytest.mark.parametrize("grad", [True, False])
def test_sdpa_math_path_matches_real_run(variant, grad):
    check_against_real_run(SDPAMath(variant), (("B", "L", 32),), [dict(B=2, L=9), dict(B=3, L=40), dict(B=1, L=17)],
                           grad=grad)
    if grad:
        check_training_against_real_run(SDPAMath(variant), (("B", "L", 32),), [dict(B=2, L=21)],
                                        lambda p: torch.optim.SGD(p, lr=0.1), num_threads=1)


def test_batchnorm_eval_and_train_match_real_run():
    for mode in ("train", "eval"):
        model = nn.Sequential(nn.BatchNorm2d(5), nn.Conv2d(5, 4, 1), nn.BatchNorm2d(4))
        getattr(model, mode)()
        check_against_real_run(model, (("B", 5, "H", "W"),), [dict(B=2, H=6, W=7), dict(B=4, H=3, W=9), dict(B=3, H=10, W=2)])


class Grad(nn.Module):
    """``fn(x @ w)`` as a model output: with the default ``out.sum()`` loss its gradient arrives
    expanded (zero strides), which several CPU backward kernels copy."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return self.fn(x @ self.w)


TRAINING_OPS = {
    "softmax": lambda h: h.softmax(-1), "log_softmax": lambda h: h.log_softmax(-1),
    "softmax-dim1": lambda h: h.softmax(1), "layer_norm": lambda h: F.layer_norm(h, (6,)),
    "layer_norm-transposed": lambda h: F.layer_norm(h.transpose(1, 2), (h.shape[1],)),
    "group_norm": lambda h: F.group_norm(h.transpose(1, 2), 2), "gelu": F.gelu, "relu": F.relu,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "elu": F.elu, "silu": F.silu, "softplus": F.softplus,
    "leaky_relu": lambda h: F.leaky_relu(h, 0.2), "exp": torch.exp, "pow": lambda h: h ** 2,
    "bmm": lambda h: h @ h.transpose(1, 2), "mean": lambda h: h.mean(1), "sum-dim": lambda h: h.sum(1),
    "cat": lambda h: torch.cat([h, h], -1), "max": lambda h: h.max(-1).values, "topk": lambda h: h.topk(2, -1).values,
    "norm": lambda h: h.norm(dim=-1), "var": lambda h: h.var(-1), "logsumexp": lambda h: h.logsumexp(-1),
    "cumsum": lambda h: h.cumsum(1), "index_select": lambda h: h.index_select(1, torch.tensor([0, 2])),
    "embedding": lambda h: F.embedding(torch.tensor([[0, 1], [2, 3]]), h[0]),
    "cross_entropy": lambda h: F.cross_entropy(h.flatten(0, 1), torch.zeros(h.shape[0] * h.shape[1], dtype=torch.long)),
    "mse_loss": lambda h: F.mse_loss(h, torch.zeros_like(h)), "dropout": lambda h: F.dropout(h, 0.3),
    "where": lambda h: torch.where(h > 0, h, h * 0.1), "clamp": lambda h: h.clamp(-1, 1),
    "sqrt": lambda h: (h * h + 1).sqrt(), "abs": torch.abs, "hardtanh": F.hardtanh,
}


@pytest.mark.parametrize("name", sorted(TRAINING_OPS))
def test_backward_kernels_match_a_real_training_step(name):
    check_training_against_real_run(Grad(TRAINING_OPS[name]), (("B", "N", 6),), [dict(B=3, N=5), dict(B=2, N=9)],
                                    lambda p: torch.optim.SGD(p, lr=0.1))
