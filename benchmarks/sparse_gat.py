"""Dense-adjacency GATs on a sparse graph: fxmem.optimize's edge list next to PyG's GATConv.

Part "cora" (N=2708 nodes, 10,556 random edges made symmetric, with self loops: the kept entries K;
1433 input features; attention dropout 0 - part "dropout" below has it on): one training step
(forward, fxmem's default loss, backward, SGD step, zero_grad) of

  tutorial dense GAT       gordicaleksa/pytorch-GAT implementation #3 (tests/zoo/public_impls.py): one
                           projection, 8 heads of 8, a 0/-inf connectivity mask added to the scores
    optimize()             its attention fused in dense row blocks (the default)
    optimize(edge_list)    ``settings={"fused-attention": {"edge_list": True}}``: over the kept entries
  PyG GATConv              torch_geometric.nn.GATConv(1433, 8, heads=8) on the edge list
  pyGAT GAT                Diego999/pyGAT's model: 8 one-head layers (8 features each) and an output
                           layer, each masking with ``where(adj > 0, e, -9e15)``
    optimize(edge_list)
  PyG GAT, 2 layers        GATConv(1433, 8, heads=8), ELU, GATConv(64, 7)

Peak: above resident, measured by the CPU allocator; fxmem's prediction of the optimized models at
(N, K1) from one analysis made at its own example sizes; time: median of ``--repeats`` steps taken
round-robin over the variants in one process, on the machine's default thread count.

Part "crossover": one 8-head edge-list layer at N=1500 with the edge list and with the dense row
blocks forced, at densities around 1/20 of the pairs (``fxmem.ops.edge_attention.SPARSE_SHARE``):
the density where the two take the same time.

Part "dropout": the same graph, the tutorial's dense GAT and pyGAT's model with their attention
dropout (p=0.6, their default) in train mode: as written, optimize() (dense row blocks that draw the
model's dropout mask) and optimize(edge_list) (the edge list, drawing the dense weights' numbers
block by block and keeping those at the edges); next to PyG GATConv with dropout 0.6 (which draws
its own numbers for the edges only). The difference column: the largest difference of a step's
outputs and parameter gradients from the model's, from the same seed, relative to their largest
magnitude.

    python benchmarks/sparse_gat.py [--repeats 7] [--parts cora,crossover,dropout]
Results: benchmarks/results/sparse_gat_cpu.{json,md} (parts not run are kept from the stored file)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import fxmem  # noqa: E402
from fxmem import data_paths  # noqa: E402
from fxmem.measure import machine_name, measure  # noqa: E402
from fxmem.ops.edge_attention import SPARSE_SHARE  # noqa: E402
from fxmem.training import default_loss, train_step  # noqa: E402
from public_code import timed  # noqa: E402 - round-robin medians, as the public-code benchmark takes them

N, E, FIN = 2708, 10556, 1433
EDGES = {"fused-attention": {"edge_list": True}}


def cora_like(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(0, N, (2, E), generator=g)
    adj = torch.zeros(N, N)
    adj[dst, src] = 1.0
    adj[src, dst] = 1.0
    adj += torch.eye(N)
    adj = (adj > 0).float()
    return {"x": torch.randn(N, FIN, generator=g), "adj": adj, "mask": torch.where(adj > 0, 0.0, float("-inf")),
            "edge_index": adj.nonzero().t().contiguous().flip(0), "K": int(adj.sum())}


def step(module: torch.nn.Module, xs: list) -> None:
    module.zero_grad(set_to_none=True)
    module(*xs).sum().backward()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def step_peak(module: torch.nn.Module, xs: list) -> int:
    """Peak above resident of a training step (forward, loss, backward, SGD step, zero_grad), measured
    after one such step (gradients and state exist: the steady step)."""
    optimizer = sgd(module.parameters())
    train_step(module, xs, optimizer, default_loss)
    return measure(lambda: train_step(module, xs, optimizer, default_loss)).peak_above_start


def predicted(opt: torch.nn.Module, specs: tuple, dims: dict) -> int:
    """fxmem's peak above resident of that training step for ``opt`` at ``dims``."""
    ev = fxmem.analyze(opt, *specs, optimizer=sgd).evaluate(**dims)
    return ev["train_peak"] - ev["train_resident"]


class PygGAT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import torch_geometric.nn as gnn

        self.c1 = gnn.GATConv(FIN, 8, heads=8)
        self.c2 = gnn.GATConv(64, 7, heads=1)

    def forward(self, x, edge_index):
        return self.c2(torch.nn.functional.elu(self.c1(x, edge_index)), edge_index)


