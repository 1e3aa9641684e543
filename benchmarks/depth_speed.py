"""How an analysis' time grows with depth: ``nn.Sequential`` of N small layers (issue 43: 5000
layers took 124 s, superlinear from 13.4 s at 2000; the depth cost must be linear).

    python benchmarks/depth_speed.py                  # N = 500, 1000, 2000, 4000, 5000; results written
    python benchmarks/depth_speed.py --depths 500,1000 --reps 1 --no-write
    python benchmarks/depth_speed.py --help           # this text; runs nothing

Each case times ``fxmem.analyze(nn.Sequential(*[nn.Linear(8, 8) for _ in range(N)]), ("B", 8))``
(training-free forward, the self-check on) ``--reps`` times in this one process after a warm-up
analysis, the model built outside the timing; the median is reported with seconds per layer and
that figure's ratio to the smallest depth's (1.0 everywhere: linear; growing: superlinear).

Results go to ``benchmarks/results/depth_speed.{json,md}`` with the CPU model (lscpu), torch
version, thread count and the command.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llm_speed import cpu_model  # noqa: E402 - lscpu's model name, as every benchmark prints it
DEPTHS = (500, 1000, 2000, 4000, 5000)


def seconds(depth: int) -> float:
    """One analysis of a ``depth``-layer Sequential of Linear(8, 8), in seconds."""
    import torch

    import fxmem

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(depth)])
    start = time.perf_counter()
    fxmem.analyze(model, ("B", 8))
    return time.perf_counter() - start


def table(medians: dict[int, float]) -> list[dict]:
    """Rows: depth, median seconds, seconds per layer, and its ratio to the smallest depth's."""
    first = min(medians)
    base = medians[first] / first
    return [{"layers": n, "seconds": round(s, 2), "ms per layer": round(1000 * s / n, 3),
             "per-layer ratio": round((s / n) / base, 2)} for n, s in sorted(medians.items())]


def write(rows: list[dict], meta: dict) -> None:
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "depth_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Analysis time by depth: nn.Sequential of N x nn.Linear(8, 8)", "",
             f"Machine: {meta['machine']} (shared with other jobs), {meta['threads']} threads; torch {meta['torch']}; "
             f"{meta['date']}. Command: `{meta['command']}`. Median of {meta['reps']} run(s) each, in one process.",
             "", "| layers | seconds | ms per layer | per-layer ratio to the first |", "|---|---|---|---|"]
    lines += [f"| {r['layers']} | {r['seconds']} | {r['ms per layer']} | {r['per-layer ratio']} |" for r in rows]
    (out / "depth_speed.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="comma-separated numbers of layers")
    parser.add_argument("--reps", type=int, default=1, help="runs per depth (median reported)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    import torch

    import fxmem

    fxmem.analyze(torch.nn.Sequential(torch.nn.Linear(8, 8)), ("B", 8))  # warm-up: imports, first-use caches
    runs: dict[int, list[float]] = {}
    for depth in depths:
        for _ in range(args.reps):
            runs.setdefault(depth, []).append(seconds(depth))
        print(f"{depth} layers: {runs[depth][-1]:.2f} s", flush=True)
    rows = table({n: statistics.median(v) for n, v in runs.items()})
    meta = {"machine": f"{cpu_model()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "fxmem": os.path.dirname(fxmem.__file__),
            "command": "python benchmarks/depth_speed.py " + " ".join(sys.argv[1:]), "reps": args.reps,
            "date": time.strftime("%Y-%m-%d")}
    print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if not args.no_write:
        write(rows, meta)


if __name__ == "__main__":
    main()
