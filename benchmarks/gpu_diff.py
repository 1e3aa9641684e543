"""Where a CUDA prediction and a real GPU run part: the allocator's own events next to fxmem's storages.

For one model of ``benchmarks/gpu_validate.py``: records the caching allocator's history
(``torch.cuda.memory._record_memory_history``) during a warmed-up forward and a steady-state AdamW
step, and prints every allocation (size, the aten op and Python line that made it) next to the
storages fxmem predicts, so that each byte of a difference is named.

    python benchmarks/gpu_diff.py --only seed002-attention    # needs a CUDA GPU
"""
from __future__ import annotations

import argparse
import collections
import copy
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "examples"), str(ROOT)]


def _allocs(snapshot: dict) -> list[tuple[int, str]]:
    out = []
    for trace in snapshot["device_traces"]:
        for ev in trace:
            if ev["action"] == "alloc":
                frames = [f for f in ev.get("frames", []) if "/torch/" not in f["filename"] and "unwind" not in f["name"]
                          and "Caching" not in f["name"] and "gather" not in f["name"] and "malloc" not in f["name"]]
                where = "; ".join(f"{pathlib.Path(f['filename']).name}:{f['line']}:{f['name'][:80]}" for f in frames[:5])
                out.append((ev["size"], where))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", required=True, help="models whose name contains this (see gpu_validate.py)")
    p.add_argument("--stacks", default="python", choices=["python", "all"], help="frames recorded (all: C++ too)")
    args = p.parse_args()
    import torch

    import fxmem
    from fxmem.accounting import cuda_block_bytes
    from fxmem.capture import trace
    from fxmem.records import Phase
    from fxmem.training import default_loss, train_step
    from gpu_validate import _inputs, _models
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    for name, factory, specs, dims, makers in _models():
        if args.only not in name:
            continue
        torch.manual_seed(0)
        model = factory().train()
        fwd = fxmem.analyze(model, *specs, device="cuda")
        step = fxmem.analyze(model, *specs, device="cuda", optimizer=adamw)
        xs = _inputs(fwd, dims, makers, "cuda")
        real = copy.deepcopy(model).cuda()
        module = trace(real) if fwd.mode == "graph" else real
        opt = adamw(real.parameters())
        for _ in range(2):
            train_step(module, xs, opt, default_loss)
            module(*xs)
        torch.cuda.synchronize()
        for what, fn, report in (("forward", lambda: module(*xs), fwd),
                                 ("training step", lambda: train_step(module, xs, opt, default_loss), step)):
            torch.cuda.memory._record_memory_history(max_entries=100000, stacks=args.stacks)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            del out
            ev = report.evaluate(**dims)
            here = report._at(dims, check=True)[0]  # the analysis whose formulas hold at dims
            key = "peak_above_resident" if what == "forward" else None
            pred = ev[key] if key else ev["train_peak"] - ev["train_resident"]
            print(f"\n=== {name} · {what} · measured peak {peak:,} · predicted {pred:,} · diff {peak - pred:,}")
            real_sizes = collections.Counter(s for s, _ in _allocs(snap))
            predicted = collections.Counter()
            for s in here.storages:
                if s.step is None or (what == "forward" and s.phase != Phase.FORWARD):
                    continue  # made before the run (parameters, inputs, optimizer state), or not in a forward
                predicted[cuda_block_bytes(int(here.at(s.bytes, **dims)))] += 1
            extra = real_sizes - predicted
            missing = predicted - real_sizes
            print(f"real allocations: {sum(real_sizes.values())}, predicted storages: {sum(predicted.values())}")
            print("real, not predicted (size: count):", dict(extra))
            print("predicted, not real (size: count):", dict(missing))
            for size, where in _allocs(snap):
                if extra.get(size):
                    print(f"  {size:>10,}  {where}")


if __name__ == "__main__":
    main()
