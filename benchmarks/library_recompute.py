"""``fxmem.optimize(budget=)`` on public transformers next to the libraries' own checkpointing and
torch.compile's min-cut partitioner: measured training-step peak and time.

For each model (random weights, configs below; timm's need ``timm`` and ``torchvision``, which
need a CUDA build of torch - the model runs on the CPU either way) and AdamW at the dims shown:

* ``model``: the model's own training step;
* ``fxmem 0.6x`` / ``fxmem 0.4x``: ``fxmem.optimize(model, ..., budget=f * that step's measured
  peak, dims=, optimizer=)`` - its plan, fxmem's predicted peak and the real one, or the
  BudgetError's smallest reachable peak;
* ``library``: the library's own checkpointing (Hugging Face ``gradient_checkpointing_enable``,
  timm ``set_grad_checkpointing``; nanoGPT has none);
* ``compile``: ``torch.compile`` with AOTAutograd's min-cut rematerialization partitioner (no
  kernel compiler: the graphs run as captured) at ``activation_memory_budget`` 1.0, 0.5 and 0.0 -
  the lowest measured peak of the three, with its budget.

Peaks are absolute (inputs, parameters, buffers, gradients and AdamW state resident at the step's start, plus
what the CPU allocator saw above that during a steady-state step: ``fxmem.measure``); times are
the median of ``--repeats`` steady-state steps in one process (``--threads`` threads), taken
round-robin over a model's runs.

    python benchmarks/library_recompute.py [--cases hf-llama,hf-gpt2,...] [--out NAME]
Results: benchmarks/results/library_recompute.{json,md} (and _timm for the timm models)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import fxmem  # noqa: E402
from fxmem.measure import machine_name, measure  # noqa: E402
from fxmem.passes.recompute import BudgetError  # noqa: E402
from fxmem.training import default_loss, train_step  # noqa: E402

FRACTIONS = (0.6, 0.4)
PARTITIONER_BUDGETS = (1.0, 0.5, 0.0)


class Logits(nn.Module):
    """A Hugging Face model's logits (or last hidden state): one tensor to take the loss of."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _hf(kind: str) -> Callable[[], tuple]:
    def build() -> tuple:
        import transformers

        common = dict(vocab_size=2000, use_cache=False)
        if kind == "llama":
            cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                           num_attention_heads=8, num_key_value_heads=4, **common)
            model = transformers.LlamaForCausalLM(cfg)
        elif kind == "gpt2":
            cfg = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, n_positions=512, **common)
            model = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.BertConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                          num_attention_heads=8, max_position_embeddings=512, **common)
            model = transformers.BertModel(cfg, add_pooling_layer=False)
        lib = lambda m: m.model.gradient_checkpointing_enable(  # noqa: E731
            gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
        return Logits(model), (ids,), dict(B=4, L=512), lambda d: [torch.randint(0, 2000, (d["B"], d["L"]))], lib
    return build


def _nanogpt() -> tuple:
    from zoo.public_impls import NanoGPT

    model = NanoGPT(vocab=2000, n_layer=4, n_embd=256, n_head=8, block_size=512, dropout=0.1)
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    return model, (ids,), dict(B=4, L=512), lambda d: [torch.randint(0, 2000, (d["B"], d["L"]))], None


def _timm(name: str, **kw: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=100, **kw)
        size = kw.get("img_size", 224)
        lib = lambda m: m.set_grad_checkpointing(True)  # noqa: E731
        return model, (("B", 3, size, size),), dict(B=32), lambda d: [torch.randn(d["B"], 3, size, size)], lib
    return build


CASES = {
    "hf-llama": _hf("llama"),
    "hf-gpt2": _hf("gpt2"),
    "hf-bert": _hf("bert"),
    "nanogpt": _nanogpt,
    "timm-vit": _timm("vit_small_patch16_224", img_size=96, depth=6),
    "timm-swin": _timm("swin_tiny_patch4_window7_224", img_size=112, window_size=7),
}


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _resident(module: nn.Module, opt: torch.optim.Optimizer, xs: list) -> int:
    """Bytes of the inputs, parameters, buffers, gradients and optimizer state held at a
    steady-state step's start."""
    seen: dict = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in xs}
    for b in module.buffers():
        seen[b.untyped_storage().data_ptr()] = b.untyped_storage().nbytes()
    for p in module.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        if p.grad is not None:
            seen[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class _Runner:
    """A module's steady-state training step: its measured absolute peak (bytes) once, then its
    step times, taken round-robin with the other runs of the case (the machine's noise shared)."""

    def __init__(self, module: nn.Module, xs: list) -> None:
        torch.manual_seed(0)
        self.module, self.xs, self.times = module, xs, []
        self.opt = adamw(module.parameters())
        train_step(module, xs, self.opt, default_loss)  # the optimizer's state
        start = _resident(module, self.opt, xs)
        self.peak = start + measure(lambda: train_step(module, xs, self.opt, default_loss)).peak_above_start

    def time(self) -> None:
        t = time.perf_counter()
        train_step(self.module, self.xs, self.opt, default_loss)
        self.times.append(time.perf_counter() - t)


def _partitioned(model: nn.Module, budget: float) -> nn.Module:
    """``model`` under torch.compile with the min-cut partitioner at ``activation_memory_budget``."""
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from functorch.compile import make_boxed_func

    def nop(gm: torch.fx.GraphModule, _inputs: Any) -> Callable:
        return make_boxed_func(gm)  # boxed: AOTAutograd frees the inputs as it goes, as with inductor

    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop,
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    compiled = torch.compile(model, backend=backend, dynamic=False)

    class Budgeted(nn.Module):  # the partitioner reads the budget when it compiles: the first call
        def __init__(self) -> None:
            super().__init__()
            self.inner = compiled

        def forward(self, *xs: Any) -> Any:
            with functorch_config.patch(activation_memory_budget=budget):
                return self.inner(*xs)
    return Budgeted()


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def run_case(name: str, repeats: int) -> dict:
    import torch._dynamo

    torch.manual_seed(0)
    model, specs, dims, make, lib = CASES[name]()
    model.train()
    xs = make(dims)
    row: dict = {"case": name, "dims": dims, "rows": []}
    runs: list = []  # (entry, runner): timed round-robin at the end
    t = time.perf_counter()
    report = fxmem.analyze(model, *specs, optimizer=adamw)
    analysis_s = time.perf_counter() - t
    own = _Runner(model, xs)
    runs.append(({"what": "model", "predicted": report.evaluate(**dims)["train_peak"], "analysis_s": analysis_s}, own))
    for f in FRACTIONS:
        budget = int(own.peak * f)
        entry: dict = {"what": f"fxmem {f}x", "budget": budget}
        t = time.perf_counter()
        try:
            opt = fxmem.optimize(model, *specs, budget=budget, dims=dims, optimizer=adamw)
            entry["optimize_s"] = time.perf_counter() - t
            rec = next(e for e in reversed(opt.meta["fxmem"]) if e["rule"] == "recompute")
            entry.update(plan=rec["where"], status=rec["status"], predicted=rec["peak_at_dims_after"] or
                         rec["peak_at_dims_before"])
            runs.append((entry, _Runner(opt, xs)))
        except BudgetError as exc:
            entry.update(optimize_s=time.perf_counter() - t, status="BudgetError", smallest=exc.smallest_peak,
                         plan=str(exc).split("(recomputing ", 1)[-1].split(")", 1)[0][:120])
            runs.append((entry, None))
    if lib is not None:
        torch.manual_seed(0)
        model2, *_ = CASES[name]()
        model2.load_state_dict(model.state_dict())
        lib(model2)
        model2.train()
        runs.append(({"what": "library"}, _Runner(model2, xs)))
    best = None
    for b in PARTITIONER_BUDGETS:
        torch._dynamo.reset()
        try:
            got = _Runner(_partitioned(model, b), xs)
        except Exception as exc:  # noqa: BLE001 - a benchmark row, not a crash: say what failed
            runs.append(({"what": f"compile {b}", "error": f"{type(exc).__name__}: {str(exc)[:160]}"}, None))
            continue
        if best is None or got.peak < best[1].peak:
            best = ({"what": f"compile (budget {b})"}, got)
    if best is not None:
        runs.append(best)
    timed = [r for _, r in runs if r is not None]
    for _ in range(repeats):
        for r in timed:
            r.time()
    torch._dynamo.reset()
    for entry, r in runs:
        if r is not None:
            entry.update(peak=r.peak, step_s=statistics.median(r.times))
        row["rows"].append(entry)
    return row


def markdown(rows: list, meta: dict) -> str:
    out = ["# fxmem.optimize(budget=) on public transformers, next to their own checkpointing and torch.compile",
           "", f"{meta['machine']}; torch {meta['torch']}; {meta['threads']} threads; median of {meta['repeats']} "
           f"steps; command: `{meta['command']}`", "",
           "| model (dims) | run | plan | predicted MiB | measured peak MiB | measured - predicted (bytes) | step s "
           "| vs model peak | vs model time |",
           "|---|---|---|---|---|---|---|---|---|"]
    for case in rows:
        base = case["rows"][0]
        label = f"{case['case']} ({', '.join(f'{k}={v}' for k, v in case['dims'].items())})"
        for r in case["rows"]:
            if "error" in r:
                out.append(f"| {label} | {r['what']} | {r['error']} | | | | | | |")
                continue
            if r.get("status") == "BudgetError":
                out.append(f"| {label} | {r['what']} (budget {_mib(r['budget'])}) | refused (BudgetError): the "
                           f"smallest peak recomputation reaches is {_mib(r['smallest'])} MiB | | | | | | |")
                continue
            what = r["what"] + (f" (budget {_mib(r['budget'])})" if "budget" in r else "")
            ratio = r["peak"] / base["peak"]
            diff = r["peak"] - r["predicted"] if r.get("predicted") is not None else None
            out.append(f"| {label} | {what} | {r.get('plan', '')} | {_mib(r.get('predicted'))} | {_mib(r['peak'])} "
                       f"| {'-' if diff is None else f'{diff:,}'} | {r['step_s']:.3f} | {ratio:.2f}x "
                       f"| {r['step_s'] / base['step_s']:.2f}x |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="hf-llama,hf-gpt2,hf-bert,nanogpt",
                        help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="library_recompute")
    parser.add_argument("--render", action="store_true", help="only write the .md again from the committed .json")
    args = parser.parse_args(argv)
    results = os.path.join(HERE, "results")
    if args.render:
        with open(os.path.join(results, f"{args.out}.json")) as fh:
            data = json.load(fh)
        with open(os.path.join(results, f"{args.out}.md"), "w") as fh:
            fh.write(markdown(data["rows"], data["meta"]))
        return
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.cases.split(","):
        print(f"== {name}", flush=True)
        rows.append(run_case(name, args.repeats))
        print(markdown(rows[-1:], {"machine": "", "torch": "", "threads": "", "repeats": "", "command": ""}),
              flush=True)
    meta = {"machine": machine_name(), "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
            "command": "python benchmarks/library_recompute.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    with open(os.path.join(results, f"{args.out}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1, default=str)
    with open(os.path.join(results, f"{args.out}.md"), "w") as fh:
        fh.write(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
