"""How long ``fxmem.analyze`` takes, and what ``evaluate`` costs outside the formulas' region.

Measured, each in one run of this script (the machine is shared: quote medians and ratios):

* **cold**: the first analysis in a fresh Python process (``import fxmem`` excluded; torch's own
  lazy imports and set-up of fake tensors and symbolic shapes included), next to the warm median;
* **warm**: the median of repeated analyses in one process;
* **depth**: a Llama-7B configuration on the meta device (bfloat16, 4 and 32 layers), forward and
  forward + AdamW step, and the ratio 32 layers / 4 layers;
* **transformer-12**: a 12-block GPT-style stack (375 fx nodes), the 0.5 s-warm goal;
* **regions**: a small CNN whose formulas hold for B >= 16 (example sizes near 100), evaluated
  at B = 1, 2, 3, 5: the first size of each region re-analyses, the others reuse that analysis.

Where the time goes is printed too (``--profile``: the share of time inside PyTorch's fake-tensor
dispatch, for the 12-block transformer).

    python benchmarks/analyze_speed.py            # writes benchmarks/results/analyze_speed.{json,md}
    python benchmarks/analyze_speed.py --quick    # fewer repetitions, no files written
    python benchmarks/analyze_speed.py --reported # only the cases users reported slow (issue 26):
                                                  # writes benchmarks/results/analyze_speed_reported.{json,md}

The reported cases: a 1000-layer MLP (Linear 16->16 + ReLU), forward and forward + AdamW step
(reported 26 s, 8x its forward); a small model chaining cdist -> baddbmm -> cumprod -> unbind
(reported not finishing in 190 s; the reporter's exact model is not known, this is a reconstruction
with those ops). Each is timed next to the plain forward analysis of the same model: the goal is no
analysis slower than ~10x the forward's.
"""
from __future__ import annotations

import cProfile
import dataclasses
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

GOALS = {"llama7b_32_train_s": 3.0, "depth_ratio_32_over_4": 2.5, "transformer12_warm_s": 0.5}


