"""GAT attention, four ways: memory and speed of one training step, measured and predicted.

Variants (B=4, 6 input features, F=128, 8 heads concatenated, dropout 0, same weights):
  repeat-concat    seed 000's layer (corrected cat on the feature dim), one per head
  fxmem.optimize   the same model after fxmem's pair-concat rewrite
  hand-decomposed  e = Wh·a[:F] + (Wh·a[F:])ᵀ written by hand (pyGAT's own fix)
  PyG DenseGATConv torch_geometric.nn.DenseGATConv(6, 128, heads=8), when installed (no ELU,
                   add_loop=False; its weights are set from the same W and a)

For every N in 250, 500, 1000, 2000, 4000, 8000, ... until the variant no longer fits: the time of
a training step (forward, loss, backward, SGD step, zero_grad; median of repeats after warm-up;
CUDA events on a GPU), its peak memory above resident (CPU: the allocator's counters through the
profiler; GPU: max_memory_allocated), and fxmem's predicted peak for it (eager mode: the modules
run as written).

    python benchmarks/gat.py --device cpu        # here: sizes whose predicted peak fits --budget
    python benchmarks/gat.py --device cuda       # on a GPU: every N until out of memory
Results: benchmarks/results/gat_<device>.{json,md}
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import fxmem  # noqa: E402
from fxmem.measure import machine_name, measure  # noqa: E402
from fxmem.training import train_step  # noqa: E402
from seed_gat import GraphAttentionLayerFixed  # noqa: E402

B, IN, F_OUT, HEADS = 4, 6, 128, 8


class MultiHead(nn.Module):
    """``HEADS`` attention heads, outputs concatenated (as in the seed's network)."""

    def __init__(self, heads: list[nn.Module]):
        super().__init__()
        self.heads = nn.ModuleList(heads)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.cat([h(x, adj) for h in self.heads], dim=2)


class DecomposedHead(nn.Module):
    """pyGAT's hand fix: the logits as a broadcast add, no pair tensor."""

    def __init__(self, W: torch.Tensor, a: torch.Tensor, alpha: float = 0.2):
        super().__init__()
        self.W, self.a = nn.Parameter(W.clone()), nn.Parameter(a.clone())
        self.leakyrelu = nn.LeakyReLU(alpha)

    def forward(self, inp: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(inp, self.W)
        f = self.W.shape[1]
        e = self.leakyrelu(torch.matmul(h, self.a[:f]) + torch.matmul(h, self.a[f:]).transpose(1, 2))
        attention = torch.where(adj > 0, e, -9e15 * torch.ones_like(e))
        attention = F.softmax(attention, dim=2)
        return F.elu(torch.matmul(attention, h))


class PygGAT(nn.Module):
    def __init__(self, heads: list[GraphAttentionLayerFixed]):
        super().__init__()
        from torch_geometric.nn import DenseGATConv

        self.conv = DenseGATConv(IN, F_OUT, heads=HEADS, concat=True, dropout=0.0)
        with torch.no_grad():
            self.conv.lin.weight.copy_(torch.cat([h.W.t() for h in heads], dim=0))
            self.conv.att_dst.copy_(torch.stack([h.a[:F_OUT, 0] for h in heads]).view(1, 1, HEADS, F_OUT))
            self.conv.att_src.copy_(torch.stack([h.a[F_OUT:, 0] for h in heads]).view(1, 1, HEADS, F_OUT))
            self.conv.bias.zero_()

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.conv(x, adj, add_loop=False)


def variants() -> dict:
    torch.manual_seed(0)
    heads = [GraphAttentionLayerFixed(IN, F_OUT, dropout=0.0) for _ in range(HEADS)]
    out = {
        "repeat-concat": lambda: MultiHead(heads),
        "fxmem.optimize": lambda: fxmem.optimize(MultiHead(heads), ("B", "N", IN), ("B", "N", "N")),
        "hand-decomposed": lambda: MultiHead([DecomposedHead(h.W.data, h.a.data) for h in heads]),
    }
    import importlib.util

    if importlib.util.find_spec("torch_geometric") is not None:
        out["PyG DenseGATConv"] = lambda: PygGAT(heads)
    return out


def _time(fn, device: str, repeats: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(device: str, sizes: list[int], budget: int | None, repeats: int) -> list[dict]:
    rows = []
    sgd = lambda p: torch.optim.SGD(p, lr=1e-3)  # noqa: E731
    for name, make in variants().items():
        model = make().to(device)
        report = fxmem.analyze(model, ("B", "N", IN), fxmem.TensorSpec(("B", "N", "N"), dtype=torch.bool),
                               device=device, mode="eager", optimizer=sgd)
        for n in sizes:
            pred = report.evaluate(B=B, N=n)
            row = {"variant": name, "N": n, "predicted_peak": pred["train_peak"] - pred["train_resident"]}
            if budget is not None and row["predicted_peak"] > budget:
                row["status"] = f"skipped: predicted peak above the {budget / 2**30:.0f} GiB budget"
                rows.append(row)
                print(row, flush=True)
                continue
            x = torch.randn(B, n, IN, device=device)
            adj = (torch.rand(B, n, n, device=device) > 0.5) | torch.eye(n, dtype=torch.bool, device=device)
            opt = sgd(model.parameters())
            step = lambda: train_step(model, (x, adj), opt)  # noqa: E731
            try:
                m = measure(step, device=device, warmup=1)
                row["measured_peak"] = m.peak_above_start
                row["seconds"] = _time(step, device, repeats)
                row["status"] = "ok"
            except torch.cuda.OutOfMemoryError if device == "cuda" else MemoryError:
                row["status"] = "out of memory"
                torch.cuda.empty_cache() if device == "cuda" else None
            rows.append(row)
            print(row, flush=True)
            x = adj = opt = step = None  # free this size's tensors before the next one  # noqa: F841
            if row["status"] == "out of memory":
                break
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default=None, help="comma-separated N (default: 250, 500, 1000, ... doubling)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="skip real runs whose predicted peak exceeds this (default: 6 on CPU, none on GPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default: 20 on GPU, 3 on CPU)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [250 * 2**k for k in range(8)]
    budget_gib = args.budget_gib if args.budget_gib is not None else (6.0 if args.device == "cpu" else None)
    budget = int(budget_gib * 2**30) if budget_gib else None
    repeats = args.repeats or (20 if args.device == "cuda" else 3)
    rows = run(args.device, sizes, budget, repeats)
    meta = {"device": args.device, "machine": machine_name(args.device), "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "command": "python benchmarks/gat.py " + " ".join(sys.argv[1:]), "batch": B, "heads": HEADS,
            "features": [IN, F_OUT], "repeats": repeats, "budget_gib": budget_gib}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    base = os.path.join(HERE, "results", f"gat_{args.device}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = [f"# GAT attention, four ways ({args.device})", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; command: `{meta['command']}`. "
             f"One training step (forward, sum loss, backward, SGD step, zero_grad), B={B}, {IN}->{F_OUT} features, "
             f"{HEADS} heads; time = median of {repeats}; peak = above resident (parameters and inputs).", "",
             "| variant | N | fxmem predicted peak | measured peak | predicted = measured | time (s) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        measured = r.get("measured_peak")
        same = "" if measured is None else ("yes" if measured == r["predicted_peak"] else f"off by {measured - r['predicted_peak']:,} B")
        lines.append(f"| {r['variant']} | {r['N']} | {fxmem.format_bytes(r['predicted_peak'])} | "
                     f"{fxmem.format_bytes(measured) if measured is not None else r['status']} | {same} | "
                     f"{r['seconds']:.4f} |" if "seconds" in r else
                     f"| {r['variant']} | {r['N']} | {fxmem.format_bytes(r['predicted_peak'])} | {r['status']} | | |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
