"""fxmem's predictions next to the allocator, for a third-party corpus and the random-model fuzzer.

For every corpus model (tests/corpus/models.py: transformers, PyTorch Geometric; models whose
package is missing are listed as skipped) and every fuzzer seed in ``--fuzz-seeds``: fxmem's
(peak above start, retained) bytes of a forward and of an AdamW (corpus) / SGD (fuzzer) training
step, next to what the CPU allocator measured on real runs at held-out sizes (including 1 and 2).

    python benchmarks/exactness.py                       # corpus + fuzzer seeds 0:300
    python benchmarks/exactness.py --fuzz-seeds 0:1000   # a longer fuzz run
    python benchmarks/exactness.py --no-corpus           # the fuzzer only
    python benchmarks/exactness.py --between 20           # between the points: the corpus at 20 random
                                                         # sizes per model (exactness_between.{json,md})
    python benchmarks/exactness.py --corpus held-out --fuzz-seeds 0:0
                                                         # the second corpus (tests/corpus/models.py's
                                                         # HELD_OUT: 41 more architectures), no fuzzing
    python benchmarks/exactness.py --no-corpus --extended --fuzz-seeds 0:600
                                                         # the newer op families too (sort, cumulative,
                                                         # flip/roll, one_hot, gather/scatter, pooling,
                                                         # group norm, grouped convs, interpolate, unfold,
                                                         # cdist, dtype casts, in-place through views, RNNs)

Writes benchmarks/results/exactness.{json,md} (``--extended``: exactness_extended.{json,md}; ``--corpus held-out``:
exactness_held_out.{json,md}; ``--name``: another) with the machine, torch version and command.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


costs: list[tuple[str, float, float]] = []  # (model, forward analysis seconds without / with the self-check)


def _analysis_seconds(entry) -> tuple[float, float]:
    """One forward analysis without and one with the self-check (its real run), in seconds."""
    import fxmem

    model = entry.build().train()
    out = []
    for check in (False, True):
        t = time.perf_counter()
        fxmem.analyze(model, *entry.specs, mode=entry.mode, check=check)
        out.append(round(time.perf_counter() - t, 3))
    return out[0], out[1]


def corpus_rows(which: str = "main") -> tuple[list[dict], list[str]]:
    """The rows of the corpus ``which`` names: ``main`` (the tests' CORPUS) or ``held-out`` (HELD_OUT)."""
    from corpus.harness import compare
    from corpus.models import CORPUS, HELD_OUT

    rows, skipped = [], []
    costs.clear()
    for name, entry in (HELD_OUT if which == "held-out" else CORPUS).items():
        if not entry.available():
            skipped.append(f"{name} ({entry.requires} not installed)")
            continue
        t = time.perf_counter()
        try:
            found = compare(name, entry.build, entry.specs, entry.sizes, mode=entry.mode, makers=entry.makers,
                            data=entry.data)
        except Exception as exc:  # noqa: BLE001 - a refusal is a result
            rows.append({"model": name, "mode": entry.mode, "what": "-", "sizes": {}, "predicted": None,
                         "measured": None, "difference": None, "status": f"refused: {exc}"[:300]})
            continue
        costs.append((name, *_analysis_seconds(entry)))
        for r in found:
            rows.append({"model": name, "mode": r.mode, "what": r.what, "sizes": r.sizes,
                         "predicted": _numbers(r.predicted), "measured": _numbers(r.measured),
                         "difference": None if isinstance(r.measured, str) else
                         [p - m for p, m in zip(r.predicted, r.measured)], "status": _status(r)})
        print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return rows, skipped


def _numbers(value):
    """A row's bytes as a list, or the refusal's text (a size the real model rejects)."""
    return value if isinstance(value, str) else list(value)


def _status(r) -> str:
    """exact, flagged (the report says it may not be), MISMATCH (silent), or, at a size the real
    model rejects, "refused as the model" (fxmem refused too) / MISMATCH (fxmem answered)."""
    if isinstance(r.measured, str):
        return "refused as the model" if r.exact else "MISMATCH"
    return "exact" if r.exact else "flagged" if r.says_inexact else "MISMATCH"


def between_sizes(entry, count: int, seed: int) -> list[dict]:
    """``count`` random sizes between and around the entry's held-out ones: each dim drawn from 1 to
    twice its largest held-out size (at least 8), so the sweep lands in every piece and region the
    analysis has, not only at the sizes the tests chose."""
    import random

    rng = random.Random(seed)
    dims = sorted({k for s in entry.sizes for k in s})
    top = {k: max(8, 2 * max(s.get(k, 1) for s in entry.sizes)) for k in dims}
    return [{k: rng.randint(1, top[k]) for k in dims} for _ in range(count)]


def between_rows(count: int, models: str | None, budget: float) -> tuple[list[dict], list[dict]]:
    """The corpus at ``count`` random sizes per model (see :func:`between_sizes`): rows as
    :func:`corpus_rows` gives them, and per model its seconds and the analyses it took (``budget``:
    seconds for the whole sweep; models past it are listed as not run)."""
    import importlib

    from corpus.harness import compare
    from corpus.models import CORPUS

    analyze_module = importlib.import_module("fxmem.analyze")
    simulate = analyze_module.simulate
    runs: list = []

    def counted(*a, **k):
        runs.append(1)
        return simulate(*a, **k)

    analyze_module.simulate = counted
    rows, per_model = [], []
    start = time.perf_counter()
    for k, (name, entry) in enumerate(CORPUS.items()):
        if models and name not in models.split(","):
            continue
        if not entry.available():
            continue
        if time.perf_counter() - start > budget:
            per_model.append({"model": name, "seconds": None, "simulations": None, "status": "not run (time budget)"})
            continue
        sizes = between_sizes(entry, count, seed=k)
        runs.clear()
        t = time.perf_counter()
        try:
            found = compare(name, entry.build, entry.specs, sizes, mode=entry.mode, makers=entry.makers, data=entry.data)
        except Exception as exc:  # noqa: BLE001 - a refusal is a result
            per_model.append({"model": name, "seconds": round(time.perf_counter() - t, 1), "simulations": len(runs),
                              "status": f"refused: {str(exc).splitlines()[0][:200]}"})
            continue
        statuses = collections.Counter()
        for r in found:
            status = _status(r)
            statuses[status] += 1
            rows.append({"model": name, "mode": r.mode, "what": r.what, "sizes": r.sizes,
                         "predicted": _numbers(r.predicted), "measured": _numbers(r.measured), "status": status})
        per_model.append({"model": name, "seconds": round(time.perf_counter() - t, 1), "simulations": len(runs),
                          "status": ", ".join(f"{v} {k}" for k, v in sorted(statuses.items()))})
        print(f"{name}: {per_model[-1]}", file=sys.stderr, flush=True)
    analyze_module.simulate = simulate
    return rows, per_model


def write_between(rows: list[dict], per_model: list[dict], meta: dict, count: int) -> None:
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "exactness_between.json"), "w") as f:
        json.dump({"meta": meta, "models": per_model, "rows": rows}, f, indent=0)
    counts = collections.Counter(r["status"] for r in rows)
    lines = ["# Between the points: the corpus at random sizes", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; threads {meta['threads']}; command: "
             f"`{meta['command']}` ({meta['seconds']} s).", "",
             f"Each corpus model analysed once (forward, and an AdamW step), then evaluated at {count} random sizes "
             f"(each dim 1 .. twice its largest held-out size) and run for real there: (peak above start, retained) "
             f"against the CPU allocator. `simulations` counts the analyses that took (the first of each kind, and "
             f"one per region a size fell outside of).", "",
             f"Rows: {counts.get('exact', 0)} exact, {counts.get('flagged', 0)} flagged by their report, "
             f"{counts.get('refused as the model', 0)} refused at sizes the real model rejects too, "
             f"**{counts.get('MISMATCH', 0)} silent mismatches**.", "",
             "| model | seconds | simulations | rows |", "|---|---|---|---|"]
    lines += [f"| {m['model']} | {m['seconds']} | {m['simulations']} | {m['status']} |" for m in per_model]
    bad = [r for r in rows if r["status"] != "exact"]
    if bad:
        lines += ["", "| model | step | sizes | predicted | measured | status |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['what']} | {r['sizes']} | {r['predicted']} | {r['measured']} | {r['status']} |"
                  for r in bad]
    with open(os.path.join(out, "exactness_between.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def fuzz_row(seed: int, extended: bool = False, threads: int | None = None) -> dict:
    """One fuzzer seed checked against real runs (a worker process's job with ``--jobs``)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from fuzz.generator import EXTENDED_OPS, generate
    from fuzz.runner import check

    if threads:
        torch.set_num_threads(threads)
    case = generate(seed, EXTENDED_OPS if extended else None)
    outcome = check(case)
    print(f"seed {seed}: {outcome.status} {outcome.detail[:120]}", file=sys.stderr, flush=True)
    return {"seed": seed, "status": outcome.status, "detail": outcome.detail[:400],
            "rows": [{"what": what, "sizes": dims, "predicted": list(p) if isinstance(p, tuple) else p,
                      "measured": list(m) if isinstance(m, tuple) else m} for what, dims, p, m in outcome.rows],
            "program": case.describe() if outcome.status != "exact" else ""}


def fuzz_rows(seeds: range, extended: bool = False, jobs: int = 1) -> list[dict]:
    """Every seed's row; ``jobs`` > 1: that many worker processes, one intra-op thread each (each
    seed's analysis and real runs share their process, so they see the same thread count)."""
    if jobs <= 1:
        return [fuzz_row(seed, extended) for seed in seeds]
    import concurrent.futures
    import functools
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(functools.partial(fuzz_row, extended=extended, threads=1), seeds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-seeds", default="0:300", help="start:stop of the fuzzer's seeds")
    parser.add_argument("--no-corpus", action="store_true")
    parser.add_argument("--corpus", choices=("main", "held-out"), default="main",
                        help="which corpus: the tests' (main) or the 41 architectures the tests do not run (held-out)")
    parser.add_argument("--extended", action="store_true", help="the fuzzer's newer op families too")
    parser.add_argument("--jobs", type=int, default=1, help="fuzzer worker processes (one thread each)")
    parser.add_argument("--name", help="the results' file name (default exactness or exactness_extended): "
                                       "a run on another CPU kept next to the first")
    parser.add_argument("--between", type=int, default=0,
                        help="instead: the corpus at this many random sizes per model (exactness_between.{json,md})")
    parser.add_argument("--models", help="with --between: these corpus models only (comma-separated)")
    parser.add_argument("--budget", type=float, default=3600.0, help="with --between: seconds for the sweep")
    args = parser.parse_args()
    start, stop = (int(v) for v in args.fuzz_seeds.split(":"))
    t0 = time.perf_counter()
    if args.between:
        from fxmem.measure import machine_name

        rows, per_model = between_rows(args.between, args.models, args.budget)
        meta = {"machine": machine_name("cpu"), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "command": "python benchmarks/exactness.py " + " ".join(sys.argv[1:]),
                "seconds": round(time.perf_counter() - t0, 1)}
        write_between(rows, per_model, meta, args.between)
        return
    corpus, skipped = ([], []) if args.no_corpus else corpus_rows(args.corpus)
    fuzz = fuzz_rows(range(start, stop), args.extended, args.jobs)
    stem = args.name or ("exactness_held_out" if args.corpus == "held-out" else
                         "exactness_extended" if args.extended else "exactness")
    from fxmem.measure import machine_name

    counts = collections.Counter(r["status"] for r in fuzz)
    meta = {"self_check_seconds": [list(c) for c in costs], "machine": machine_name("cpu"), "python": platform.python_version(), "torch": torch.__version__,
            "threads": (f"corpus {torch.get_num_threads()}, fuzzer workers 1 each" if args.jobs > 1
                        else torch.get_num_threads()), "command": "python benchmarks/exactness.py " + " ".join(sys.argv[1:]),
            "seconds": round(time.perf_counter() - t0, 1)}
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:  # one line per row
        f.write('{"meta": ' + json.dumps(meta) + ',\n "fuzz_counts": ' + json.dumps(dict(counts)) +
                ',\n "corpus_skipped": ' + json.dumps(skipped) + ',\n "corpus": [\n  ' +
                ",\n  ".join(json.dumps(r) for r in corpus) + '],\n "fuzz": [\n  ' +
                ",\n  ".join(json.dumps(r) for r in fuzz) + "]}\n")
    exact_corpus = sum(r["status"] == "exact" for r in corpus)
    flagged_corpus = sum(r["status"] == "flagged" for r in corpus)
    lines = ["# Exactness: predictions next to the allocator", "",
             f"Machine: {meta['machine']}; Python {meta['python']}; torch {meta['torch']}; threads: {meta['threads']}; "
             f"command: `{meta['command']}` ({meta['seconds']} s).", "",
             "Bytes are (peak above start, retained) of one call (`forward`) or one steady-state training step "
             "(`train`; AdamW for the corpus, SGD for the fuzzer), predicted by fxmem from one analysis and measured "
             "by the CPU allocator on real runs at sizes the analysis did not see.", ""]
    if not args.no_corpus:
        lines += [f"## Third-party corpus{' (held out: HELD_OUT)' if args.corpus == 'held-out' else ''}: "
                  f"{exact_corpus} of {len(corpus)} rows exact", "",
                  f"{flagged_corpus} rows differ and their report says so (`Report.exact` is False and a note says "
                  f"why: a library function that decided on values fxmem was not given, a custom op's workspace "
                  f"only a real run shows); "
                  f"{sum(r['status'] == 'MISMATCH' for r in corpus)} silent mismatches.", "",
                  "| model | mode | step | sizes | predicted | measured | difference |", "|---|---|---|---|---|---|---|"]
    for r in corpus:
        sizes = ", ".join(f"{k}={v}" for k, v in r["sizes"].items())
        diff = "0" if r["status"] == "exact" else f"{r['difference']} ({r['status']})"
        lines.append(f"| {r['model']} | {r['mode']} | {r['what']} | {sizes} | {r['predicted']} | {r['measured']} | "
                     f"{diff} |")
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped) + "."]
    if costs:
        off, on = sum(c[1] for c in costs), sum(c[2] for c in costs)
        ratios = sorted(c[2] / c[1] for c in costs if c[1] > 0)
        lines += ["", "### The self-check's cost", "",
                  f"One forward analysis of each corpus model without and with the self-check (`check=False` / the "
                  f"default), in the same process, once each: {off:.1f} s and {on:.1f} s in all ({on / off:.3f}x; "
                  f"median per model {ratios[len(ratios) // 2]:.3f}x). Medians of repeated runs are in "
                  f"`selfcheck_cost.md`.", "", "| model | without (s) | with (s) | ratio |", "|---|---|---|---|"]
        lines += [f"| {m} | {a} | {b} | {b / a:.3f} |" for m, a, b in costs if a > 0]
    n = len(fuzz)
    lines += [] if not n else [  # --fuzz-seeds 0:0: the corpus only
              "", f"## Fuzzer{' (with the newer op families)' if args.extended else ''}: seeds {start}..{stop - 1}", "",
              f"{counts.get('exact', 0)} of {n} random models exact "
              f"({100 * counts.get('exact', 0) / max(n, 1):.1f} %) at every held-out size (forward and training step); "
              f"{counts.get('refused', 0)} refused with a reason; {counts.get('flagged', 0)} flagged as not exact in "
              f"the report's notes; **{counts.get('mismatch', 0)} silent mismatches**.", ""]
    others = [r for r in fuzz if r["status"] != "exact"]
    if n and others:
        lines += ["| seed | outcome | detail |", "|---|---|---|"]
        for r in others:
            lines.append(f"| {r['seed']} | {r['status']} | {r['detail'][:200].replace('|', '/')} |")
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
