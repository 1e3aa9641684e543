"""fxmem.from_config / fxmem.llm_answer / `fxmem llm`: a Hugging Face config to the training step's
memory, against real training steps of the same config with random weights (CPU allocator), at
sizes the analysis did not see: plain, gradient checkpointing, LoRA (peft), FSDP2 and tensor
parallelism per rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fxmem
from fxmem.llm import OPTIMIZERS, fsdp_per_block, llm_answer, tensor_parallel_plan, training_module
from fxmem.measure import measure
from fxmem.training import train_step

pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN2 = {**LLAMA, "model_type": "qwen2", "num_key_value_heads": 1}
GPT2 = {"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256,
        "bos_token_id": 1, "eos_token_id": 2}


def _real(config: dict, **variant) -> torch.nn.Module:
    """The same config with random weights on the CPU, prepared as the analysis prepares it."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                                      if k != "model_type"})
    return training_module(transformers.AutoModelForCausalLM.from_config(cfg), **variant)


def _real_step(step: torch.nn.Module, b: int, l: int) -> tuple[int, int]:
    """(peak above start, retained) of a steady-state AdamW step (after one warm-up step)."""
    x, mask = torch.randint(3, 90, (b, l)), torch.ones(b, l, dtype=torch.long)
    opt = OPTIMIZERS["adamw"](step.parameters())
    loss = lambda out: out  # noqa: E731 - the model returns its loss
    train_step(step, [x, mask], opt, loss)
    m = measure(lambda: train_step(step, [x, mask], opt, loss), warmup=0)
    return m.peak_above_start, m.retained


@pytest.mark.parametrize("config, variant", [
    (LLAMA, {}), (QWEN2, {}), (GPT2, {}),
    (LLAMA, dict(checkpointing=True)),
    (LLAMA, dict(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})),
], ids=["llama", "qwen2-gqa", "gpt2", "llama-checkpointing", "llama-lora"])
def test_from_config_training_step_is_exact(config, variant):
    answer = llm_answer(fxmem.from_config(config), batch=2, seq=48, **variant)
    report = answer.report
    assert next(report.model.parameters()).device.type == "meta"  # nothing allocated for weights
    assert report.exact, report.notes
    for b, l in ((3, 37), (2, 70)):
        at = report.evaluate(B=b, L=l)
        predicted = (at["train_peak"] - at["train_resident"], at["train_retained"])
        assert _real_step(_real(config, **variant), b, l) == predicted, (b, l, report.notes)
    if "lora" in variant:  # frozen base: gradients (and AdamW state) only for the adapters
        trainable = sum(p.numel() for p in _real(config, **variant).parameters() if p.requires_grad)
        assert answer.trainable == trainable < answer.parameters // 10
        assert answer.gradient_bytes == 4 * trainable


def test_fsdp_rank_is_exact_against_the_synchronous_real_step():
    from fxmem.distributed.real_runs import measure_synchronous

    answer = llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, fsdp=2)
    # formulas in B and L (the warm-up step once fixed both: transformers' loss pads the labels)
    assert not any("fixed dim" in n for n in answer.report.notes), answer.report.notes
    assert {"B", "L"} <= {str(s) for s in answer.report.train_peak.free_symbols}
    torch.set_num_threads(1)
    for b, l in ((3, 37), (2, 61)):
        x = torch.randint(3, 90, (b, l))
        real = measure_synchronous(lambda: _real(LLAMA), (x, torch.ones_like(x)), fsdp_per_block, 2, 0, OPTIMIZERS["adamw"],
                                   loss=lambda out: out)
        at = answer.report.evaluate(B=b, L=l)
        assert (real.peak_above_start, real.retained, real.optimizer_state) == \
            (at["train_peak"] - at["train_resident"], at["train_retained"], at["optimizer_state"])


