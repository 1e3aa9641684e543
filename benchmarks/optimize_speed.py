"""What ``fxmem.optimize`` costs, as a multiple of one analysis of the same model.

For each model: one ``fxmem.analyze`` (a training step with the optimizer), ``fxmem.optimize``
with no budget, and ``fxmem.optimize(budget=, dims=)`` at a fraction of the original step's peak,
also in optimize's careful pass alone (each rewrite verified before it is kept, as before the
optimistic pass that verifies a kept rewrite with the recomputed plan made on it).
Each is timed ``--repeats`` times round-robin in one process (after one warm-up call of each, so
that oneDNN's first-call work is not counted); medians, and their ratio to the analysis' median.
The table also counts, per call, the analyses (fake-tensor simulations) and real verification runs.

    python benchmarks/optimize_speed.py
Results: benchmarks/results/optimize_speed_cpu.{json,md}
"""
from __future__ import annotations

import importlib
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fxmem  # noqa: E402
from recompute import adamw, decoder_arguments, decoder_meta, decoder_setup, save_json  # noqa: E402


def counted():
    """Count fake-tensor simulations and verification runs (the two costs optimize is made of)."""
    simulate = importlib.import_module("fxmem.simulation.simulate")
    verify = importlib.import_module("fxmem.passes.verify")
    counts = {"simulations": 0, "verifications": 0}
    once, compare = simulate.simulate_once, verify.compare

    def sim(*a, **k):
        counts["simulations"] += 1
        return once(*a, **k)

    def ver(*a, **k):
        counts["verifications"] += 1
        return compare(*a, **k)

    simulate.simulate_once = sim
    driver = importlib.import_module("fxmem.passes.optimize")
    driver.compare = ver
    recompute = importlib.import_module("fxmem.passes.recompute")
    recompute.compare = ver
    return counts


def careful(fn):
    """``fn`` with optimize's careful pass only (each trial verified before it is kept: the pass a
    failed verification falls back to, and every pass before the optimistic one was added)."""
    driver = importlib.import_module("fxmem.passes.optimize")

    def run():
        inner = driver._optimize

        def one_pass(*a):
            return inner(*a[:-2], False, a[-1])  # (..., optimistic, dropped)

        driver._optimize = one_pass
        try:
            return fn()
        finally:
            driver._optimize = inner
    return run


def main() -> None:
    ap = decoder_arguments(__doc__, "optimize_speed_cpu", 3)
    ap.add_argument("--fraction", type=float, default=0.6, help="budget as a share of the original step's peak")
    args = ap.parse_args()
    model, spec, dims, base = decoder_setup(args)
    budget = int(base * args.fraction)
    calls = {
        "analyze (training step, AdamW)": lambda: fxmem.analyze(model, spec, optimizer=adamw),
        "optimize()": lambda: fxmem.optimize(model, spec),
        f"optimize(budget={args.fraction:.0%} of the peak, AdamW)":
            lambda: fxmem.optimize(model, spec, budget=budget, dims=dims, optimizer=adamw),
        "the same, each rewrite verified before it is kept (the careful pass)":
            careful(lambda: fxmem.optimize(model, spec, budget=budget, dims=dims, optimizer=adamw)),
    }
    counts = counted()
    times: dict = {k: [] for k in calls}
    work: dict = {}
    for k, fn in calls.items():  # warm-up, and what each call does
        counts.update(simulations=0, verifications=0)
        out = fn()
        work[k] = dict(counts)
        if isinstance(out, torch.fx.GraphModule):
            work[k]["applied"] = sorted({e["rule"] for e in out.meta["fxmem"] if e["status"] == "applied"})
    for _ in range(args.repeats):
        for k, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    first = statistics.median(times[next(iter(calls))])
    rows = [{"call": k, "median_s": round(statistics.median(v), 2), "times_s": [round(x, 2) for x in v],
             "ratio": round(statistics.median(v) / first, 2), **work[k]} for k, v in times.items()]
    meta = decoder_meta("optimize_speed.py", args, dims, budget=budget, repeats=args.repeats)
    command = meta["command"]
    save_json(args, {"meta": meta, "rows": rows})
    lines = ["# What fxmem.optimize costs, next to one analysis (cpu)", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; {args.threads} thread(s); command: `{command}`. "
             f"{meta['model']} (the benchmarks' GPT decoder: causal softmax attention with dropout), tokens "
             f"[B, L]; budget at B={dims['B']}, L={dims['L']}. Whole calls, median of {args.repeats} taken "
             f"round-robin in one process after a warm-up call of each; simulations: fxmem analyses' fake-tensor "
             f"runs (a training-step analysis is one, an inference one another); verifications: comparisons "
             f"with the model on real runs (train/eval, with and without grad, three sizes each).", "",
             "| call | median | x one analysis | simulations | verifications | applied |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['call']} | {r['median_s']:.2f} s | {r['ratio']:.1f}x | {r['simulations']} | "
                     f"{r['verifications']} | {', '.join(r.get('applied', [])) or '-'} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
