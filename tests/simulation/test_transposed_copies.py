"""ATen's CPU copy of a transposed matrix into a contiguous one (a 2-D source with strides
(1, rows), at least 60 x 60 elements) goes through a 60 x 60 block buffer of its dtype (120 x 120
for uint8): a fixed 14,400 B for float32 that fake kernels never show. It happens wherever such a
copy does: ``.t().contiguous()``, and the contiguous copies kernels make inside (embedding's
backward of a transposed output gradient, softmax, layer norm). Checked against real runs, on both
sides of the threshold."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import check_against_real_run, check_training_against_real_run


class TransposedEmbedding(nn.Module):
    """``emb(idx)`` used transposed: its backward gets a (N, D) gradient with strides (1, N)."""

    def __init__(self, vocab: int = 3000, dim: int = 12):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, idx):
        return torch.tanh(self.emb(idx).t()) * self.scale


class Copy(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.fn(x, self.w)


def ids(vocab):
    return {"idx": lambda shape, sizes: torch.randint(0, vocab, shape)}


def test_embedding_backward_of_a_transposed_gradient():
    spec = fxmem.TensorSpec(("N",), dtype=torch.int64)
    sizes = [dict(N=600), dict(N=150), dict(N=1100)]  # 12*N elements: under and over 3600
    torch.manual_seed(0)
    check_training_against_real_run(TransposedEmbedding(), (spec,), sizes, lambda p: torch.optim.SGD(p, lr=0.1),
                                    makers=ids(3000))


COPIES = {
    "float32": (lambda x, w: (x * w).t().contiguous(), torch.float32),
    "float64": (lambda x, w: (x * w).t().contiguous(), torch.float64),
    "softmax-of-transposed": (lambda x, w: (x * w).t().softmax(-1), torch.float32),
    "layer-norm-of-transposed": (lambda x, w: nn.functional.layer_norm((x * w).t(), (x.shape[0],)), torch.float32),
}


@pytest.mark.parametrize("name", sorted(COPIES))
def test_transposed_copies_match_real_runs(name):
    fn, dtype = COPIES[name]
    torch.manual_seed(0)
    model = Copy(fn).to(dtype)
    spec = fxmem.TensorSpec(("B", 64), dtype=dtype)
    check_against_real_run(model, (spec,), [dict(B=70), dict(B=20), dict(B=3)], grad=False)


def test_uint8_uses_a_larger_block():
    model = Copy(lambda x, w: x.t().contiguous())
    spec = fxmem.TensorSpec(("B", 130), dtype=torch.uint8)
    check_against_real_run(model, (spec,), [dict(B=150), dict(B=70), dict(B=3)], grad=False)


class TransposedLayerNorm(nn.Module):
    """Layer norm over a transposed input: its forward and backward copy input and gradient."""

    def __init__(self, features: int = 80):
        super().__init__()
        self.ln = nn.LayerNorm(features)

    def forward(self, x):
        return self.ln(x.t() * 2).t() * 3


def test_layer_norm_backward_of_transposed_operands():
    torch.manual_seed(0)
    check_training_against_real_run(TransposedLayerNorm(), ((80, "N"),), [dict(N=100), dict(N=7)],
                                    lambda p: torch.optim.SGD(p, lr=0.1))