def test_fsdp_as_a_symbol_gives_the_fewest_ranks_that_fit(tmp_path):
    """fsdp="W": formulas in the number of FSDP2 ranks (three analyses: 2, 4 and 8 of this config's
    sharded sizes, whose gcd is 16); against real steps at 16 ranks (not analysed), and the fewest
    ranks for a budget between two real steps' peaks."""
    from fxmem.distributed.real_runs import measure_synchronous

    torch.set_num_threads(1)
    x = torch.randint(3, 90, (2, 48))

    def real_peak(world_size):
        r = measure_synchronous(lambda: _real(LLAMA), (x, torch.ones_like(x)), fsdp_per_block, world_size, 0,
                                OPTIMIZERS["adamw"], loss=lambda out: out)
        return r.resident + r.peak_above_start

    budget = real_peak(4) + 256  # fits on 4 ranks, and (checked) not on 2
    answer = llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, fsdp="W", gpu=budget)
    assert real_peak(2) > budget and answer.fewest == 4 and answer.ranks == 4
    assert "fewest ranks        4  (FSDP2 over 4)" in str(answer) and answer.step_peak <= budget
    assert answer.report.evaluate(B=2, L=48, W=16)["train_peak"] == real_peak(16)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    out = subprocess.run([sys.executable, "-m", "fxmem", "llm", str(path), "--batch", "2", "--seq", "48",
                          "--fsdp", "W", "--gpu", str(budget), "--quiet"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert "fewest ranks        4  (FSDP2 over 4)" in out.stdout, out.stdout
    with pytest.raises(fxmem.SpecError, match="later stage's ranks move"):
        llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, fsdp="W", pp=2)


@pytest.mark.parametrize("fsdp, tp", [(None, 2), pytest.param(2, 2, marks=pytest.mark.slow)],  # CI: tp=2; the 2-D
                         ids=["tp2", "fsdp2xtp2"])  # mesh of the same model in tests/distributed's 2 x 2 tests
def test_tensor_parallel_rank_is_exact_against_the_synchronous_real_step(fsdp, tp):
    """tp=: the config's own plan (transformers' base_model_tp_plan: q, k, v, gate and up column-wise,
    o and down row-wise); with fsdp= too, FSDP2 across the tensor-parallel groups of a 2-D mesh."""
    from fxmem.distributed.real_runs import measure_synchronous
    from fxmem.llm import fsdp_tp_per_block

    answer = llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, tp=tp, fsdp=fsdp)
    assert answer.ranks == (fsdp or 1) * tp and "tensor parallelism by the model's own plan" in answer.notes[1]
    torch.set_num_threads(1)
    for b, l in ((3, 37), (2, 61)):
        x = torch.randint(3, 90, (b, l))
        real = measure_synchronous(lambda: _real(LLAMA), (x, torch.ones_like(x)), fsdp_tp_per_block, answer.ranks, 0,
                                   OPTIMIZERS["adamw"], loss=lambda out: out,
                                   mesh={"dp": fsdp, "tp": tp} if fsdp is not None else None)
        at = answer.report.evaluate(B=b, L=l)
        assert (real.peak_above_start, real.retained, real.optimizer_state) == \
            (at["train_peak"] - at["train_resident"], at["train_retained"], at["optimizer_state"])


def test_tensor_parallelism_needs_the_configs_plan():
    with pytest.raises(fxmem.SpecError, match="the gpt2 config has no tensor-parallel plan"):
        llm_answer(fxmem.from_config(GPT2), batch=2, seq=48, tp=2)
    with pytest.raises(fxmem.SpecError, match="tp= with LoRA adapters is not modelled"):
        llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, tp=2, lora={"r": 4, "target_modules": ["q_proj"]})
    with pytest.raises(fxmem.SpecError, match="tp=0: a number of ranks"):
        llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, tp=0)


