"""Where ``fxmem.optimize(budget=)``'s time goes, and the least it could cost if every simulation
reused the original's work for what a rewrite leaves unchanged.

``optimize(budget=)`` analyses the original graph (its training step and its inference), the
rewritten graph (both again), and the recomputation plan (a training step), and verifies the
rewrite and the plan on real runs. Each simulation is timed by part: the forward's fx nodes inside
the model's blocks (which both rewrites change, in every block of this decoder) and outside them
(embedding, final norm, head), backward, the optimizer's state made quietly before the step
("warm-up"), and the recorded ``optimizer.step()``.

The floor assumes a perfect reuse that does not exist (a rewritten graph's simulation copying the
original's events for every op it did not change): it takes off, from each simulation after the
original's two, the forward outside the blocks, the same share of backward (backward is not timed
per node), the optimizer's warm-up and step, the loss, ``zero_grad`` and the return; and every
verification but the first (one verification of the final graph: the first also makes the model's
own runs, which any verification compares with, and which later ones reuse). What is left is the least the
call's design (each graph analysed exactly, train and inference; the final graph verified) costs.
The bound also counts everything else the call does (tracing, probes, matching, copies, FLOP
counting, decisions) as free: the simulations with that reuse and one verification, nothing more.
The design's least adds back only the analyses' own work around their simulations (finding the
repeated blocks, unrolling them, building the formulas), which each exact analysis of a graph
does: what the call costs under its design if every other part were free.

    python benchmarks/optimize_floor.py [--layers 24]
Results: benchmarks/results/optimize_floor_cpu.{json,md}
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fxmem  # noqa: E402
from recompute import adamw, decoder_arguments, decoder_meta, decoder_setup, save_json  # noqa: E402

PHASES = ("loss", "backward", "optimizer.step", "zero_grad", "return")


class Timed:
    """Per-call timings of fxmem's simulations (by part) and verifications (monkeypatched wrappers)."""

    def __init__(self) -> None:
        self.sims: list[dict] = []
        self.verifications: list[float] = []
        self._now: dict | None = None
        sim = importlib.import_module("fxmem.simulation.simulate")
        runner = importlib.import_module("fxmem.simulation.graph_runner")
        verify = importlib.import_module("fxmem.passes.verify")
        once, run_node, phase, warm, compare = (sim.simulate_once, runner.GraphRunner.run_node, sim._Run.phase,
                                                sim._steady_state_optimizer, verify.compare)
        timed = self

        def simulate_once(*a, **k):
            timed._now = now = collections.defaultdict(float)
            training = k.get("training")  # simulate_once(model, specs, options, symbols, *, training=...)
            t = time.perf_counter()
            try:
                return once(*a, **k)
            finally:
                now["total"] = time.perf_counter() - t
                timed.sims.append({"kind": "training step" if training is not None else "inference", **now})

        def node(self, n):
            t = time.perf_counter()
            try:
                return run_node(self, n)
            finally:
                inside = (runner.module_path(n) or "").startswith("blocks") or n.name.startswith(("blocks", "recompute_"))
                timed._now["forward in blocks" if inside else "forward outside"] += time.perf_counter() - t

        @contextlib.contextmanager
        def phased(self, p):
            t = time.perf_counter()
            with phase(self, p):
                yield
            timed._now[p.value] += time.perf_counter() - t

        def warm_up(*a, **k):
            t = time.perf_counter()
            try:
                return warm(*a, **k)
            finally:
                timed._now["optimizer warm-up"] += time.perf_counter() - t

        def verified(*a, **k):
            t = time.perf_counter()
            try:
                return compare(*a, **k)
            finally:
                timed.verifications.append(time.perf_counter() - t)

        analyse, depth = sys.modules["fxmem.analyze"].analyze, [0]

        def analysed(*a, **k):  # one analysis whole: its simulation and its own work around it
            depth[0] += 1
            t = time.perf_counter()
            try:
                return analyse(*a, **k)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    timed.analyses.append(time.perf_counter() - t)

        sim.simulate_once, runner.GraphRunner.run_node, sim._Run.phase = simulate_once, node, phased
        sim._steady_state_optimizer = warm_up
        for name in ("fxmem.passes.optimize", "fxmem.passes.recompute"):
            importlib.import_module(name).compare = verified
        for name in ("fxmem.passes.optimize", "fxmem.passes.recompute", "fxmem.passes.peaks"):
            importlib.import_module(name).analyze = analysed
        self.analyses: list[float] = []

    def reset(self) -> None:
        self.sims, self.verifications, self.analyses = [], [], []


def reusable(s: dict) -> float:
    """What a perfect reuse of the original's events would not simulate again (seconds)."""
    fwd_in, fwd_out = s.get("forward in blocks", 0.0), s.get("forward outside", 0.0)
    share = fwd_out / (fwd_in + fwd_out) if fwd_in + fwd_out else 0.0
    rest = sum(s.get(p, 0.0) for p in PHASES if p != "backward")
    return fwd_out + share * s.get("backward", 0.0) + s.get("optimizer warm-up", 0.0) + rest


