"""Each hidden-allocation rule (fxmem.hidden) and real-path rule (fxmem.real_paths), checked
against a real run of a one-op model at three sizes. A rule that drifts from the kernel it
describes (say after a torch upgrade) fails here with the op's name."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from conftest import check_against_real_run


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


def test_batchnorm_eval_and_train_match_real_run():
    for mode in ("train", "eval"):
        model = nn.Sequential(nn.BatchNorm2d(5), nn.Conv2d(5, 4, 1), nn.BatchNorm2d(4))
        getattr(model, mode)()
        check_against_real_run(model, (("B", 5, "H", "W"),), [dict(B=2, H=6, W=7), dict(B=4, H=3, W=9), dict(B=3, H=10, W=2)])
