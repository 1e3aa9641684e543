"""fxmem.optimize on public implementations (tests/zoo/public_impls.py, restated from their published
form): the rewrites they get, verified against the original; and what a TorchDynamo capture must
keep of the model's behaviour (its dtype after ``.double()`` and under autocast).

The large-size figures (Cora, GPT-2 small) are in benchmarks/public_code.py's results.
"""
from __future__ import annotations

import pytest
import torch

import fxmem
from zoo import public_impls as P
from zoo import Logits
from equivalence import assert_same_in_every_mode

EDGES = fxmem.TensorSpec((2, "E"), dtype=torch.int64)


def _graph(n: int = 9, e: int = 30, f: int = 16, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, f, generator=g), torch.randint(0, n, (2, e), generator=g)


def _applied(opt) -> list[str]:
    return sorted({e["rule"] for e in opt.meta["fxmem"] if e["status"] == "applied"})


def test_a_dynamo_captured_graph_follows_the_models_dtype():
    """The tutorial's edge-list GAT makes ``torch.zeros(n, H, dtype=scores.dtype)`` with n from
    ``x.shape[0]``: fx cannot trace it, Dynamo's graph wrote float32 into the zeros, and optimize's
    float64 verification raised a raw RuntimeError. The graph now reads the dtype from the tensor."""
    torch.manual_seed(0)
    model = P.TutorialGATEdges(16)
    opt = fxmem.optimize(model, ("N", 16), EDGES)
    assert "TorchDynamo" in str(opt.meta.get("fxmem_capture", "")) or "fused-message-passing" in _applied(opt)
    assert "fused-message-passing" in _applied(opt), opt.meta["fxmem"]
    x, ei = _graph(n=9, e=40)
    assert_same_in_every_mode(model, opt, [x, ei])
    model.eval(), opt.eval()
    xd = x.double()
    a, b = model.double()(xd, ei), opt.double()(xd, ei)
    assert b.dtype == torch.float64 and torch.allclose(a, b)
    model.float(), opt.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = model(x, ei), opt(x, ei)
    assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("build, specs, rule", [
    (lambda: P.PyGAT2017Layer(16, 8), (("N", 16), ("N", "N")), "fused-attention"),
    (lambda: P.HandGCN(16), (("N", 16), EDGES, ("E",)), "fused-message-passing"),
    (lambda: P.TimmAttention(32, 4), (("B", "L", 32),), "sdpa"),
], ids=["pyGAT-2017", "hand-GCN", "timm-attention"])
def test_public_implementations_get_their_rewrite_without_hints(build, specs, rule):
    torch.manual_seed(0)
    model = build()
    opt = fxmem.optimize(model, *specs)
    assert rule in _applied(opt), opt.meta["fxmem"]
    if rule == "sdpa":
        xs = [torch.randn(2, 5, 32)]
    elif rule == "fused-message-passing":
        x, ei = _graph(n=6, e=30)
        xs = [x, ei, torch.rand(30)]
    else:
        x, _ = _graph(n=7)
        xs = [x, (torch.rand(7, 7) > 0.5).float() + torch.eye(7)]
    assert_same_in_every_mode(model, opt, xs)


