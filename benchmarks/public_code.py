"""fxmem.optimize on other people's code, at their users' sizes: public GAT, GCN and attention
implementations (restated in tests/zoo/public_impls.py), each optimized without hints, then one
training step of the original and of the result measured at the user's size, next to PyG's layers.

Sizes: Cora (N=2708 nodes, E=10,556 edges, 1433 input features, 8 heads of 8) for the graph layers;
GPT-2 small's attention (B=8, L=1024, 768 wide, 12 heads) for the attention layers.

For each: the rules ``optimize`` applied (from ``meta["fxmem"]``), the peak above resident of one
training step (forward, ``out.sum().backward()``) measured by the CPU allocator, the time of a step
(median of ``--repeats``, taken round-robin over the original and the result in one process), the
time ``optimize`` took, and the largest difference of the result's outputs and gradients from the
original's at the user's size (eval mode, relative to their largest magnitude).

    python benchmarks/public_code.py [--only NAME [--merge]] [--repeats 3]

``--merge`` with ``--only``: the re-measured rows replace theirs in the stored results, new ones
are added (the command that measured them is recorded next to the one that measured the rest).
Results: benchmarks/results/public_code_cpu.{json,md}
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import fxmem  # noqa: E402
from fxmem.measure import machine_name, measure  # noqa: E402

CORA = dict(N=2708, E=10556, F=1433)
GPT = dict(B=8, L=1024, C=768)


def cora(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n, e = CORA["N"], CORA["E"]
    edge_index = torch.randint(0, n, (2, e), generator=g)
    adj = torch.zeros(n, n)
    adj[edge_index[1], edge_index[0]] = 1.0
    adj += torch.eye(n)
    return {"x": torch.randn(n, CORA["F"], generator=g), "adj": adj, "edge_index": edge_index,
            "mask": torch.where(adj > 0, 0.0, float("-inf")), "weight": torch.rand(e, generator=g)}


def entries() -> list[tuple]:
    """(name, what it restates, build, specs, inputs(graph, tokens))"""
    from zoo import public_impls as P

    f = CORA["F"]
    node, dense = ("N", f), ("N", "N")
    edges = fxmem.TensorSpec((2, "E"), dtype=torch.int64)
    tokens = ("B", "L", GPT["C"])
    return [
        ("pyGAT layer", "Diego999/pyGAT GraphAttentionLayer", lambda: P.PyGATLayer(f, 64), (node, dense),
         lambda g, t: [g["x"], g["adj"]]),
        ("pyGAT 2017 layer", "pyGAT's first layer (repeat-concat pairs)", lambda: P.PyGAT2017Layer(f, 64),
         (node, dense), lambda g, t: [g["x"], g["adj"]]),
        ("pyGAT GAT (8 heads)", "Diego999/pyGAT GAT", lambda: P.PyGAT(f), (node, dense), lambda g, t: [g["x"], g["adj"]]),
        ("tutorial GAT, dense", "gordicaleksa/pytorch-GAT implementation #3", lambda: P.TutorialGATDense(f),
         (node, dense), lambda g, t: [g["x"], g["mask"]]),
        ("tutorial GAT, edge list", "gordicaleksa/pytorch-GAT implementation #1", lambda: P.TutorialGATEdges(f),
         (node, edges), lambda g, t: [g["x"], g["edge_index"]]),
        ("GCN by hand (index_add_)", "hand-written GCN sum", lambda: P.HandGCN(f),
         (node, edges, ("E",)), lambda g, t: [g["x"], g["edge_index"], g["weight"]]),
        ("GraphSAGE by hand (scatter_add_)", "hand-written mean aggregator", lambda: P.HandSAGE(f),
         (node, edges), lambda g, t: [g["x"], g["edge_index"]]),
        ("nanoGPT attention (manual)", "karpathy/nanoGPT CausalSelfAttention (minGPT's is the same)",
         lambda: P.NanoGPTAttention(), (tokens,), lambda g, t: [t]),
        ("vit-pytorch Attention", "lucidrains/vit-pytorch Attention", lambda: P.ViTAttention(), (tokens,),
         lambda g, t: [t]),
        ("timm Attention (fused_attn=False)", "timm.models.vision_transformer.Attention", lambda: P.TimmAttention(),
         (tokens,), lambda g, t: [t]),
        *_pyg_as_written(f),
    ]


def _pyg_as_written(f: int) -> list[tuple]:
    """PyG's own layers optimized as they are (where torch_geometric is installed)."""
    if not __import__("importlib").util.find_spec("torch_geometric"):
        return []
    import torch_geometric.nn as gnn

    return [("PyG DenseGATConv, dropout 0.6 (8 heads)", "torch_geometric.nn.DenseGATConv(heads=8, dropout=0.6) itself "
             "(heads last: [B, N, N, H])", lambda: gnn.DenseGATConv(f, 8, heads=8, dropout=0.6),
             (("B", "N", f), ("B", "N", "N")), lambda g, t: [g["x"][None], g["adj"][None]])]


