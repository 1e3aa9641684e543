"""How long a serving question takes, and how many analyses it makes (issue 45, item 3): the command

    fxmem llm benchmarks/llm_configs/llama3_8b.json --batch 1 --serve --prompt 4096 --new-tokens 128 \
        --dtype bfloat16 --gpu 80GiB

(Llama-3-8B on the meta device, no weights), run as a subprocess and timed end to end; its progress
lines are kept and counted: each ``simulating ... on fake tensors`` line is one simulation of
generate() (an analysis is the calls of 3, 4 and 5 new tokens at one set of sizes, three simulations).

    python benchmarks/serve_speed.py            # writes benchmarks/results/serve_speed.{json,md}
    python benchmarks/serve_speed.py --help     # this text; runs nothing

Results carry the CPU model (lscpu), core count, torch and transformers versions, and the command.
The goal (issue 45): at most two analyses and at most 60 s on a 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ARGS = ["llm", str(HERE / "llm_configs" / "llama3_8b.json"), "--batch", "1", "--serve", "--prompt", "4096",
        "--new-tokens", "128", "--dtype", "bfloat16", "--gpu", "80GiB"]


def run(args: list, timeout: int) -> dict:
    """The command's wall time (s), its answer (stdout), its progress lines and their counts."""
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "fxmem", *args], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=HERE.parent)
        stdout, stderr, code = out.stdout, out.stderr, out.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, code = exc.stdout or "", exc.stderr or "", f"timed out after {timeout} s"
        stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
    progress = [line for line in stderr.splitlines() if line.startswith("fxmem: [")]
    return {"seconds": round(time.perf_counter() - start, 1), "exit": code, "answer": stdout.strip(),
            "simulations": sum("simulating" in line for line in progress),
            "analyses": _analyses(progress),
            "progress": progress}


def _analyses(progress: list) -> int:
    """Analyses that simulated: an "analysing/re-analysing generate()" line followed by a simulation
    (one answered by another piece of a recording costs no simulation)."""
    count, opened = 0, False
    for line in progress:
        if re.search(r"(re-)?analysing generate\(\) for", line):
            opened = True
        elif "simulating" in line and opened:
            count, opened = count + 1, False
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=int, default=900, help="seconds before the command is stopped")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    import torch
    import transformers

    from llm_speed import cpu_model

    result = run(ARGS, args.timeout)
    print(json.dumps({k: v for k, v in result.items()}, indent=1), flush=True)
    meta = {"machine": f"{cpu_model()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "command": "python -m fxmem " + " ".join(a.replace(str(HERE.parent) + "/", "") for a in ARGS),
            "date": time.strftime("%Y-%m-%d")}
    if args.no_write:
        return
    out = HERE / "results"
    (out / "serve_speed.json").write_text(json.dumps({"meta": meta, "result": result}, indent=1) + "\n")
    lines = ["# A serving question on the Llama-3-8B configuration: how long it takes", "",
             f"Machine: {meta['machine']} (shared), {meta['threads']} threads; torch {meta['torch']}, transformers "
             f"{meta['transformers']}; {meta['date']}. Command: `{meta['command']}` (timed end to end, one run).", "",
             "| measure | value |", "|---|---|",
             f"| wall time (s) | {result['seconds']} |", f"| exit | {result['exit']} |",
             f"| analyses (3 simulations each: 3, 4, 5 new tokens) | {result['analyses']} |",
             f"| simulations of generate() | {result['simulations']} |", "", "Answer:", "", "```",
             result["answer"], "```", "", "Progress:", "", "```", *result["progress"], "```"]
    (out / "serve_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
