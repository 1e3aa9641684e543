"""The fused-attention pass and its kernel (``fxmem.ops.attention``, rules in ``fxmem.kernels.fused``).

* every spelling of GAT attention over decomposed scores is fused: same outputs, gradients and
  buffers as the original in train/eval mode with and without grad (``equivalence.py``, independent
  of the pass's own check), no N x N float tensor left in fxmem's analysis of the result, and that
  analysis equal to the CPU allocator on real runs - forward and training step, one block and many;
* the kernel's rule alone against real runs: several blocks, a last partial block, masks that are
  views, bool and float adjacencies, float64, operands that must be copied;
* look-alikes are declined with the reason, and the graph is left as it was;
* dropout with p > 0: inside the kernel with the model's own random mask (the same outputs and
  gradients from the same seed), or, where the weights are laid out otherwise, the original
  attention in train mode.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zoo import attention_spellings as A
import fxmem
from conftest import check_against_real_run, check_training_against_real_run, load_example
from conftest import quadratic_float_activations as quadratic
from equivalence import assert_same_in_every_mode, rewritten


def optimize(*args, **kw):
    """fxmem.optimize, the form where its rewrites are taken (the switch itself: test_decide.py)."""
    return rewritten(fxmem.optimize(*args, **kw))
from fxmem.ops import attention as kernel
from fxmem.ops.attention import block_rows, masked_attention
from fxmem.passes.modes import trace_modes

seed_gat = load_example("seed_gat")
SEED_SPECS = (("B", "N", 6), ("B", "N", "N"))
# where bernoulli_ draws a tensor in one stream per call (PyTorch with MKL on Intel CPUs) the kernel
# cannot draw dropout's mask: the rewrite then runs the original attention while dropout is on
# (test_where_bernoulli_does_not_draw_in_order_the_original_runs_while_dropout_is_on, on every machine)
IN_ORDER = pytest.mark.skipif(not kernel.DRAWS_IN_PIECES, reason="this CPU's bernoulli_ draws one stream per call "
                              "(MKL on Intel): the kernel's dropout runs the original attention here")
BOOL_ADJ = fxmem.TensorSpec(("N", "N"), dtype=torch.bool)


def specs_of(cls) -> tuple:
    return (("N", A.FIN), BOOL_ADJ) if cls is A.UnbatchedBoolMask else cls.SPECS


def inputs(specs: tuple, sizes: dict, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        dims = spec.shape if isinstance(spec, fxmem.TensorSpec) else spec
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in dims)
        out.append(torch.rand(shape, generator=gen) > 0.5 if isinstance(spec, fxmem.TensorSpec)
                   else torch.randn(shape, generator=gen))
    return out


def fused(opt: torch.fx.GraphModule) -> list[dict]:
    return [r for r in opt.meta["fxmem"] if r["rule"] == "fused-attention"]


def quadratic_float_activations(report: fxmem.Report) -> list:
    """Float storages growing with N**2 (conftest's quadratic_float_activations)."""
    return quadratic(report, "N")


# --- every spelling is fused -------------------------------------------------------------------------

# without dropout every spelling is also compared with the model in
# test_fused_graph_keeps_no_quadratic_tensor_and_fxmem_is_exact: here in the slow set but one
SPELLINGS = [(cls, {}) if cls is A.DecomposedHead else pytest.param(cls, {}, marks=pytest.mark.slow)
             for cls in A.SPELLINGS] + [(A.DecomposedHead, {"dropout": 0.5}), (A.HeadsFirst, {"dropout": 0.3}),
                                        (A.BothExpanded, {"dropout": 0.5})]


@pytest.mark.parametrize("cls,kw", SPELLINGS, ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_spelling_is_fused_and_computes_the_same(cls, kw):
    torch.manual_seed(0)
    model = cls(**kw)
    specs = specs_of(cls)
    opt = optimize(model, *specs)
    (entry,) = fused(opt)
    assert entry["status"] == "applied", entry["reason"]
    assert "no N x N float tensor" in entry["details"]
    for at in ({"B": 2, "N": 5}, {"B": 3, "N": 7}):
        assert_same_in_every_mode(model, opt, inputs(specs, at))


@pytest.mark.parametrize("cls", A.SPELLINGS, ids=lambda c: c.__name__)
def test_fused_graph_keeps_no_quadratic_tensor_and_fxmem_is_exact(cls):
    torch.manual_seed(0)
    model = cls()
    specs = specs_of(cls)
    opt = optimize(model, *specs)
    report = check_against_real_run(opt, specs, [{"B": 3, "N": 17}, {"B": 2, "N": 40}] if "B" in str(specs)
                                    else [{"N": 17}, {"N": 40}])
    assert quadratic_float_activations(report) == []
    assert quadratic_float_activations(fxmem.analyze(model, *specs)) != []  # the original has them
    train = check_training_against_real_run(opt, specs, [{"B": 3, "N": 17}] if "B" in str(specs) else [{"N": 17}],
                                            lambda p: torch.optim.Adam(p))
    assert quadratic_float_activations(train) == []
    for at in ({"B": 2, "N": 5}, {"B": 3, "N": 7}):  # outputs and gradients, train and eval
        assert_same_in_every_mode(model, opt, inputs(specs, at))


def test_seed_layer_pair_rule_then_fused_attention():
    torch.manual_seed(0)
    layer = seed_gat.GraphAttentionLayerFixed(6, 16, dropout=0.0)
    opt = optimize(layer, *SEED_SPECS)
    assert [(r["rule"], r["status"]) for r in opt.meta["fxmem"] if r["status"] != "no match"] == [
        ("pair-linear", "applied"), ("fused-attention", "applied")]
    before = fxmem.analyze(layer, *SEED_SPECS, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    after = check_training_against_real_run(opt, SEED_SPECS, [{"B": 2, "N": 33}], lambda p: torch.optim.SGD(p, lr=0.1))
    at = dict(B=4, N=500)
    b, a = before.evaluate(**at), after.evaluate(**at)
    # what is left above the resident inputs is linear in N (the 4 B N^2 adjacency is an input)
    assert (a["train_peak"] - a["train_resident"]) * 40 < b["train_peak"] - b["train_resident"]
    assert_same_in_every_mode(layer, opt, inputs(SEED_SPECS, {"B": 2, "N": 6}))


def test_many_blocks_are_exact(monkeypatch):
    torch.manual_seed(0)
    model = A.HeadsFirst()
    opt = optimize(model, *A.HeadsFirst.SPECS, settings={"fused-attention": {"block_bytes": 4000}})
    (entry,) = fused(opt)
    assert entry["status"] == "applied" and "4000 bytes" in entry["details"]
    report = check_against_real_run(opt, A.HeadsFirst.SPECS, [{"B": 2, "N": 23}, {"B": 3, "N": 50}])
    # several blocks (a partial last one at N=23): rows per block from the budget
    assert 1 < block_rows(23, 23, 8, 2 * A.HEADS, 2, 4, 4000) < 23 and 23 % block_rows(23, 23, 8, 6, 2, 4, 4000)
    check_training_against_real_run(opt, A.HeadsFirst.SPECS, [{"B": 2, "N": 23}], lambda p: torch.optim.SGD(p, lr=0.1))
    assert_same_in_every_mode(model, opt, inputs(A.HeadsFirst.SPECS, {"B": 2, "N": 9}))
    assert report.region  # the block count is a guard of the formulas' region


# --- the kernel and its rule alone ---------------------------------------------------------------------

class KernelOnly(nn.Module):
    """s, t, h from one linear map; the fused kernel with the given options (h permuted: it is copied)."""

    def __init__(self, heads: int, compare: str, keep: bool, block_bytes: int, permuted: bool,
                 dropout: float = 0.0, heads_last: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(6, heads * 8)
        self.a, self.b = nn.Parameter(torch.randn(heads, 8)), nn.Parameter(torch.randn(heads, 8))
        self.heads, self.compare, self.keep, self.block_bytes, self.permuted = heads, compare, keep, block_bytes, permuted
        self.dropout, self.heads_last = dropout, heads_last

    def forward(self, x, adj):
        B, N = x.shape[0], x.shape[1]
        h = self.lin(x).view(B, N, self.heads, 8)
        h = h.transpose(1, 2) if self.permuted else h.permute(0, 2, 1, 3).contiguous()  # [B, H, N, 8]
        s, t = (h * self.a[:, None]).sum(-1), (h * self.b[:, None]).sum(-1)
        return masked_attention(s, t, h, adj, compare=self.compare, keep=self.keep, block_bytes=self.block_bytes,
                                fill=-1e9, dropout=self.dropout, heads_last=self.heads_last).sum(1)


@pytest.mark.parametrize("heads,compare,keep,block_bytes,permuted,dtype,dropout,heads_last", [
    (2, "gt", True, 4 * 2**20, False, torch.float32, 0.0, False),  # one block
    (2, "gt", True, 3000, True, torch.float32, 0.0, False),  # blocks of one row, h copied
    (3, "eq", False, 20000, False, torch.float32, 0.0, False),  # several rows per block, a partial last one
    (1, "true", True, 10000, False, torch.bool, 0.0, False),  # bool adjacency, its negation allocated
    (2, "true", False, 10000, True, torch.bool, 0.0, False),  # a bool adjacency that says what to drop: a view
    (2, "ne", False, 10000, False, torch.float64, 0.0, False),  # float64 scores and adjacency
    (3, "eq", False, 20000, False, torch.float32, 0.5, False),  # dropout: one group per block, its noise
    (2, "ne", False, 10000, True, torch.float64, 0.2, False),  # dropout in float64 (1 - p wrapped, not cast)
    (3, "gt", True, 20000, False, torch.float32, 0.5, True),  # dropout, heads last: a block is every head's rows
])
def test_kernel_rule_matches_real_runs(heads, compare, keep, block_bytes, permuted, dtype, dropout, heads_last):
    torch.manual_seed(0)
    model = KernelOnly(heads, compare, keep, block_bytes, permuted, dropout, heads_last)
    float_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    model = model.to(float_dtype)
    specs = (fxmem.TensorSpec(("B", "N", 6), dtype=float_dtype), fxmem.TensorSpec(("B", "N", "N"), dtype=dtype))
    sizes = [{"B": 3, "N": 17}, {"B": 2, "N": 41}]
    check_against_real_run(model, specs, sizes, dtype=float_dtype)
    check_training_against_real_run(model, specs, sizes[:1], lambda p: torch.optim.SGD(p, lr=0.1), dtype=float_dtype)


def test_kernel_gradients_match_autograd_of_the_plain_form():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 9, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
    adj = torch.rand(2, 9, 7) > 0.6
    adj[0, 0] = False  # a row with no edge: uniform weights, as the plain form gives

    def plain(s, t, h):
        e = torch.nn.functional.leaky_relu(s[..., None] + t[..., None, :], 0.2)
        return torch.softmax(torch.where(adj[:, None], e, -9e15), -1) @ h

    for block_bytes in (10**9, 300):
        out = masked_attention(s, t, h, adj, compare="true", block_bytes=block_bytes)
        torch.testing.assert_close(out, plain(s, t, h))
        assert torch.autograd.gradcheck(lambda *a: masked_attention(*a, adj, compare="true", block_bytes=block_bytes),
                                        (s, t, h))


# --- look-alikes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,words", [
    (A.GATv2Attention, ["not LeakyReLU(s_i + t_j)", "GATv2"]),
    (A.LearnedBias, ["computed from parameters", "gradient"]),
    (A.DotProductScores, ["not LeakyReLU(s_i + t_j)", "dot products"]),
    (A.ProductScores, ["LeakyReLU's input is mul", "not a broadcast sum"]),
    (A.DropoutAlwaysOn, ["always on", "training=True"]),
    (A.SoftmaxOverRows, ["does not sum over the axis the softmax normalises"]),
    (A.ExpandedOverNewAxis, ["the sum is not s_i + t_j"]),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_lookalike_is_declined(cls, words):
    torch.manual_seed(0)
    model = cls()
    opt = optimize(model, *cls.SPECS)
    (entry,) = fused(opt)
    assert entry["status"] == "declined"
    for w in words:
        assert w in entry["details"], entry["details"]
    if not any(r["status"] == "applied" for r in opt.meta["fxmem"]):
        assert opt.code == trace_modes(model).graph_module.code


def test_an_additive_mask_is_fused_and_computes_the_same():
    """softmax(LeakyReLU(s_i + t_j) + mask): the kernel adds the mask's rows to each block (and
    gives the mask its gradient); a switch picks the fused form where it lowers the peak."""
    torch.manual_seed(0)
    model = A.AdditiveMask()
    opt = optimize(model, *A.AdditiveMask.SPECS)
    assert "applied" in [e["status"] for e in fused(opt)], opt.meta["fxmem"]
    switch = [e for e in opt.meta["fxmem"] if e["rule"] == "switch" and e["status"] == "applied"]
    sides = [{"B": 2, "N": 5}]
    if switch:  # N >= k*B: one size on the fused side too
        k = int(switch[0]["condition"].split(">=")[1].split("*")[0])
        sides.append({"B": 1, "N": k + 2})
    for at in sides:
        assert_same_in_every_mode(model, opt, inputs(A.AdditiveMask.SPECS, at))


def test_seed_layer_as_written_is_not_fused():
    # cat on dim=1: the pair rule declines, so the scores stay a linear map over scrambled pairs
    torch.manual_seed(0)
    opt = optimize(seed_gat.GraphAttentionLayer(6, 16), *SEED_SPECS)
    (entry,) = fused(opt)
    assert entry["status"] == "declined" and "LeakyReLU's input is matmul" in entry["details"]


# --- dropout in training ---------------------------------------------------------------------------------

@IN_ORDER
@pytest.mark.parametrize("cls,p", [(A.DecomposedHead, 0.6), (A.HeadsFirst, 0.3), (A.DenseGATLike, 0.6)],
                         ids=["functional", "module", "heads-last"])
def test_dropout_runs_inside_the_kernel_with_the_models_own_mask(cls, p):
    """pyGAT's dropout (p=0.6) on the attention: the kernel draws the model's own mask (same outputs
    and gradients as the original in train mode), so the training step keeps no N x N tensor either,
    and fxmem's analysis of it equals the allocator on a real step."""
    torch.manual_seed(0)
    model = cls(dropout=p)
    opt = optimize(model, *cls.SPECS)
    (entry,) = fused(opt)
    assert entry["status"] == "applied" and f"dropout (p={p:g}) inside the kernel" in entry["details"], entry
    assert entry["train_peak_after"] != entry["train_peak_before"]
    step = check_training_against_real_run(opt.train(), cls.SPECS, [{"B": 2, "N": 23}],
                                           lambda q: torch.optim.SGD(q, lr=0.1))
    assert quadratic_float_activations(step) == []
    assert set(opt.state_dict()) == set(model.state_dict())
    assert_same_in_every_mode(model, opt, inputs(cls.SPECS, {"B": 2, "N": 6}))


def test_where_the_kernel_cannot_draw_the_mask_the_original_runs_while_dropout_is_on(monkeypatch):
    """Weights laid out in another order than the kernel visits them: the fused kernel runs in eval
    mode, the original attention (the model's own dropout) in train mode."""
    import fxmem.passes.fused_attention as rule

    monkeypatch.setattr(rule, "_draws_in_order", lambda weights, order: False)
    torch.manual_seed(0)
    model = A.DecomposedHead(dropout=0.6)
    opt = optimize(model, *A.DecomposedHead.SPECS)
    (entry,) = fused(opt)
    assert entry["status"] == "applied" and "while dropout (p=0.6) is on (train mode) the original" in entry["details"]
    # train mode: the same memory as before (the original nodes run); eval mode without grad: less
    assert entry["train_peak_after"] == entry["train_peak_before"]
    assert entry["inference_peak_after"] != entry["inference_peak_before"]
    inference = fxmem.analyze(opt.eval(), *A.DecomposedHead.SPECS, grad=False)
    assert quadratic_float_activations(inference) == []
    check_against_real_run(opt.eval(), A.DecomposedHead.SPECS, [{"B": 3, "N": 17}], grad=False)
    check_against_real_run(opt.train(), A.DecomposedHead.SPECS, [{"B": 3, "N": 17}])
    assert_same_in_every_mode(model, opt, inputs(A.DecomposedHead.SPECS, {"B": 2, "N": 6}))


@IN_ORDER
@pytest.mark.cuda_sim
def test_on_cuda_the_original_attention_runs_while_dropout_is_on():
    """CUDA's dropout draws by offsets, not in memory order, so the kernel cannot draw the model's
    mask there: on CUDA the rewritten graph runs the original attention while dropout is on (fxmem's
    CUDA analysis keeps the N x N weights for backward), on the CPU the kernel with the dropout."""
    torch.manual_seed(0)
    model = A.DecomposedHead(dropout=0.6)
    opt = optimize(model, *A.DecomposedHead.SPECS)
    (entry,) = fused(opt)
    assert entry["status"] == "applied" and "dropout (p=0.6) inside the kernel" in entry["details"], entry
    on_cuda = fxmem.analyze(opt.train(), *A.DecomposedHead.SPECS, device="cuda")
    on_cpu = fxmem.analyze(opt.train(), *A.DecomposedHead.SPECS)
    assert quadratic_float_activations(on_cuda) and not quadratic_float_activations(on_cpu)


@IN_ORDER
def test_the_kernels_dropout_is_the_models_own():
    """The kernel with dropout against the plain form with F.dropout, from the same seed: the same
    outputs bit for bit, the same gradients, and the generator left where F.dropout leaves it - one
    group and several (mask per group or shared), one block and many; and with ``heads_last`` as
    dropout over weights laid out [Gm, N, M, Gh] (PyG's DenseGATConv) draws."""
    F = torch.nn.functional
    for gm, gh, am, block_bytes, heads_last in ((1, 1, 1, 10**9, False), (1, 1, 1, 300, False), (2, 3, 2, 300, False),
                                                (2, 3, 1, 10**9, False), (2, 3, 2, 300, True), (2, 3, 1, 10**9, True),
                                                (1, 4, 1, 700, True)):
        s = torch.randn(gm, gh, 9, dtype=torch.float64, requires_grad=True)
        t = torch.randn(gm, gh, 7, dtype=torch.float64, requires_grad=True)
        h = torch.randn(gm, gh, 7, 4, dtype=torch.float64, requires_grad=True)
        adj = torch.rand(am, 9, 7) > 0.6

        def plain(s, t, h):
            e = F.leaky_relu(s[..., None] + t[..., None, :], 0.2)
            w = torch.softmax(torch.where(adj[:, None], e, -9e15), -1)
            if heads_last:  # the weights [Gm, N, M, Gh] in memory, as the model has them
                return F.dropout(w.permute(0, 2, 3, 1).contiguous(), 0.4, True).permute(0, 3, 1, 2) @ h
            return F.dropout(w, 0.4, True) @ h

        def fused_form(s, t, h):
            return masked_attention(s, t, h, adj, compare="true", block_bytes=block_bytes, dropout=0.4,
                                    heads_last=heads_last)

        runs = []
        for fn in (fused_form, plain):
            torch.manual_seed(5)
            out = fn(s, t, h)
            after = torch.rand(3)
            weights = torch.arange(out.numel(), dtype=out.dtype).view_as(out)
            runs.append((out, torch.autograd.grad((out * weights).sum(), (s, t, h)), after))
        (out, grads, after), (out2, grads2, after2) = runs
        assert torch.equal(out, out2) and torch.equal(after, after2), (gm, gh, am, block_bytes, heads_last)
        for a, b in zip(grads, grads2):
            torch.testing.assert_close(a, b)


def test_settings_are_checked():
    with pytest.raises(fxmem.SpecError, match="no pass is called"):
        optimize(A.HeadsFirst(), *A.HeadsFirst.SPECS, settings={"fused": {}})
    with pytest.raises(fxmem.SpecError, match="block_size.*cannot be set"):
        optimize(A.HeadsFirst(), *A.HeadsFirst.SPECS, settings={"fused-attention": {"block_size": 3}})
    with pytest.raises(fxmem.SpecError, match="positive int"):
        optimize(A.HeadsFirst(), *A.HeadsFirst.SPECS, settings={"fused-attention": {"block_bytes": -1}})


def test_where_bernoulli_does_not_draw_in_order_the_original_runs_while_dropout_is_on(monkeypatch):
    """On a machine whose bernoulli_ takes one stream per call (PyTorch with MKL on Intel CPUs), a
    kernel drawing block by block cannot draw dropout's mask: the rule says so and the rewritten graph
    runs the original attention while dropout is on (the model's own numbers), the kernel in eval
    mode. A module optimized where the kernel drew the mask does the same when run on such a machine."""
    torch.manual_seed(0)
    model = A.DecomposedHead(dropout=0.6)
    drawing = optimize(model, *A.DecomposedHead.SPECS)  # made where the kernel draws (or not: then as below)
    monkeypatch.setattr(kernel, "DRAWS_IN_PIECES", False)
    opt = optimize(model, *A.DecomposedHead.SPECS)
    (entry,) = fused(opt)
    assert entry["status"] == "applied" and "draws each call from a stream of its own" in entry["details"], entry
    assert entry["train_peak_after"] == entry["train_peak_before"]
    assert entry["inference_peak_after"] != entry["inference_peak_before"]
    for module in (opt, drawing):
        assert_same_in_every_mode(model, module, inputs(A.DecomposedHead.SPECS, {"B": 2, "N": 6}))
    step = check_training_against_real_run(drawing.train(), A.DecomposedHead.SPECS, [{"B": 2, "N": 23}],
                                           lambda q: torch.optim.SGD(q, lr=0.1))
    assert quadratic_float_activations(step)  # the original's N x N weights, kept for backward
