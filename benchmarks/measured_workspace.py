"""Measured kernel workspaces (fxmem.kernels.measured): what oneDNN keeps, and what answering costs.

    python benchmarks/measured_workspace.py            # results written to benchmarks/results/
    python benchmarks/measured_workspace.py --no-write
    python benchmarks/measured_workspace.py --help     # this text; runs nothing

Two parts, in this one process, on this CPU:

* ``scratch``: a 16 -> 32 channel, 3x3, stride-2 convolution's backward (the strided layer of
  ``tests/kernels/test_measured.py``'s model) run for real at a few input shapes: the largest
  hidden buffer it allocates at each (the one no fit from samples describes on some CPUs) and its
  whole program's peak above its start. The numbers depend on the CPU and the thread count.
* ``answers``: that model's AdamW training step analysed once at the default example sizes; then
  ``evaluate`` at ``--sizes`` random sizes (B 2..32, H and W 6..128), each new size costing real runs
  of the measured kernels (and the fitted kernels' checks), then the same sizes again (cached);
  and the predictions next to real steps at three of them (``fxmem.validate``). With an empty
  calibration cache (a temporary ``XDG_CACHE_HOME``), so the first pass measures everything.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from llm_speed import cpu_model  # noqa: E402 - lscpu's model name, as every benchmark prints it

SHAPES = [(2, 6, 6), (2, 16, 26), (2, 32, 32), (2, 96, 41), (2, 96, 42), (2, 96, 80), (16, 96, 80)]


def scratch_rows() -> list[dict]:
    import torch

    from fxmem.kernels.calibrate import run_and_read
    from fxmem.kernels.measured import summarize

    torch.manual_seed(0)
    w = torch.randn(32, 16, 3, 3)
    rows = []
    for b, h, wd in SHAPES:
        x = torch.randn(b, 16, h, wd)
        g = torch.randn(b, 32, (h - 1) // 2 + 1, (wd - 1) // 2 + 1)
        program, _ = run_and_read(lambda: torch.ops.aten.convolution_backward(
            g, x, w, [32], [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]))
        _, stretches = summarize(program)
        rows.append({"input": f"{b}x16x{h}x{wd}", "largest_buffer": max(p for p in program if isinstance(p, int)),
                     "peak_above_start_before_grad_input": stretches[0][0]})
    return rows


def answer_rows(count: int) -> dict:
    import torch

    import fxmem
    from kernels.test_measured import StridedNet, adamw  # the test's model, not restated

    torch.manual_seed(0)
    model = StridedNet().train()
    t = time.perf_counter()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw)
    analysis = time.perf_counter() - t
    rng = random.Random(0)
    sizes = [dict(B=rng.randint(2, 32), H=rng.randint(6, 128), W=rng.randint(6, 128)) for _ in range(count)]
    first, again = [], []
    for d in sizes:
        t = time.perf_counter()
        report.evaluate(**d)
        first.append(time.perf_counter() - t)
    for d in sizes:
        t = time.perf_counter()
        report.evaluate(**d)
        again.append(time.perf_counter() - t)
    simulations = len(report.regions())
    checks = []
    for d in sizes[:3]:
        v = fxmem.validate(model, ("B", 3, "H", "W"), dims=d, device="cpu", optimizer=adamw)
        row = {r.what: (r.predicted, r.measured) for r in v.rows}
        checks.append({"dims": d, "train_peak_above_resident": row.get("training step: peak above resident")})
    return {"analysis_s": analysis, "exact": report.exact, "region": report.region, "sizes": count,
            "first_median_s": statistics.median(first), "first_total_s": sum(first),
            "again_median_s": statistics.median(again), "again_total_s": sum(again),
            "analyses": simulations, "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, default=100)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as cache:
        os.environ["XDG_CACHE_HOME"] = cache
        scratch = scratch_rows()
        answers = answer_rows(args.sizes)
    meta = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/measured_workspace.py"
            + (f" --sizes {args.sizes}" if args.sizes != 100 else "")}
    lines = ["# Measured kernel workspaces", "",
             f"Machine: {meta['cpu']} (shared with other jobs), {meta['threads']} threads; torch {meta['torch']}; "
             f"{meta['date']}. Command: `{meta['command']}`.", "",
             "## A strided convolution's backward, run for real (bytes)", "",
             "| input | largest hidden buffer | most held before grad_input is born |", "|---|---|---|"]
    lines += [f"| {r['input']} | {r['largest_buffer']:,} | {r['peak_above_start_before_grad_input']:,} |"
              for r in scratch]
    a = answers
    lines += ["", "## Answering sizes after one analysis (the model of tests/kernels/test_measured.py, AdamW)", "",
              f"analysis {a['analysis_s']:.2f} s, exact {a['exact']}, region {', '.join(a['region'])}; "
              f"{a['sizes']} random sizes: first pass median {a['first_median_s'] * 1000:.1f} ms per size "
              f"({a['first_total_s']:.1f} s in all: real runs of the measured and fitted kernels), again "
              f"(cached) median {a['again_median_s'] * 1000:.3f} ms ({a['again_total_s']:.2f} s); analyses in all: "
              f"{a['analyses']}.", "",
              "| sizes | training step peak above resident: predicted | measured |", "|---|---|---|"]
    lines += [f"| {c['dims']} | {c['train_peak_above_resident'][0]:,} | {c['train_peak_above_resident'][1]:,} |"
              for c in a["checks"]]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        out = HERE / "results"
        (out / "measured_workspace.md").write_text(text)
        (out / "measured_workspace.json").write_text(json.dumps({"meta": meta, "scratch": scratch,
                                                                 "answers": answers}, indent=1, default=str))


if __name__ == "__main__":
    main()
