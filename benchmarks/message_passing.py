"""Message passing, several ways (seed 003): memory and speed of a GCN layer, measured and predicted.

One GCN layer, 64 -> 64 features, N=1000 nodes, E/N in {5, 20, 100} random edges with per-edge
weights (an input, as GCN's normalisation is), ``out = sum over edges w_e * lin(x)[src_e]`` into
``dst_e``:
  gather + index_add_   zeros_like(h).index_add_(0, dst, h[src] * w[:, None]): the E x 64 message
  fxmem.optimize        the same model after fxmem.optimize (hints: the benchmark's N and E), which
                        fuses the chain into a CSR product where its analysis says it pays
  PyG scatter           torch_geometric.utils.scatter(h[src] * w[:, None], dst, reduce="sum")
  sparse.mm (CSR)       the CSR matrix built in the forward by hand, torch.sparse.mm

For each: the forward's peak (autograd recording) and the training step's peak above resident,
measured (the CPU allocator, through the profiler) and predicted by fxmem (eager mode), and the
time of a training step (median of repeats taken round-robin over the variants, one process,
``--threads`` threads).

    python benchmarks/message_passing.py
Results: benchmarks/results/message_passing_cpu.{json,md}
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
import warnings

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))

import fxmem  # noqa: E402
from fxmem.measure import machine_name, measure  # noqa: E402
from fxmem.training import train_step  # noqa: E402

N, FEATURES, RATIOS = 1000, 64, (5, 20, 100)
SPECS = (("N", FEATURES), fxmem.TensorSpec((2, "E"), dtype=torch.int64), ("E",))


class GatherIndexAdd(nn.Module):
    """The message written out: h[src] * w, summed into the targets with index_add_."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = torch.zeros_like(h)
        out.index_add_(0, edge_index[1], h[edge_index[0]] * w[:, None])
        return out


class PygScatter(GatherIndexAdd):
    """PyG's scatter (a sum) of the same messages."""

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from torch_geometric.utils import scatter

        h = self.lin(x)
        return scatter(h[edge_index[0]] * w[:, None], edge_index[1], dim=0, dim_size=h.shape[0], reduce="sum")


class HandCSR(GatherIndexAdd):
    """The CSR matrix built in the forward (sort by target), torch.sparse.mm."""

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        n = h.shape[0]
        perm = torch.argsort(edge_index[1], stable=True)
        crow = torch.searchsorted(edge_index[1][perm], torch.arange(n + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = torch.sparse_csr_tensor(crow, edge_index[0][perm], w[perm], (n, n), check_invariants=False)
        return torch.sparse.mm(a, h)


def variants(edges: int) -> dict:
    torch.manual_seed(0)
    base = GatherIndexAdd()
    out = {
        "gather + index_add_": lambda: base,
        "fxmem.optimize": lambda: fxmem.optimize(base, *SPECS, hints={"N": N + 9, "E": edges + 7}),
    }
    if importlib.util.find_spec("torch_geometric") is not None:
        out["PyG scatter"] = lambda: _same_weights(PygScatter(), base)
    out["sparse.mm (CSR, by hand)"] = lambda: _same_weights(HandCSR(), base)
    return out


def _same_weights(model: nn.Module, like: nn.Module) -> nn.Module:
    model.load_state_dict(like.state_dict())
    return model


def graph(edges: int) -> tuple:
    gen = torch.Generator().manual_seed(edges)
    x = torch.randn(N, FEATURES, generator=gen)
    edge_index = torch.randint(0, N, (2, edges), generator=gen)
    w = torch.rand(edges, generator=gen)
    return x, edge_index, w


def run(ratio: int, repeats: int) -> list[dict]:
    edges = N * ratio
    xs = graph(edges)
    sgd = lambda p: torch.optim.SGD(p, lr=1e-3)  # noqa: E731
    models = {name: make() for name, make in variants(edges).items()}
    rows, steps = [], {}
    at = {"N": N, "E": edges}
    for name, model in models.items():
        opt = sgd(model.parameters())
        steps[name] = lambda model=model, opt=opt: train_step(model, xs, opt)  # noqa: E731
        row = {"variant": name, "N": N, "E": edges,
               "measured_forward_peak": measure(lambda model=model: model(*xs)).peak_above_start,
               "measured_train_peak": measure(steps[name]).peak_above_start}
        try:
            hints = {"N": N + 9, "E": edges + 7}
            forward = fxmem.analyze(model, *SPECS, mode="eager", hints=hints).evaluate(**at)
            train = fxmem.analyze(model, *SPECS, mode="eager", optimizer=sgd, hints=hints).evaluate(**at)
            row["predicted_forward_peak"] = forward["peak_above_resident"]
            row["predicted_train_peak"] = train["train_peak"] - train["train_resident"]
        except fxmem.FxMemError as exc:  # building a sparse tensor on fake tensors: fxmem says it cannot
            row["not_predicted"] = str(exc).splitlines()[0][:200]
        if name == "fxmem.optimize":
            row["rewrites"] = [(r["rule"], r["status"]) for r in model.meta["fxmem"]]
        rows.append(row)
    times: dict = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    for row in rows:
        row["seconds"] = statistics.median(times[row["variant"]])
        row["all_seconds"] = [round(t, 5) for t in times[row["variant"]]]
        print({k: v for k, v in row.items() if k != "all_seconds"}, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for ratio in RATIOS for r in run(ratio, args.repeats)]
    meta = {"machine": machine_name("cpu"), "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "torch_geometric": _version("torch_geometric"),
            "command": "python benchmarks/message_passing.py " + " ".join(sys.argv[1:]), "repeats": args.repeats}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    base = os.path.join(HERE, "results", "message_passing_cpu")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    fmt = fxmem.format_bytes
    lines = ["# Message passing, several ways (cpu)", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; torch_geometric {meta['torch_geometric']}; "
             f"{meta['threads']} thread(s); command: `{meta['command']}`. One GCN layer {FEATURES}->{FEATURES}, "
             f"N={N}; peaks above resident (forward with autograd recording; training step: forward, sum loss, "
             f"backward, SGD step, zero_grad); time = median of {args.repeats} training steps, round-robin over the "
             f"variants in one process. \"=\": fxmem's prediction equals the measurement.", "",
             "| E/N | variant | forward peak | = | training-step peak | = | time (ms) |", "|---|---|---|---|---|---|---|"]
    def same(r: dict, key: str) -> str:
        if f"predicted_{key}" not in r:
            return "not predicted"
        diff = r[f"measured_{key}"] - r[f"predicted_{key}"]
        return "yes" if diff == 0 else f"off by {diff:,} B"

    for r in rows:
        same_f, same_t = same(r, "forward_peak"), same(r, "train_peak")
        lines.append(f"| {r['E'] // N} | {r['variant']} | {fmt(r['measured_forward_peak'])} | {same_f} | "
                     f"{fmt(r['measured_train_peak'])} | {same_t} | {r['seconds'] * 1e3:.2f} |")
    rewrites = {r["E"] // N: r["rewrites"] for r in rows if "rewrites" in r}
    lines += ["", f"fxmem.optimize's decisions by E/N: {rewrites}"]
    refused = {r["variant"]: r["not_predicted"] for r in rows if "not_predicted" in r}
    if refused:
        lines += ["", "Not predicted (fxmem refuses, with this error): "
                  + "; ".join(f"{k}: {v}" for k, v in refused.items())]
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
