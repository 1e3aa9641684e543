"""The independent check every rewrite test uses: run the original and the rewritten module on the
same inputs, with the same random numbers, in train and eval mode, with autograd and under
``no_grad``, and compare outputs, gradients (w.r.t. parameters and inputs) and buffers after the call
- in float64, on copies, so the user's module is never touched."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


def run(module: nn.Module, xs: list, training: bool, grad: bool, seed: int = 7) -> dict:
    """float64 outputs, gradients (w.r.t. parameters and float inputs) and buffers after one call, on a copy."""
    module = copy.deepcopy(module).double().train(training)
    xs = [x.detach().double().requires_grad_(grad) if x.is_floating_point() else x for x in xs]
    with torch.random.fork_rng(devices=[]), (torch.enable_grad() if grad else torch.no_grad()):
        torch.manual_seed(seed)
        out = module(*xs)
    result = {"output": out.detach()}
    result.update({f"buffer {n}": b.clone() for n, b in module.named_buffers()})
    if grad:
        named = list(module.named_parameters()) + [(f"input {k}", x) for k, x in enumerate(xs) if x.requires_grad]
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
        grads = torch.autograd.grad((out * w).nan_to_num().sum(), [t for _, t in named], allow_unused=True)
        result.update({n: g if g is not None else torch.zeros_like(t) for (n, t), g in zip(named, grads)})
    return result


def assert_same_in_every_mode(model: nn.Module, opt: nn.Module, xs: list, rtol: float = 1e-9,
                              atol: float = 1e-12) -> None:
    """Same outputs, gradients and buffers in train/eval mode, with and without grad."""
    for training in (True, False):
        for grad in (True, False):
            want, got = run(model, xs, training, grad), run(opt, xs, training, grad)
            assert set(want) <= set(got), (training, grad)
            for name, w in want.items():
                torch.testing.assert_close(got[name], w, rtol=rtol, atol=atol, equal_nan=True,
                                           msg=f"{name}, training={training}, grad={grad}")


def rewritten(opt):
    """The rewritten form of an ``fxmem.optimize`` result, with the ``meta["fxmem"]`` entries of that
    form: the result itself, or, where the rewrites pay only for some sizes and the result carries
    two forms (``fxmem.passes.switch``), the form taken where the condition holds."""
    forms = getattr(opt, "fxmem_forms", None)
    if forms is None:
        return opt
    gm = forms.when
    gm.meta["fxmem"] = [e for e in opt.meta["fxmem"] if e["when"] == str(forms.condition) and e["rule"] != "switch"]
    return gm
