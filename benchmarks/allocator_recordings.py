"""Record the CUDA caching allocator on a GPU, for the replay's tests (needs a CUDA GPU).

For each model of ``benchmarks/gpu_validate.py`` (``--only`` picks some), in a fresh process: the
model moved with ``.to("cuda")``, its inputs, two forwards and three AdamW steps, with
``torch.cuda.memory._record_memory_history`` on. Writes one JSON per model to
``tests/accounting/allocator_recordings/``: every request and free in order (``alloc`` events carry
the requested bytes), the peaks of ``memory_stats`` (``allocated_bytes.all.peak``,
``reserved_bytes.all.peak``) and the segments' sizes. ``tests/accounting/test_caching_allocator.py``
replays each through :mod:`fxmem.accounting.caching_allocator` and asks for the same segments and
peaks, byte for byte; ``--predict`` also prints fxmem's ``reserved`` / ``train_reserved`` next to them.

    python benchmarks/allocator_recordings.py                 # every model, one process each
    python benchmarks/allocator_recordings.py --only seed     # models whose name contains "seed"
    PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64 python benchmarks/allocator_recordings.py --suffix split64

The allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) are recorded with each run and replayed with it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests/accounting/allocator_recordings"
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "examples"), str(ROOT)]


def _events(snapshot: dict) -> list:
    """The trace's requests and frees in order, as ``(action, address, bytes)``."""
    out = []
    for trace in snapshot["device_traces"]:
        for ev in trace:
            if ev["action"] == "alloc":
                out.append(("alloc", ev["addr"], ev["size"]))
            elif ev["action"] == "free_completed":
                out.append(("free", ev["addr"], ev["size"]))
    return out


def record(name: str, predict: bool) -> dict:
    """One model's recording (run in a process of its own: the allocator starts empty)."""
    import torch

    import fxmem
    from gpu_validate import _inputs, _models
    from fxmem._torch_compat import cuda_memory_history
    (_, factory, specs, dims, makers), = [m for m in _models() if m[0] == name]
    report = fxmem.analyze(factory(), *specs, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), device="cuda")
    torch.manual_seed(0)
    with cuda_memory_history(stacks="python") as take:
        model = factory().to("cuda")
        inputs = _inputs(report, dims, makers, "cuda")
        for _ in range(2):
            with torch.no_grad():
                model(*inputs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            out = model(*inputs)
            (out if isinstance(out, torch.Tensor) else out[0]).float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
        torch.cuda.synchronize()
        snapshot = take()
    stats = torch.cuda.memory_stats()
    rec = {"model": name, "dims": dims, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "events": _events(snapshot), "max_allocated": stats["allocated_bytes.all.peak"],
           "max_reserved": stats["reserved_bytes.all.peak"],
           "segment_sizes": [s["total_size"] for s in snapshot["segments"]]}
    if predict:
        ev = report.evaluate(**dims)
        rec["fxmem"] = {"reserved": ev.get("reserved"), "train_reserved": ev.get("train_reserved")}
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="models whose name contains this")
    p.add_argument("--predict", action="store_true", help="also print fxmem's reserved memory next to the recording")
    p.add_argument("--suffix", default="", help="added to each recording's file name (another allocator setting)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: record this model
    args = p.parse_args()
    if args.one:
        print(json.dumps(record(args.one, args.predict)))
        return
    from gpu_validate import _models
    OUT.mkdir(parents=True, exist_ok=True)
    for name, *_ in _models():
        if args.only not in name:
            continue
        cmd = [sys.executable, __file__, "--one", name] + (["--predict"] if args.predict else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-2000:]}")
            continue
        rec = json.loads(done.stdout.strip().splitlines()[-1])
        stem = name.replace(" ", "_") + (f"-{args.suffix}" if args.suffix else "")
        (OUT / f"{stem}.json").write_text(json.dumps(rec))
        print(name, rec["max_reserved"], rec["max_allocated"], rec.get("fxmem", ""))


if __name__ == "__main__":
    main()
