"""SDPA's own dropout as an opt-in (``passes/sdpa_dropout.py``): ``settings={"sdpa": {"same_distribution": True}}``.

Outputs cannot be compared bit for bit in train mode with p > 0, so the rewrite is checked as
follows, each against the ORIGINAL model (``equivalence.py``, independent of the pass's own checks):

* exactly: eval mode (SDPA without dropout), train mode with the dropout's p set to 0 (the rewrite
  reads an ``nn.Dropout``'s p when it runs, as the model does), and train mode with the model's own
  random bits (``model_bits``, what ``optimize`` verifies under);
* as a distribution, in train mode with p > 0: ``DRAWS`` runs of the original and of the rewrite,
  on independent seeds (fixed: deterministic), of the outputs and a gradient. Two statistics per
  run - the deviation from the pooled mean projected on fixed random weights, and the squared
  deviation summed over the elements - must have the same mean in both samples within ``SIGMAS``
  standard errors estimated from the samples themselves (a two-sample z-test each). The first
  compares the means, the second the spread: a wrong p (the test shows p=0.1 against p=0.3 is
  caught), a missing rescale or no dropout moves one of them by many standard errors;
* SDPA's dropout itself, directly: with v the identity, SDPA's output IS the dropped weights:
  every kept weight is w / (1 - p) exactly, and the fraction zeroed is p within a binomial bound;
* memory: fxmem's analysed training-step peak of the result is lower than the original's on a
  hand-written decoder and on Hugging Face's GPT-2 (eager attention, attn_pdrop=0.1), and equals a
  real training step's on the allocator;
* refusals: dropout written with training=True, dropout not directly on the softmax weights before
  the product with v, dropout on the scores.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from conftest import check_training_against_real_run
from equivalence import assert_same_in_every_mode, run, rewritten
from fxmem.passes import sdpa_dropout as own
from fxmem.passes.base import Probe
from fxmem.passes.sdpa_parts import as_product
from zoo import sdpa_spellings as S
from zoo import Logits
from zoo.transformers import GPT, TOKENS

OPT_IN = {"sdpa": {"same_distribution": True}}
DRAWS, SIGMAS = 200, 5.0
SGD = (lambda p: torch.optim.SGD(p, lr=0.1))


def sdpa_entries(opt: torch.fx.GraphModule) -> list[dict]:
    return [r for r in opt.meta["fxmem"] if r["rule"] == "sdpa"]


@pytest.fixture(scope="module")
def decoder():
    """A hand-written two-block decoder (nn.Dropout(0.1) on the attention weights, the residual and
    the MLP) and its rewrite with the opt-in."""
    torch.manual_seed(0)
    model = GPT(2)
    return model, rewritten(fxmem.optimize(model, TOKENS, settings=OPT_IN))


def tokens(b: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (b, length), generator=torch.Generator().manual_seed(seed))


# --- the record, and what is compared exactly ----------------------------------------------------------

def test_the_record_says_sdpa_draws_the_dropout_now(decoder):
    _, opt = decoder
    entries = sdpa_entries(opt)
    assert [e["status"] for e in entries] == ["applied", "applied"], entries
    for e in entries:
        assert "settings={'sdpa': {'same_distribution': True}}" in e["details"]
        assert "the same distribution, NOT THE SAME RANDOM BITS" in e["details"]
        assert e["verification"] == "passed"
        assert e["train_peak_after"] != e["train_peak_before"]  # the default keeps the training step as it is
    assert opt.code.count(".p;") == 2  # each block's dropout p, read when the graph runs (as nn.Dropout does)


def test_eval_mode_is_the_originals(decoder):
    model, opt = decoder
    xs = [tokens(2, 6)]
    for grad in (True, False):
        want, got = run(model, xs, False, grad), run(opt, xs, False, grad)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12, msg=name)


def test_train_mode_with_p_zero_and_with_the_models_own_bits_is_the_originals(decoder):
    model, opt = decoder
    xs = [tokens(2, 7, seed=1)]
    with own.model_bits():  # what optimize verifies under: the original attention draws the model's bits
        assert_same_in_every_mode(model, opt, xs)
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    try:
        for m in drops:  # the rewrite shares the model's modules and reads p when it runs
            m.p = 0.0
        assert_same_in_every_mode(model, opt, xs)
    finally:
        for m in drops:
            m.p = 0.1


# --- the distribution, in train mode -------------------------------------------------------------------

def samples(module: nn.Module, xs: list, first_seed: int) -> torch.Tensor:
    """[DRAWS, elements]: the train-mode output and block 0's qkv weight gradient, one row per seed."""
    weights = None
    rows = []
    module = module.train()
    for seed in range(first_seed, first_seed + DRAWS):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = module(*xs)
        if weights is None:
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        param = module.get_submodule("blocks.0.qkv").weight
        (grad,) = torch.autograd.grad((out * weights).sum(), [param])
        rows.append(torch.cat([out.detach().flatten(), grad.flatten()]).double())
    return torch.stack(rows)