class Projections(torch.nn.Module):
    """pyGAT's model without its attention: the eight one-head projections (x @ W, 1433 -> 8 each), ELU,
    and the output layer's projection - what its step costs whatever the attention does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        hidden = torch.nn.functional.elu(torch.cat([torch.mm(x, att.W) for att in self.model.attentions], dim=1))
        return torch.mm(hidden, self.model.out_att.W)


def cora_part(repeats: int) -> list[dict]:
    from zoo import public_impls as P
    import torch_geometric.nn as gnn

    g = cora_like()
    specs = (("N", FIN), ("N", "N"))
    dims = {"N": N, "K1": g["K"]}
    torch.manual_seed(0)
    tutorial = P.TutorialGATDense(FIN, dropout=0.0).train()
    pygat = P.PyGAT(FIN, dropout=0.0).train()
    made = {}
    for name, model, settings in (("tutorial dense GAT, optimize()", tutorial, None),
                                  ("tutorial dense GAT, optimize(edge_list)", tutorial, EDGES),
                                  ("pyGAT GAT, optimize(edge_list)", pygat, EDGES)):
        t = time.perf_counter()
        made[name] = (fxmem.optimize(model, *specs, settings=settings), time.perf_counter() - t)
    torch.manual_seed(0)
    variants = {
        "tutorial dense GAT": (tutorial, [g["x"], g["mask"]], None),
        "tutorial dense GAT, optimize()": (made["tutorial dense GAT, optimize()"][0], [g["x"], g["mask"]], "dense"),
        "tutorial dense GAT, optimize(edge_list)": (made["tutorial dense GAT, optimize(edge_list)"][0],
                                                    [g["x"], g["mask"]], "edges"),
        "PyG GATConv (8 heads)": (gnn.GATConv(FIN, 8, heads=8).train(), [g["x"], g["edge_index"]], None),
        "pyGAT GAT": (pygat, [g["x"], g["adj"]], None),
        "pyGAT GAT, optimize(edge_list)": (made["pyGAT GAT, optimize(edge_list)"][0], [g["x"], g["adj"]], "edges"),
        "PyG GAT, 2 layers": (PygGAT().train(), [g["x"], g["edge_index"]], None),
        "pyGAT GAT's projections alone": (Projections(pygat), [g["x"]], None),
    }
    rows = []
    for name, (module, xs, kind) in variants.items():
        row = {"name": name, "peak": step_peak(module, xs)}
        if kind is not None:
            row["predicted"] = predicted(module, specs, dims if kind == "edges" else {"N": N})
            row["optimize_s"] = round(made[name][1], 1)
            row["applied"] = sorted({e["rule"] for e in module.meta["fxmem"] if e["status"] == "applied"})
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    times = timed({n: (lambda m=m, xs=xs: step(m, xs)) for n, (m, xs, _) in variants.items()}, repeats)
    for row in rows:
        row["step_s"] = round(times[row["name"]], 4)
    return rows


def seeded_step(module: torch.nn.Module, xs: list) -> list:
    """A step's output and parameter gradients, from seed 3 (dropout draws the same numbers)."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out = module(*xs)
    out.sum().backward()
    found = [out.detach()] + [p.grad for _, p in sorted(module.named_parameters())]
    module.zero_grad(set_to_none=True)
    return found


def relative_difference(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) / max(float(x.abs().max()), 1e-30) for x, y in zip(a, b))


def dropout_part(repeats: int) -> list[dict]:
    from zoo import public_impls as P
    import torch_geometric.nn as gnn

    g = cora_like()
    specs = (("N", FIN), ("N", "N"))
    dims = {"N": N, "K1": g["K"]}
    torch.manual_seed(0)
    models = {"tutorial dense GAT": (P.TutorialGATDense(FIN, dropout=0.6).train(), [g["x"], g["mask"]]),
              "pyGAT GAT": (P.PyGAT(FIN, dropout=0.6).train(), [g["x"], g["adj"]])}
    variants: dict = {}
    made: dict = {}
    for name, (model, xs) in models.items():
        variants[f"{name}, dropout 0.6"] = (model, xs, None, None)
        for how, settings in (("optimize()", None), ("optimize(edge_list)", EDGES)):
            t = time.perf_counter()
            opt = fxmem.optimize(model, *specs, settings=settings)
            made[f"{name}, dropout 0.6, {how}"] = time.perf_counter() - t
            variants[f"{name}, dropout 0.6, {how}"] = (opt, xs, "edges" if settings else "dense", model)
    conv = gnn.GATConv(FIN, 8, heads=8, dropout=0.6).train()
    variants["PyG GATConv (8 heads), dropout 0.6"] = (conv, [g["x"], g["edge_index"]], None, None)
    compared = {}  # before any step below moves a model's parameters: fresh copies, the same seed
    for name, (module, xs, kind, model) in variants.items():
        if kind is not None:
            with data_paths.asked() as taken:
                found = seeded_step(copy.deepcopy(module), xs)
            compared[name] = (relative_difference(seeded_step(copy.deepcopy(model), xs), found),
                              bool(taken) and all(taken))
    rows = []
    for name, (module, xs, kind, model) in variants.items():
        row = {"name": name, "peak": step_peak(module, xs)}
        if kind is not None:
            row["predicted"] = predicted(module, specs, dims if kind == "edges" else {"N": N})
            row["optimize_s"] = round(made[name], 1)
            row["applied"] = sorted({e["rule"] for e in module.meta["fxmem"] if e["status"] == "applied"})
            row["difference"], row["edge_list_taken"] = compared[name]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    times = timed({n: (lambda m=m, xs=xs: step(m, xs)) for n, (m, xs, _, _) in variants.items()}, repeats)
    for row in rows:
        row["step_s"] = round(times[row["name"]], 4)
    return rows