def stages_match_real_steps(answer, config, sizes, microbatches=2, schedule="1F1B", fsdp=None, tp=None):
    """Every stage's rank of ``answer`` (pp=2 of ``config``) against a real step of the same split
    (fxmem.llm_stages), in one process with the other ranks' start-up messages, at ``sizes`` the
    analysis did not see: step peak above start, retained, resident and optimizer state, in bytes."""
    import functools

    from fxmem import llm_stages
    from fxmem.distributed.real_runs import measure_synchronous

    layout = llm_stages.mesh(2, fsdp, tp)
    parallelize = functools.partial(llm_stages.pipeline_per_stage, microbatches=microbatches, schedule=schedule,
                                    plan=tensor_parallel_plan(_real(config)) if tp else None)
    torch.set_num_threads(1)
    for stage in answer.stages:
        # the last stage holds the head and its logits; the first the embedding (and more micro-batches in flight)
        for b, l in sizes:
            x = torch.randint(3, 90, (b, l))
            real = measure_synchronous(lambda: _real(config), (x, torch.ones_like(x)), parallelize, answer.ranks,
                                       stage.rank, OPTIMIZERS["adamw"], step=llm_stages.train_stage,
                                       mesh=layout if len(layout) > 1 else None)
            at = stage.report.evaluate(B=b, L=l)
            assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == \
                (at["train_peak"] - at["train_resident"], at["train_retained"], at["train_resident"],
                 at["optimizer_state"]), (config["model_type"], schedule, stage.stage, b, l)
        assert real.optimizer_state > 0  # every stage trains its layers (a backward on each rank)


@pytest.mark.parametrize("fsdp, tp", [(None, None), pytest.param(2, None, marks=pytest.mark.slow),
                                     pytest.param(None, 2, marks=pytest.mark.slow)],
                         ids=["pp2", "pp2xdp2", "pp2xtp2"])  # CI: the pipeline alone (the meshes: tests/distributed)
def test_pipeline_stages_are_exact_against_the_synchronous_real_step(fsdp, tp):
    """pp=2: every stage's rank against a real step of the same split, 1F1B over 2 micro-batches."""
    answer = llm_answer(fxmem.from_config(LLAMA), batch=4, seq=48, pp=2, fsdp=fsdp, tp=tp, gpu="4MiB")
    assert [s.stage for s in answer.stages] == [0, 1] and answer.ranks == 2 * (fsdp or 1) * (tp or 1)
    worst = max(answer.stages, key=lambda s: s.step_peak)
    assert answer.step_peak == worst.step_peak and f"stage {worst.stage} of 2" in str(answer)
    assert f"on this rank, one of {answer.ranks} (its stage's layers)" in str(answer)
    stages_match_real_steps(answer, LLAMA, ((4, 37), (6, 61)), fsdp=fsdp, tp=tp)
    # the largest batch: a multiple of the micro-batches that every stage fits, and the next does not
    fits = [s.report.evaluate(B=answer.max_batch, L=48)["train_peak"] for s in answer.stages]
    over = [s.report.evaluate(B=answer.max_batch + 2, L=48)["train_peak"] for s in answer.stages]
    assert answer.max_batch % 2 == 0 and max(fits) <= 4 * 2**20 < max(over)


