"""Every public entry point leaves the user's world as it found it (fxmem/isolation.py): the model
(parameters, buffers, gradients, Python attributes, hook tables), what the user's hooks observed
(nothing: fxmem analyses without them and says so), the user's own profiler session (its events
before and after the call, and an export that works), and torch's global state - on models whose
forward counts in a buffer and an attribute, runs BatchNorm and writes a parameter in place,
inside an active profiler, under ``torch.no_grad()`` and ``torch.inference_mode()``.

The evidence is the state itself, compared bit for bit before and after each call.
"""
from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook

import fxmem
import fxmem.cli
from conftest import global_state


class Stateful(nn.Module):
    """Counts its calls (an attribute and a buffer), normalises with BatchNorm, clips a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.count += 1
        self.head.weight.data.clamp_(-0.2, 0.2)  # a parameter written in place (weight clipping)
        return self.head(torch.relu(self.bn(self.lin(x))))


class Untraceable(Stateful):
    """fx cannot trace a shape assert: optimize captures it with TorchDynamo, a real run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] == 6
        return super().forward(x)


class Watched:
    """The user's hooks on ``model``, and what they saw."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: list = []
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        model.register_forward_hook(lambda m, args, out: self.seen.append(("forward", type(out).__name__)))
        linears[0].register_forward_pre_hook(lambda m, args: self.seen.append(("pre", type(args[0]).__name__)))
        linears[-1].register_full_backward_hook(lambda m, gin, gout: self.seen.append(("backward", len(gout))))
        linears[0].weight.register_hook(lambda g: self.seen.append(("gradient", type(g).__name__)))
        mine = set(map(id, model.modules()))
        self.handle = register_module_forward_hook(
            lambda m, args, out: self.seen.append(("global", type(m).__name__)) if id(m) in mine else None)


def model_state(model: nn.Module) -> list:
    """Everything of the model a user could notice, as plain values (tensors as bytes)."""
    def value(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", id(v), v.dtype, tuple(v.shape), v.requires_grad, v.detach().clone().numpy().tobytes(),
                    value(v.grad) if v.grad is not None else None)
        return copy.copy(v)

    out = []
    for name, m in model.named_modules():
        for k, v in sorted(vars(m).items()):
            if k in ("_parameters", "_buffers", "_modules"):
                out.append((name, k, [(n, value(t) if isinstance(t, torch.Tensor) else id(t)) for n, t in v.items()]))
            elif isinstance(v, dict) and ("hooks" in k):
                out.append((name, k, list(v.items())))
            else:
                out.append((name, k, value(v)))
    return out


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config).eval()
    model.model.layers[0].register_forward_hook(lambda m, args, out: None)
    return model


SGD = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
CASES = {  # name: (model factory, call); the call may refuse (an FxMemError) - the state is checked either way
    "analyze": (Stateful, lambda m: fxmem.analyze(m, ("B", 6))),
    "analyze training step": (Stateful, lambda m: fxmem.analyze(m, ("B", 6), optimizer=SGD)),
    "analyze eager": (Stateful, lambda m: fxmem.analyze(m, ("B", 6), mode="eager", optimizer=SGD)),
    "evaluate outside the region": (Stateful, lambda m: fxmem.analyze(m, ("B", 6)).evaluate(B=2)),  # B >= 3 holds
    "analyze untraceable": (Untraceable, lambda m: fxmem.analyze(m, ("B", 6), optimizer=SGD)),
    "optimize": (Untraceable, lambda m: fxmem.optimize(m, ("B", 6))),
    "optimize budget": (Stateful, lambda m: fxmem.optimize(m, ("B", 6), budget="2KiB", dims={"B": 4},
                                                           optimizer=SGD)),
    "validate": (Stateful, lambda m: fxmem.validate(m, ("B", 6), dims={"B": 4}, device="cpu", optimizer=SGD)),
    "generation": (_llama, lambda m: fxmem.generation(m, ("B", "P"), new_tokens=2)),
    "llm_answer": (_llama, lambda m: fxmem.llm_answer(m, batch=2, seq=8)),
    "llm_layouts": (_llama, lambda m: fxmem.llm_layouts(m, batch=2, seq=8, layouts=["pp2", "dp2"])),
}
SLOW = {"generation", "llm_answer", "llm_layouts"}
CONTEXTS = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _run_inside_a_profile(call, context, tmp_path) -> tuple:
    """``call()`` between two labelled ops of the user's, inside the user's own profiler session."""
    from torch.profiler import ProfilerActivity, profile, record_function

    raised = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("user_before"):
            torch.ones(3).mul(2)
        with context():
            try:
                call()
            except fxmem.FxMemError as exc:
                raised = exc
        with record_function("user_after"):
            torch.ones(3).add(5)
    labels = {e.name for e in prof.events()}
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))  # crashed the process when an analysis had ended the session
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    return raised, labels, names


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_an_entry_point_leaves_the_users_world_as_it_was(case, context, tmp_path):
    factory, call = CASES[case]
    model = factory()
    watched = Watched(model)
    try:
        torch.manual_seed(7)
        before, world = model_state(model), global_state()
        raised, labels, names = _run_inside_a_profile(lambda: call(model), CONTEXTS[context], tmp_path)
        assert model_state(model) == before, f"{case} changed the model"
        assert global_state() == world, f"{case} changed torch's global state"
        assert watched.seen == [], f"{case} ran the user's hooks: {watched.seen[:5]}"
        assert {"user_before", "user_after"} <= labels and {"user_before", "user_after"} <= names, \
            f"{case} ended the user's profiler session"
    finally:
        watched.handle.remove()
    # the model's own forward still runs its hooks and side effects: they were put back, not lost
    model(torch.randn(4, 6)) if not case.startswith(("generation", "llm")) else model(torch.zeros(1, 3, dtype=torch.long))
    assert ("forward", "Tensor") in watched.seen or ("forward", "CausalLMOutputWithPast") in watched.seen \
        or case in SLOW
    if case in SLOW:
        return
    assert model.calls == 1 and int(model.count) == 1
    if case == "validate":  # it measures with the profiler: refused inside the user's session, not silently
        assert isinstance(raised, fxmem.ProfilerBusyError)


def test_a_report_says_which_hooks_were_left_out_and_the_analysis_is_the_models_without_them():
    plain, hooked = Stateful(), Stateful()
    hooked.load_state_dict(plain.state_dict())
    Watched(hooked).handle.remove()
    a = fxmem.analyze(plain, ("B", 6), optimizer=SGD)
    b = fxmem.analyze(hooked, ("B", 6), optimizer=SGD)
    note = next(n for n in b.notes if "hooks were left out" in n)
    assert "forward_hooks" not in note and "forward hook" in note and "on lin" in note and "backward" in note
    assert "gradient hook Watched.__init__.<locals>.<lambda> on lin.weight" in note
    assert not any("hooks were left out" in n for n in a.notes)
    assert a.formulas() == b.formulas()
    assert b.checked.endswith("equal"), b.checked  # a real run of the model without them agrees


def test_the_self_check_inside_a_profile_says_why_it_was_not_made():
    from torch.profiler import profile

    with profile():
        report = fxmem.analyze(Stateful(), ("B", 6))
    assert "profiler session is recording" in report.checked
    assert fxmem.analyze(Stateful(), ("B", 6)).checked.endswith("equal")


def test_the_command_line_inside_a_profile(tmp_path, capsys):
    from torch.profiler import profile, record_function

    world = global_state()
    with profile() as prof:
        with record_function("user_before"):
            torch.ones(2).mul(3)
        assert fxmem.cli.main(["analyze", "torch.nn:Linear", "--init", "in_features=6,out_features=8", "--input",
                               "B,6", "--dims", "B=4", "--quiet"]) == 0
        with record_function("user_after"):
            torch.ones(2).add(3)
    assert {"user_before", "user_after"} <= {e.name for e in prof.events()}
    assert global_state() == world
    assert "peak" in capsys.readouterr().out


def test_optimize_gives_the_rewrite_the_users_hooks_or_refuses():
    """The rewrite runs the user's hooks where it calls their module (the root); a hook on a module
    whose code the graph inlines has nothing to run at: refused with its name, never dropped."""
    model = Stateful().eval()
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(out.shape) or out * 2)
    opt = fxmem.optimize(model, ("B", 6))
    x = torch.randn(4, 6)
    assert seen == []  # not called by the analyses and verifications
    assert torch.allclose(opt(x), model(x)) and len(seen) == 2  # once for each call, doubling both
    model.lin.register_forward_pre_hook(lambda m, args: None)
    with pytest.raises(fxmem.ModelError, match="forward pre hook .* on lin: the rewritten graph runs"):
        fxmem.optimize(model, ("B", 6))
