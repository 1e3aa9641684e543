"""How long a serving question takes: ``fxmem.generation`` on the Llama-2-7B configuration (meta device,
no weights), with a number of new tokens (one decode step simulated per token) and with
``new_tokens="T"`` (formulas in the number of tokens from three short analyses), issue 22.

    python benchmarks/serve_speed.py            # writes benchmarks/results/serve_speed.{json,md}
    python benchmarks/serve_speed.py --help     # this text; runs nothing

Timed in one process: ``generation(new_tokens=n)`` for two numbers of tokens (their difference over
the tokens between is the cost of one decode step), building ``generation(new_tokens="T")``, and
answering with it: the peak at B=8, P=128, T=64 and the largest batch at P=128, T=64 in 80 GiB
(where the batch search passes a bound of the formulas' region, they are re-analysed near the sizes
asked: about one more build). Results carry the CPU model (lscpu), torch version, threads and the
command.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4,8", help="two numbers of new tokens analysed one step at a time")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fxmem
    from llm_speed import cpu_model

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                         eos_token_id=2, pad_token_id=0, bos_token_id=1)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    fxmem.analyze(torch.nn.Linear(4, 4), ("B", 4))  # warm-up: imports and first-use caches
    rows: dict = {}
    few, more = (int(x) for x in args.tokens.split(","))
    for n in (few, more):
        start = time.perf_counter()
        report = fxmem.generation(model, ("B", "P"), new_tokens=n)
        rows[f"generation(new_tokens={n}) (s)"] = round(time.perf_counter() - start, 1)
        print(rows, flush=True)
    step = (rows[f"generation(new_tokens={more}) (s)"] - rows[f"generation(new_tokens={few}) (s)"]) / (more - few)
    rows["one decode step, from the two (s)"] = round(step, 2)
    start = time.perf_counter()
    formulas = fxmem.generation(model, ("B", "P"), new_tokens="T")
    rows['building generation(new_tokens="T") (s)'] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    peak = formulas.evaluate(B=8, P=128, T=64)["peak"]
    batch = formulas.max_size("B", "80GiB", P=128, T=64)
    rows["peak at B=8, P=128, T=64 and largest batch in 80 GiB (s)"] = round(time.perf_counter() - start, 2)
    rows["peak at B=8, P=128, T=64"] = fxmem.format_bytes(peak)
    rows["largest batch at P=128, T=64 in 80 GiB"] = batch
    rows["re-analyses near the sizes asked (3 short analyses each)"] = formulas.reanalyses
    print(rows, flush=True)
    meta = {"machine": f"{cpu_model()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "threads": torch.get_num_threads(), "command": "python benchmarks/serve_speed.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d")}
    if args.no_write:
        return
    out = HERE / "results"
    (out / "serve_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Serving questions on the Llama-2-7B configuration: how long they take", "",
             f"Machine: {meta['machine']} (shared), {meta['threads']} threads; torch {meta['torch']}; {meta['date']}. "
             f"Command: `{meta['command']}`. One run each, in one process.", "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows.items()]
    (out / "serve_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