def crossover_part(repeats: int) -> list[dict]:
    from fxmem.ops.edge_attention import edge_attention, kept_edges
    from fxmem.ops.attention import masked_attention

    n, heads, f = 1500, 8, 8
    g = torch.Generator().manual_seed(1)
    s = torch.randn(1, heads, n, generator=g, requires_grad=True)
    t = torch.randn(1, heads, n, generator=g, requires_grad=True)
    h = torch.randn(1, heads, n, f, generator=g, requires_grad=True)
    rows = []
    for share in (64, 32, 24, 20, 16, 8, 4):
        adj = (torch.rand(1, n, n, generator=g) < 1 / share).float()

        def edges():
            with data_paths.forced(True):
                e = kept_edges(adj, "gt", 0.0, True)
            edge_attention(s, t, h, e, mask_groups=1, fill=-9e15, slope=0.2).sum().backward()

        def blocks():
            masked_attention(s, t, h, adj, compare="gt", threshold=0.0, fill=-9e15, slope=0.2).sum().backward()

        times = timed({"edges": edges, "blocks": blocks}, repeats)
        rows.append({"share": f"1/{share}", "edges_s": round(times["edges"], 4), "blocks_s": round(times["blocks"], 4)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--parts", default="cora,crossover,dropout", help="which parts to run (comma-separated)")
    args = parser.parse_args()
    parts = {"cora": cora_part, "crossover": crossover_part, "dropout": dropout_part}
    chosen = args.parts.split(",")
    unknown = sorted(set(chosen) - set(parts))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; the parts are {sorted(parts)}")
    out = os.path.join(HERE, "results")
    stored_path = os.path.join(out, "sparse_gat_cpu.json")
    stored = json.load(open(stored_path)) if os.path.exists(stored_path) else {}
    command = "python benchmarks/sparse_gat.py " + " ".join(sys.argv[1:])
    meta = {"machine": machine_name("cpu"), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "K": cora_like()["K"], "sparse_share": SPARSE_SHARE,
            "commands": {**stored.get("meta", {}).get("commands", {}), **{p: command for p in chosen}}}
    if "command" in stored.get("meta", {}):  # results stored before the parts each said their command
        meta["commands"] = {**{p: stored["meta"]["command"] for p in ("cora", "crossover")}, **meta["commands"]}
    result = {"meta": meta, **{p: stored.get(p) for p in parts if p not in chosen}}
    for p in chosen:
        result[p] = parts[p](args.repeats)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sparse_gat_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, os.path.join(out, "sparse_gat_cpu.md"))


def write_markdown(result: dict, path: str) -> None:
    meta, mib = result["meta"], 2 ** 20
    rows = {r["name"]: r for r in result["cora"]}
    lines = ["# Dense-adjacency GATs on a sparse graph (cpu)", "",
             f"Machine: {meta['machine']}; Python {meta['python']}; torch {meta['torch']}; {meta['threads']} threads; "
             f"commands: " + "; ".join(f"{p}: `{c}`" for p, c in meta['commands'].items()) + ".", "",
             f"## Cora's size: N={N}, {E} random edges made symmetric, with self loops (K={meta['K']} kept entries), "
             f"{FIN} features, attention dropout 0", "",
             "One training step (forward, loss, backward, SGD step, zero_grad); peak above resident measured by the CPU allocator; "
             "fxmem's prediction of the optimized models at (N, K1) from one analysis at its own example sizes; time: "
             "forward and backward (`out.sum().backward()`), median, round-robin in one process.", "",
             "| variant | rules applied | step peak | fxmem predicted | predicted = measured | step time | optimize |",
             "|---|---|---|---|---|---|---|"]
    for r in result["cora"]:
        pred = r.get("predicted")
        lines.append(f"| {r['name']} | {', '.join(r.get('applied', [])) or '-'} | {r['peak'] / mib:.2f} MiB | "
                     + (f"{pred / mib:.2f} MiB | {'yes' if pred == r['peak'] else 'no'}" if pred is not None else "| ")
                     + f" | {r['step_s']:.4f} s | " + (f"{r['optimize_s']:.1f} s" if "optimize_s" in r else "") + " |")
    edge, conv = rows["tutorial dense GAT, optimize(edge_list)"], rows["PyG GATConv (8 heads)"]
    two, pyg2 = rows["pyGAT GAT, optimize(edge_list)"], rows["PyG GAT, 2 layers"]
    alone = rows["pyGAT GAT's projections alone"]
    lines += ["", f"Goal (issue: sparse graphs at sparse cost): the edge list's step against PyG GATConv's: "
                  f"time {edge['step_s'] / conv['step_s']:.2f}x (goal <= 2), memory {edge['peak'] / conv['peak']:.2f}x "
                  f"(goal < 1); against the dense row blocks: {rows['tutorial dense GAT, optimize()']['step_s'] / edge['step_s']:.1f}x "
                  f"faster. pyGAT's model against PyG's two layers: time {two['step_s'] / pyg2['step_s']:.2f}x, memory "
                  f"{two['peak'] / pyg2['peak']:.2f}x (its eight one-head projections, eight skinny matrix "
                  f"products of its own code, take {alone['step_s']:.4f} s of a step "
                  f"alone).", "",
              f"## Crossover: one 8-head layer, N=1500, the edge list against the dense row blocks", "",
              f"The edge list is used up to 1/{meta['sparse_share']} of the pairs (`SPARSE_SHARE`).", "",
              "| kept share | edge list | row blocks |", "|---|---|---|"]
    lines += [f"| {r['share']} | {r['edges_s']:.4f} s | {r['blocks_s']:.4f} s |" for r in result["crossover"]]
    if result.get("dropout"):
        drop = {r["name"]: r for r in result["dropout"]}
        lines += ["", "## Attention dropout 0.6 (train mode), the same graph", "",
                  "The models' own dropout: optimize() draws the model's mask in the dense row blocks, "
                  "optimize(edge_list) draws the dense weights' numbers block by block and keeps those at the edges "
                  "(N x N random numbers drawn, none kept); PyG's GATConv draws numbers for its edges only (its own "
                  "mask). Difference: a step's outputs and gradients against the model's from the same seed, relative "
                  "to their largest magnitude.", "",
                  "| variant | rules applied | step peak | fxmem predicted | predicted = measured | step time | "
                  "difference | optimize |", "|---|---|---|---|---|---|---|---|"]
        for r in result["dropout"]:
            pred = r.get("predicted")
            lines.append(f"| {r['name']} | {', '.join(r.get('applied', [])) or '-'} | {r['peak'] / mib:.2f} MiB | "
                         + (f"{pred / mib:.2f} MiB | {'yes' if pred == r['peak'] else 'no'}" if pred is not None else
                            "| ")
                         + f" | {r['step_s']:.4f} s | "
                         + (f"{r['difference']:.1e}" if "difference" in r else "") + " | "
                         + (f"{r['optimize_s']:.1f} s" if "optimize_s" in r else "") + " |")
        for name in ("tutorial dense GAT", "pyGAT GAT"):
            dense, edges = drop[f"{name}, dropout 0.6, optimize()"], drop[f"{name}, dropout 0.6, optimize(edge_list)"]
            conv = drop["PyG GATConv (8 heads), dropout 0.6"]
            lines.append(f"\n{name}: the edge list's step {dense['step_s'] / edges['step_s']:.1f}x faster than the "
                         f"dense row blocks', {edges['peak'] / dense['peak']:.2f}x their memory; against PyG GATConv "
                         f"with dropout: time {edges['step_s'] / conv['step_s']:.1f}x, memory "
                         f"{edges['peak'] / conv['peak']:.2f}x.")
        lines += ["", "With dropout the edge list still draws N x N random numbers (one per dense weight, in the "
                      "order F.dropout draws them, so that the rewrite computes what the model does from the same "
                      "seed); they set its time, not its memory. PyG's GATConv draws E numbers: its time is out of "
                      "reach of a rewrite that keeps the model's own mask."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
