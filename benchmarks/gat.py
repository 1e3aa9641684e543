"""GAT attention, several ways: memory and speed of one training step, measured and predicted.

Part "dense" (B=4, 6 input features, F=128, 8 heads concatenated, dropout 0, the same weights, a
random adjacency with half the entries and self loops):
  repeat-concat     seed 000's layer (cat on the feature dim), one per head
  fxmem.optimize    the same model after fxmem.optimize: the pair split, then the fused attention
  hand-decomposed   e = Wh·a[:F] + (Wh·a[F:])ᵀ written by hand (pyGAT's own fix)
  PyG DenseGATConv  torch_geometric.nn.DenseGATConv(6, 128, heads=8) with the same weights

Part "sparse" (one graph, N=2000, about 1 % of the pairs are edges (E ~ 42k with self loops),
32 input features, 4 heads x 32):
  PyG GATConv       torch_geometric.nn.GATConv over edge_index (add_self_loops=False: they are in the list)
  hand-decomposed   the dense form on the adjacency matrix of the same graph
  fxmem.optimize    the hand-decomposed form after fxmem.optimize (fused attention)
  PyG DenseGATConv  on the adjacency matrix

For every size: the time of a training step (forward, loss, backward, SGD step, zero_grad), median
of repeats taken round-robin over the variants in one process, on ``--threads`` threads (default 1:
the machine is shared, and one thread's timings are stable where two threads wait on each other);
its peak memory above resident (the CPU allocator's counters through the profiler; CUDA:
max_memory_allocated), and fxmem's prediction of it (eager mode: the modules run as written).
The "goals" section of the dense part computes, at N=500, the fused form's peak and time against
the hand-decomposed form and DenseGATConv, and the largest N whose whole training step (inputs
and parameters included) fits ``--budget-gib``, from fxmem's exact formulas.

    python benchmarks/gat.py --device cpu            # here: sizes whose predicted peak fits --budget-gib
    python benchmarks/gat.py --device cuda           # on a GPU: every N until out of memory
    FXMEM_TRITON_ATTENTION=1 python benchmarks/gat.py --device cuda   # the fused form on its Triton kernels
Results: benchmarks/results/gat_<device>.{json,md}
"""
from __future__ import annotations

import argparse
import importlib.util
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
SPARSE_N, SPARSE_IN, SPARSE_F, SPARSE_HEADS, DENSITY = 2000, 32, 32, 4, 0.01
HAS_PYG = importlib.util.find_spec("torch_geometric") is not None


class MultiHead(nn.Module):
    """Attention heads, outputs concatenated (as in the seed's network)."""

    def __init__(self, heads: list[nn.Module]):
        super().__init__()
        self.heads = nn.ModuleList(heads)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.cat([h(x, adj) for h in self.heads], dim=-1)