def _connectivity(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    adj = (torch.rand(n, n, generator=g) > 0.9) | torch.eye(n, dtype=torch.bool)
    return torch.zeros(n, n).masked_fill(~adj, float("-inf"))


def test_an_additive_mask_is_fused_where_the_kernel_pays():
    """The tutorial's dense GAT masks its scores by adding 0 / -inf. At the example sizes one row
    block holds every row and the fused kernel saves nothing; optimize looks again beyond them, where
    it works in blocks, and switches to the fused form from the size that regime starts at. The
    mask's own gradient is computed (it is an input: verification gives it one)."""
    from fxmem.measure import measure

    torch.manual_seed(0)
    model = P.TutorialGATDense(16, dropout=0.0)
    opt = fxmem.optimize(model, ("N", 16), ("N", "N"))
    switch = [e for e in opt.meta["fxmem"] if e["rule"] == "switch"]
    assert [e["status"] for e in switch] == ["applied"] and "N >= " in switch[0]["condition"], opt.meta["fxmem"]
    start = int(switch[0]["condition"].split(">=")[1])
    assert 100 < start <= 1024
    for n in (7, start + 3):  # each side of the condition: the original form, then the fused one
        x = torch.randn(n, 16)
        assert_same_in_every_mode(model, opt, [x, _connectivity(n)])

    def step_peak(m, xs):
        def step():
            m.zero_grad(set_to_none=True)
            m(*xs).sum().backward()
        step()
        return measure(step).peak_above_start
    xs = [torch.randn(start + 200, 16), _connectivity(start + 200)]
    before, after = step_peak(model, xs), step_peak(opt, xs)
    assert after < before / 2, (before, after)  # 8 heads' N x N scores, softmax and mask gradient gone


def test_the_fused_additive_mask_kernel_is_exact_against_the_allocator():
    """The fused kernel's memory rule in its additive-mask mode (no bool mask block; the mask's
    gradient summed over heads per block), checked on real runs of the rewritten model where its
    fused form runs, forward and an Adam step."""
    from conftest import check_against_real_run, check_training_against_real_run

    torch.manual_seed(0)
    model = P.TutorialGATDense(16, dropout=0.0)
    opt = fxmem.optimize(model, ("N", 16), ("N", "N"))
    start = int(next(e for e in opt.meta["fxmem"] if e["rule"] == "switch")["condition"].split(">=")[1])
    sizes = [dict(N=start + 3), dict(N=start + 40)]
    makers = {"connectivity_mask": lambda shape, dims: _connectivity(shape[0])}
    report = check_against_real_run(opt, (("N", 16), ("N", "N")), sizes, makers=makers)
    assert report.exact, report.notes
    report = check_training_against_real_run(opt, (("N", 16), ("N", "N")), sizes[:1], lambda p: torch.optim.Adam(p),
                                             makers=makers)
    assert report.exact, report.notes
    grad_mask = (("N", 16), fxmem.TensorSpec(("N", "N"), requires_grad=True))  # the mask's gradient too
    report = check_training_against_real_run(opt, grad_mask, sizes[:1], lambda p: torch.optim.Adam(p), makers=makers)
    assert report.exact, report.notes


def test_a_hugging_face_model_is_captured_with_its_output_class_and_its_dropout_flag():
    # transformers' GPT-2: fx cannot trace it; TorchDynamo sees its forward through a decorator's
    # (*args, **kwargs), it returns a ModelOutput, and its nn.Dropout modules are inlined as
    # dropout(p if training else 0): one graph that follows the flag, the attention found by sdpa
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32, use_cache=False,
                                  attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = fxmem.optimize(model, fxmem.TensorSpec(("B", "L"), dtype=torch.int64))
    log = opt.meta["fxmem"]
    assert not [e for e in log if e["rule"] == "train/eval"], log
    # both layers' attention: while dropout is on the original runs and frees the [B, 1, L, L] mask
    # once added, as the model does (it used to be held through the call: declined, 4·B·L² higher)
    assert [e["status"] for e in log if e["rule"] == "sdpa"] == ["applied", "applied"], log
    ids = torch.randint(0, 50, (2, 7))
    assert type(opt(ids)) is type(model(ids))
    assert_same_in_every_mode(Logits(model), Logits(opt), [ids])


def test_a_causal_lm_as_shipped_with_use_cache_is_rewritten_without_its_cache():
    # transformers' default use_cache=True makes every call return a DynamicCache, which no graph
    # returns: it was a TraceError. The result computes with use_cache=False, said in a record; the
    # user's model and config are untouched, and the logits and gradients are the original's
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    assert model.config.use_cache is True  # as shipped
    opt = fxmem.optimize(model, fxmem.TensorSpec(("B", "L"), dtype=torch.int64))
    entry = next(e for e in opt.meta["fxmem"] if e["rule"] == "use_cache")
    assert entry["status"] == "applied" and "past_key_values" in entry["reason"] and "original" in entry["details"]
    ids = torch.randint(0, 64, (2, 7))
    assert model.config.use_cache is True and model(ids).past_key_values is not None
    assert opt(ids).past_key_values is None
    assert_same_in_every_mode(Logits(model), Logits(opt), [ids])


@pytest.mark.slow  # ~45 s; the second graph that is made is checked in CI by
# test_a_size_bound_the_model_asserts_is_a_region_not_a_refusal
def test_where_no_second_graph_can_be_made_the_record_says_so_and_a_budget_there_is_refused(monkeypatch):
    """The second graph at L == block_size is one more pass of the optimize call; where it fails, the result
    runs the model's own forward there, its record does not claim a second graph, and a budget at
    that size the model's own step does not meet is a BudgetError, never silence."""
    import importlib

    from fxmem.passes.recompute import BudgetError

    driver = importlib.import_module("fxmem.passes.optimize")
    original, inner = driver.optimize, driver._optimize

    def failing(model, specs, *rest):  # only the second graph's pass: its spec has L fixed at 48
        if any(isinstance(s, fxmem.TensorSpec) and 48 in s.shape for s in specs):
            raise fxmem.TraceError("no graph here (made to fail by the test)")
        return inner(model, specs, *rest)

    monkeypatch.setattr(driver, "_optimize", failing)
    torch.manual_seed(0)
    model = P.NanoGPT(n_layer=1, block_size=48)
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    opt = original(model, ids)
    log = opt.meta["fxmem"]
    (region,) = [e for e in log if e["rule"] == "region" and e["status"] == "applied"]
    assert "the graph captured at" not in region["reason"] and "own forward at every other size" in region["reason"]
    (declined,) = [e for e in log if e["rule"] == "region" and e["status"] == "declined"]
    assert "made to fail by the test" in declined["details"] and declined["when"] == "L == 48"
    assert_same_in_every_mode(model, opt, [torch.randint(0, 64, (2, 48))], rtol=1e-6, atol=1e-8)
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-4)  # noqa: E731
    step = fxmem.analyze(model, ids, optimizer=adamw).evaluate(B=8, L=48)["train_peak"]
    with pytest.raises(BudgetError, match="no second graph could be made at L == 48"):
        original(model, ids, budget=int(step * 0.75), dims={"B": 8, "L": 48}, optimizer=adamw)