class Block(nn.Module):
    """A GPT-style pre-norm block, traced through (no leaf modules but Linear/LayerNorm)."""

    def __init__(self, dim: int = 768, heads: int = 12):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = self.drop((q @ k.transpose(-1, -2) * (C // self.heads) ** -0.5).softmax(-1))
        x = x + self.drop(self.proj((a @ v).transpose(1, 2).reshape(B, L, C)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Stack(nn.Module):
    def __init__(self, depth: int = 12, dim: int = 768, heads: int = 12):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.blocks(x))


class CNN(nn.Module):
    """Conv, batch norm, pooling, a strided conv: oneDNN picks its path by batch and image size."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                               nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)


def case(name: str):  # -> (model, specs, analyze keywords); models on the meta device: no memory
    import fxmem
    from llama import LLAMA_7B, Llama

    kw: dict = {}
    if name.endswith("-every-block"):  # the same analysis with every block simulated (no reuse)
        name = name[:-len("-every-block")]
        kw["repeats"] = False
    if name.startswith("llama7b"):  # llama7b-<layers>-<fwd|train>
        _, layers, what = name.split("-")
        with torch.device("meta"):
            model = Llama(dataclasses.replace(LLAMA_7B, layers=int(layers))).to(torch.bfloat16)
        kw["dtype"] = torch.bfloat16
        if what == "train":
            kw["optimizer"] = lambda p: torch.optim.AdamW(p, lr=1e-4)
        return model, (fxmem.TensorSpec(("B", "L"), dtype=torch.int64),), kw
    if name == "transformer-12":
        with torch.device("meta"):
            return Stack(), (("B", "L", 768),), kw
    if name == "cnn":
        return CNN(), (("B", 3, "H", "W"),), kw
    raise SystemExit(f"unknown case {name}")


REUSED = "run the same code on tensors of the same sizes"  # the note of a report whose blocks were repeated


def time_once(name: str, formulas: dict | None = None) -> float:
    import fxmem

    model, specs, kw = case(name)
    t = time.perf_counter()
    report = fxmem.analyze(model, *specs, **kw)
    elapsed = time.perf_counter() - t
    assert report.peak.free_symbols
    if name.startswith(("llama7b-32", "transformer-12")):  # the depth these numbers are about
        assert any(REUSED in n for n in report.notes) == kw.get("repeats", True), name
    if formulas is not None:
        formulas[name] = {k: str(v) for k, v in report.formulas().items()}
    return elapsed


def cold(name: str) -> float:
    """The first analysis in a fresh process (imports of fxmem and the model excluded)."""
    out = subprocess.run([sys.executable, __file__, "--first", name], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def regions() -> dict:
    """evaluate() below the CNN's region: seconds per call, in order, and the regions analysed."""
    import fxmem

    model, specs, kw = case("cnn")
    t = time.perf_counter()
    report = fxmem.analyze(model, *specs, **kw)
    out = {"analyse_s": round(time.perf_counter() - t, 3), "region": report.region, "evaluate_s": {}}
    for B in (1, 2, 3, 5, 1, 2):
        t = time.perf_counter()
        report.evaluate(B=B, H=32, W=32)
        out["evaluate_s"].setdefault(f"B={B}", []).append(round(time.perf_counter() - t, 3))
    out["regions"] = [r for r, _ in report.regions()]
    return out


def fake_share() -> dict:
    """Where a warm analysis of the 12-block transformer spends its time (cProfile, cumulative)."""
    time_once("transformer-12")
    prof = cProfile.Profile()
    prof.runcall(time_once, "transformer-12")
    stats = pstats.Stats(prof)
    total = max(v[3] for v in stats.stats.values())

    def cum(fragment: str) -> float:
        return max((v[3] for k, v in stats.stats.items() if fragment in f"{k[0]}:{k[2]}"), default=0.0)

    return {"total_s_under_profiler": round(total, 3),
            "fake_tensor_dispatch": round(cum("fake_tensor.py:dispatch") / total, 3),
            "symbolic_int_arithmetic": round(cum("sym_node.py:binary_magic_impl") / total, 3),
            "fxmem_recording": round(cum("recorder.py:_record") / total, 3),
            "fxmem_accounting": round(cum("plan.py:__init__") / total, 3)}


class DeepMLP(nn.Module):
    def __init__(self, depth: int = 1000, width: int = 16):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class PairChain(nn.Module):
    """cdist -> baddbmm -> cumprod -> unbind (a reconstruction of the reported 10-op model)."""

    def __init__(self, f: int = 6):
        super().__init__()
        self.proj = nn.Linear(f, f)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(x, y)
        z = torch.baddbmm(d, self.proj(x), y.transpose(1, 2))
        c = torch.cumprod(z.tanh(), dim=-1)
        first, *rest = c.unbind(1)
        return first + rest[-1]


def reported() -> None:
    """Time the reported cases (forward, then forward + AdamW) and write their results."""
    import fxmem

    adamw = {"optimizer": lambda p: torch.optim.AdamW(p, lr=1e-3)}
    cases = {"mlp-1000": (DeepMLP(), (("B", 16),)), "cdist-baddbmm-cumprod-unbind": (PairChain(), (("B", "N", 6),
                                                                                                     ("B", "K", 6)))}
    fxmem.analyze(nn.Linear(2, 2), ("B", 2), **adamw)  # warm torch's lazy set-up
    rows = {}
    for name, (model, specs) in cases.items():
        row = {}
        for what, kw in (("forward", {}), ("adamw", adamw)):
            t = time.perf_counter()
            fxmem.analyze(model, *specs, **kw)
            row[f"{what}_s"] = round(time.perf_counter() - t, 2)
        row["adamw_over_forward"] = round(row["adamw_s"] / row["forward_s"], 2)
        rows[name] = row
        print(name, row, flush=True)
    from fxmem.measure import machine_name

    meta = {"machine": machine_name("cpu"), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "command": "python benchmarks/analyze_speed.py --reported", "date": time.strftime("%Y-%m-%d")}
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "analyze_speed_reported.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    lines = ["# fxmem.analyze speed: the cases users reported slow", "",
             f"Machine: {meta['machine']}, {meta['threads']} threads (shared with other jobs); torch {meta['torch']}; "
             f"{meta['date']}. Command: `{meta['command']}`. One run each, after a warm-up analysis.", "",
             "| model | forward analysis (s) | forward + AdamW step (s) | ratio |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['forward_s']} | {r['adamw_s']} | {r['adamw_over_forward']}x |" for n, r in rows.items()]
    with open(os.path.join(out, "analyze_speed_reported.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return
    if "--reported" in sys.argv:
        reported()
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--first":
        import fxmem  # noqa: F401 - imported before the clock starts, as a user's script does
        print(json.dumps({"seconds": time_once(sys.argv[2])}))
        return
    quick = "--quick" in sys.argv
    reps = 2 if quick else 3
    names = ["transformer-12", "llama7b-4-fwd", "llama7b-32-fwd", "llama7b-4-train", "llama7b-32-train"]
    rows = {}
    for name in names:
        first = cold(name)
        time_once(name)
        warm = []
        for _ in range(reps):  # round-robin would mix processes' caches; repeat in this one
            warm.append(time_once(name))
        rows[name] = {"first_s": round(first, 3), "warm_median_s": round(statistics.median(warm), 3),
                      "warm_all_s": [round(w, 3) for w in warm]}
        print(name, rows[name], flush=True)
    ratios = {what: round(rows[f"llama7b-32-{what}"]["warm_median_s"] / rows[f"llama7b-4-{what}"]["warm_median_s"], 2)
              for what in ("fwd", "train")}
    # the same 32-layer analyses with every block simulated: one warm run each, and the same formulas
    formulas: dict = {}
    every = {}
    for what in ("fwd", "train"):
        name = f"llama7b-32-{what}"
        time_once(name, formulas)
        every[what] = round(time_once(f"{name}-every-block", formulas), 3)
        assert formulas[name] == formulas[f"{name}-every-block"], f"{name}: formulas differ without reuse"
        print(name, "every block simulated", every[what], flush=True)
    region_row = regions()
    share = fake_share()
    print("ratios", ratios, "\nregions", region_row, "\nshare", share, flush=True)
    if quick:
        return
    from fxmem.measure import machine_name

    meta = {"machine": machine_name("cpu"), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "command": "python benchmarks/analyze_speed.py",
            "date": time.strftime("%Y-%m-%d"), "goals": GOALS}
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "analyze_speed.json"), "w") as f:
        json.dump({"meta": meta, "results": rows, "ratio_32_over_4_layers": ratios, "regions": region_row,
                   "time_shares": share, "llama7b_32_every_block_simulated_s": every}, f, indent=2)
    lines = ["# fxmem.analyze speed", "",
             f"Machine: {meta['machine']}, {meta['threads']} threads (shared with other jobs); Python "
             f"{meta['python']}; torch {meta['torch']}; {meta['date']}. Command: `{meta['command']}`.", "",
             f"Warm = median of {reps} analyses in one process after one unmeasured; first = the first analysis "
             "in a fresh process (fxmem imported before the clock starts). Llama-7B: the 7B configuration "
             "with its layer count changed, built on the meta device in bfloat16.", "",
             "| model | first analysis in a process (s) | warm, median (s) | warm runs (s) |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['first_s']} | {r['warm_median_s']} | {', '.join(map(str, r['warm_all_s']))} |")
    lines += ["", f"32 layers / 4 layers (warm medians): forward {ratios['fwd']}x, forward + AdamW step "
                  f"{ratios['train']}x (goal: <= {GOALS['depth_ratio_32_over_4']}x). Goals: Llama-7B 32 layers "
                  f"forward + AdamW <= {GOALS['llama7b_32_train_s']} s warm, transformer-12 <= "
                  f"{GOALS['transformer12_warm_s']} s warm.", "",
              "Identical blocks (Llama's 32 decoder layers, the transformer's 12 blocks) are simulated four at a "
              "time and the inner blocks' events repeated (every report above says so in its notes). The same "
              f"32-layer analyses with every block simulated (`repeats=False`, one warm run each, same formulas "
              f"checked): forward {every['fwd']} s, forward + AdamW step {every['train']} s.", "",
              "Where a warm analysis of transformer-12 spends its time (cProfile, share of the total): "
              + ", ".join(f"{k} {v}" for k, v in share.items() if k != "total_s_under_profiler") + ".", "",
              f"Regions: the CNN's formulas hold for {', '.join(region_row['region'])} (analysed in "
              f"{region_row['analyse_s']} s); evaluate() at H=W=32, in this order, took (s): "
              + "; ".join(f"{k}: {', '.join(map(str, v))}" for k, v in region_row["evaluate_s"].items())
              + ". Regions analysed: " + " | ".join(", ".join(r) for r in region_row["regions"]) + "."]
    with open(os.path.join(out, "analyze_speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
