"""fxmem's per-rank figures for FSDP2, tensor parallelism and 2-D meshes, beside torch's
``FSDPMemTracker`` and the allocator, on one real run.

Two decoders train with AdamW on ``W`` gloo processes on CPU: the tests' decoder (sizes that
divide by no world size) with FSDP2 (``fully_shard`` per block and on the root) on 2 and 4
ranks, and the tests' tensor-parallel decoder (whole heads per rank) with Megatron-style tensor
parallelism on 2 ranks, FSDP2 + TP on a 2 x 2 mesh (torchtitan's layout) and HSDP on a 2 x 2 mesh.
On every rank, after two warm-up steps: the allocator measures one steady-state step
(``fxmem.measure``: resident bytes + peak above them), then ``FSDPMemTracker`` tracks the next
step (its "peak" snapshot, total over its categories) where it applies (a model with FSDP2
modules; "n/a" for tensor parallelism alone). The same rank's step is also run for real in one
process with torch's fake process group (``synchronous``: each collective's buffers freed as soon
as the code lets go of them). fxmem's figure is the analysis of that rank (``world_size=W,
rank=r``, ``mesh=``, one process, fake process group): the synchronous schedule; ``late_bound`` is
the most the report says FSDP's asynchronous collectives can add (no bound is stated for tensor
parallelism's all-reduces: "-").

    python benchmarks/fsdp.py            # every layout; writes benchmarks/results/fsdp_cpu.{json,md}
    python benchmarks/fsdp.py --quick    # FSDP2 on W = 2 only, no files written
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


def TPDecoder() -> nn.Module:
    """The tests' tensor-parallel decoder (2 blocks, d=24, whole heads on 2 ranks)."""
    return models.TPDecoder()


TP_D = 24

# (layout, model factory, its input's feature size, parallelize, world size, mesh)
CASES = {
    "fsdp 2": (Decoder, D, models.fsdp, 2, None),
    "fsdp 4": (Decoder, D, models.fsdp, 4, None),
    "tp 2": (TPDecoder, TP_D, models.tp, 2, None),
    "dp 2 x tp 2": (TPDecoder, TP_D, models.fsdp_tp, 4, {"dp": 2, "tp": 2}),
    "hsdp 2 x 2": (TPDecoder, TP_D, models.hsdp, 4, {"replicate": 2, "shard": 2}),
}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def tracker_probe(model, inputs, opt, loss):
    """FSDPMemTracker over one more steady-state step of this rank."""
    from fxmem import _torch_compat as tc
    from fxmem.training import train_step

    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return {"tracker_peak": "n/a"}  # FSDPMemTracker tracks FSDP2 modules only
    tracker = tc.fsdp_mem_tracker()(model, opt)
    tracker.track_inputs(inputs)
    with tracker:
        train_step(model, inputs, opt, loss)
    peak = tracker.get_tracker_snapshot("peak")
    return {"tracker_peak": int(sum(v for dev, snap in peak.items() for k, v in snap.items() if k == "Total"))}


def run(layout: str) -> list[dict]:
    import fxmem
    from fxmem.distributed.parallel import late_bytes
    from fxmem.distributed.real_runs import measure_ranks, measure_synchronous

    make, d, parallelize, world_size, mesh = CASES[layout]
    torch.manual_seed(0)
    x = torch.randn(B, L, d)
    ranks = measure_ranks(make, (x,), parallelize, world_size, adamw, probe=tracker_probe, mesh=mesh)
    rows = []
    for r in ranks:
        sync = measure_synchronous(make, (x,), parallelize, world_size, r.rank, adamw, mesh=mesh)
        t = time.perf_counter()
        report = fxmem.analyze(make(), ("B", "L", d), optimizer=adamw, world_size=world_size, parallelize=parallelize,
                               rank=r.rank, mesh=mesh)
        seconds = time.perf_counter() - t
        e = report.evaluate(B=B, L=L)
        gathers = [int(s.bytes) for s in report.storages if s.name.startswith("all-gather ")]
        reduces = [int(s.bytes) for s in report.storages if s.name.startswith("reduce-scatter ")]
        rows.append(dict(layout=layout, world_size=world_size, rank=r.rank,
                         allocator_peak=r.resident + r.peak_above_start,
                         synchronous_peak=sync.resident + sync.peak_above_start, fxmem_peak=e["train_peak"],
                         late_bound=late_bytes(gathers, reduces) if gathers else "-",
                         tracker_peak=r.extra["tracker_peak"], state_storages=r.extra["state_storages"],
                         fxmem_resident=e["train_resident"], allocator_retained=r.retained,
                         fxmem_seconds=round(seconds, 2)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="FSDP2 on W = 2 only; no files written")
    parser.add_argument("--layouts", nargs="+", choices=list(CASES), default=list(CASES),
                        help="which layouts (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for layout in (["fsdp 2"] if args.quick else args.layouts) for row in run(layout)]
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), platform.processor())
    head = (f"# Many GPUs per rank: fxmem vs FSDPMemTracker vs the allocator\n\ncommand: `python benchmarks/fsdp.py`; "
            f"CPU: {cpu}; torch {torch.__version__}; gloo, 1 thread per rank; B={B}, L={L}, AdamW; FSDP2: the "
            f"decoder D={D}, hidden={H}, vocab={V}, {LAYERS} blocks; tp, dp x tp, hsdp: the tensor-parallel decoder "
            f"(2 blocks, d={TP_D}, hidden 48, vocab {models.V})\n\n"
            "allocator peak = resident after two steps + the third step's peak above it on gloo (bytes; late frees of "
            "its asynchronous collectives included); synchronous = the same rank's real step in torch's fake process "
            "group (every collective's buffers freed as soon as the code lets go of them); fxmem = the synchronous "
            "schedule, late bound = the most the report says FSDP's asynchronous collectives can add (none stated for "
            "tensor parallelism's all-reduces: -); tracker = FSDPMemTracker's peak (n/a: no FSDP2 module).\n\n")
    cols = ("layout", "world_size", "rank", "allocator_peak", "synchronous_peak", "fxmem_peak", "late_bound",
            "tracker_peak", "state_storages", "fxmem_resident", "allocator_retained", "fxmem_seconds")
    table = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + "".join(
        "| " + " | ".join(f"{row[c]:,}" if isinstance(row[c], int) else str(row[c]) for c in cols) + " |\n"
        for row in rows)
    print(head + table)
    if not args.quick and args.layouts == list(CASES):  # the committed table has every layout
        out = os.path.join(HERE, "results")
        with open(os.path.join(out, "fsdp_cpu.json"), "w") as f:
            json.dump(dict(cpu=cpu, torch=torch.__version__, rows=rows), f, indent=1)
        with open(os.path.join(out, "fsdp_cpu.md"), "w") as f:
            f.write(head + table)


if __name__ == "__main__":
    main()
