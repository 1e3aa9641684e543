"""fxmem's answer for a Llama training step next to what ``accelerate estimate-memory`` and
DeepSpeed's ZeRO estimators say for the same model (issue 22's evidence).

    python benchmarks/llm_estimators.py            # every row, results written
    python benchmarks/llm_estimators.py --help     # this text; runs nothing

The estimators count model states only (parameters, gradients, optimizer state; DeepSpeed adds a
buffer factor), from the parameter count; fxmem simulates the step (activations, temporaries,
the moment each is freed). Two models, both ``transformers.LlamaForCausalLM`` from a config:

* ``tiny``: 2 layers, hidden size 64, random weights, float32, AdamW - the real step runs on this
  CPU and the allocator's peak (resident + peak above it, after one warm-up step) is the reference;
* ``7b``: the Llama-2-7B configuration on the meta device (no weights), the mixed-precision step
  the estimators assume (float32 master weights and AdamW state, the forward under bfloat16
  autocast), at sequence length 4096: no real run (no GPU here), fxmem's formula evaluated.

The estimators' calls: accelerate's ``estimate_training_usage(total_size, dtype)`` on
``calculate_maximum_sizes(model)`` (what ``accelerate estimate-memory`` prints as "Training using
Adam"); DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` (one GPU, no offload: their per-GPU bytes). Each is
skipped, with a note, where its package is missing.

Results go to ``benchmarks/results/llm_estimators.{json,md}`` with the CPU model, torch version
and the command.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512)
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)


def llama(config: dict, meta: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(**config))
    return LlamaForCausalLM(LlamaConfig(**config))


def estimators(model, world_size: int = 1) -> dict:
    """What accelerate and DeepSpeed say for ``model`` (bytes per GPU; None where a package is
    missing; accelerate has no multi-GPU estimate)."""
    out: dict = {}
    n = sum(p.numel() for p in model.parameters())
    try:
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes

        total, largest = calculate_maximum_sizes(model)
        largest_params = largest[0] // 4
        if world_size > 1:
            raise ImportError
        out["accelerate, float32 (Training using Adam)"] = max(estimate_training_usage(total, "float32").values())
        out["accelerate, bfloat16 (Training using Adam)"] = max(estimate_training_usage(total, "bfloat16").values())
    except ImportError:
        largest_params = max(p.numel() for p in model.parameters())
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        out["DeepSpeed ZeRO-2 (no offload)"] = estimate_zero2_model_states_mem_needs(
            n, num_gpus_per_node=world_size, cpu_offload=False)[1]
        out["DeepSpeed ZeRO-3 (no offload)"] = estimate_zero3_model_states_mem_needs(
            n, largest_params, num_gpus_per_node=world_size, cpu_offload=False, cpu_offload_params=False)[1]
    except ImportError:
        pass
    return out


def tiny_row(batch: int, seq: int) -> dict:
    """fxmem's step peak, the real one on this CPU, and the estimators', for the tiny model."""
    import torch

    from fxmem.llm import OPTIMIZERS, llm_answer, training_module
    from fxmem.measure import measure
    from fxmem.training import train_step

    start = time.perf_counter()
    answer = llm_answer(llama(TINY, meta=True), batch=batch, seq=seq)
    seconds = time.perf_counter() - start
    step = training_module(llama(TINY, meta=False))
    x, mask = torch.randint(3, 250, (batch, seq)), torch.ones(batch, seq, dtype=torch.long)
    opt = OPTIMIZERS["adamw"](step.parameters())
    loss = lambda out: out  # noqa: E731 - the model returns its loss
    train_step(step, [x, mask], opt, loss)
    m = measure(lambda: train_step(step, [x, mask], opt, loss), warmup=0)
    states = sum(t.nbytes for t in [*step.parameters(), *step.buffers()]) + sum(
        t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    real = states + x.nbytes + mask.nbytes + m.peak_above_start
    return dict(model="tiny Llama (2 layers, float32)", batch=batch, seq=seq, parameters=answer.parameters,
                fxmem=answer.step_peak, real=real, fxmem_seconds=round(seconds, 2),
                model_states=answer.parameter_bytes + answer.gradient_bytes + answer.optimizer_state_bytes,
                exact=answer.step_peak == real, **estimators(llama(TINY, meta=True)))


def big_row(batch: int, seq: int, world_size: int = 1) -> dict:
    """fxmem's mixed-precision step on the 7B config (meta) and the estimators' numbers (per GPU
    of ``world_size``: fxmem's FSDP2 per block and root, rank 0; DeepSpeed's ZeRO over as many)."""
    import torch

    import fxmem
    from fxmem.llm import fsdp_per_block, training_module
    from fxmem.specs import TensorSpec

    model = llama(LLAMA2_7B, meta=True)
    step = training_module(model)
    kw = dict(world_size=world_size, parallelize=fsdp_per_block) if world_size > 1 else {}
    start = time.perf_counter()
    report = fxmem.analyze(step, TensorSpec(("B", "L"), dtype=torch.long), TensorSpec(("B", "L"), dtype=torch.long,
                                                                                     fill=1),
                           optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), loss=lambda loss: loss,
                           autocast=torch.bfloat16, **kw)
    seconds = time.perf_counter() - start
    at = report.evaluate(B=batch, L=seq)
    return dict(model="Llama-2-7B (float32 weights, bfloat16 autocast)" + (
                    f", FSDP2 rank 0 of {world_size}" if world_size > 1 else ""), batch=batch, seq=seq,
                parameters=sum(p.numel() for p in model.parameters()), fxmem=int(at["train_peak"]), real=None,
                fxmem_seconds=round(seconds, 1), exact=report.exact,
                model_states=int(at["train_resident"]) + int(at["grads"]),
                max_batch_80gib=report.max_size("B", "80GiB", train=True, L=seq),
                **estimators(model, world_size))


def gib(b) -> str:
    from fxmem.units import format_bytes

    return "-" if b is None else format_bytes(int(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results files as they are")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    rows = [tiny_row(2, 64), tiny_row(4, 128), big_row(1, 4096), big_row(1, 4096, world_size=8)]
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")),
        platform.processor())
    head = (f"Machine: {cpu}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. "
            f"Command: `python benchmarks/llm_estimators.py`.")
    keys = list(dict.fromkeys(k for r in rows for k in r if k.startswith(("accelerate", "DeepSpeed"))))
    lines = ["# A Llama training step: fxmem next to accelerate's and DeepSpeed's estimators", "", head, "",
             "Bytes per GPU. Real: the CPU allocator's peak of the same step (resident + peak above it).", "",
             "| model | B | L | real peak | fxmem step peak | fxmem exact? | fxmem model states | "
             + " | ".join(keys) + " |", "|---" * (7 + len(keys)) + "|"]
    for r in rows:
        exact = "yes" if r["exact"] else "flagged"
        lines.append(f"| {r['model']} | {r['batch']} | {r['seq']} | {gib(r['real'])} | {gib(r['fxmem'])} | {exact} | "
                     f"{gib(r['model_states'])} | " + " | ".join(gib(r.get(k)) for k in keys) + " |")
    lines += [""] + [f"fxmem's analysis of '{r['model']}' took {r['fxmem_seconds']} s; its largest batch at "
                     f"L={r['seq']} in 80 GiB: {r['max_batch_80gib']}." for r in rows if "max_batch_80gib" in r]
    lines += ["", "The estimators count model states from the parameter count (no activations, so no batch size); "
              "accelerate's 'Training using Adam' is the largest of its model/gradients/optimizer/step terms. "
              "fxmem's 7B rows simulate the CPU's kernels (no GPU here): they are flagged because CPU bfloat16 "
              "matrix products use oneDNN scratch fxmem does not predict."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        out = HERE / "results"
        (out / "llm_estimators.md").write_text(text)
        (out / "llm_estimators.json").write_text(json.dumps(dict(machine=cpu, torch=torch.__version__,
                                                                 command=" ".join(sys.argv), rows=rows), indent=1,
                                                            default=str))


if __name__ == "__main__":
    main()
