"""Formulas for every size (issue 44): how long answering sizes takes once a model is analysed.

    python benchmarks/pieces_speed.py                 # results written to benchmarks/results/
    python benchmarks/pieces_speed.py --reps 1 --no-write
    python benchmarks/pieces_speed.py --help          # this text; runs nothing

Cases, each in this one process:

* ``llama``: a tiny HF Llama (2 layers, hidden 64; random weights) with AdamW, ``("B", "L")``:
  the analysis (self-check on), ``report.pieces()`` (each piece's formulas and its self-check), then
  ``evaluate`` at 1,000 random sizes (B 2..16, L 2..2048: every flash-attention regime) and
  ``max_size("B", "64MiB", train=True, L=...)`` at 20 lengths. How many simulations ran is counted.
* ``cnn``: a small ResNet-like CNN with ``("B", 3, "H", "W")`` and AdamW: the same, 1,000 random
  sizes (B 2..16, H and W 32..128). oneDNN's convolution and batch-norm scratch is no formula: it is
  measured (one real run of each such kernel alone per new size, :mod:`fxmem.kernels.measured`),
  and sizes outside the first region are analysed again; the row says how many simulations that
  took (within a time limit ``--cnn-limit`` seconds; sizes left are counted).
* ``resnet18``: torchvision's ResNet-18 architecture (``tests/zoo/resnet.py``) at width 16, the
  same, at B 2..8 and H, W 33..160 (the model's own guards: a batch of 1 and a last map of 1x1 are
  other branches, see ``tests/exactness/test_resnet18.py`` for those).

``analyses`` counts the formulas' regions the sweeps used (:meth:`fxmem.Report.regions`: the first
analysis, its other pieces, and any re-analysis); ``simulations`` how many of them ran the model.

Medians of ``--reps`` repetitions of the evaluate sweep (fresh random sizes each time, same seed
sequence), with the CPU model (lscpu), torch version, threads and the command.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llm_speed import cpu_model  # noqa: E402 - lscpu's model name, as every benchmark prints it


def counting_simulations() -> list:
    """Count fxmem's simulations from here on (each call of the simulation an analysis makes)."""
    module = importlib.import_module("fxmem.analyze")
    runs: list = []
    simulate = module.simulate

    def counted(*a, **k):
        runs.append(1)
        return simulate(*a, **k)

    module.simulate = counted
    return runs


def llama():
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg), (("B", "L"),), {"dtype": torch.int64}, \
        lambda rng: {"B": rng.randint(2, 16), "L": rng.randint(2, 2048)}, ("B", "L", (64, 2048))


def cnn():
    import torch
    import torch.nn as nn

    def block(c, o, stride):
        return nn.Sequential(nn.Conv2d(c, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(),
                             nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          block(16, 16, 1), block(16, 32, 2), block(32, 64, 2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return model, (("B", 3, "H", "W"),), {}, \
        lambda rng: {"B": rng.randint(2, 16), "H": rng.randint(32, 128), "W": rng.randint(32, 128)}, \
        ("B", "H", (32, 128))


def resnet18():
    import torch

    sys.path.insert(0, str(HERE.parent / "tests"))
    from zoo.resnet import ResNet18  # the tests' model, not restated

    torch.manual_seed(0)
    return ResNet18(width=16, num_classes=10).train(), (("B", 3, "H", "W"),), {}, \
        lambda rng: {"B": rng.randint(2, 8), "H": rng.randint(33, 160), "W": rng.randint(33, 160)}, \
        ("B", "H", (33, 160))


CASES = {"llama": llama, "cnn": cnn, "resnet18": resnet18}


def run_case(name: str, reps: int, limit: float) -> dict:
    import torch

    import fxmem

    runs = counting_simulations()
    model, specs, kw, size, (dim, other, others) = CASES[name]()
    start = time.perf_counter()
    report = fxmem.analyze(model, *specs, optimizer=lambda p: torch.optim.AdamW(p), **kw)
    analysis = time.perf_counter() - start
    start = time.perf_counter()
    pieces = report.pieces()
    piece_time = time.perf_counter() - start
    times, left_out = [], 0
    for rep in range(reps):
        rng = random.Random(rep)
        points = [size(rng) for _ in range(1000)]
        start = time.perf_counter()
        for p in points:
            if time.perf_counter() - start > limit:
                left_out += 1
                continue
            report.evaluate(**p)
        times.append(time.perf_counter() - start)
    rng = random.Random(99)
    fixed = [rng.randint(*others) for _ in range(20)]
    start = time.perf_counter()
    found = [report.max_size(dim, "64MiB", train=True, **{other: v},
                             **({} if name == "llama" else {"W": v})) for v in fixed]
    search = time.perf_counter() - start
    return {"case": name, "analysis s": round(analysis, 2), "pieces": len(pieces), "pieces s": round(piece_time, 2),
            "sizes answered per sweep": round((reps * 1000 - left_out) / reps),
            "sweep s (median)": round(statistics.median(times), 3), "left out (time limit)": left_out,
            "20 max_size s": round(search, 3), "analyses": len(report.regions()), "simulations": len(runs),
            "largest B found": max(found),
            "region": ", ".join(report.region)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cnn-limit", type=float, default=120.0, help="seconds for one evaluate sweep of a case")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    rows = [run_case(name, args.reps, args.cnn_limit) for name in args.cases.split(",")]
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    """Print the rows, and (unless ``--no-write``) write them with the machine and command."""
    import torch

    meta = {"machine": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "reps": args.reps,
            "command": "python benchmarks/pieces_speed.py " + " ".join(sys.argv[1:])}
    for r in rows:
        print(r)
    if args.no_write:
        return
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "pieces_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    keys = list(rows[0])
    lines = ["# Answering sizes after one analysis (formulas for every size)", "",
             f"Machine: {meta['machine']} (shared with other jobs), {meta['threads']} threads; torch {meta['torch']}; "
             f"{meta['date']}. Command: `{meta['command']}`. Each sweep asks 1,000 random sizes within a time "
             f"limit (`--cnn-limit` seconds); medians of {meta['reps']} sweeps. A size outside every piece is "
             f"simulated again (`simulations` counts them all, the max_size searches' too).", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    (out / "pieces_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
