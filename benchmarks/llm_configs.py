"""``fxmem llm`` on published model configs: the answers a user gets and how long each takes.

    python benchmarks/llm_configs.py                  # every config, results written
    python benchmarks/llm_configs.py --only llama3_8b,gemma2_9b --no-write
    python benchmarks/llm_configs.py --help           # this text; runs nothing

Each config in ``benchmarks/llm_configs/`` (the published ``config.json`` values of Llama-3-8B,
Llama-3-70B, Mistral-7B-v0.1, Qwen2.5-7B, Gemma-2-9B, Phi-3-mini-4k and Mixtral-8x7B) is asked
two questions through the CLI, each a fresh process timed from start to answer (the model is
built on the meta device: no weights):

* training: ``fxmem llm CFG --batch 1 --seq 4096 --train adamw --recipe R --gpu 80GiB`` for the
  recipes in ``--recipes`` (default ``bf16`` and ``amp-bf16``: pure bfloat16, and bfloat16
  autocast over float32 master weights and AdamW state);
* serving: ``fxmem llm CFG --serve --batch 1 --prompt 4096 --new-tokens 128 --dtype bfloat16
  --gpu 80GiB``.

Next to each training row: accelerate's ``estimate_training_usage`` for the same parameter count
(what ``accelerate estimate-memory`` prints as "Training using Adam") and DeepSpeed's ZeRO-2 and
ZeRO-3 model-state estimators (one GPU, no offload): model states only, from the parameter count;
absent where the package is not installed. ``--estimators-only`` recomputes those columns of the
written results without running fxmem. Results go to
``benchmarks/results/llm_configs.{json,md}`` with the CPU model, torch version and the command.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from llm_speed import cpu_model  # lscpu's model name, as every benchmark prints it

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "llm_configs"
NAMES = {"llama3_8b": "Llama-3-8B", "llama3_70b": "Llama-3-70B", "mistral_7b": "Mistral-7B-v0.1",
         "qwen2_5_7b": "Qwen2.5-7B", "gemma2_9b": "Gemma-2-9B", "phi3_mini": "Phi-3-mini-4k",
         "mixtral_8x7b": "Mixtral-8x7B"}
# parameter counts the model cards publish (rounded as they print them), to check the models built
PUBLISHED = {"llama3_8b": "8.03B", "llama3_70b": "70.6B", "mistral_7b": "7.24B", "qwen2_5_7b": "7.62B",
             "gemma2_9b": "9.24B", "phi3_mini": "3.82B", "mixtral_8x7b": "46.7B"}


def run(args: list[str], timeout: int) -> tuple[float, str, int]:
    """(seconds, stdout, exit code) of ``python -m fxmem`` with ``args``, a fresh process."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "fxmem", *args], capture_output=True, text=True, timeout=timeout,
                              cwd=HERE.parent)
        return time.perf_counter() - start, done.stdout + done.stderr[-2000:] * (done.returncode != 0), done.returncode
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, f"(no answer in {timeout} s)", -1


def field(text: str, label: str) -> str:
    """The value after ``label`` on its line of the CLI's answer ('' where absent)."""
    m = re.search(rf"^\s*{re.escape(label)}\s+(.+?)(?:\s\s|$)", text, re.M)
    return m.group(1).strip() if m else ""


def estimates(name: str, parameters: int) -> dict:
    """What the estimators people use say for config ``name`` (bytes, one GPU; absent where a
    package is missing): accelerate's "Training using Adam" in float32 and bfloat16, DeepSpeed's
    ZeRO-2 and ZeRO-3 model states (no offload). They count model states from the parameter
    count (ZeRO-3 also from the largest layer), not activations."""
    out: dict = {}
    try:
        from accelerate.commands.estimate import estimate_training_usage

        for dt, size in (("float32", 4), ("bfloat16", 2)):
            out[f"accelerate {dt}"] = max(estimate_training_usage(parameters * size, dt).values())
    except ImportError:
        pass
    try:
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        import fxmem

        model = fxmem.from_config(str(CONFIGS / f"{name}.json"))
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        out["DeepSpeed ZeRO-2"] = estimate_zero2_model_states_mem_needs(parameters, num_gpus_per_node=1,
                                                                         cpu_offload=False)[1]
        out["DeepSpeed ZeRO-3"] = estimate_zero3_model_states_mem_needs(parameters, largest, num_gpus_per_node=1,
                                                                         cpu_offload=False, cpu_offload_params=False)[1]
    except ImportError:
        pass
    return {k: f"{v / 2**30:.2f} GiB" for k, v in out.items()}


