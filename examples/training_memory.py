"""Seed 001: where training memory goes - the rule of thumb next to fxmem's exact figures.

Seed 001 says: SGD takes 2x the parameter bytes (parameters + gradients), momentum 3x, Adam 4x.
fxmem simulates the real torch.optim optimizers on one steady-state training step of seed 002's
attention (B=64, L=32, C=512, H=8) and shows what the rule leaves out.

Run:  python examples/training_memory.py
"""
from __future__ import annotations

import torch

import fxmem
from seed_attention import Attention

OPTIMIZERS = {
    "SGD": (2, lambda p: torch.optim.SGD(p, lr=0.1)),
    "SGD + momentum": (3, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "Adam": (4, lambda p: torch.optim.Adam(p, lr=1e-3)),
    "Adam (foreach)": (4, lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True)),
}


def main() -> None:
    mib = 1024**2
    model = Attention(512, 8)
    P = sum(p.numel() * p.element_size() for p in model.parameters())
    dims = dict(B=64, L=32)
    print(f"parameters: {P:,} B ({P / mib:.2f} MiB); sizes {dims}\n")
    print(f"{'optimizer':<16} {'rule':>10} {'params+grads+state':>20} {'train peak':>12}   formula of the step's peak")
    for name, (k, factory) in OPTIMIZERS.items():
        report = fxmem.analyze(model, ("B", "L", 512), optimizer=factory)
        n = report.evaluate(**dims)
        state = n["optimizer_state"]
        exact = P + n["grads"] + state
        print(f"{name:<16} {k * P / mib:8.2f}MiB {exact / mib:18.2f}MiB {n['train_peak'] / mib:10.2f}MiB   "
              f"{report.train_peak}")
    print("""
What the rule of thumb misses:
  * Adam's per-parameter `step` counters (a 4-byte tensor per parameter tensor on CPU);
  * activations: everything autograd keeps from the forward, alive until backward frees it -
    here the L**2 attention terms, which grow with the sequence, not with the parameters;
  * the optimizer's temporaries: Adam computes sqrt(exp_avg_sq) and a division per parameter
    (the for-loop version one tensor at a time, the foreach version for all parameters at once);
  * inputs, and gradients of intermediate tensors during backward.
fxmem's train_peak is the exact peak of one steady-state step (forward, loss, backward,
optimizer.step, zero_grad), checked against real steps in tests/simulation/test_training.py.""")


if __name__ == "__main__":
    main()