@pytest.mark.parametrize("schedule, fsdp, tp", [("ZBVZeroBubble", None, None)] + [
    pytest.param(s, None, None, marks=pytest.mark.slow) for s in (
        "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "DualPipeV")] + [
    pytest.param("Interleaved1F1B", 2, None, marks=pytest.mark.slow),
    pytest.param("ZBVZeroBubble", None, 2, marks=pytest.mark.slow)])  # CI: a V of zero bubble
def test_pipeline_schedules_are_exact_against_the_synchronous_real_step(schedule, fsdp, tp):
    """pp=2 under each schedule fxmem llm builds (those of two stages a rank split 4 layers into 4 stages:
    rank 0 runs 0 and 2, or in a V 0 and 3, the embedding with the head), one micro-batch per stage, every
    rank against a real step of the same split at sizes the analysis did not see; two stages a rank with
    FSDP2 or tensor parallelism inside each too."""
    from fxmem import llm_stages

    config = {**LLAMA, "num_hidden_layers": 4}
    per_rank = llm_stages.SCHEDULES[schedule][1]
    answer = llm_answer(fxmem.from_config(config), batch=4, seq=48, pp=2, fsdp=fsdp, tp=tp,
                        schedule=schedule.lower())
    assert f"{llm_stages.SCHEDULES[schedule][0]} over {2 * per_rank} micro-batches" in str(answer)
    assert [s.layers for s in answer.stages] == [2, 2]
    if per_rank == 2:
        v = schedule in ("ZBVZeroBubble", "DualPipeV")
        assert f"stage 0 (runs stages 0 and {3 if v else 2} of 4: 2 decoder layers, the embedding" \
               f"{', the norm, head and loss' if v else ''})" in str(answer)
    stages_match_real_steps(answer, config, ((4, 37), (8, 61)), 2 * per_rank, schedule, fsdp, tp)


@pytest.mark.parametrize("kind", ["qwen2", pytest.param("mistral", marks=pytest.mark.slow),
                                  pytest.param("qwen3", marks=pytest.mark.slow)])
def test_pipeline_stages_of_the_other_split_architectures_are_exact(kind):
    """pp=2 of each architecture fxmem splits besides Llama (fxmem.llm_stages.SPLITTABLE): both stages'
    ranks against real steps of the same split."""
    config = {**(QWEN2 if kind == "qwen2" else LLAMA), "model_type": kind}
    stages_match_real_steps(llm_answer(fxmem.from_config(config), batch=4, seq=48, pp=2), config, ((4, 37), (6, 61)))


def test_a_first_import_of_torchs_pipelining_is_not_made_inside_the_analysis():
    # pipelining's microbatch module makes torch.tensor(0.0) when imported: imported first inside the fake
    # mode, it stayed a fake tensor in torch's module (in the user's later real runs) and a 4-byte "step
    # state" on stage 0. A fresh interpreter that has not imported it gives this process's numbers.
    import torch.distributed.pipelining  # noqa: F401 - this process's import, made outside any analysis

    here = llm_answer(fxmem.from_config(LLAMA), batch=4, seq=48, pp=2)
    code = ("import sys, json, fxmem, torch\n"
            "from fxmem.llm import llm_answer\n"
            "assert 'torch.distributed.pipelining' not in sys.modules\n"
            f"a = llm_answer(fxmem.from_config({LLAMA!r}), batch=4, seq=48, pp=2)\n"
            "from torch.distributed.pipelining.microbatch import sum_reducer\n"
            "print(json.dumps([type(sum_reducer.init_value).__name__, [s.resident for s in a.stages],"
            " [s.step_peak for s in a.stages]]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == ["Tensor", [s.resident for s in here.stages],
                                                       [s.step_peak for s in here.stages]]


def test_pipeline_schedule_refusals():
    with pytest.raises(fxmem.SpecError, match="schedule='Zigzag': use one of 1F1B, GPipe"):
        llm_answer(fxmem.from_config(LLAMA), batch=4, seq=48, pp=2, schedule="Zigzag")
    with pytest.raises(fxmem.SpecError, match="fewer than the 4 stages .Interleaved1F1B runs 2 a rank.; use pp <= 1"):
        llm_answer(fxmem.from_config(LLAMA), batch=4, seq=48, pp=2, schedule="Interleaved1F1B")
    with pytest.raises(fxmem.SpecError, match="DualPipeV needs at least as many micro-batches as stages .4."):
        llm_answer(fxmem.from_config({**LLAMA, "num_hidden_layers": 4}), batch=4, seq=48, pp=2, schedule="DualPipeV",
                   microbatches=2)
    with pytest.raises(fxmem.SpecError, match="schedule= is the pipeline's"):
        llm_answer(fxmem.from_config(LLAMA), batch=4, seq=48, schedule="GPipe")


def test_layouts_side_by_side(tmp_path):
    # a row per layout, each the answer of its own layout: the single device's against a real step, the
    # pipeline's worst stage against a real run of that stage's rank; the command line prints the same table
    import functools

    from fxmem import llm_stages
    from fxmem.distributed.real_runs import measure_synchronous

    table = fxmem.llm_layouts(fxmem.from_config(LLAMA), batch=4, seq=48, layouts=["dp1", "pp2"], gpu="4MiB")
    assert list(table) == ["dp 1", "pp 2"] and [a.ranks for a in table.values()] == [1, 2]
    one, pipe = table["dp 1"], table["pp 2"]
    at = one.report.evaluate(B=4, L=48)
    assert _real_step(_real(LLAMA), 4, 48) == (at["train_peak"] - at["train_resident"], at["train_retained"])
    worst = max(pipe.stages, key=lambda s: s.step_peak)
    x = torch.randint(3, 90, (4, 48))
    torch.set_num_threads(1)
    real = measure_synchronous(lambda: _real(LLAMA), (x, torch.ones_like(x)),
                               functools.partial(llm_stages.pipeline_per_stage, microbatches=2), 2, worst.rank,
                               OPTIMIZERS["adamw"], step=llm_stages.train_stage)
    assert pipe.step_peak == worst.step_peak == real.resident + real.peak_above_start
    assert pipe.max_batch % 2 == 0 and pipe.max_batch == min(s.max_batch for s in pipe.stages)
    text = str(table)
    assert fxmem.format_bytes(pipe.step_peak) in text and f"{pipe.max_batch:,}" in text
    with pytest.raises(fxmem.SpecError, match="'tp2xq3' is not a layout"):
        fxmem.llm_layouts(fxmem.from_config(LLAMA), batch=4, seq=48, layouts=["tp2xq3"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    out = subprocess.run([sys.executable, "-m", "fxmem", "llm", str(path), "--batch", "4", "--seq", "48",
                          "--gpu", "4MiB", "--layouts", "dp1", "pp2", "--quiet"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert text.splitlines()[-1] in out.stdout and text.splitlines()[-2] in out.stdout, out.stdout


def test_pipeline_refusals():
    with pytest.raises(fxmem.SpecError, match="a gpt2 model is not split yet"):
        llm_answer(fxmem.from_config(GPT2), batch=2, seq=48, pp=2)
    with pytest.raises(fxmem.SpecError, match="batch=3 does not split into 2 equal micro-batches"):
        llm_answer(fxmem.from_config(LLAMA), batch=3, seq=48, pp=2)
    with pytest.raises(fxmem.SpecError, match="pp=3: the model has 2 decoder layers"):
        llm_answer(fxmem.from_config(LLAMA), batch=3, seq=48, pp=3)
    with pytest.raises(fxmem.SpecError, match="microbatches= is the pipeline's"):
        llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, microbatches=2)
    with pytest.raises(fxmem.SpecError, match="recipe='amp-bf16' with pp="):
        llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, pp=2, recipe="amp-bf16")


def test_answers_and_their_reasons(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    model = fxmem.from_config(str(path), dtype=torch.float32)
    answer = llm_answer(model, batch=2, seq=48, gpu="4MiB")
    # exact answers: the next size does not fit
    report = answer.report
    assert report.evaluate(B=answer.max_batch, L=48)["train_peak"] <= 4 * 2**20 < \
        report.evaluate(B=answer.max_batch + 1, L=48)["train_peak"]
    assert report.evaluate(B=2, L=answer.max_seq)["train_peak"] <= 4 * 2**20 < \
        report.evaluate(B=2, L=answer.max_seq + 1)["train_peak"]
    with pytest.warns(UserWarning, match="nothing fits"):
        tiny = llm_answer(model, batch=2, seq=48, gpu="100KiB")
    assert tiny.max_batch == 0 and "resident alone" in str(tiny)
    with pytest.raises(fxmem.SpecError, match="model_type"):
        fxmem.from_config({"hidden_size": 3})
    with pytest.raises(fxmem.SpecError, match="no such file"):
        fxmem.from_config(str(tmp_path / "missing.json"))


def test_cli_llm(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    out = subprocess.run([sys.executable, "-m", "fxmem", "llm", str(path), "--batch", "2", "--seq", "48",
                          "--gpu", "4MiB", "--quiet"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    answer = llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, gpu="4MiB")
    assert f"largest batch           {answer.max_batch:,}" in out.stdout
    assert "26,784 parameters" in out.stdout and fxmem.format_bytes(answer.step_peak) in out.stdout
    out = subprocess.run([sys.executable, "-m", "fxmem", "llm", str(path), "--batch", "2", "--seq", "48",
                          "--tp", "2", "--quiet"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    answer = llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48, tp=2)
    assert "rank 0 of 2: tensor parallelism" in out.stdout and fxmem.format_bytes(answer.step_peak) in out.stdout