ESTIMATORS = ("accelerate float32", "accelerate bfloat16", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated config names (default: all)")
    parser.add_argument("--recipes", default="bf16,amp-bf16", help="training recipes (comma-separated)")
    parser.add_argument("--no-serve", action="store_true", help="training rows only")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per question")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    parser.add_argument("--estimators-only", action="store_true",
                        help="recompute the estimators' columns of the written results (no fxmem runs)")
    args = parser.parse_args()
    import torch
    import transformers

    names = args.only.split(",") if args.only else list(NAMES)
    rows = []
    if args.estimators_only:
        saved = json.loads((HERE / "results" / "llm_configs.json").read_text())
        by_name = {v: k for k, v in NAMES.items()}
        for r in saved["rows"]:
            if r.get("parameters"):
                r.update(estimates(by_name[r["config"]], r["parameters"]))
        write(saved["meta"], saved["rows"])
        return
    for name in names:
        cfg = str(CONFIGS / f"{name}.json")
        for recipe in args.recipes.split(","):
            seconds, out, rc = run(["llm", cfg, "--batch", "1", "--seq", "4096", "--train", "adamw", "--recipe", recipe,
                                    "--gpu", "80GiB"], args.timeout)
            params = re.search(r": ([\d,]+) parameters", out)
            count = int(params.group(1).replace(",", "")) if params else None
            row = dict(config=NAMES[name], question=f"training, {recipe}", seconds=round(seconds, 1), rc=rc,
                       parameters=count, published=PUBLISHED[name], model_states=field(out, "model states"),
                       peak=field(out, "training step peak"), largest_batch=field(out, "largest batch"),
                       largest_seq=field(out, "largest sequence length"),
                       **(estimates(name, count) if count else {}))
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not args.no_serve:
            seconds, out, rc = run(["llm", cfg, "--serve", "--batch", "1", "--prompt", "4096", "--new-tokens", "128",
                                    "--dtype", "bfloat16", "--gpu", "80GiB"], args.timeout)
            row = dict(config=NAMES[name], question="serving, 128 new tokens", seconds=round(seconds, 1), rc=rc,
                       peak=field(out, "peak"), kv_cache=field(out, "KV cache at the end"),
                       largest_batch=field(out, "largest batch"), largest_prompt=field(out, "largest prompt"))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.no_write:
        return
    write(dict(cpu=cpu_model(), cores=__import__("os").cpu_count(), torch=torch.__version__,
               transformers=transformers.__version__, date=time.strftime("%Y-%m-%d"),
               command="python benchmarks/llm_configs.py " + " ".join(sys.argv[1:])), rows)


def write(meta: dict, rows: list) -> None:
    """The results, as JSON and as a table."""
    results = HERE / "results"
    (results / "llm_configs.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    lines = ["# `fxmem llm` on published configs: answers and times", "",
             f"Machine: {meta['cpu']}, {meta['cores']} cores (shared); torch {meta['torch']}, transformers "
             f"{meta['transformers']}; {meta['date']}. Command: `{meta['command']}`. Each row is one fresh process "
             f"(start to answer), batch 1, sequence or prompt 4096, 80 GiB; the CPU's allocator (see the notes the "
             f"CLI prints). The estimators count model states for one GPU from the parameter count (accelerate's "
             f"\"Training using Adam\" in float32 / bfloat16; DeepSpeed's ZeRO-2 / ZeRO-3 without offload): fxmem's "
             f"model states are its `model states`, its peak adds the step's activations and temporaries.", "",
             "| config | question | s | parameters (published) | model states | peak | largest batch | largest length "
             "| KV cache | accelerate fp32 / bf16 | DeepSpeed ZeRO-2 / ZeRO-3 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        params = f"{r['parameters']:,} ({r['published']})" if r.get("parameters") else ""
        acc = " / ".join(r[k] for k in ESTIMATORS[:2] if k in r)
        ds = " / ".join(r[k] for k in ESTIMATORS[2:] if k in r)
        lines.append(f"| {r['config']} | {r['question']} | {r['seconds']} | {params} | {r.get('model_states', '')} | "
                     f"{r['peak']} | {r['largest_batch']} | {r.get('largest_seq') or r.get('largest_prompt', '')} | "
                     f"{r.get('kv_cache', '')} | {acc} | {ds} |")
    (results / "llm_configs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