def test_a_size_bound_the_model_asserts_is_a_region_not_a_refusal():
    # nanoGPT's GPT asserts t <= block_size: fx cannot trace it, TorchDynamo's graph holds where
    # L <= block_size. The result runs the rewritten graph there and the model's forward elsewhere
    torch.manual_seed(0)
    model = P.NanoGPT(n_layer=1, block_size=48, dropout=0.1)
    lengths = []  # the user's hook on the model: the result runs it once per call, at every size
    hook = model.register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    opt = fxmem.optimize(model, ids)
    log = opt.meta["fxmem"]
    for t in (5, 48):  # at 48 the second graph runs inside the result: its hooks are the result's
        lengths.clear()
        opt(torch.randint(0, 64, (2, t)))
        assert lengths == [t]
    hook.remove()
    (region,) = [e for e in log if e["rule"] == "region"]
    assert region["status"] == "applied" and "L <= 48" in region["reason"], region
    assert "sdpa" in _applied(opt), log
    assert [n for n, _ in opt.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(opt.state_dict()) == list(model.state_dict())
    # the capture leaves nothing in TorchDynamo's cache of the model's own code (the 9th capture of
    # one class in a process hit the recompile limit; the user's torch.compile would count them)
    from fxmem import _torch_compat as tc
    assert tc.dynamo_cache_entries(P.NanoGPT.forward.__code__) == 0
    assert tc.dynamo_cache_entries(P.NanoGPTAttention.forward.__code__) == 0
    for t in (5, 48):  # inside, and at 48 (a second graph): rewritten, the same outputs and gradients in every mode
        assert_same_in_every_mode(model, opt, [torch.randint(0, 64, (2, t))], rtol=1e-6, atol=1e-8)
    assert [e["status"] for e in log if e["rule"] == "sdpa" and e["when"] == "L == 48"] == ["applied"]
    full = fxmem.TensorSpec(("B", 48), dtype=torch.int64)
    rewritten48 = fxmem.analyze(opt.eval(), full, grad=False).evaluate(B=8)["peak"]
    assert rewritten48 < fxmem.analyze(model.eval(), full, grad=False).evaluate(B=8)["peak"]  # no L x L scores there
    model.train(), opt.train()
    with pytest.raises(AssertionError, match="block size is only 48"):  # outside: the model's own forward
        opt(torch.randint(0, 64, (2, 49)))
    with pytest.raises(fxmem.SpecError, match=r"hints=\{'L': 48\} lie outside .*\(L <= 48 and L != 48"):
        fxmem.optimize(model, ids, hints={"L": 48})  # named as such, not blamed on the shapes
    # fxmem's analysis of the result holds where the graph does, and agrees with the allocator
    report = fxmem.analyze(opt, ids)
    assert "L <= 48" in report.region, report.region
    from conftest import check_against_real_run
    tokens = {"idx": lambda shape, sizes: torch.randint(0, 64, shape)}
    check_against_real_run(opt.eval(), (ids,), [{"B": 3, "L": 40}, {"B": 2, "L": 17}], makers=tokens)
    check_against_real_run(opt.eval(), (full,), [{"B": 3}], makers=tokens)  # the second graph, at L = 48


def test_the_blocks_of_a_captured_graph_are_the_models_own():
    """TorchDynamo names a captured graph's modules after the local the model was called through
    (``L['module']`` in fxmem's capture, ``L['self']`` elsewhere): recomputation's blocks are the
    model's own paths, so a plan that checkpoints them builds (a get_attr of ``L['module'].blocks.0``
    names nothing, and failed the graph's lint). The fast check of the slow test below."""
    from fxmem.capture.whole_graph import capture
    from fxmem.capture import forward_parameters
    from fxmem.passes.segments import blocks, extract
    from fxmem.specs import parse_specs

    torch.manual_seed(0)
    model = P.NanoGPT(n_layer=2, block_size=48)
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    specs, _ = parse_specs((ids,), forward_parameters(model), None, "NanoGPT")
    gm = capture(model, specs, ["idx"])
    found = [b for b in blocks(gm) if b.refusal is None]
    assert [b.name for b in found] == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    plan = extract(gm, [(b, "whole" if k % 2 else "selective") for k, b in enumerate(found)])
    ids_in = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(plan(ids_in), gm(ids_in))


@pytest.mark.slow  # four optimize(budget=) calls; test_recompute.py meets budgets in CI
def test_a_budget_at_the_models_own_size_bound_is_met_or_refused():
    """nanoGPT asserts t <= block_size: a budget inside the region, and at L = block_size (a second
    graph), is met by recomputation there - or refused - never left unmet in silence."""
    torch.manual_seed(0)
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    from fxmem.passes.recompute import BudgetError
    plain = P.NanoGPT(n_layer=2, block_size=48)
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-4)
    step = fxmem.analyze(plain, ids, optimizer=adamw).evaluate(B=8, L=47)["train_peak"]
    fitted = fxmem.optimize(plain, ids, budget=int(step * 0.75), dims={"B": 8, "L": 47}, optimizer=adamw)
    (entry,) = [e for e in fitted.meta["fxmem"] if e["rule"] == "recompute" and e["when"] is None]
    assert entry["status"] == "applied" and entry["peak_at_dims_after"] <= step * 0.75, entry
    assert_same_in_every_mode(plain, fitted, [torch.randint(0, 64, (2, 9))], rtol=1e-6, atol=1e-8)
    with pytest.raises(BudgetError):
        fxmem.optimize(plain, ids, budget=int(step * 0.2), dims={"B": 8, "L": 47}, optimizer=adamw)
    # L = 48, the length nanoGPT trains at, is outside the graph's region (Dynamo guards the slice
    # bias[:, :, :L, :L] at L != 48): a second graph is captured and optimized there, so a budget at
    # L = 48 is met by its recomputation, and the result's step there fits it (fxmem, and the allocator)
    step48 = fxmem.analyze(plain, ids, optimizer=adamw).evaluate(B=8, L=48)["train_peak"]
    at48 = fxmem.optimize(plain, ids, budget=int(step48 * 0.75), dims={"B": 8, "L": 48}, optimizer=adamw)
    (entry,) = [e for e in at48.meta["fxmem"] if e["rule"] == "recompute" and e["when"] == "L == 48"]
    assert entry["status"] == "applied" and entry["peak_at_dims_after"] <= step48 * 0.75, entry
    assert_same_in_every_mode(plain, at48, [torch.randint(0, 64, (2, 48))], rtol=1e-6, atol=1e-8)
    full = fxmem.TensorSpec(("B", 48), dtype=torch.int64)
    from conftest import check_training_against_real_run
    check_training_against_real_run(at48, (full,), [{"B": 3}], adamw,
                                    makers={"idx": lambda shape, sizes: torch.randint(0, 64, shape)})
    assert fxmem.analyze(at48, full, optimizer=adamw).evaluate(B=8)["train_peak"] <= step48 * 0.75
    with pytest.raises(BudgetError):  # below what recomputation reaches at L = 48: refused, not ignored
        fxmem.optimize(plain, ids, budget=int(step48 * 0.2), dims={"B": 8, "L": 48}, optimizer=adamw)
