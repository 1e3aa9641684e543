"""A Hugging Face causal LM called with ``input_ids`` only (issue 45, item 5).

Without an ``attention_mask`` and without a cache (training, gradient checkpointing,
``use_cache=False``), transformers' ``find_packed_sequence_indices`` (masking_utils) looks at the
position ids ``arange(L)`` the model builds: consecutive ones, so no packed sequences, and no
``(B, 1, L, L)`` mask. It asks ``is_tracing(...)`` first, True for fake tensors, and on its traced
path builds the mask the real run never builds. fxmem follows the arange's values
(fxmem.simulation.progressions), so the check is answered as for the real tensor.

Evidence is the CPU allocator on real runs (fxmem.measure) at sizes the analysis did not see:
inference and a steady-state AdamW training step, ids only and ids with an all-ones mask, for
Llama, Qwen2 and Mistral (a sliding window longer than the sequence)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem import TensorSpec
from fxmem.measure import measure
from fxmem.training import train_step

transformers = pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN2 = {**LLAMA, "model_type": "qwen2", "num_key_value_heads": 1}
MISTRAL = {**LLAMA, "model_type": "mistral", "sliding_window": 4096}  # longer than every sequence here
FAMILIES = {"llama": LLAMA, "qwen2": QWEN2, "mistral-window": MISTRAL}
SIZES = ((3, 37), (2, 70))  # (B, L): not the analysis's example sizes
IDS = TensorSpec(("B", "L"), dtype=torch.long)
MASK = TensorSpec(("B", "L"), dtype=torch.long, fill=1)  # a tokenizer's mask for unpadded sequences


def _model(config: dict, **changes) -> nn.Module:
    """The config's model with random weights on the CPU (``changes`` go into the config)."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                                      if k != "model_type"}, **changes)
    return transformers.AutoModelForCausalLM.from_config(cfg)


class Logits(nn.Module):
    """``model(input_ids=x[, attention_mask=m]).logits``: inference."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class Loss(nn.Module):
    """``model(input_ids=x[, attention_mask=m], labels=x).loss``: what a training step backpropagates."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss


def _inputs(b: int, l: int, with_mask: bool) -> list[torch.Tensor]:
    x = torch.randint(3, 90, (b, l))
    return [x, torch.ones(b, l, dtype=torch.long)] if with_mask else [x]


def _resident(module: nn.Module, inputs: list[torch.Tensor], *more: torch.Tensor) -> int:
    """Bytes of the distinct storages of the real parameters, buffers, inputs (and ``more``)."""
    tensors = [*module.parameters(), *module.buffers(), *inputs, *more]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _real_forward(module: nn.Module, inputs: list[torch.Tensor]) -> tuple[int, int]:
    """(peak above start, retained) of a real inference call after a warm-up call."""
    with torch.no_grad():
        module(*inputs)
        m = measure(lambda: module(*inputs), warmup=0)
    return m.peak_above_start, m.retained


def _real_step(module: nn.Module, inputs: list[torch.Tensor]) -> tuple[int, int, int]:
    """(peak above start, retained, resident with optimizer state) of a steady-state AdamW step."""
    opt = torch.optim.AdamW(module.parameters())
    loss = lambda out: out  # noqa: E731 - the module returns its loss
    train_step(module, inputs, opt, loss)  # the first step makes the optimizer's state
    m = measure(lambda: train_step(module, inputs, opt, loss), warmup=0)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return m.peak_above_start, m.retained, _resident(module, inputs, *state)


def _specs(with_mask: bool) -> tuple:
    return (IDS, MASK) if with_mask else (IDS,)


def _assert_real_path(report: fxmem.Report, with_mask: bool) -> None:
    """Exact, and (ids only) transformers' packed-sequence check answered as the real run answers it."""
    assert report.exact, report.notes
    assert not any("traced path" in n for n in report.notes), report.notes
    if not with_mask:
        assert any(n.startswith("find_packed_sequence_indices") and "real run's path" in n for n in report.notes), \
            report.notes


@pytest.mark.parametrize("with_mask", [False, True], ids=["ids", "ids+mask"])
@pytest.mark.parametrize("family", FAMILIES)
def test_inference_is_exact(family, with_mask):
    model = _model(FAMILIES[family], use_cache=False).eval()  # no cache: the packed-sequence check runs
    report = fxmem.analyze(Logits(model), *_specs(with_mask), grad=False)
    _assert_real_path(report, with_mask)
    for b, l in SIZES:
        xs = _inputs(b, l, with_mask)
        at = report.evaluate(B=b, L=l)
        assert _real_forward(Logits(model), xs) == (at["peak_above_resident"], at["retained"]), (b, l)
        assert at["resident"] == _resident(model, xs), (b, l)