def differ(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why samples ``a`` and ``b`` ([draws, elements]) are not of one distribution (module doc), or None."""
    pooled = torch.cat([a, b]).mean(0)
    project = torch.randn(pooled.shape, generator=torch.Generator().manual_seed(11), dtype=pooled.dtype)
    for what, stat in (("projected deviation", lambda x: ((x - pooled) * project).sum(1)),
                       ("summed squared deviation", lambda x: ((x - pooled) ** 2).sum(1))):
        sa, sb = stat(a), stat(b)
        error = math.sqrt(float(sa.var() / len(sa) + sb.var() / len(sb)))
        z = abs(float(sa.mean() - sb.mean())) / error
        if z > SIGMAS:
            return f"{what}: {float(sa.mean()):.4g} vs {float(sb.mean()):.4g}, {z:.1f} standard errors apart"
    return None


def test_train_mode_draws_the_models_dropout_distribution(decoder):
    model, opt = decoder
    xs = [tokens(2, 5, seed=2)]
    original = samples(model, xs, 0)
    assert original.std(0).max() > 0  # dropout is on: the draws vary
    assert differ(original, samples(opt, xs, DRAWS)) is None  # other seeds: independent samples
    # the check can fail: the original with another p is told apart from the original with 0.1
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    try:
        for m in drops:
            m.p = 0.3
        assert "standard errors apart" in (differ(original, samples(model, xs, DRAWS)) or "")
    finally:
        for m in drops:
            m.p = 0.1


def test_sdpa_dropout_zeroes_and_rescales_the_weights_as_dropout_does():
    """With v the identity, out[.., i, j] is the dropped weight w_ij: kept ones are w / (1 - p) exactly,
    and the fraction zeroed is p within 5 binomial standard deviations (fixed seed)."""
    p, gen = 0.3, torch.Generator().manual_seed(0)
    q, k = (torch.randn(4, 3, 40, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    eye = torch.eye(40, dtype=torch.float64).expand(4, 3, 40, 40)
    weights = (q @ k.transpose(-2, -1) * 0.25).softmax(-1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        q.requires_grad_()  # under autograd: the CPU path recomputed in backward (checkpoint)
        dropped = own.call(q, k, eye, None, 0.25, False, p)
    zero = dropped == 0
    torch.testing.assert_close(dropped[~zero], (weights / (1 - p))[~zero], rtol=1e-12, atol=0)
    n = zero.numel()
    assert abs(float(zero.sum()) - p * n) <= 5 * math.sqrt(n * p * (1 - p))


# --- the rule's own distribution check can fail ----------------------------------------------------------

class _Attention(nn.Module):
    def forward(self, q, k, v):
        return (q @ k.transpose(-2, -1) * 0.5).softmax(-1) @ v


def _probes():
    gm = torch.fx.symbolic_trace(_Attention())
    probes = []
    for length in (3, 5):
        gen = torch.Generator().manual_seed(length)
        interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
        interp.run(*(torch.randn(2, 2, length, 4, generator=gen) for _ in range(3)))
        probes.append(Probe({"L": length}, dict(interp.env)))
    return gm, probes


@pytest.mark.parametrize("bug,words", [
    (None, None),
    ("twice p", "summed squared deviation"),
    ("no dropout", "summed squared deviation"),
    ("no rescale", "deviation along the mean"),
    ("fresh mask in backward", "does not use the mask its forward drew"),
])
def test_the_rules_distribution_check_refuses_a_wrong_dropout(bug, words):
    gm, probes = _probes()
    q, k, v = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    weights, _, letters = as_product(out, probes[0].env)

    def sdpa(look, p):
        return own.call(look(q), look(k), look(v), None, 0.5, False, p)

    def run_(look, p):
        if bug == "twice p":
            return sdpa(look, 2 * p)
        if bug == "no dropout":
            return sdpa(look, 0.0)
        if bug == "no rescale":
            return sdpa(look, p) * (1 - p)
        if bug == "fresh mask in backward":  # the forward's value, another draw's gradient
            first, second = sdpa(look, p), sdpa(look, p)
            return first.detach() + (second - second.detach())
        return sdpa(look, p)

    why = own.check_distribution(run_, [q, k, v], weights, v, letters, 0.2, probes)
    if words is None:
        assert why is None, why
    else:
        assert why is not None and words in why, why


# --- memory ------------------------------------------------------------------------------------------------

def test_the_analysed_training_peak_is_lower_and_a_real_step_agrees(decoder):
    model, opt = decoder
    before = fxmem.analyze(model, TOKENS, optimizer=SGD)
    after = check_training_against_real_run(opt.train(), (TOKENS,), [{"B": 3, "L": 37}], SGD, num_threads=1,
                                            makers={"tokens": lambda shape, sizes: torch.randint(0, 50, shape)})
    for at in (before.hints, {"B": 4, "L": 64}):
        assert after.evaluate(**at)["train_peak"] < before.evaluate(**at)["train_peak"], at


def test_one_attention_gains_nothing_in_training_and_the_record_says_so():
    """On CPU SDPA's dropout is recomputed in backward: for one attention the step holds the same
    weights again (and the generator's state), so the formulas decline the opt-in's rewrite, with
    the numbers; the default keeps the original nodes in train mode and applies."""
    torch.manual_seed(0)
    model = S.Bmm(dropout=0.3)
    (entry,) = sdpa_entries(fxmem.optimize(model, *S.Bmm.SPECS, settings=OPT_IN))
    assert entry["status"] == "declined" and entry["verification"] == "passed"
    assert "no memory saved" in entry["reason"] and "training-step peak" in entry["reason"]
    assert entry["bytes_after"]["train_peak"] > entry["bytes_before"]["train_peak"]


@pytest.mark.slow  # ~25 s; the quick run checks the lower training peak on the hand-written decoder above
def test_hugging_face_gpt2_trains_in_less_memory_with_the_opt_in():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32, use_cache=False,
                                  attn_implementation="eager", bos_token_id=0, eos_token_id=0, attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(cfg)
    spec = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    opt = rewritten(fxmem.optimize(model, spec, settings=OPT_IN))
    entries = sdpa_entries(opt)
    assert [e["status"] for e in entries] == ["applied", "applied"], entries
    assert all("NOT THE SAME RANDOM BITS" in e["details"] for e in entries)
    ids = tokens(2, 7)
    for grad in (True, False):  # eval mode: the original's outputs and gradients
        want, got = run(Logits(model), [ids], False, grad), run(Logits(opt), [ids], False, grad)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12, msg=name)
    with own.model_bits():  # train mode, the model's own bits
        assert_same_in_every_mode(Logits(model), Logits(opt), [ids])
    before = fxmem.analyze(Logits(model), spec, optimizer=SGD)
    after = fxmem.analyze(Logits(opt), spec, optimizer=SGD)
    for at in (before.hints, {"B": 2, "L": 32}):
        assert after.evaluate(**at)["train_peak"] < before.evaluate(**at)["train_peak"], at


# --- refusals -------------------------------------------------------------------------------------------------

class DropoutThenHeadScale(S.Heads):
    """Dropout on the weights, then a per-head scale before the product with v: not SDPA's dropout_p."""

    def __init__(self) -> None:
        super().__init__(0.1)
        self.register_buffer("head_scale", torch.tensor([1.0, 0.5]).view(1, 2, 1, 1))

    def forward(self, x):
        q, k, v = self.split(x)
        w = F.dropout((q @ k.transpose(-2, -1) * S.D ** -0.5).softmax(-1), self.p, self.training)
        return self.merge((w * self.head_scale) @ v, x)


class DropoutOnScores(S.Heads):
    """Dropout on the scores, before the softmax."""

    def __init__(self) -> None:
        super().__init__(0.1)

    def forward(self, x):
        q, k, v = self.split(x)
        w = F.dropout(q @ k.transpose(-2, -1) * S.D ** -0.5, self.p, self.training).softmax(-1)
        return self.merge(w @ v, x)


@pytest.mark.parametrize("cls,words", [
    (S.DropoutAlwaysOn, ["training=True written in the code", "same_distribution=True is refused"]),
    (DropoutThenHeadScale, ["not directly on the softmax weights", "mul", "same_distribution=True does not apply"]),
    (DropoutOnScores, ["on the scores, before the softmax", "same_distribution=True does not apply"]),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_the_opt_in_is_refused_with_a_record(cls, words):
    torch.manual_seed(0)
    model = cls()
    opt = fxmem.optimize(model, *cls.SPECS, settings=OPT_IN)
    (entry,) = sdpa_entries(opt)
    assert entry["status"] == "declined"
    for w in words:
        assert w in entry["details"], entry["details"]
    assert "scaled_dot_product_attention" not in opt.code and "sdpa" not in opt.code


def test_the_setting_is_a_flag():
    with pytest.raises(fxmem.SpecError, match="same_distribution.*True or False"):
        fxmem.optimize(S.Bmm(dropout=0.1), *S.Bmm.SPECS, settings={"sdpa": {"same_distribution": 1}})