def pyg_entries() -> list[tuple]:
    import torch_geometric.nn as gnn

    f = CORA["F"]
    return [
        ("PyG GATConv (8 heads)", lambda: gnn.GATConv(f, 8, heads=8), lambda g: [g["x"], g["edge_index"]]),
        ("PyG DenseGATConv (8 heads)", lambda: gnn.DenseGATConv(f, 8, heads=8),
         lambda g: [g["x"][None], g["adj"][None]]),
        ("PyG GCNConv", lambda: gnn.GCNConv(f, 64), lambda g: [g["x"], g["edge_index"]]),
        ("PyG SAGEConv", lambda: gnn.SAGEConv(f, 64), lambda g: [g["x"], g["edge_index"]]),
    ]


def step(module: torch.nn.Module, xs: list) -> None:
    module.zero_grad(set_to_none=True)
    module(*xs).float().sum().backward()


def step_peak(module: torch.nn.Module, xs: list) -> int:
    step(module, xs)  # gradients exist: the measured step is a steady one
    return measure(lambda: step(module, xs)).peak_above_start


def difference(a: torch.nn.Module, b: torch.nn.Module, xs: list) -> float:
    """The largest difference between the two modules' outputs and parameter gradients (eval mode:
    no dropout) at the user's size, relative to the largest magnitude of each: float32 sums taken
    in another order differ by about 1e-6 of it."""
    a.eval(), b.eval()
    try:
        runs = []
        for m in (a, b):
            m.zero_grad(set_to_none=True)
            out = m(*xs)
            out.float().sum().backward()
            runs.append([out.detach(), *[p.grad.detach() for p in m.parameters() if p.grad is not None]])
        worst = 0.0
        for x, y in zip(*runs):
            scale = float(x.abs().max()) or 1.0
            worst = max(worst, float((x - y).abs().max()) / scale)
        return worst
    finally:
        a.train(), b.train()


def inference_peak(module: torch.nn.Module, xs: list) -> int:
    """Peak above resident of one eval-mode forward without grad (dropout off)."""
    module.eval()
    try:
        with torch.no_grad():
            module(*xs)
            return measure(lambda: module(*xs)).peak_above_start
    finally:
        module.train()