@pytest.mark.parametrize("with_mask", [False, True], ids=["ids", "ids+mask"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_is_exact(family, with_mask):
    model = _model(FAMILIES[family], use_cache=False)
    report = fxmem.analyze(Loss(model).train(), *_specs(with_mask), optimizer=torch.optim.AdamW, loss=lambda out: out)
    _assert_real_path(report, with_mask)
    for b, l in SIZES:
        xs = _inputs(b, l, with_mask)
        at = report.evaluate(B=b, L=l)
        peak, retained, resident = _real_step(Loss(_model(FAMILIES[family], use_cache=False)).train(), xs)
        assert (peak, retained) == (at["train_peak"] - at["train_resident"], at["train_retained"]), (b, l)
        assert at["train_resident"] == resident, (b, l)


def test_checkpointed_training_step_with_ids_only_is_exact():
    """The default config (``use_cache=True``) with gradient checkpointing: transformers turns the
    cache off in training, so the packed-sequence check runs on the default LLM path too."""
    def step_module() -> nn.Module:
        model = _model(LLAMA)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return Loss(model).train()

    report = fxmem.analyze(step_module(), IDS, optimizer=torch.optim.AdamW, loss=lambda out: out)
    _assert_real_path(report, with_mask=False)
    for b, l in SIZES:
        at = report.evaluate(B=b, L=l)
        peak, retained, _ = _real_step(step_module(), _inputs(b, l, False))
        assert (peak, retained) == (at["train_peak"] - at["train_resident"], at["train_retained"]), (b, l)


def test_default_config_inference_with_ids_only_is_exact():
    """``analyze(model, TensorSpec(("B", "L"), dtype=torch.long))`` as a user writes it: the default
    config makes a cache (no packed-sequence check), and the report checks itself against a real run."""
    model = _model(LLAMA).eval()
    report = fxmem.analyze(model, IDS, grad=False)
    assert report.exact, report.notes
    assert report.checked.endswith("equal"), report.checked


def test_position_ids_the_user_gives_are_not_known():
    """Position ids passed in hold values the analysis does not know: the traced path is noted, never
    taken silently (a real run with packed sequences builds the mask, one without does not)."""
    model = _model(LLAMA, use_cache=False).eval()

    class WithPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids):
            return self.model(input_ids=input_ids, position_ids=position_ids).logits

    report = fxmem.analyze(WithPositions(), IDS, IDS, grad=False, check=False)
    assert not report.exact
    assert any(n.startswith("find_packed_sequence_indices") and "traced path" in n for n in report.notes)


def test_llm_answer_from_config_stays_exact():
    answer = fxmem.llm_answer(fxmem.from_config(LLAMA), batch=2, seq=48)
    assert answer.report.exact, answer.report.notes


# -- the values followed, on plain torch code -------------------------------------------------------

class PackedCheck(nn.Module):
    """transformers' packed-sequence check, spelled out: a (B, L, L) tensor only for packed position ids."""

    def __init__(self, write: bool = False):
        super().__init__()
        self.write = write

    def forward(self, x):
        pos = (torch.arange(x.shape[1]) + 0).unsqueeze(0).expand(x.shape[0], -1)
        if self.write:
            pos = pos.clone()
            pos[:, 0] = 7  # the values change: no longer known
        packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        if (packed[:, -1] == 0).all():
            return x * 2
        return x[:, :, None] * x[:, None, :]


def test_an_arange_is_followed_to_the_real_branch():
    model = PackedCheck()
    report = fxmem.analyze(model, ("B", "L"))
    assert report.exact, report.notes
    x = torch.randn(3, 37)
    real = measure(lambda: model(x))
    at = report.evaluate(B=3, L=37)
    assert (at["peak_above_resident"], at["retained"]) == (real.peak_above_start, real.retained)
    assert at["output"] == 3 * 37 * 4  # x * 2, not the (B, L, L) product


def test_a_written_arange_is_not_known():
    with pytest.raises(fxmem.FxMemError, match="values"):
        fxmem.analyze(PackedCheck(write=True), ("B", "L"))


@pytest.mark.parametrize("expr, expected", [
    (lambda p: p[:, 2:] - p[:, :-2], 2),                # a progression minus a shifted one: its step times the shift
    (lambda p: (p * 3)[:, 1:] - (p * 3)[:, :-1], 3),
    (lambda p: torch.cat([p[:, :1] - 1, p], dim=-1)[:, 1:] - p, -1 + 1),
])
def test_progression_arithmetic_matches_torch(expr, expected):
    """The values followed are the ones torch computes (read back through a branch)."""
    class Probe(nn.Module):
        def forward(self, x):
            p = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
            d = expr(p)
            return x * 2 if bool((d == expected).all()) else x

    x = torch.randn(3, 9)
    assert Probe()(x).equal(x * 2)  # the real branch
    report = fxmem.analyze(Probe(), ("B", "L"))
    assert report.exact, report.notes
    assert report.evaluate(B=3, L=9)["output"] == 3 * 9 * 4
