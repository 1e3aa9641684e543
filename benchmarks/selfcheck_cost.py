"""What the self-check (AnalysisOptions.check) costs: each corpus model analysed with check=True and
check=False, the median of --reps wall times of each, and their ratio; and what it found.

    python benchmarks/selfcheck_cost.py [--reps 3] [--out benchmarks/results/selfcheck_cost]

Results (JSON and Markdown) name the CPU model (lscpu), torch version and this command. ``--help``
prints this text and runs nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "selfcheck_cost"))
    args = p.parse_args()

    import warnings

    import torch

    import fxmem
    from corpus.models import CORPUS

    warnings.simplefilter("ignore")
    rows = []
    for name, entry in sorted(CORPUS.items()):
        if not entry.available():
            continue
        kw = {"mode": entry.mode} if getattr(entry, "mode", None) else {}
        times = {True: [], False: []}
        checked = ""
        for _ in range(args.reps):
            for check in (False, True):
                model = entry.build()
                t = time.perf_counter()
                report = fxmem.analyze(model, *entry.specs, check=check, **kw)
                times[check].append(time.perf_counter() - t)
                if check:
                    checked = report.checked
        off, on = statistics.median(times[False]), statistics.median(times[True])
        rows.append(dict(model=name, off_s=round(off, 3), on_s=round(on, 3), ratio=round(on / off, 3), checked=checked))
        print(f"{name:28s} {off:6.2f} s {on:6.2f} s  x{on / off:.2f}  {checked[:70]}", flush=True)
    total_off, total_on = sum(r["off_s"] for r in rows), sum(r["on_s"] for r in rows)
    meta = dict(cpu=cpu_model(), torch=torch.__version__, threads=torch.get_num_threads(), reps=args.reps,
                command="python benchmarks/selfcheck_cost.py " + " ".join(sys.argv[1:]),
                total_off_s=round(total_off, 2), total_on_s=round(total_on, 2),
                overall_ratio=round(total_on / total_off, 3),
                median_ratio=round(statistics.median(r["ratio"] for r in rows), 3),
                different=[r["model"] for r in rows if "different" in r["checked"]])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Self-check cost\n\n{meta['cpu']}, torch {meta['torch']}, {meta['threads']} threads; "
                f"`{meta['command']}` (medians of {args.reps}; a shared machine).\n\n"
                f"Total analysis time {total_off:.1f} s without the check, {total_on:.1f} s with it "
                f"(x{meta['overall_ratio']}; median per model x{meta['median_ratio']}). "
                f"Models whose check found a difference: {meta['different'] or 'none'}.\n\n"
                "| model | check=False (s) | check=True (s) | ratio | outcome |\n|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['model']} | {r['off_s']} | {r['on_s']} | {r['ratio']} | {r['checked']} |\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
