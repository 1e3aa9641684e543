"""Seed 002's attention before and after fxmem.optimize (the SDPA rule): memory and time, measured and predicted.

Variants (C=512, 8 heads, the same weights):
  math (seed 002)    examples/seed_attention.py's Attention as written (math mode: q @ kᵀ * scale, softmax, @ v)
  fxmem.optimize     the same module after fxmem.optimize: F.scaled_dot_product_attention (flash attention on CPU)

Sizes: seed 002's configuration (B=64, L=32) and long sequences (B=1, L=1024..8192). For each: the
peak above resident (parameters and inputs) of an inference forward (eval mode, no_grad) and of a
training step (forward, sum loss, backward, SGD step, zero_grad) - measured with the CPU
allocator's counters through the profiler, and predicted by fxmem (eager mode: the modules run as
written) - and the median time of each, taken round-robin over the variants in one process, on
``--threads`` threads (default 1: the machine is shared; CPU flash attention's backward allocates
a small buffer per worker thread, which the profiler sees only for the calling thread).
Sizes whose predicted training peak is above ``--budget-gib`` are skipped (and say so).

    python benchmarks/sdpa.py --repeats 3
Results: benchmarks/results/sdpa_cpu.{json,md}
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import fxmem  # noqa: E402
from fxmem.measure import machine_name, measure  # noqa: E402
from fxmem.training import train_step  # noqa: E402
from seed_attention import Attention  # noqa: E402

C, HEADS = 512, 8
SPECS = (("B", "L", C),)
SIZES = [{"B": 64, "L": 32}, {"B": 1, "L": 1024}, {"B": 1, "L": 2048}, {"B": 1, "L": 4096}, {"B": 1, "L": 8192}]


def sgd(params):
    return torch.optim.SGD(params, lr=1e-4)


def variants() -> tuple[dict, list]:
    torch.manual_seed(0)
    model = Attention(dim=C, num_heads=HEADS)
    opt = fxmem.optimize(model, *SPECS)
    rules = [(r["rule"], r["status"]) for r in opt.meta["fxmem"]]
    return {"math (seed 002)": model, "fxmem.optimize": opt}, rules


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_size(models: dict, reports: dict, at: dict, budget: int, repeats: int) -> list[dict]:
    """One size: each variant's predicted and measured peaks (inference, training step), then times."""
    x = torch.randn(at["B"], at["L"], C, generator=torch.Generator().manual_seed(1))
    rows, steps = [], {}
    for name, model in models.items():
        train, infer = (r.evaluate(**at) for r in reports[name])
        row = {"variant": name, **at,
               "predicted_inference_peak": infer["peak_above_resident"],
               "predicted_train_peak": train["train_peak"] - train["train_resident"]}
        rows.append(row)
        if row["predicted_train_peak"] > budget:
            row["status"] = f"skipped: predicted peak above the {budget / 2**30:g} GiB budget"
            continue
        optimizer = sgd(model.parameters())

        def inference(model=model):
            model.eval()
            with torch.no_grad():
                return model(x)

        def step(model=model, optimizer=optimizer):
            model.train()
            return train_step(model, [x], optimizer)

        row["measured_inference_peak"] = measure(inference, warmup=1).peak_above_start
        row["measured_train_peak"] = measure(step, warmup=1).peak_above_start
        row["status"] = "ok"
        steps[name] = (inference, step)
    times: dict = {name: ([], []) for name in steps}
    for _ in range(repeats):
        for name, (inference, step) in steps.items():
            times[name][0].append(_timed(inference))
            times[name][1].append(_timed(step))
    for row in rows:
        if row["variant"] in times:
            row["inference_seconds"] = statistics.median(times[row["variant"]][0])
            row["train_seconds"] = statistics.median(times[row["variant"]][1])
        print(row, flush=True)
    return rows


def _bytes(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _table(rows: list[dict]) -> list[str]:
    out = ["| variant | size | inference peak: predicted / measured | training-step peak: predicted / measured "
           "| inference time (s) | training-step time (s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        size = f"B={r['B']}, L={r['L']}"
        if r["status"] != "ok":
            out.append(f"| {r['variant']} | {size} | {_bytes(r['predicted_inference_peak'])} / - | "
                       f"{_bytes(r['predicted_train_peak'])} / - ({r['status']}) | | |")
            continue
        same = lambda p, m: f"{_bytes(p)} / {_bytes(m)}" + ("" if p == m else " (differ)")  # noqa: E731
        out.append(f"| {r['variant']} | {size} | {same(r['predicted_inference_peak'], r['measured_inference_peak'])} | "
                   f"{same(r['predicted_train_peak'], r['measured_train_peak'])} | {r['inference_seconds']:.4f} | "
                   f"{r['train_seconds']:.4f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before the analysis: flash attention's buffers are per thread
    models, rules = variants()
    reports = {name: (fxmem.analyze(m, *SPECS, mode="eager", optimizer=sgd),
                      fxmem.analyze(m.eval(), *SPECS, mode="eager", grad=False)) for name, m in models.items()}
    rows = []
    for at in SIZES:
        rows += run_size(models, reports, at, int(args.budget_gib * 2**30), args.repeats)
    command = (f"python benchmarks/sdpa.py --repeats {args.repeats} --threads {args.threads} "
               f"--budget-gib {args.budget_gib:g}")
    meta = {"machine": machine_name("cpu"), "torch": torch.__version__, "threads": args.threads,
            "repeats": args.repeats, "command": command, "rewrites": rules}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    base = os.path.join(HERE, "results", "sdpa_cpu")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    by = {(r["variant"], r["B"], r["L"]): r for r in rows}
    ratios = []
    for at in SIZES:
        a, b = by[("math (seed 002)", at["B"], at["L"])], by[("fxmem.optimize", at["B"], at["L"])]
        if a["status"] == b["status"] == "ok":
            ratios.append(f"B={at['B']}, L={at['L']}: peak before / after: training step "
                          f"{a['measured_train_peak'] / b['measured_train_peak']:.3g} "
                          f"({b['measured_train_peak'] - a['measured_train_peak']:+,} bytes), inference "
                          f"{a['measured_inference_peak'] / b['measured_inference_peak']:.3g}; time before / after: "
                          f"training step {a['train_seconds'] / b['train_seconds']:.3g}, inference "
                          f"{a['inference_seconds'] / b['inference_seconds']:.3g}")
    lines = ["# Seed 002's attention: math mode before and after fxmem.optimize (SDPA), CPU", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; {args.threads} thread(s); command: `{command}`. "
             f"Peaks above resident (parameters and the input); inference = eval mode under no_grad; training step "
             f"= forward, sum loss, backward, SGD step, zero_grad; times = median of {args.repeats}, round-robin over "
             f"the variants in one process. Rewrites: {rules}.", "", *_table(rows), "",
             "Ratios (math / fxmem.optimize, measured; above 1: fxmem.optimize is smaller or faster):", "",
             *[f"* {r}" for r in ratios], ""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