class DecomposedHead(nn.Module):
    """pyGAT's hand fix: the logits as a broadcast add, no pair tensor."""

    def __init__(self, W: torch.Tensor, a: torch.Tensor, alpha: float = 0.2):
        super().__init__()
        self.W, self.a = nn.Parameter(W.clone()), nn.Parameter(a.clone())
        self.leakyrelu = nn.LeakyReLU(alpha)

    def forward(self, inp: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(inp, self.W)
        f = self.W.shape[1]
        e = self.leakyrelu(torch.matmul(h, self.a[:f]) + torch.matmul(h, self.a[f:]).transpose(-1, -2))
        attention = torch.where(adj > 0, e, -9e15 * torch.ones_like(e))
        attention = F.softmax(attention, dim=-1)
        return F.elu(torch.matmul(attention, h))


class PygDense(nn.Module):
    """PyG's DenseGATConv with the weights of the given seed-style heads (no ELU, add_loop=False)."""

    def __init__(self, heads: list[nn.Module], fin: int, fout: int):
        super().__init__()
        from torch_geometric.nn import DenseGATConv

        self.conv = DenseGATConv(fin, fout, heads=len(heads), concat=True, dropout=0.0)
        with torch.no_grad():
            self.conv.lin.weight.copy_(torch.cat([h.W.t() for h in heads], dim=0))
            self.conv.att_dst.copy_(torch.stack([h.a[:fout, 0] for h in heads]).view(1, 1, len(heads), fout))
            self.conv.att_src.copy_(torch.stack([h.a[fout:, 0] for h in heads]).view(1, 1, len(heads), fout))
            self.conv.bias.zero_()

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.conv(x, adj, add_loop=False)


class PygSparse(nn.Module):
    """PyG's GATConv over edge_index (the edge list of the same graph)."""

    def __init__(self, fin: int, fout: int, heads: int):
        super().__init__()
        from torch_geometric.nn import GATConv

        self.conv = GATConv(fin, fout, heads=heads, add_self_loops=False)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.conv(x, edge_index)


# --- the variants ---------------------------------------------------------------------------------------

def dense_variants() -> dict:
    torch.manual_seed(0)
    heads = [GraphAttentionLayerFixed(IN, F_OUT, dropout=0.0) for _ in range(HEADS)]
    specs = (("B", "N", IN), fxmem.TensorSpec(("B", "N", "N"), dtype=torch.bool))
    out = {
        "repeat-concat": lambda: MultiHead(heads),
        "fxmem.optimize": lambda: fxmem.optimize(MultiHead(heads), *specs),
        "hand-decomposed": lambda: MultiHead([DecomposedHead(h.W.data, h.a.data) for h in heads]),
    }
    if HAS_PYG:
        out["PyG DenseGATConv"] = lambda: PygDense(heads, IN, F_OUT)
    return out


def sparse_variants() -> dict:
    torch.manual_seed(0)
    heads = [GraphAttentionLayerFixed(SPARSE_IN, SPARSE_F, dropout=0.0) for _ in range(SPARSE_HEADS)]
    decomposed = lambda: MultiHead([DecomposedHead(h.W.data, h.a.data) for h in heads])  # noqa: E731
    specs = (("N", SPARSE_IN), fxmem.TensorSpec(("N", "N"), dtype=torch.bool))
    out = {}
    if HAS_PYG:
        out["PyG GATConv (edge_index)"] = lambda: PygSparse(SPARSE_IN, SPARSE_F, SPARSE_HEADS)
    out["hand-decomposed"] = decomposed
    out["fxmem.optimize(hand-decomposed)"] = lambda: fxmem.optimize(decomposed(), *specs)
    if HAS_PYG:
        out["PyG DenseGATConv"] = lambda: PygDense(heads, SPARSE_IN, SPARSE_F)
    return out


def dense_inputs(n: int, device: str) -> tuple:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(B, n, IN, generator=gen)
    adj = (torch.rand(B, n, n, generator=gen) > 0.5) | torch.eye(n, dtype=torch.bool)
    return x.to(device), adj.to(device)


def sparse_graph(device: str) -> tuple:
    """x [N, 32], the bool adjacency [N, N] and its edge list [2, E] (self loops included)."""
    gen = torch.Generator().manual_seed(1)
    n = SPARSE_N
    adj = (torch.rand(n, n, generator=gen) < DENSITY) | torch.eye(n, dtype=torch.bool)
    edge_index = adj.nonzero().t().flip(0).contiguous()  # row 0: sources j, row 1: targets i (adj[i, j])
    x = torch.randn(n, SPARSE_IN, generator=gen)
    return x.to(device), adj.to(device), edge_index.to(device)


# --- running ------------------------------------------------------------------------------------------------

def _timed(fn, device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_size(models: dict, reports: dict, inputs: dict, at: dict, device: str, budget: int | None,
             repeats: int) -> list[dict]:
    """One size: every variant's predicted and measured peak, then times taken round-robin."""
    sgd = lambda p: torch.optim.SGD(p, lr=1e-3)  # noqa: E731
    rows, steps = [], {}
    for name, model in models.items():
        if isinstance(reports[name], str):  # fxmem refused this torch (the reason is kept): measure only
            row = {"variant": name, **at, "predicted_peak": None, "predicted_total": None,
                   "prediction_error": reports[name]}
        else:
            pred = reports[name].evaluate(**at)
            row = {"variant": name, **at, "predicted_peak": pred["train_peak"] - pred["train_resident"],
                   "predicted_total": pred["train_peak"]}
        rows.append(row)
        if budget is not None and row["predicted_peak"] is not None and row["predicted_peak"] > budget:
            row["status"] = f"skipped: predicted peak above the {budget / 2**30:.0f} GiB budget"
            continue
        opt = sgd(model.parameters())
        xs = inputs[name]
        steps[name] = (lambda model=model, xs=xs, opt=opt: train_step(model, xs, opt))  # noqa: E731
        try:
            row["measured_peak"] = measure(steps[name], device=device, warmup=1).peak_above_start
            row["status"] = "ok"
        except (torch.cuda.OutOfMemoryError if device == "cuda" else MemoryError):
            row["status"] = "out of memory"
            steps.pop(name)
    times: dict = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(_timed(step, device))
    for row in rows:
        if row["variant"] in times:
            row["seconds"] = statistics.median(times[row["variant"]])
            row["all_seconds"] = [round(t, 4) for t in times[row["variant"]]]
        print({k: v for k, v in row.items() if k != "all_seconds"}, flush=True)
    return rows


def analyse(models: dict, specs: dict, device: str, hints: dict) -> dict:
    """fxmem's report per variant, or the reason it gave none (a string: the row is then measured only)."""
    sgd = lambda p: torch.optim.SGD(p, lr=1e-3)  # noqa: E731
    dims = lambda spec: {d for s in spec for d in (s.shape if isinstance(s, fxmem.TensorSpec) else s)}  # noqa: E731
    out = {}
    for name, m in models.items():
        try:
            out[name] = fxmem.analyze(m, *specs[name], device=device, mode="eager", optimizer=sgd,
                                      hints={k: v for k, v in hints.items() if k in dims(specs[name])})
        except fxmem.FxMemError as exc:
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return out


def dense_part(device: str, sizes: list[int], budget: int | None, repeats: int, budget_gib: float) -> dict:
    # every variant built on the CPU first (fxmem.optimize probes there), then moved: they share weights
    models, refused = _build(dense_variants())
    models = {name: m.to(device) for name, m in models.items()}
    spec = (("B", "N", IN), fxmem.TensorSpec(("B", "N", "N"), dtype=torch.bool))
    reports = analyse(models, {name: spec for name in models}, device, {"B": 4, "N": 509})
    rows = []
    for n in sizes:
        xs = dense_inputs(n, device)
        rows += run_size(models, reports, {name: xs for name in models}, {"B": B, "N": n}, device, budget, repeats)
    goals = {}
    at500 = {r["variant"]: r for r in rows if r["N"] == 500}
    fused, hand, pyg = at500.get("fxmem.optimize"), at500.get("hand-decomposed"), at500.get("PyG DenseGATConv")
    if fused and hand and "measured_peak" in fused and "measured_peak" in hand:
        goals["peak_ratio_hand_over_fused_at_500"] = hand["measured_peak"] / fused["measured_peak"]
    if fused and pyg and "seconds" in fused and "seconds" in pyg:
        goals["time_ratio_fused_over_densegat_at_500"] = fused["seconds"] / pyg["seconds"]
    largest = {}
    for name in ("hand-decomposed", "fxmem.optimize", "PyG DenseGATConv"):
        if name in reports and not isinstance(reports[name], str):
            largest[name] = reports[name].max_size("N", budget=f"{budget_gib}GiB", train=True, B=B)
    goals["largest_N_in_budget"] = largest
    if largest.get("hand-decomposed") and largest.get("fxmem.optimize"):
        goals["largest_N_ratio_fused_over_hand"] = largest["fxmem.optimize"] / largest["hand-decomposed"]
    entries = models["fxmem.optimize"].meta["fxmem"] if "fxmem.optimize" in models else []
    applied = [r["rule"] for r in entries if r["status"] == "applied"]
    goals["rewrites"] = {rule: applied.count(rule) for rule in dict.fromkeys(applied)}
    return {"rows": rows, "goals": goals, "refused": refused}


def sparse_part(device: str, repeats: int) -> dict:
    x, adj, edge_index = sparse_graph(device)
    models, refused = _build(sparse_variants())
    models = {name: m.to(device) for name, m in models.items()}
    sparse_spec = (("N", SPARSE_IN), fxmem.TensorSpec((2, "E"), dtype=torch.int64))
    dense_spec = (("N", SPARSE_IN), fxmem.TensorSpec(("N", "N"), dtype=torch.bool))
    specs = {name: sparse_spec if "edge_index" in name else dense_spec for name in models}
    reports = analyse(models, specs, device, {"N": 2003, "E": 42013})
    inputs = {name: (x, edge_index) if "edge_index" in name else (x, adj) for name in models}
    at = {"N": SPARSE_N, "E": edge_index.shape[1]}
    rows = []
    for name in models:  # each variant at its own dims (E is not a dim of the dense forms)
        one = run_size({name: models[name]}, {name: reports[name]}, inputs,
                       at if "edge_index" in name else {"N": SPARSE_N}, device, None, 1)
        rows += one
    # times round-robin over all variants, in one process
    sgd = lambda p: torch.optim.SGD(p, lr=1e-3)  # noqa: E731
    steps = {name: (lambda m=models[name], xs=inputs[name], o=sgd(models[name].parameters()): train_step(m, xs, o))
             for name in models}
    for step in steps.values():
        step()
    times: dict = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(_timed(step, device))
    for row in rows:
        row["seconds"] = statistics.median(times[row["variant"]])
        row["all_seconds"] = [round(t, 4) for t in times[row["variant"]]]
        row["E"] = edge_index.shape[1]
    return {"rows": rows, "refused": refused}


def _build(variants: dict) -> tuple[dict, dict]:
    """The variants' models, and the reason for each that could not be built (fxmem.optimize's refusal)."""
    models, refused = {}, {}
    for name, make in variants.items():
        try:
            models[name] = make()
        except fxmem.FxMemError as exc:
            refused[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(f"{name}: not built: {refused[name]}", flush=True)
    return models, refused


def _bytes(n) -> str:
    return fxmem.format_bytes(n) if n is not None else ""


def _table(rows: list[dict], dims: str) -> list[str]:
    lines = [f"| variant | {dims} | fxmem predicted peak | measured peak | predicted = measured | time (s) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        at = ", ".join(f"{k}={r[k]}" for k in ("B", "N", "E") if k in r)
        measured = r.get("measured_peak")
        same = "" if measured is None or r["predicted_peak"] is None else (
            "yes" if measured == r["predicted_peak"] else f"off by {measured - r['predicted_peak']:,} B")
        time_text = f"{r['seconds']:.3f}" if "seconds" in r else ""
        lines.append(f"| {r['variant']} | {at} | {_bytes(r['predicted_peak'])} | "
                     f"{_bytes(measured) if measured is not None else r.get('status', '')} | {same} | {time_text} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--part", default="all", choices=["dense", "sparse", "all"])
    p.add_argument("--sizes", default="250,500,1000,2000", help="comma-separated N of the dense part")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="skip real runs whose predicted peak exceeds this; also the budget of the largest-N goal "
                        "(default: 6 on CPU, none / 80 on GPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default: 20 on GPU, 5 on CPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    budget_gib = args.budget_gib if args.budget_gib is not None else (6.0 if args.device == "cpu" else None)
    budget = int(budget_gib * 2**30) if budget_gib else None
    repeats = args.repeats or (20 if args.device == "cuda" else 5)
    result: dict = {}
    if args.part in ("dense", "all"):
        result["dense"] = dense_part(args.device, sizes, budget, repeats, budget_gib or 80.0)
    if args.part in ("sparse", "all"):
        result["sparse"] = sparse_part(args.device, repeats)
    meta = {"device": args.device, "machine": machine_name(args.device), "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "torch_geometric": _version("torch_geometric"),
            "command": "python benchmarks/gat.py " + " ".join(sys.argv[1:]), "repeats": repeats,
            "budget_gib": budget_gib}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    base = os.path.join(HERE, "results", f"gat_{args.device}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, **result}, f, indent=2)
    lines = [f"# GAT attention, several ways ({args.device})", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; torch_geometric {meta['torch_geometric']}; "
             f"{meta['threads']} thread(s); command: `{meta['command']}`. One training step (forward, sum loss, "
             f"backward, SGD step, zero_grad); peak = above resident (parameters and inputs); time = median of "
             f"{repeats}, taken round-robin over the variants in one process.", ""]
    if "dense" in result:
        lines += [f"## Dense: B={B}, {IN}->{F_OUT} features, {HEADS} heads, half the pairs are edges", ""]
        lines += _table(result["dense"]["rows"], "size")
        lines += [f"\n{k}: not measured: {v}" for k, v in result["dense"].get("refused", {}).items()]
        g = result["dense"]["goals"]
        lines += ["", "Goals at N=500 (issue 13): "
                  f"hand-decomposed peak / fused peak = {g.get('peak_ratio_hand_over_fused_at_500', float('nan')):.2f} "
                  f"(goal >= 8); fused time / DenseGATConv time = "
                  f"{g.get('time_ratio_fused_over_densegat_at_500', float('nan')):.2f} (goal <= 1); largest N whose "
                  f"whole training step fits {budget_gib or 80.0:g} GiB (fxmem's exact formulas): "
                  + ", ".join(f"{k} {v}" for k, v in g["largest_N_in_budget"].items())
                  + (f" (fused / hand-decomposed = {g['largest_N_ratio_fused_over_hand']:.1f}, goal >= 4)"
                     if "largest_N_ratio_fused_over_hand" in g else "")
                  + ". Rewrites applied by fxmem.optimize: "
                  + ", ".join(f"{n} {rule}" for rule, n in g["rewrites"].items()) + ".", ""]
    if "sparse" in result:
        lines += [f"## Sparse: one graph, N={SPARSE_N}, {DENSITY:.0%} of the pairs are edges (and self loops), "
                  f"{SPARSE_IN}->{SPARSE_F} features, {SPARSE_HEADS} heads", ""]
        lines += _table(result["sparse"]["rows"], "size")
        lines += [f"\n{k}: not measured: {v}" for k, v in result["sparse"].get("refused", {}).items()]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
