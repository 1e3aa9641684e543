"""Measured kernel workspaces (fxmem.kernels.measured): what oneDNN keeps, and what answering costs.

    python benchmarks/measured_workspace.py            # results written to benchmarks/results/
    python benchmarks/measured_workspace.py --no-write
    python benchmarks/measured_workspace.py --help     # this text; runs nothing

Two parts, in this one process, on this CPU:

* ``scratch``: a 16 -> 32 channel, 3x3, stride-2 convolution's backward (the strided layer of
  ``tests/zoo``'s StridedNet, which ``tests/kernels/test_measured.py`` checks) run for real at a few input shapes: the largest
  hidden buffer it allocates at each and the most it holds before its first output (grad_input) is born. The numbers depend on the CPU and the thread count.
* ``answers``: that model's AdamW training step analysed once at the default example sizes; then
  ``evaluate`` at ``--sizes`` random sizes (B 2..32, H and W 6..128), each new size costing real runs
  of the measured kernels (and the fitted kernels' checks), then the same sizes again (cached);
  and the predictions next to real steps at three of them (``fxmem.validate``). With an empty
  calibration cache (a temporary ``XDG_CACHE_HOME``), so the first pass measures everything.
* ``resnet18``: torchvision's ResNet-18 architecture (``tests/zoo/resnet.py``, width 64, 1,000
  classes) with AdamW, analysed once with ``("B", 3, "H", "W")``: the analysis' time, then the 11
  sizes of ``tests/zoo/resnet.py`` that ``tests/exactness/test_resnet18.py`` checks (batch 1 to 6, images 7x9 to 128x96) evaluated and
  run for real (training steps, peak above start against the allocator), how many simulations
  all of that took, and the largest batch at 224x224 within 4 GiB (``--real-max``: checked
  against a real training step at that batch).
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
from pieces_speed import counting_simulations  # noqa: E402 - counts fxmem's simulations from here on

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
        rows.append({"input": f"{b}x16x{h}x{wd}", "buffers": sum(1 for p in program if isinstance(p, int) and p > 0),
                     "peak_above_start_before_grad_input": stretches[0][0]})
    return rows


def answer_rows(count: int) -> dict:
    import torch

    import fxmem
    from zoo import StridedNet  # the tests' model, not restated

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)

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


def resnet18_rows(real_max: bool) -> dict:
    import torch

    import fxmem
    from conftest import check_steps_against_report
    from zoo.resnet import SIZES, ResNet18

    runs = counting_simulations()

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)

    torch.manual_seed(0)
    model = ResNet18(width=64, num_classes=1000).train()
    t = time.perf_counter()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=adamw)
    analysis = time.perf_counter() - t
    t = time.perf_counter()
    for d in SIZES:
        report.evaluate(**d)
    answers = time.perf_counter() - t
    check_steps_against_report(model, report, SIZES, adamw)  # raises unless every size is exact
    t = time.perf_counter()
    largest = report.max_size("B", "4GiB", train=True, H=224, W=224)
    search = time.perf_counter() - t
    out = {"analysis_s": analysis, "exact": report.exact, "sizes": len(SIZES), "evaluate_s": answers,
           "simulations": len(runs), "all_equal_to_real_steps": True, "max_batch_4GiB_224": largest,
           "max_size_s": search, "train_peak_at_it": report.evaluate(B=largest, H=224, W=224)["train_peak"],
           "train_peak_one_more": report.evaluate(B=largest + 1, H=224, W=224)["train_peak"]}
    if real_max:  # the answer against a real step there (about 4 GiB of memory)
        check_steps_against_report(model, report, [dict(B=largest, H=224, W=224)], adamw)
        out["answer_equal_to_real_step"] = True
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, default=100)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--real-max", action="store_true",
                        help="also run a real training step at the largest batch found (about 4 GiB of memory)")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as cache:
        os.environ["XDG_CACHE_HOME"] = cache
        scratch = scratch_rows()
        answers = answer_rows(args.sizes)
        resnet = resnet18_rows(args.real_max)
    meta = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/measured_workspace.py"
            + (f" --sizes {args.sizes}" if args.sizes != 100 else "") + (" --real-max" if args.real_max else "")}
    lines = ["# Measured kernel workspaces", "",
             f"Machine: {meta['cpu']} (shared with other jobs), {meta['threads']} threads; torch {meta['torch']}; "
             f"{meta['date']}. Command: `{meta['command']}`.", "",
             "## A strided convolution's backward, run for real (bytes)", "",
             "| input | hidden buffers it allocates | most held before grad_input is born |", "|---|---|---|"]
    lines += [f"| {r['input']} | {r['buffers']} | {r['peak_above_start_before_grad_input']:,} |"
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
    r = resnet
    lines += ["", "## torchvision's ResNet-18 (width 64), AdamW, analysed once", "",
              f"analysis {r['analysis_s']:.1f} s, exact {r['exact']}; {r['sizes']} sizes (B 1..6, images 7x9..128x96) "
              f"evaluated in {r['evaluate_s']:.1f} s (pieces of the one recording, their self-checks and kernel runs); "
              f"simulations in all: {r['simulations']} (the first, and one per size-1 case PyTorch treats apart: B=1, and "
              f"images whose last stage is a 1x1 map, H or W <= 32); every size equal to a real "
              f"training step (peak above start, retained, optimizer state, resident): {r['all_equal_to_real_steps']}.", "",
              f"`max_size('B', '4GiB', train=True, H=224, W=224)`: {r['max_batch_4GiB_224']} in {r['max_size_s']:.1f} s "
              f"(train_peak {r['train_peak_at_it']:,} B there, {r['train_peak_one_more']:,} B at one more; past "
              f"2**24 elements the measured kernels are extended along the batch); against a real step there: "
              f"{r.get('answer_equal_to_real_step', 'not run (--real-max)')}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        out = HERE / "results"
        (out / "measured_workspace.md").write_text(text)
        (out / "measured_workspace.json").write_text(json.dumps({"meta": meta, "scratch": scratch, "answers": answers,
                                                                 "resnet18": resnet}, indent=1, default=str))


if __name__ == "__main__":
    main()
