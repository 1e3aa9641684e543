"""How long LLM questions take: a Hugging Face Llama-7B config against the project's own Llama,
``max_size`` against one analysis, and a process's first analysis with and without the on-disk
calibration cache (issue 22, "answers in seconds").

    python benchmarks/llm_speed.py                 # everything, 3 runs each, results written
    python benchmarks/llm_speed.py --reps 1 --only calibration,maxsize
    python benchmarks/llm_speed.py --help          # this text; runs nothing

Cases (each timed ``--reps`` times in this one process, the median reported; models on the meta
device, bfloat16, one AdamW training step, tokens ``(B, L)``):

* ``ours-7b``: ``examples/llama.py``'s 7B model (graph mode; its 32 identical blocks simulated as 4);
* ``hf-7b``: ``transformers.LlamaForCausalLM`` with the Llama-2-7B configuration (eager mode);
* ``hf-7b-config``: the same model as a user builds it from a checkpoint's ``config.json``
  (``AutoConfig.from_pretrained`` on a folder holding it, ``AutoModelForCausalLM.from_config``, no
  ``dtype=``), then ``.to(bfloat16)``;
* ``hf-7b-no-kernels``: ``hf-7b`` in a subprocess where the ``kernels`` package (which transformers
  5.25 requires, and which gives every attention module a kernel module of its own) cannot be found;
* ``maxsize``: on a fresh analysis of ``ours-7b``, ``max_size("B", "80GiB", train=True, L=2048)``
  (L=2048 lies outside the formulas' region L <= 191: one re-analysis) over one analysis' time;
* ``calibration``: a small ResNet-like CNN's first analysis (training, SGD) in a fresh process (subprocesses), with an empty
  cache directory, then with the one the first process filled.

Results go to ``benchmarks/results/llm_speed.{json,md}`` with the CPU model (lscpu), torch version,
thread count and the command.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = ("ours-7b", "hf-7b", "hf-7b-config", "hf-7b-no-kernels", "maxsize", "calibration")
LLAMA2_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "torch_dtype": "float16"}

FIRST_ANALYSIS = """
import logging, time, torch, fxmem
from torch import nn
calibrations = []  # counted through the documented fxmem logger
class Count(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("calibrating"):
            calibrations.append(1)
logging.getLogger("fxmem").addHandler(Count())
logging.getLogger("fxmem").setLevel(logging.INFO)
def stage(cin, cout, stride):  # a ResNet stage's convolution geometries: 3x3 (strided), 1x1 shortcut
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
model = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                      *stage(16, 16, 1), *stage(16, 32, 2), *stage(32, 64, 2), *stage(64, 128, 2),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
start = time.perf_counter()
fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=torch.optim.SGD)
print(time.perf_counter() - start, len(calibrations))
"""


def _tokens():
    import fxmem
    import torch

    return fxmem.TensorSpec(("B", "L"), dtype=torch.int64)


def ours_7b():
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from llama import LLAMA_7B, Llama

    with torch.device("meta"):
        return Llama(LLAMA_7B).to(torch.bfloat16)


def hf_7b():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def hf_7b_from_config_json():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(LLAMA2_7B))
        config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


# hf-7b where the kernels package cannot be found: transformers asks importlib.util.find_spec
WITHOUT_KERNELS = """
import importlib.util, sys, time
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "kernels" else find_spec(name, *a)
sys.modules["kernels"] = None  # and import kernels fails
sys.path.insert(0, {here!r})
from llm_speed import analyse, hf_7b
import fxmem, torch
fxmem.analyze(torch.nn.Linear(4, 4), ("B", 4))
model = hf_7b()
assert not any("_kernel_funcs" in vars(m) for m in model.modules()), "kernels was found"
start = time.perf_counter()
analyse(model)
print(time.perf_counter() - start)
"""


def without_kernels() -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", WITHOUT_KERNELS.format(here=str(HERE))], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"the no-kernels process failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def kernels_installed() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def analyse(model):
    import fxmem
    import torch

    return fxmem.analyze(model, _tokens(), dtype=torch.bfloat16, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def first_analysis(cache: str) -> tuple[float, int]:
    env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", FIRST_ANALYSIS], env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"the first-analysis process failed:\n{done.stderr[-3000:]}")
    seconds, calibrations = done.stdout.strip().splitlines()[-1].split()
    return float(seconds), int(calibrations)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="runs per case (median reported)")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    import torch

    import fxmem

    fxmem.analyze(torch.nn.Linear(4, 4), ("B", 4))  # warm-up: imports and first-use caches
    runs: dict[str, list[float]] = {}
    for _ in range(args.reps):
        if "ours-7b" in only or "maxsize" in only:
            model = ours_7b()  # built outside the timing (as the HF models are): the analysis is timed
            t, report = timed(lambda: analyse(model))
            runs.setdefault("ours-7b analysis (s)", []).append(t)
            if "maxsize" in only:
                t2, answer = timed(lambda: report.max_size("B", "80GiB", train=True, L=2048))
                runs.setdefault("ours-7b max_size B at L=2048, 80GiB (s)", []).append(t2)
                runs.setdefault("max_size / analysis", []).append(t2 / t)
                print(f"max_size = {int(answer)}", flush=True)
        if "hf-7b" in only:
            model = hf_7b()  # built outside the timing, as ours-7b's is not: the analysis is timed
            t, _ = timed(lambda: analyse(model))
            runs.setdefault("hf-7b analysis (s)", []).append(t)
        if "hf-7b-config" in only:
            model = hf_7b_from_config_json()
            t, _ = timed(lambda: analyse(model))
            runs.setdefault("hf-7b from config.json analysis (s)", []).append(t)
        if "hf-7b-no-kernels" in only:
            runs.setdefault("hf-7b without kernels analysis (s, a subprocess)", []).append(without_kernels())
        if "calibration" in only:
            with tempfile.TemporaryDirectory() as cache:
                for label in ("empty cache", "cache filled"):
                    seconds, calibrations = first_analysis(cache)
                    runs.setdefault(f"first analysis, {label} (s)", []).append(seconds)
                    runs.setdefault(f"first analysis, {label}: calibrations run", []).append(calibrations)
        print({k: round(v[-1], 2) for k, v in runs.items()}, flush=True)
    medians = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    for key, label in (("hf-7b analysis (s)", "hf-7b / ours-7b"),
                       ("hf-7b from config.json analysis (s)", "hf-7b from config.json / ours-7b"),
                       ("hf-7b without kernels analysis (s, a subprocess)", "hf-7b without kernels / ours-7b")):
        if key in medians and "ours-7b analysis (s)" in medians:
            medians[label] = round(medians[key] / medians["ours-7b analysis (s)"], 2)
    import transformers

    meta = {"machine": f"{cpu_model()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "transformers": transformers.__version__, "kernels": kernels_installed(),
            "threads": torch.get_num_threads(), "command": "python benchmarks/llm_speed.py " + " ".join(sys.argv[1:]),
            "reps": args.reps, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps({"meta": meta, "medians": medians}, indent=1))
    if args.no_write:
        return
    out = HERE / "results"
    (out / "llm_speed.json").write_text(json.dumps({"meta": meta, "medians": medians, "runs": runs}, indent=1) + "\n")
    lines = ["# LLM questions: how long they take", "",
             f"Machine: {meta['machine']} (shared with other jobs), {meta['threads']} threads; torch {meta['torch']}, "
             f"transformers {meta['transformers']}, kernels {meta['kernels']}; "
             f"{meta['date']}. Command: `{meta['command']}`. Median of {args.reps} run(s) each in one process "
             "(the calibration rows: fresh subprocesses).", "", "| measure | median |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in medians.items()]
    (out / "llm_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
