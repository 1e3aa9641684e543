"""fxmem's CUDA predictions against a real GPU, for every model of tests/ and examples/ and the corpus.

For each model: ``fxmem.validate(..., device="cuda", optimizer=AdamW)`` at sizes the analysis did
not see - forward (peak above resident, retained) and a steady-state AdamW step (peak above
resident, retained, optimizer state), predicted vs ``torch.cuda.max_memory_allocated`` after a
warm-up (so cuBLAS's workspaces already exist), in bytes. Then seed 002's attention as the blog
measured it (the original forward, eager, B=64, L=32): every MiB of its ``max_memory_allocated``.

    python benchmarks/gpu_validate.py                  # needs a CUDA GPU; writes benchmarks/results/validate_cuda.{json,md}
    python benchmarks/gpu_validate.py --only seed      # models whose name contains "seed"
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples"), str(ROOT)]


def _models() -> list[tuple[str, object, tuple, dict, dict]]:
    """(name, factory, specs, dims, makers) for every model validated."""
    import torch

    import fxmem
    from zoo.cases import CASES
    from corpus.models import CORPUS

    out = []
    for name, (factory, specs, sizes, kw) in sorted(CASES.items()):
        out.append((name, factory, specs, sizes[0], kw.get("makers", {})))
    gat = __import__("seed_gat")
    attention = __import__("seed_attention")
    out.append(("example seed_gat GraphAttentionLayer B=4 N=500", lambda: gat.GraphAttentionLayer(6, 128),
                (("B", "N", 6), ("B", "N", "N")), dict(B=4, N=500), {}))
    out.append(("example seed_gat GraphAttentionLayerFixed B=4 N=500", lambda: gat.GraphAttentionLayerFixed(6, 128),
                (("B", "N", 6), ("B", "N", "N")), dict(B=4, N=500), {}))
    out.append(("example seed_attention B=64 L=32", lambda: attention.Attention(512, 8), (("B", "L", 512),),
                dict(B=64, L=32), {}))
    llama = __import__("llama")
    out.append(("example llama TINY B=4 L=64", lambda: llama.Llama(llama.TINY),
                (fxmem.TensorSpec(("B", "L"), dtype=torch.int64),), dict(B=4, L=64), {}))
    for name, entry in sorted(CORPUS.items()):
        if entry.available() and entry.data is None:
            out.append((f"corpus {name}", entry.build, entry.specs, entry.sizes[0], entry.makers))
    return out


def _inputs(report, dims: dict, makers: dict, device: str) -> list:
    import torch

    from fxmem.inputs import random_inputs
    torch.manual_seed(0)
    return [x.to(device) for x in random_inputs(report.specs, dims, makers=makers or None)]


def _seed002(out: list) -> dict:
    """Seed 002 as the blog measured it: the original forward (eager) at B=64, L=32, C=512, H=8,
    ``max_memory_allocated`` from an empty device, parameters and input included."""
    import torch

    import fxmem
    attention = __import__("seed_attention")
    torch.manual_seed(0)
    report = fxmem.analyze(attention.Attention(512, 8), ("B", "L", 512), mode="eager", device="cuda")
    ev = report.evaluate(B=64, L=32)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = attention.Attention(512, 8).cuda()
    x = torch.randn(64, 32, 512, device="cuda")
    after_params = torch.cuda.memory_allocated() - base
    warm = model(x)  # cuBLAS allocates its workspace through the caching allocator on first use
    del warm
    after_warmup = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    y = model(x)
    peak = torch.cuda.max_memory_allocated() - base
    retained = torch.cuda.memory_allocated() - base
    del y
    row = {"resident_measured": after_params, "resident_predicted": int(ev["resident"]),
           "cublas_workspace_measured": after_warmup - after_params,
           "peak_measured_from_empty": peak, "peak_predicted_plus_workspace": int(ev["peak"]) + after_warmup - after_params,
           "peak_predicted": int(ev["peak"]), "retained_measured_from_empty": retained,
           "retained_predicted_plus_resident_plus_workspace": int(ev["retained"]) + int(ev["resident"])
           + after_warmup - after_params,
           "formula_peak": str(report.peak)}
    out.append(row)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="validate only models whose name contains this")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for validate_cuda.{json,md}")
    args = p.parse_args()

    import torch

    import fxmem
    if not torch.cuda.is_available():
        sys.exit("gpu_validate.py needs a CUDA GPU")
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    gpu = torch.cuda.get_device_name()
    cpu = subprocess.run("lscpu | sed -n 's/^Model name: *//p'", shell=True, capture_output=True,
                         text=True).stdout.strip()
    results = []
    for name, factory, specs, dims, makers in _models():
        if args.only not in name:
            continue
        t0 = time.perf_counter()
        try:
            torch.manual_seed(0)
            model = factory().train()
            report = fxmem.analyze(model, *specs, device="cuda")
            xs = _inputs(report, dims, makers, "cuda")
            v = fxmem.validate(model, *specs, dims=dims, device="cuda", inputs=xs, optimizer=adamw)
            row = {**v.to_dict(), "model": name, "class": v.model, "exact": all(r.diff == 0 for r in v.rows),
                   "report_exact": report.exact, "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as exc:  # a refusal or a failure is a row too
            row = {"model": name, "dims": dims, "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                   "trace": traceback.format_exc()[-1500:], "seconds": round(time.perf_counter() - t0, 2)}
        print(json.dumps({k: row[k] for k in row if k not in ("trace",)}), flush=True)
        results.append(row)
    seed = []
    if "seed" in args.only or not args.only:
        try:
            print(json.dumps(_seed002(seed)), flush=True)
        except Exception as exc:
            seed.append({"error": f"{type(exc).__name__}: {exc}"})
    meta = {"gpu": gpu, "cpu": cpu, "torch": torch.__version__, "python": platform.python_version(),
            "command": "python benchmarks/gpu_validate.py" + (f" --only {args.only}" if args.only else ""),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate_cuda.json").write_text(json.dumps({"meta": meta, "models": results, "seed002": seed}, indent=1))
    lines = [f"# fxmem.validate on {gpu}", "", f"torch {torch.__version__}, Python {platform.python_version()}, "
             f"host CPU {cpu}; command: `{meta['command']}`", "",
             "Each row: predicted vs measured bytes (measured minus predicted in the diff columns), forward and a "
             "steady-state AdamW step, after a warm-up, at sizes the analysis did not see.", "",
             "| model | dims | fwd peak diff | fwd retained diff | step peak diff | step retained diff | state diff | exact |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['dims']} | {r['error'][:120]} | | | | | refused |")
            continue
        d = [x["diff"] for x in r["rows"]]
        lines.append(f"| {r['model']} | {r['dims']} | " + " | ".join(f"{x:,}" for x in d[:5])
                     + f" | {'yes' if r['exact'] else 'no'} |")
    exact = sum(1 for r in results if r.get("exact"))
    lines += ["", f"{exact} of {len(results)} models exact in every row."]
    if seed and "error" not in seed[0]:
        s = seed[0]
        lines += ["", "## Seed 002's attention as the blog measured it (original forward, B=64, L=32)", "",
                  f"* parameters + input: measured {s['resident_measured']:,} B, predicted {s['resident_predicted']:,} B",
                  f"* cuBLAS workspace (allocated by the first matmul through the caching allocator): "
                  f"{s['cublas_workspace_measured']:,} B",
                  f"* max_memory_allocated from an empty device: {s['peak_measured_from_empty']:,} B; fxmem's peak "
                  f"{s['peak_predicted']:,} B + the workspace = {s['peak_predicted_plus_workspace']:,} B"]
    (out / "validate_cuda.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
