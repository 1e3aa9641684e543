"""A new tensor's strides in the simulation are ATen's, also at dims of size 1 (fxmem/output_strides.py).

Kernels choose their memory format from every stride, and at batch 1 ATen and PyTorch's Python
references (which fake tensors run) disagree: the real run then copies and reorders where the
simulated one does not. Each case below compares the fake output's strides with a real output's,
for fake tensors with concrete and with symbolic sizes, and the models are checked against the
allocator at sizes the analysis did not see.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from corpus.models import UNetAttentionBlock  # a diffusers UNet's attention block
from fxmem._torch_compat import _FakeMode, new_fake_mode
from fxmem.inputs import random_inputs
from fxmem.measure import measure
from fxmem.output_strides import preserve_strides, tensor_iterator_strides


def _layouts():
    """Tensors with size-1 dims and strides ATen chose: a batch-1 image made from tokens, channels
    last, a permuted and a transposed one, and a batch of 2 for contrast."""
    yield "tokens-as-image", torch.randn(1, 8, 16).transpose(1, 2).view(1, 16, 2, 4)
    yield "tokens-as-image-b2", torch.randn(2, 8, 16).transpose(1, 2).view(2, 16, 2, 4)
    yield "nchw-b1", torch.randn(1, 4, 3, 5)
    yield "channels-last-b1", torch.randn(1, 4, 3, 5).contiguous(memory_format=torch.channels_last)
    yield "channels-last-b2", torch.randn(2, 4, 3, 5).contiguous(memory_format=torch.channels_last)
    yield "1c11", torch.randn(1, 4, 1, 1)
    yield "permuted", torch.randn(3, 1, 5).permute(2, 1, 0)
    yield "transposed", torch.randn(6, 4).t()[None]
    yield "sliced", torch.randn(1, 4, 6)[..., ::2]


OPS = {
    "neg": lambda x: -x, "div-number": lambda x: x / 2.0, "add-self": lambda x: x + x, "silu": F.silu,
    "add-contiguous": lambda x: x + x.contiguous(), "mul-broadcast": lambda x: x * x.sum(-1, keepdim=True),
    "clone": lambda x: x.clone(), "to-float64": lambda x: x.to(torch.float64), "contiguous": lambda x: x.contiguous() + 0,
    "where-number": lambda x: torch.where(x > 0, x, 0.0), "eq-number": lambda x: x == 0, "pow": lambda x: x ** 2,
    "empty-like": lambda x: torch.empty_like(x).fill_(0), "zeros-like": torch.zeros_like,
    "rand-like": lambda x: torch.rand_like(x).zero_(), "flip": lambda x: x.flip(-1), "roll": lambda x: x.roll(1, -1),
    "sort": lambda x: x.sort(-1)[0], "masked-fill": lambda x: x.masked_fill(x > 0, 0.0), "half": lambda x: x.half(),
    "layer-norm": lambda x: F.layer_norm(x, x.shape[-1:]), "clamp": lambda x: x.clamp(0, 1), "gelu": F.gelu,
    "add-number-scalar": lambda x: torch.add(x, 3), "softmax": lambda x: x.softmax(-1),
}


def _hint(v):
    return v.node.hint if isinstance(v, torch.SymInt) else v


@pytest.mark.parametrize("symbolic", [False, True], ids=["concrete", "symbolic"])
def test_new_outputs_get_atens_strides(symbolic):
    wrong = []
    for (layout, x), (name, op) in itertools.product(list(_layouts()), OPS.items()):
        real = op(x)
        mode = new_fake_mode()[0] if symbolic else _FakeMode(allow_non_fake_inputs=True)
        with mode:
            fake = op(mode.from_tensor(x))
        got = tuple(_hint(s) for s in fake.stride())  # never compared symbolically: no guard is added
        if got != tuple(real.stride()):
            wrong.append(f"{name} on {layout} {tuple(x.shape)}: ATen {tuple(real.stride())}, simulated {got}")
    assert not wrong, "\n".join(wrong)


def test_the_rules_agree_with_aten_on_random_layouts():
    """tensor_iterator_strides / preserve_strides against ATen's own outputs, on random shapes with
    size-1 dims, random dim orders, broadcasting and gaps."""
    g = torch.Generator().manual_seed(0)
    wrong = []
    for _ in range(300):
        ndim = int(torch.randint(1, 5, (), generator=g))
        shape = [int(v) for v in torch.randint(1, 4, (ndim,), generator=g)]
        perm = torch.randperm(ndim, generator=g).tolist()
        base = torch.randn([shape[p] for p in perm]).permute(*[perm.index(i) for i in range(ndim)])
        if torch.rand((), generator=g) < 0.3:
            base = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
        other = torch.randn([1 if torch.rand((), generator=g) < 0.4 else s for s in shape])
        for x, y in ((base, other), (other, base), (base, base.contiguous())):
            real = torch.add(x, y)
            mine = tensor_iterator_strides(tuple(real.shape), [(tuple(x.shape), x.stride()), (tuple(y.shape), y.stride())])
            if tuple(mine) != real.stride():
                wrong.append(f"add {tuple(x.shape)}{x.stride()} + {tuple(y.shape)}{y.stride()}: ATen {real.stride()}, rule {mine}")
        real = torch.empty_like(base)
        if tuple(preserve_strides(tuple(base.shape), base.stride())) != real.stride():
            wrong.append(f"empty_like {tuple(base.shape)}{base.stride()}: ATen {real.stride()}")
    assert not wrong, "\n".join(wrong[:10])


class OneHotFeatures(nn.Module):
    """Class ids made one-hot features (the fuzzer's one_hot family)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 2).long().clamp(max=4)
        return self.proj(F.one_hot(ids, 5).float()).sum(1)


@pytest.mark.parametrize("model, specs, sizes", [
    (lambda: UNetAttentionBlock(16), (("B", 16, "S", "S"),), [dict(B=1, S=6), dict(B=1, S=9), dict(B=2, S=5)]),
    (OneHotFeatures, (("B", "N"),), [dict(B=1, N=1), dict(B=1, N=7), dict(B=3, N=4)]),
], ids=["attention-on-an-image", "one-hot"])
def test_models_whose_layouts_differ_at_size_1_are_exact(model, specs, sizes):
    torch.manual_seed(0)
    m = model()
    for grad, mode in ((False, "graph"), (True, "graph"), (True, "eager")):
        report = fxmem.analyze(m, *specs, grad=grad, mode=mode)
        run = report.graph_module if mode == "graph" else m  # eager: the forward's locals live to its end
        for dims in sizes:
            xs = random_inputs(report.specs, dims)
            with torch.set_grad_enabled(grad):
                real = measure(lambda: run(*xs))
            ev = report.evaluate(**dims)
            assert (ev["peak_above_resident"], ev["retained"]) == (real.peak_above_start, real.retained), (grad, mode, dims)
            at, _ = report._at(dims)
            assert at.exact, (grad, mode, dims, at.notes)