def main() -> None:
    ap = decoder_arguments(__doc__, "optimize_floor_cpu", 3)
    ap.add_argument("--fraction", type=float, default=0.6, help="budget as a share of the original step's peak")
    args = ap.parse_args()
    if args.layers != 6 and args.out.endswith("optimize_floor_cpu"):
        args.out += f"_{args.layers}layers"
    model, spec, dims, base = decoder_setup(args)
    budget = int(base * args.fraction)
    timed = Timed()

    def analysis():
        fxmem.analyze(model, spec, optimizer=adamw)

    def optimize():
        fxmem.optimize(model, spec, budget=budget, dims=dims, optimizer=adamw)

    analysis(), optimize()  # warm-up: oneDNN's first calls, lazy imports
    runs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        analysis()
        a = time.perf_counter() - t
        timed.reset()
        t = time.perf_counter()
        optimize()
        o = time.perf_counter() - t
        sims, verifications = list(timed.sims), list(timed.verifications)  # the next analysis adds its own
        analyses = list(timed.analyses)
        first = {}
        for k, s in enumerate(sims):  # the original's own analyses come first: nothing to reuse there
            first.setdefault(s["kind"], k)
        saved = sum(reusable(s) for k, s in enumerate(sims) if k not in first.values())
        extra_verifications = sum(verifications[1:])
        simulated = sum(s["total"] for s in sims)
        around = sum(analyses) - simulated  # the analyses' own work beyond their simulations
        bound = simulated - saved + (verifications[0] if verifications else 0.0)
        runs.append({"analysis_s": a, "optimize_s": o, "simulations_s": simulated, "around_s": around,
                     "verifications_s": sum(verifications),
                     "other_s": o - simulated - around - sum(verifications),
                     "reusable_s": saved, "floor_s": o - saved - extra_verifications,
                     "bound_s": bound, "design_s": bound + around,
                     "sims": sims, "verifications": verifications, "analyses": analyses})
    med = {k: statistics.median(r[k] for r in runs) for k in
           ("analysis_s", "optimize_s", "simulations_s", "around_s", "verifications_s", "other_s", "reusable_s",
            "floor_s", "bound_s", "design_s")}
    typical = min(runs, key=lambda r: abs(r["optimize_s"] - med["optimize_s"]))
    meta = decoder_meta("optimize_floor.py", args, dims, budget=budget, repeats=args.repeats)
    command = meta["command"]
    save_json(args, {"meta": meta, "medians": med, "runs": runs})
    x = med["analysis_s"]
    lines = ["# What fxmem.optimize(budget=) costs, and its floor with a perfect reuse (cpu)", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; {args.threads} thread(s); command: `{command}`. "
             f"{meta['model']} (the benchmarks' GPT decoder), tokens [B, L], AdamW; budget "
             f"{args.fraction:.0%} of the original step's peak at B={dims['B']}, L={dims['L']}. Medians of "
             f"{args.repeats} (analysis and optimize alternating, after a warm-up call of each).", "",
             "| | seconds | x one analysis |", "|---|---|---|",
             f"| one analysis (training step, AdamW) | {x:.2f} | 1.0x |",
             f"| optimize(budget=) | {med['optimize_s']:.2f} | {med['optimize_s'] / x:.1f}x |",
             f"| of which simulations | {med['simulations_s']:.2f} | {med['simulations_s'] / x:.1f}x |",
             f"| of which the analyses' own work around their simulations (finding the repeated blocks, "
             f"unrolling them, formulas) | {med['around_s']:.2f} | {med['around_s'] / x:.1f}x |",
             f"| of which verifications on real runs | {med['verifications_s']:.2f} | "
             f"{med['verifications_s'] / x:.1f}x |",
             f"| of which everything else (tracing both modes, probes, matching, copies, FLOP counting, "
             f"decisions) | {med['other_s']:.2f} | {med['other_s'] / x:.1f}x |",
             f"| what a perfect reuse would save (see below) | {med['reusable_s']:.2f} | {med['reusable_s'] / x:.1f}x |",
             f"| **floor**: optimize less that, and with one verification | {med['floor_s']:.2f} | "
             f"**{med['floor_s'] / x:.1f}x** |",
             f"| **bound**: the floor's simulations and one verification, everything else free | "
             f"{med['bound_s']:.2f} | **{med['bound_s'] / x:.1f}x** |",
             f"| **the design's least**: the bound and the analyses' own work (each graph analysed exactly, "
             f"one verification; tracing, probes, matching and decisions free) | {med['design_s']:.2f} | "
             f"**{med['design_s'] / x:.1f}x** |", "",
             f"The simulations of the call closest to the median ({typical['optimize_s']:.2f} s), in order; "
             f"seconds by part (forward split at the model's blocks):", "",
             "| # | simulation | total | forward in blocks | forward outside | backward | optimizer warm-up | "
             "optimizer.step | reusable at best |", "|---|---|---|---|---|---|---|---|---|"]
    seen: set = set()
    for k, s in enumerate(typical["sims"]):
        whose = "the original's" if s["kind"] not in seen else "a rewrite's"
        seen.add(s["kind"])
        reuse = 0.0 if whose == "the original's" else reusable(s)
        lines.append(f"| {k + 1} | {whose} {s['kind']} | {s['total']:.2f} | {s.get('forward in blocks', 0):.2f} | "
                     f"{s.get('forward outside', 0):.2f} | {s.get('backward', 0):.2f} | "
                     f"{s.get('optimizer warm-up', 0):.2f} | {s.get('optimizer.step', 0):.2f} | "
                     f"{reuse:.2f} |")
    lines += ["", "Verifications (seconds): " + ", ".join(f"{v:.2f}" for v in typical["verifications"]) + "."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
