"""What ``fxmem.optimize`` costs, as a multiple of one analysis of the same model.

For each model: one ``fxmem.analyze`` (a training step with the optimizer), ``fxmem.optimize``
with no budget, and ``fxmem.optimize(budget=, dims=)`` at a fraction of the original step's peak,
also in optimize's careful pass alone (each rewrite verified before it is kept, as before the
optimistic pass that verifies a kept rewrite with the recomputed plan made on it) and with the
whole model verified at every size (as before verification region by region); and the same
decoder written with ``F.scaled_dot_product_attention``, where optimize has nothing to apply.
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
from recompute import (Decoder, SdpaBlock, adamw, decoder_arguments, decoder_meta, decoder_setup,  # noqa: E402
                       save_json)


def counted():
    """Count fake-tensor simulations and comparisons on real runs (the two costs optimize is made
    of): of the whole model, and of a region a rewrite changed; and time the verifications."""
    simulate = importlib.import_module("fxmem.simulation.simulate")
    driver = importlib.import_module("fxmem.passes.optimize")
    counts = {"simulations": 0, "verifications": 0, "region_checks": 0, "verification_s": 0.0}
    once, compare, verify = simulate.simulate_once, driver.compare, driver._Search.verify

    def sim(*a, **k):
        counts["simulations"] += 1
        return once(*a, **k)

    def ver(*a, **k):
        counts["region_checks" if type(a[0]).__name__ == "region" else "verifications"] += 1
        return compare(*a, **k)

    def timed(self, candidate):  # everything a verification does: comparisons, regions, their inputs
        t = time.perf_counter()
        try:
            return verify(self, candidate)
        finally:
            counts["verification_s"] += time.perf_counter() - t

    simulate.simulate_once = sim
    driver.compare = ver
    driver._Search.verify = timed
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


def whole_model(fn):
    """``fn`` with every verification a comparison of the whole model at every size (as before
    verification region by region, passes/local_verify.py): the A/B of that change, in one run."""
    driver = importlib.import_module("fxmem.passes.optimize")

    def run():
        own = driver._Search._compare
        driver._Search._compare = lambda self, c: driver.compare(self.model, c, self.verify_inputs,
                                                                 references=self.references)
        try:
            return fn()
        finally:
            driver._Search._compare = own
    return run


def main() -> None:
    ap = decoder_arguments(__doc__, "optimize_speed_cpu", 3)
    ap.add_argument("--fraction", type=float, default=0.6, help="budget as a share of the original step's peak")
    args = ap.parse_args()
    model, spec, dims, base = decoder_setup(args)
    budget = int(base * args.fraction)
    torch.manual_seed(0)
    plain = Decoder(args.layers, args.dim, args.heads, block=SdpaBlock)  # its attention already SDPA
    calls = {
        "analyze (training step, AdamW)": lambda: fxmem.analyze(model, spec, optimizer=adamw),
        "analyze, the decoder written with SDPA (training step, AdamW)":
            lambda: fxmem.analyze(plain, spec, optimizer=adamw),
        "optimize(), the decoder written with SDPA: nothing to apply": lambda: fxmem.optimize(plain, spec),
        "optimize()": lambda: fxmem.optimize(model, spec),
        f"optimize(budget={args.fraction:.0%} of the peak, AdamW)":
            lambda: fxmem.optimize(model, spec, budget=budget, dims=dims, optimizer=adamw),
        "the same, each rewrite verified before it is kept (the careful pass)":
            careful(lambda: fxmem.optimize(model, spec, budget=budget, dims=dims, optimizer=adamw)),
        "the same budget, the whole model verified at every size (no regions)":
            whole_model(lambda: fxmem.optimize(model, spec, budget=budget, dims=dims, optimizer=adamw)),
    }
    counts = counted()
    times: dict = {k: [] for k in calls}
    work: dict = {}
    for k, fn in calls.items():  # warm-up, and what each call does
        counts.update(simulations=0, verifications=0, region_checks=0)
        out = fn()
        work[k] = dict(counts)
        if isinstance(out, torch.fx.GraphModule):
            work[k]["applied"] = sorted({e["rule"] for e in out.meta["fxmem"] if e["status"] == "applied"})
    spent: dict = {k: [] for k in calls}
    for _ in range(args.repeats):
        for k, fn in calls.items():
            counts["verification_s"] = 0.0
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
            spent[k].append(counts["verification_s"])
    names = list(calls)
    # each call next to the analysis of its own model (the SDPA decoder's rows to its own)
    baseline = {k: names[1] if "SDPA" in k else names[0] for k in names}
    rows = [{"call": k, "median_s": round(statistics.median(v), 2), "times_s": [round(x, 2) for x in v],
             "ratio": round(statistics.median(v) / statistics.median(times[baseline[k]]), 2),
             "verification_s": round(statistics.median(spent[k]), 2), **work[k]} for k, v in times.items()]
    meta = decoder_meta("optimize_speed.py", args, dims, budget=budget, repeats=args.repeats)
    command = meta["command"]
    save_json(args, {"meta": meta, "rows": rows})
    lines = ["# What fxmem.optimize costs, next to one analysis (cpu)", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; {args.threads} thread(s); command: `{command}`. "
             f"{meta['model']} (the benchmarks' GPT decoder: causal softmax attention with dropout), tokens "
             f"[B, L]; budget at B={dims['B']}, L={dims['L']}. Whole calls, median of {args.repeats} taken "
             f"round-robin in one process after a warm-up call of each; simulations: fxmem analyses' fake-tensor "
             f"runs (a training-step analysis is one, an inference one another); whole: comparisons of the "
             f"whole model with the rewrite on real runs (train/eval, with and without grad; at the smallest "
             f"verification size, or at all three where no region can be told apart); regions: comparisons of "
             f"one changed region with what it replaced, at the three sizes (alike regions once); verifying: "
             f"the seconds of all of it, inputs of the regions included. Each row's ratio is to the analysis "
             f"of its own model.", "",
             "| call | median | x one analysis | simulations | whole | regions | verifying | applied |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['call']} | {r['median_s']:.2f} s | {r['ratio']:.1f}x | {r['simulations']} | "
                     f"{r['verifications']} | {r['region_checks']} | {r['verification_s']:.2f} s | "
                     f"{', '.join(r.get('applied', [])) or '-'} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