def timed(fns: dict, repeats: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one implementation (a substring of its name)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the stored .json")
    parser.add_argument("--merge", action="store_true", help="with --only: replace those rows in the stored results")
    args = parser.parse_args()
    if args.markdown_only:
        path = os.path.join(HERE, "results", "public_code_cpu")
        with open(path + ".json") as f:
            stored = json.load(f)
        write_markdown(stored["meta"], stored["rows"], stored["pyg"], path + ".md")
        return
    graph = cora()
    tokens = torch.randn(GPT["B"], GPT["L"], GPT["C"], generator=torch.Generator().manual_seed(1))
    rows = []
    for name, source, build, specs, inputs in entries():
        if args.only and args.only not in name:
            continue
        torch.manual_seed(0)
        model = build().train()
        t = time.perf_counter()
        opt = fxmem.optimize(model, *specs)
        took = time.perf_counter() - t
        log = opt.meta.get("fxmem", [])
        applied = sorted({e["rule"] for e in log if e["status"] == "applied"})
        xs = inputs(graph, tokens)
        before, after = step_peak(model, xs), step_peak(opt, xs)
        infer_before, infer_after = inference_peak(model, xs), inference_peak(opt, xs)
        times = timed({"before": lambda: step(model, xs), "after": lambda: step(opt, xs)}, args.repeats)
        row = {"name": name, "source": source, "applied": applied, "optimize_s": round(took, 1),
               "peak_before": before, "peak_after": after, "inference_before": infer_before, "inference_after": infer_after, "step_s_before": round(times["before"], 3),
               "step_s_after": round(times["after"], 3), "difference": difference(model, opt, xs),
               "declined": [f"{e['rule']}: {e['status']}" for e in log if e["status"] not in ("applied", "no match")]}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    pyg = []
    if not args.only and __import__("importlib").util.find_spec("torch_geometric"):
        for name, build, inputs in pyg_entries():
            torch.manual_seed(0)
            m = build().train()
            xs = inputs(graph)
            peak = step_peak(m, xs)
            secs = timed({"m": lambda: step(m, xs)}, args.repeats)["m"]
            pyg.append({"name": name, "peak": peak, "step_s": round(secs, 3)})
            print(json.dumps(pyg[-1]), file=sys.stderr, flush=True)
    meta = {"machine": machine_name("cpu"), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "command": "python benchmarks/public_code.py " + " ".join(sys.argv[1:])}
    if args.only and args.merge:
        path = os.path.join(HERE, "results", "public_code_cpu")
        with open(path + ".json") as f:
            stored = json.load(f)
        fresh = {r["name"]: r for r in rows}
        known = {r["name"] for r in stored["rows"]}
        stored["rows"] = [fresh.get(r["name"], r) for r in stored["rows"]] + [r for r in rows if r["name"] not in known]
        if stored["meta"]["machine"] != meta["machine"] or stored["meta"]["torch"] != meta["torch"]:
            raise SystemExit(f"the stored results were measured on {stored['meta']['machine']} with torch "
                             f"{stored['meta']['torch']}; re-measure every row here instead of merging")
        stored["meta"].setdefault("updates", []).append({"rows": sorted(fresh), "command": meta["command"]})
        with open(path + ".json", "w") as f:
            json.dump(stored, f, indent=1)
        write_markdown(stored["meta"], stored["rows"], stored["pyg"], path + ".md")
        return
    if args.only:
        return
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "public_code_cpu.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "pyg": pyg}, f, indent=1)
    write_markdown(meta, rows, pyg, os.path.join(out, "public_code_cpu.md"))


def write_markdown(meta: dict, rows: list, pyg: list, path: str) -> None:
    mib = 2 ** 20
    lines = ["# fxmem.optimize on public implementations, at their users' sizes", "",
             f"Machine: {meta['machine']}; Python {meta['python']}; torch {meta['torch']}; {meta['threads']} threads; "
             f"command: `{meta['command']}`"
             + "".join(f"; {', '.join(u['rows'])} re-measured by `{u['command']}`" for u in meta.get("updates", []))
             + ".", "",
             f"Graph layers at Cora's size (N={CORA['N']}, E={CORA['E']} random edges, {CORA['F']} features); attention "
             f"layers at GPT-2 small's (B={GPT['B']}, L={GPT['L']}, C={GPT['C']}, 12 heads). `optimize` is called "
             "without hints. Step peak: one training step's peak above resident (train mode, so dropout is on: "
             "forward, `out.sum().backward()`); inference peak: one eval-mode forward without grad; both measured by "
             "the CPU allocator. Where a layer has dropout on its attention (pyGAT p=0.6, the tutorial's), the fused "
             "kernel draws dropout's own mask (the weights visited in the order dropout draws them) where the "
             "weights are laid out so, and otherwise runs the original attention while dropout is on. Time: median "
             "of the steps, taken round-robin. Difference: "
             "the largest difference of the result's outputs and parameter gradients from the original's at this "
             "size (eval mode), relative to their largest magnitude (`optimize` verified each rewrite in float64 at "
             "small sizes first). Every rule's record (`meta[\"fxmem\"]`) names the formula comparison its "
             "decision rests on; they are in the JSON file.", "",
             "| implementation | rules applied | step peak before | after | ratio | inference peak before | after | "
             "step time before | after | difference | optimize |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {', '.join(r['applied']) or 'none'} | {r['peak_before'] / mib:.1f} MiB | "
                     f"{r['peak_after'] / mib:.1f} MiB | {r['peak_before'] / max(r['peak_after'], 1):.2f}x | "
                     f"{r['inference_before'] / mib:.1f} MiB | {r['inference_after'] / mib:.1f} MiB | "
                     f"{r['step_s_before']:.3f} s | {r['step_s_after']:.3f} s | {r['difference']:.1e} | "
                     f"{r['optimize_s']:.1f} s |")
    if pyg:
        lines += ["", "PyG's layers at the same graph size, for comparison (no rewrite):", "",
                  "| layer | step peak | step time |", "|---|---|---|"]
        lines += [f"| {p['name']} | {p['peak'] / mib:.1f} MiB | {p['step_s']:.3f} s |" for p in pyg]
    missed = [f"{r['name']} ({', '.join(sorted({d.split(':')[0] for d in r['declined']}))})" for r in rows
              if not r["applied"] and r["declined"]]
    if missed:
        lines += ["", "Matched and declined everywhere (the reasons are in the JSON file): " + "; ".join(missed) + "."]
    for note in meta.get("notes", []):  # what a run's reader should know, kept in the JSON file
        lines += ["", note]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
