"""How long ``fxmem.analyze`` takes: a 12-block transformer stack and seed 000's GAT network.

Target: under 3 s each on the project's 2-core machine. "warm" is the median of repeated
analyses in one process; "first" is the first analysis in a fresh process, which also pays for
torch's lazy initialisation of fake tensors and symbolic shapes (imports excluded).

    python benchmarks/analyze_speed.py            # writes benchmarks/results/analyze_speed.{json,md}
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


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


def case(name: str):  # -> (model, specs)
    if name == "transformer-12":
        return Stack(), (("B", "L", 768),)
    from seed_gat import GAT

    return GAT(6, 128, 1600, 8), (("B", "N", 6), ("B", "N", "N"))


def time_once(name: str) -> float:
    import fxmem

    model, specs = case(name)
    t = time.perf_counter()
    report = fxmem.analyze(model, *specs)
    elapsed = time.perf_counter() - t
    assert report.peak.free_symbols
    return elapsed


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--first":
        print(json.dumps({"seconds": time_once(sys.argv[2])}))
        return
    rows = []
    for name in ("transformer-12", "seed000-gat"):
        first = json.loads(subprocess.run([sys.executable, __file__, "--first", name], capture_output=True,
                                          text=True, check=True).stdout.strip().splitlines()[-1])["seconds"]
        time_once(name)
        warm = [time_once(name) for _ in range(5)]
        model, _ = case(name)
        rows.append({"model": name, "first_s": round(first, 3), "warm_median_s": round(statistics.median(warm), 3),
                     "warm_all_s": [round(w, 3) for w in warm],
                     "parameters": sum(p.numel() for p in model.parameters())})
    from fxmem.measure import machine_name

    meta = {"machine": machine_name("cpu"), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "command": "python benchmarks/analyze_speed.py", "target_s": 3.0}
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "analyze_speed.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    lines = ["# fxmem.analyze speed", "",
             f"Machine: {meta['machine']}; Python {meta['python']}; torch {meta['torch']}; "
             f"command: `{meta['command']}`. Target: under {meta['target_s']} s.", "",
             "| model | parameters | first analysis in a process (s) | warm, median of 5 (s) |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['parameters']:,} | {r['first_s']} | {r['warm_median_s']} |")
    with open(os.path.join(out, "analyze_speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
