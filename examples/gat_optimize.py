"""Seed 000, made smaller by fxmem: the GAT pair tensor decomposed, the attention fused, all checked.

The seed's author ran out of memory because attention was computed on a [B, N, N, 2F] tensor of
all pairs (Wh_i || Wh_j). ``fxmem.optimize`` finds that the logits are a linear map over pairs and
rewrites ``a · [Wh_i || Wh_j]`` as ``a[:F] · Wh_i + a[F:] · Wh_j``, a broadcast add of a
[B, N, 1, 1] and a [B, 1, N, 1] tensor; then it finds the masked softmax attention over those
decomposed scores and replaces it by a fused kernel that works in row blocks and keeps nothing
N x N for backward - after checking that outputs and gradients match the original in train and
eval mode. This script prints, at the seed's sizes (B=4, N=500, 6 -> 128 features):

* fxmem's predicted peak before and after, and the peak measured by the CPU allocator on real
  runs of both graphs (the run before needs about 2 GB of RAM) - in eval mode, and for a training
  step of the same layer without dropout (with dropout p > 0 the fused kernel draws dropout's own
  mask: tests/passes/test_fused_attention.py);
* the largest batch that fits a 32 GiB card, for inference and for a training step with Adam;
* what ``optimize`` says about the seed's original layer (cat on dim=1), and the 9-layer network.

Run:  python examples/gat_optimize.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fxmem  # noqa: E402
from fxmem.measure import measure  # noqa: E402
from seed_gat import GAT, GraphAttentionLayer, GraphAttentionLayerFixed  # noqa: E402

SPECS = (("B", "N", 6), ("B", "N", "N"))
SEED = dict(B=4, N=500)


def adam(params):
    return torch.optim.Adam(params)


def mib(n: int) -> str:
    return f"{n:>15,} B  ({n / 2**20:9.1f} MiB)"


def real_inputs(B: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(B, N, 6), (torch.rand(B, N, N) > 0.5).float()


def main() -> None:
    torch.manual_seed(0)
    layer = GraphAttentionLayerFixed(6, 128)  # dropout 0.6, as pyGAT
    opt = fxmem.optimize(layer, *SPECS)

    print("== fxmem.optimize(GraphAttentionLayerFixed(6, 128), ('B', 'N', 6), ('B', 'N', 'N')) ==")
    for r in opt.meta["fxmem"]:
        print(f"  {r['status']}: {r['rule']} at {r['where']}\n    {r['reason']}\n    {r.get('details') or ''}")
    rewritten = {n.name for n in opt.graph.nodes if n.meta.get("fxmem_rewrite")}
    print("  the rewritten lines of opt.code:")
    for line in opt.code.splitlines():
        if line.strip().split(" = ")[0] in rewritten:
            print("   ", line.strip().split(";")[0][:150])

    xs = real_inputs(**SEED)
    layer.eval()
    opt.eval()
    before, after = fxmem.analyze(layer, *SPECS, grad=False), fxmem.analyze(opt, *SPECS, grad=False)
    pb, pa = before.evaluate(**SEED), after.evaluate(**SEED)
    with torch.no_grad():
        mb = measure(lambda: before.graph_module(*xs)).peak_above_start
        ma = measure(lambda: opt(*xs)).peak_above_start
    print("\n== inference (eval mode, no_grad) at B=4, N=500 ==")
    _compare(pb, pa, "peak", "peak_above_resident", mb, ma)

    torch.manual_seed(0)
    plain = GraphAttentionLayerFixed(6, 128, dropout=0.0)
    fused = fxmem.optimize(plain, *SPECS)
    train_before = fxmem.analyze(plain, *SPECS, optimizer=adam)
    train_after = fxmem.analyze(fused, *SPECS, optimizer=adam)
    tb, ta = train_before.evaluate(**SEED), train_after.evaluate(**SEED)
    mb = _train_measure(train_before.graph_module, plain, xs)
    ma = _train_measure(fused, plain, xs)
    print("\n== a training step (Adam) of the layer without dropout at B=4, N=500 ==")
    print(f"  rewrites: {[(r['rule'], r['status']) for r in fused.meta['fxmem']]}")
    _compare(tb, ta, "train_peak", None, mb, ma, resident="train_resident")

    print("\n== largest batch B at N=500 on a 32 GiB card ==")
    print(f"  inference (eval mode, no_grad): {before.max_size('B', budget='32GiB', N=500):>6} -> "
          f"{after.max_size('B', budget='32GiB', N=500)}")
    print(f"  training step (Adam, no dropout): {train_before.max_size('B', budget='32GiB', train=True, N=500):>6} -> "
          f"{train_after.max_size('B', budget='32GiB', train=True, N=500)}")

    print("\n== the seed's layer as the blog wrote it (cat on dim=1) ==")
    for r in fxmem.optimize(GraphAttentionLayer(6, 128), *SPECS).meta["fxmem"]:
        print(f"  {r['status']}: {r['rule']} at {r['where']}\n    {r['reason']}\n    {r.get('details') or ''}")

    print("\n== the seed's network: 8 heads x 128 features + a 1600-class output head (no dropout; fxmem's numbers) ==")
    net = GAT(6, 128, 1600, 8, dropout=0.0)
    net_opt = fxmem.optimize(net, *SPECS)
    applied = [r["rule"] for r in net_opt.meta["fxmem"] if r["status"] == "applied"]
    nb = fxmem.analyze(net, *SPECS, optimizer=adam).evaluate(**SEED)
    na = fxmem.analyze(net_opt, *SPECS, optimizer=adam).evaluate(**SEED)
    print(f"  applied: {applied.count('pair-linear')} pair splits, {applied.count('fused-attention')} fused attentions; "
          f"training-step peak at B=4, N=500: {nb['train_peak'] / 2**30:.2f} GiB -> {na['train_peak'] / 2**30:.2f} GiB "
          f"({nb['train_peak'] / na['train_peak']:.0f}x lower)")


def _compare(pb: dict, pa: dict, peak: str, above: str | None, mb: int, ma: int, resident: str = "resident") -> None:
    print(f"  {'':32}{'before':>36}{'after':>36}")
    print(f"  {'fxmem: peak':32}{mib(pb[peak]):>36}{mib(pa[peak]):>36}")
    fb, fa = pb[peak] - pb[resident], pa[peak] - pa[resident]
    print(f"  {'fxmem: peak above resident':32}{mib(fb):>36}{mib(fa):>36}")
    print(f"  {'measured: peak above start':32}{mib(mb):>36}{mib(ma):>36}")
    print(f"  above resident {fb / fa:.1f}x lower; measured {mb / ma:.1f}x lower; prediction == measurement: "
          f"{(fb, fa) == (mb, ma)}")


def _train_measure(module: torch.nn.Module, model: torch.nn.Module, xs: tuple) -> int:
    from fxmem.training import train_step

    optimizer = adam(model.parameters())
    train_step(module, xs, optimizer)  # the optimizer's state, as in a steady state
    return measure(lambda: train_step(module, xs, optimizer)).peak_above_start


if __name__ == "__main__":
    main()
