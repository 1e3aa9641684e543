"""Seed 000, made smaller by fxmem: the GAT pair tensor decomposed automatically, and checked.

The seed's author ran out of memory because attention was computed on a [B, N, N, 2F] tensor of
all pairs (Wh_i || Wh_j). ``fxmem.optimize`` finds that the logits are a linear map over pairs and
rewrites ``a · [Wh_i || Wh_j]`` as ``a[:F] · Wh_i + a[F:] · Wh_j``, a broadcast add of a
[B, N, 1, 1] and a [B, 1, N, 1] tensor - after checking that outputs and gradients match the
original. This script prints, at the seed's sizes (B=4, N=500, 6 -> 128 features):

* fxmem's predicted peak before and after, and the peak measured by the CPU allocator on real
  runs of both graphs (the run before needs about 2 GB of RAM);
* the largest batch that fits a 32 GiB card, for one forward and for a training step with Adam;
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
    layer = GraphAttentionLayerFixed(6, 128)
    opt = fxmem.optimize(layer, *SPECS)

    print("== fxmem.optimize(GraphAttentionLayerFixed(6, 128), ('B', 'N', 6), ('B', 'N', 'N')) ==")
    for r in opt.meta["fxmem"]:
        print(f"  {r['status']}: {r['rule']} at {r['where']}\n    {r['reason']}")
        print(f"    peak  {r['peak_before']}  ->  {r['peak_after']}")
        print(f"    saved {r['saved_before']}  ->  {r['saved_after']}")
    rewritten = {n.name for n in opt.graph.nodes if n.meta.get("fxmem_rewrite")}
    print("  the rewritten lines of opt.code:")
    for line in opt.code.splitlines():
        if line.strip().split(" = ")[0] in rewritten:
            print("   ", line.strip().split(";")[0])

    before, after = fxmem.analyze(layer, *SPECS), fxmem.analyze(opt, *SPECS)
    pb, pa = before.evaluate(**SEED), after.evaluate(**SEED)
    xs = real_inputs(**SEED)
    mb = measure(lambda: before.graph_module(*xs)).peak_above_start
    ma = measure(lambda: opt(*xs)).peak_above_start
    print("\n== one forward (autograd recording) at B=4, N=500 ==")
    print(f"  {'':32}{'before':>36}{'after':>36}")
    print(f"  {'fxmem: peak':32}{mib(pb['peak']):>36}{mib(pa['peak']):>36}")
    print(f"  {'fxmem: peak above resident':32}{mib(pb['peak_above_resident']):>36}{mib(pa['peak_above_resident']):>36}")
    print(f"  {'measured: peak above start':32}{mib(mb):>36}{mib(ma):>36}")
    print(f"  {'fxmem: kept for backward':32}{mib(pb['saved']):>36}{mib(pa['saved']):>36}")
    above = (pb["peak_above_resident"], pa["peak_above_resident"])
    print(f"  peak {pb['peak'] / pa['peak']:.1f}x lower; above resident {above[0] / above[1]:.1f}x lower; "
          f"measured {mb / ma:.1f}x lower; prediction == measurement: {above == (mb, ma)}")

    train_before = fxmem.analyze(layer, *SPECS, optimizer=adam)
    train_after = fxmem.analyze(opt, *SPECS, optimizer=adam)
    print("\n== largest batch B at N=500 on a 32 GiB card ==")
    print(f"  one forward:                 {before.max_size('B', budget='32GiB', N=500):>6} -> "
          f"{after.max_size('B', budget='32GiB', N=500)}")
    print(f"  training step (Adam):        {train_before.max_size('B', budget='32GiB', train=True, N=500):>6} -> "
          f"{train_after.max_size('B', budget='32GiB', train=True, N=500)}")
    print(f"  training-step peak at B=4:   {train_before.evaluate(**SEED)['train_peak']:,} -> "
          f"{train_after.evaluate(**SEED)['train_peak']:,} B")

    print("\n== the seed's layer as the blog wrote it (cat on dim=1) ==")
    for r in fxmem.optimize(GraphAttentionLayer(6, 128), *SPECS).meta["fxmem"]:
        print(f"  {r['status']}: {r['where']}\n    {r['reason']}")

    print("\n== the seed's network: 8 heads x 128 features + a 1600-class output head (fxmem's numbers) ==")
    net = GAT(6, 128, 1600, 8)
    net_opt = fxmem.optimize(net, *SPECS)
    applied = sum(r["status"] == "applied" for r in net_opt.meta["fxmem"])
    nb, na = fxmem.analyze(net, *SPECS).evaluate(**SEED), fxmem.analyze(net_opt, *SPECS).evaluate(**SEED)
    print(f"  {applied} of 9 attention layers rewritten; peak at B=4, N=500: {nb['peak'] / 2**30:.2f} GiB -> "
          f"{na['peak'] / 2**30:.2f} GiB ({nb['peak'] / na['peak']:.0f}x lower)")


if __name__ == "__main__":
    main()
