"""What the reorder pass gains: over the corpus (tests/corpus), the random models of the fuzzer, and
the examples/ and test-zoo models of tests/exactness/test_exactness.py.

For each model that torch.fx can trace: the reorder pass (passes/reorder.py) on the traced graph,
alone (no other rewrite): whether its liveness model finds a lower order, whether fxmem's exact
analysis confirms it (no peak higher - forward and SGD training step in train mode, inference in
eval mode, at the example sizes, twice them and the small sizes optimize verifies at - and one
lower), whether outputs and gradients agree; for each order kept, the allocator's peak of real
runs of both graphs at held-out sizes (forward with autograd, and under no_grad in eval mode)
next to fxmem's predictions.

    python benchmarks/reorder.py                      # corpus + fuzzer seeds 0:100 + examples/zoo
    python benchmarks/reorder.py --fuzz-seeds 0:300
Results: benchmarks/results/reorder.{json,md}
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import fxmem  # noqa: E402
from fxmem.errors import FxMemError  # noqa: E402
from fxmem.inputs import random_inputs  # noqa: E402
from fxmem.measure import machine_name, measure  # noqa: E402
from fxmem.passes.modes import in_mode, trace_modes  # noqa: E402
from fxmem.passes.peaks import memory as _memory  # noqa: E402 - the analysis optimize keeps a rewrite by
from fxmem.passes.probes import PROBE_LADDER  # noqa: E402
from fxmem.passes.reorder import reorder  # noqa: E402
from fxmem.passes.verify import compare  # noqa: E402
from fxmem.specs import choose_hints  # noqa: E402


def models() -> list[tuple[str, str, object, tuple, list, dict]]:
    """(group, name, build, specs, held-out sizes, makers)."""
    from corpus.models import CORPUS
    from fuzz.generator import generate

    out = []
    for name, e in CORPUS.items():
        if e.available():
            out.append(("corpus", name, e.build, e.specs, e.sizes, e.makers))
    from zoo.cases import CASES  # the examples' and the test zoo's models, with sizes

    for name, (factory, specs, sizes, kw) in CASES.items():
        out.append(("examples+zoo", name, factory, specs, sizes[-1:], kw.get("makers", {})))
    return out


def one(group: str, name: str, build, specs, sizes, makers) -> dict:
    row = {"group": group, "model": name}
    torch.manual_seed(0)
    model = build() if not isinstance(build, torch.nn.Module) else build
    try:
        traced = trace_modes(model)
    except FxMemError as exc:
        return {**row, "status": "not traceable by torch.fx", "detail": str(exc).splitlines()[0][:160]}
    if traced.reason:
        return {**row, "status": "two graphs (train/eval differ)", "detail": traced.reason[:160]}
    gm = traced.graph_module
    row["nodes"] = len(gm.graph.nodes)
    try:
        report = fxmem.analyze(gm, *specs)
        hints = choose_hints(report.symbols, None)
        inputs = random_inputs(report.specs, sizes[-1], makers=makers, requires_grad=False)
        kw = dict(device="cpu", dtype=torch.float32, grad=True, hints=None, leaf_modules=())
        small = [{d: base + k for k, d in enumerate(report.symbols)} for base in PROBE_LADDER[0]]  # as optimize
        new, entry = reorder(gm, inputs, report.specs, hints, lambda g: _memory(g, specs, kw),
                             lambda g: compare(gm, g, [inputs]), small)  # the trace: it has the modules it calls
    except Exception as exc:  # noqa: BLE001 - a failure is a result
        return {**row, "status": "error", "detail": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    if entry is None:
        return {**row, "status": "no lower order modelled"}
    row.update(entry=entry)
    if entry["status"] != "applied":
        return {**row, "status": "modelled lower, not confirmed", "detail": entry.get("details") or entry["reason"]}
    row["status"] = "applied"
    row["checks"] = []
    for grad, training in ((True, True), (False, False)):
        before = fxmem.analyze(in_mode(gm, training), *specs, grad=grad)
        after = fxmem.analyze(in_mode(new, training), *specs, grad=grad)
        for dims in sizes:
            xs = random_inputs(before.specs, dims, makers=makers, requires_grad=False)
            with torch.set_grad_enabled(grad):
                mb = measure(lambda: in_mode(gm, training)(*xs)).peak_above_start
                ma = measure(lambda: in_mode(new, training)(*xs)).peak_above_start
            pb, pa = (r.evaluate(**dims)["peak_above_resident"] for r in (before, after))
            row["checks"].append({"grad": grad, "sizes": dims, "measured": [mb, ma], "predicted": [pb, pa]})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fuzz-seeds", default="0:100")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "reorder"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    for group, name, build, specs, sizes, makers in models():
        rows.append(one(group, name, build, specs, sizes, makers))
        print(f"{name}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    from fuzz.generator import generate

    start, stop = (int(v) for v in args.fuzz_seeds.split(":"))
    for seed in range(start, stop):
        case = generate(seed)
        rows.append(one("fuzzer", f"seed {seed}", case.model, case.specs, case.sizes[-1:], {}))
        print(f"seed {seed}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    write(args, rows, time.perf_counter() - t0)


def _largest_gain(entry: dict) -> float:
    """The largest change of a peak at the example sizes, in percent (negative: lower), read off the
    record's ``bytes_before`` / ``bytes_after``."""
    before, after = entry["bytes_before"], entry["bytes_after"]
    return min(100 * (after[k] - before[k]) / before[k] for k in before if before[k])


