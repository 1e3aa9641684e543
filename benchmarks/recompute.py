"""Fitting a budget by recomputation: peak vs budget vs recomputed FLOPs vs measured time.

A GPT-style decoder (``--layers`` pre-norm blocks: LayerNorm, causal softmax attention with
dropout, GELU MLP; width ``--dim``) trained with AdamW at B x L tokens. For each budget (a fraction
of the original training step's peak) ``fxmem.optimize(model, ..., budget=, dims=, optimizer=)``
chooses what to recompute; the table has its plan, fxmem's predicted training-step peak, the peak
the CPU allocator measured on a real steady-state step (absolute: resident + peak above start),
the FLOPs recomputed (as a share of the forward's), and the time of a training step (median of
``--repeats`` steps taken round-robin over the plans, one process, ``--threads`` threads).

    python benchmarks/recompute.py
Results: benchmarks/results/recompute_cpu.{json,md}
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))

import fxmem  # noqa: E402
from fxmem.measure import machine_name, measure  # noqa: E402
from fxmem.training import default_loss, train_step  # noqa: E402

FRACTIONS = (1.0, 0.8, 0.6, 0.45, 0.3, 0.1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(C // self.heads)
        a = self.drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
        x = x + self.proj((a @ v).transpose(1, 2).reshape(B, L, C))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class SdpaBlock(Block):
    """The same block with its attention written as ``F.scaled_dot_product_attention``: nothing
    for fxmem.optimize's rules to rewrite."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, C))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Decoder(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int = 512, block: type = Block) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        L = tokens.shape[1]
        mask = tokens.new_ones(L, L, dtype=torch.bool).triu(1)  # causal: True above the diagonal
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.norm(x)).log_softmax(-1)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def decoder_arguments(doc: str, out: str, repeats: int) -> argparse.ArgumentParser:
    """The decoder's and the run's command-line arguments (shared by the benchmarks that use it)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(HERE, "results", out))
    return ap


def decoder_setup(args: argparse.Namespace) -> tuple:
    """(model, token spec, dims, the original AdamW training step's peak at dims in bytes)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Decoder(args.layers, args.dim, args.heads)
    spec = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    dims = dict(B=args.batch, L=args.length)
    base = fxmem.analyze(model, spec, optimizer=adamw).evaluate(**dims)["train_peak"]
    return model, spec, dims, base


def main() -> None:
    args = decoder_arguments(__doc__, "recompute_cpu", 5).parse_args()
    model, spec, dims, base = decoder_setup(args)
    tokens = torch.randint(0, 512, (args.batch, args.length))

    rows, modules = [], {}
    for frac in FRACTIONS:
        budget = int(base * frac)
        t = time.perf_counter()
        try:
            opt = fxmem.optimize(model, spec, budget=budget, dims=dims, optimizer=adamw)
        except fxmem.FxMemError as exc:
            rows.append({"fraction": frac, "budget": budget, "plan": None, "error": str(exc),
                         "smallest_peak": getattr(exc, "smallest_peak", None)})
            continue
        entry = opt.meta["fxmem"][-1]
        seconds = time.perf_counter() - t
        report = fxmem.analyze(opt, spec, optimizer=adamw)
        predicted = report.evaluate(**dims)
        o = adamw(opt.parameters())
        train_step(opt, [tokens], o, default_loss)  # the optimizer's state: a steady-state step
        m = measure(lambda: train_step(opt, [tokens], o, default_loss))
        measured = predicted["train_resident"] + m.peak_above_start
        rows.append({"fraction": frac, "budget": budget, "plan": entry["where"] if entry["status"] == "applied"
                     else "nothing", "predicted_peak": predicted["train_peak"], "measured_peak": measured,
                     "recompute_flops": entry["recompute_flops"], "forward_flops": entry["forward_flops"],
                     "optimize_seconds": round(seconds, 1)})
        modules[frac] = (opt, o)
    times: dict = {f: [] for f in modules}
    for _ in range(args.repeats):  # round-robin: the machine's noise hits every plan alike
        for f, (opt, o) in modules.items():
            t = time.perf_counter()
            train_step(opt, [tokens], o, default_loss)
            times[f].append(time.perf_counter() - t)
    for r in rows:
        if r["fraction"] in times:
            r["step_ms"] = round(1000 * statistics.median(times[r["fraction"]]), 1)
    write(args, rows, base, dims)


def decoder_meta(script: str, args: argparse.Namespace, dims: dict, **more) -> dict:
    """A decoder benchmark's run as its results describe it: the machine, torch, the command, the model."""
    command = (f"python benchmarks/{script} " + " ".join(sys.argv[1:])).strip()
    return {"machine": machine_name(), "torch": torch.__version__, "threads": args.threads, "command": command,
            "model": f"Decoder(layers={args.layers}, dim={args.dim}, heads={args.heads})", "dims": dims, **more}


def save_json(args: argparse.Namespace, results: dict) -> None:
    """``results`` to ``--out``.json."""
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)


def write(args: argparse.Namespace, rows: list, base: int, dims: dict) -> None:
    meta = decoder_meta("recompute.py", args, dims, original_train_peak=base, optimizer="AdamW")
    save_json(args, {"meta": meta, "rows": rows})
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    plain = next((r for r in rows if r.get("plan") == "nothing"), None)
    lines = ["# Fitting a budget by recomputation (cpu)", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; {args.threads} thread(s); command: "
             f"`{meta['command']}`. {meta['model']}, AdamW, B={dims['B']}, L={dims['L']}; the original training "
             f"step's peak is {mib(base)} (fxmem). Peaks are absolute (parameters, gradients, AdamW state, "
             f"activations); measured = resident + the CPU allocator's peak above start on a real steady-state "
             f"step. FLOPs: recomputed in backward, as a share of the forward's (products as "
             f"torch.utils.flop_counter counts them, other ops one per element). Time: median of "
             f"{args.repeats} training steps, round-robin over the plans in one process.", "",
             "| budget | plan | predicted peak | measured peak | recomputed FLOPs | step time |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        head = f"{r['fraction']:.0%} = {mib(r['budget'])}"
        if r.get("plan") is None:
            lines.append(f"| {head} | none fits: smallest peak {mib(r['smallest_peak'] or 0)} | | | | |")
            continue
        share = 100 * r["recompute_flops"] / r["forward_flops"] if r["forward_flops"] else 0
        slower = f" ({r['step_ms'] / plain['step_ms']:.2f}x)" if plain and plain.get("step_ms") else ""
        lines.append(f"| {head} | {r['plan']} | {mib(r['predicted_peak'])} | {mib(r['measured_peak'])} | "
                     f"{share:.1f}% | {r.get('step_ms', '-')} ms{slower} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
