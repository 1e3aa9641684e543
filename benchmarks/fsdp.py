"""fxmem's per-rank figures for FSDP2, beside torch's ``FSDPMemTracker`` and the allocator, on one real run.

A small decoder (sizes that divide by no world size) trains with FSDP2 (``fully_shard`` per block
and on the root) and AdamW on ``W`` gloo processes on CPU. On every rank, after two warm-up steps:
the allocator measures one steady-state step (``fxmem.measure``: resident bytes + peak above them),
then ``FSDPMemTracker`` tracks the next step (its "peak" snapshot, total over its categories).
fxmem's figure is the analysis of that rank (``world_size=W, rank=r``, one process, fake process
group): the synchronous schedule, whose bound for asynchronous late frees the report states.

    python benchmarks/fsdp.py            # W = 2 and 4; writes benchmarks/results/fsdp_cpu.{json,md}
    python benchmarks/fsdp.py --quick    # W = 2 only, no files written
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from zoo import distributed as models  # noqa: E402 - the shared model zoo

D, H, V, LAYERS, B, L = 60, 170, 250, 4, 4, 32


def Decoder() -> nn.Module:
    """The tests' decoder (tests/zoo/distributed.py) at this benchmark's sizes; a module-level
    factory, so the spawned gloo processes build it too."""
    return models.Decoder(LAYERS, D, H, V)


fsdp = models.fsdp  # fully_shard per block and on the root


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def tracker_probe(model, inputs, opt, loss):
    """FSDPMemTracker over one more steady-state step of this rank."""
    from fxmem import _torch_compat as tc
    from fxmem.training import train_step

    tracker = tc.fsdp_mem_tracker()(model, opt)
    tracker.track_inputs(inputs)
    with tracker:
        train_step(model, inputs, opt, loss)
    peak = tracker.get_tracker_snapshot("peak")
    return {"tracker_peak": int(sum(v for dev, snap in peak.items() for k, v in snap.items() if k == "Total"))}


def run(world_size: int) -> list[dict]:
    import fxmem
    from fxmem.distributed.parallel import late_bytes
    from fxmem.distributed.real_runs import measure_ranks

    torch.manual_seed(0)
    x = torch.randn(B, L, D)
    ranks = measure_ranks(Decoder, (x,), fsdp, world_size, adamw, probe=tracker_probe)
    rows = []
    for r in ranks:
        t = time.perf_counter()
        report = fxmem.analyze(Decoder(), ("B", "L", D), optimizer=adamw, world_size=world_size, parallelize=fsdp,
                               rank=r.rank)
        seconds = time.perf_counter() - t
        e = report.evaluate(B=B, L=L)
        gathers = [int(s.bytes) for s in report.storages if s.name.startswith("all-gather ")]
        reduces = [int(s.bytes) for s in report.storages if s.name.startswith("reduce-scatter ")]
        rows.append(dict(world_size=world_size, rank=r.rank, allocator_peak=r.resident + r.peak_above_start,
                         allocator_retained=r.retained, state_storages=r.extra["state_storages"],
                         tracker_peak=r.extra["tracker_peak"], fxmem_peak=e["train_peak"],
                         fxmem_resident=e["train_resident"], fxmem_seconds=round(seconds, 2),
                         late_bound=late_bytes(gathers, reduces)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="W = 2 only; no files written")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for w in ((2,) if args.quick else (2, 4)) for row in run(w)]
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), platform.processor())
    head = (f"# FSDP2 per rank: fxmem vs FSDPMemTracker vs the allocator\n\ncommand: `python benchmarks/fsdp.py`; "
            f"CPU: {cpu}; torch {torch.__version__}; gloo, 1 thread per rank; decoder D={D}, hidden={H}, vocab={V}, "
            f"{LAYERS} blocks, B={B}, L={L}, AdamW\n\n"
            "allocator peak = resident after two steps + the third step's peak above it (bytes; late frees of "
            "gloo's asynchronous collectives included); fxmem = the synchronous schedule, + late bound = the most "
            "the report says asynchronous collectives can add.\n\n")
    cols = ("world_size", "rank", "allocator_peak", "fxmem_peak", "late_bound", "tracker_peak", "state_storages",
            "fxmem_resident", "allocator_retained", "fxmem_seconds")
    table = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + "".join(
        "| " + " | ".join(f"{row[c]:,}" if isinstance(row[c], int) else str(row[c]) for c in cols) + " |\n"
        for row in rows)
    print(head + table)
    if not args.quick:
        out = os.path.join(HERE, "results")
        with open(os.path.join(out, "fsdp_cpu.json"), "w") as f:
            json.dump(dict(cpu=cpu, torch=torch.__version__, rows=rows), f, indent=1)
        with open(os.path.join(out, "fsdp_cpu.md"), "w") as f:
            f.write(head + table)


if __name__ == "__main__":
    main()