def _gain(entry: dict, key: str) -> str:
    return f"`{entry[key + '_before']}` -> `{entry[key + '_after']}`"


def write(args: argparse.Namespace, rows: list, seconds: float) -> None:
    meta = {"machine": machine_name(), "torch": torch.__version__, "threads": 1, "seconds": round(seconds),
            "command": ("python benchmarks/reorder.py " + " ".join(sys.argv[1:])).strip()}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    counts = collections.Counter((r["group"], r["status"]) for r in rows)
    groups = sorted({r["group"] for r in rows})
    statuses = sorted({r["status"] for r in rows})
    lines = ["# The reorder pass over the corpus, the fuzzer's models, the examples and the test zoo (cpu)", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; 1 thread; {meta['seconds']} s; command: "
             f"`{meta['command']}`. Each model fx can trace is reordered alone (no other rewrite); an order is "
             f"kept only if fxmem's analysis finds no peak higher and one lower (forward and SGD training "
             f"step in train mode, inference in eval mode, at the example sizes, twice them and small sizes "
             f"(3+k, 4+k, 5+k for the k-th dim)) and the "
             f"outputs and gradients agree.", "",
             "| status | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for s in statuses:
        lines.append(f"| {s} | " + " | ".join(str(counts.get((g, s), 0)) for g in groups) + " |")
    applied = [r for r in rows if r["status"] == "applied"]
    gains = sorted(_largest_gain(r["entry"]) for r in applied)
    checks = [c for r in applied for c in r["checks"]]
    lines += ["", f"Orders kept: {len(applied)} of {sum(1 for r in rows if 'nodes' in r)} traced graphs"
              + (f"; largest peak gain per model at the example sizes: median {-statistics.median(gains):.1f}%, "
                 f"up to {-gains[0]:.1f}%" if gains else "")
              + f". Real runs of the kept orders: {sum(c['measured'] == c['predicted'] for c in checks)} of "
              f"{len(checks)} measured peaks equal fxmem's prediction; the reordered graph's measured peak is lower "
              f"in {sum(c['measured'][1] < c['measured'][0] for c in checks)}, the same in "
              f"{sum(c['measured'][1] == c['measured'][0] for c in checks)}, higher in "
              f"{sum(c['measured'][1] > c['measured'][0] for c in checks)}.", ""]
    if applied:
        lines += ["| model | nodes | gain at the example sizes | inference peak | training-step peak | "
                  "real runs: measured peak above start (before -> after) = fxmem's |", "|---|---|---|---|---|---|"]
        for r in applied:
            e = r["entry"]
            checks = "; ".join(f"{'grad' if c['grad'] else 'no_grad'} {c['sizes']}: {c['measured'][0]} -> "
                               f"{c['measured'][1]} ({'=' if c['measured'] == c['predicted'] else 'MISMATCH'})"
                               for c in r["checks"])
            lines.append(f"| {r['model']} | {r['nodes']} | {e['reason']} | {_gain(e, 'inference_peak')} | "
                         f"{_gain(e, 'train_peak')} | {checks} |")
    declined = [r for r in rows if r["status"] == "modelled lower, not confirmed"]
    if declined:
        by_sizes = [r["model"] for r in declined if "depends on the sizes" in r.get("detail", "")]
        lines += ["", f"Modelled lower by the liveness model but not kept: {len(declined)} - lower only at some "
                  f"sizes ({len(by_sizes)}: {', '.join(by_sizes)}); no lower peak, or a higher one, by fxmem's "
                  f"analysis, or not verified (" + ", ".join(r["model"] for r in declined if r["model"] not in by_sizes)
                  + ")."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
