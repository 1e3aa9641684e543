"""GAT attention over a sparse dense-adjacency's edge list (``settings={"fused-attention": {"edge_list":
True}}``): the kernel equals the dense masked softmax for every adjacency (rows without an edge, a fill
close to the scores, additive masks, masks shared by a batch), ``optimize`` applies it to layers as people
write them, the result computes what the model does on sparse and dense graphs, and fxmem's formulas in
the number of edges (K1) equal the CPU allocator on real runs at sizes and densities the analysis did
not see - the edge list's path below its bound, the dense row blocks' above it."""
from __future__ import annotations

import copy

import pytest
import sympy
import torch
import torch.nn.functional as F

import fxmem
from fxmem import data_paths
from fxmem.errors import SpecError
from fxmem.measure import measure
from fxmem.ops import attention as kernel
from fxmem.ops.edge_attention import edge_attention, kept_edges
from fxmem.training import default_loss, train_step

from zoo import attention_spellings as A
from zoo import public_impls as P
from equivalence import rewritten

EDGES = {"fused-attention": {"edge_list": True}}
# the kernels draw dropout's mask where bernoulli_ draws in order (not PyTorch with MKL on Intel CPUs,
# where the original attention runs while dropout is on: test_fused_attention.py checks that path)
IN_ORDER = pytest.mark.skipif(not kernel.DRAWS_IN_PIECES, reason="this CPU's bernoulli_ draws one stream per call "
                              "(MKL on Intel): the kernels' dropout runs the original attention here")


def _dense(s, t, h, adj, compare, fill, slope):
    """The plain form, written out: every pair's score, masked, softmax over the row, @ h."""
    z = F.leaky_relu(s[..., :, None] + t[..., None, :], slope)
    if compare == "add":
        return torch.softmax(z + adj.unsqueeze(1), -1) @ h
    kept = (adj > 0).unsqueeze(1) if compare == "gt" else (adj != 0).unsqueeze(1)
    return torch.softmax(torch.where(kept, z, torch.full_like(z, fill)), -1) @ h


@pytest.mark.parametrize("gm,gh,am,fill,density,compare", [
    (1, 1, 1, -9e15, 0.2, "gt"),     # pyGAT
    (2, 3, 2, -9e15, 0.3, "gt"),     # a batch of graphs, 3 heads
    (3, 2, 1, -9e15, 0.3, "ne"),     # one graph shared by a batch
    (1, 2, 1, -2.0, 0.3, "gt"),      # a fill close to the scores: masked entries keep weight
    (2, 1, 2, float("-inf"), 0.4, "gt"),
    (1, 1, 1, -9e15, 1.0, "gt"),     # every pair an edge
    (2, 2, 1, 0.0, 0.2, "add"),      # an additive mask (-inf where no edge), with its gradient
])
def test_edge_list_attention_equals_the_dense_softmax(gm, gh, am, fill, density, compare):
    g = torch.Generator().manual_seed(3)
    n, m, f = 9, 7, 4
    s = torch.randn(gm, gh, n, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randn(gm, gh, m, dtype=torch.float64, generator=g, requires_grad=True)
    h = torch.randn(gm, gh, m, f, dtype=torch.float64, generator=g, requires_grad=True)
    edge = torch.rand(am, n, m, generator=g) < density
    edge[:, 1] = density == 1.0  # a row without an edge (uniform over all M, or NaN with fill=-inf)
    if fill == float("-inf"):
        edge[:, 1, 0] = True
    if compare == "add":
        adj = torch.where(edge, torch.randn(am, n, m, dtype=torch.float64, generator=g), float("-inf"))
        edge[:, 1, 2] = True
        adj[:, 1, 2] = 0.5
        adj.requires_grad_(True)
    else:
        adj = edge.double() * torch.rand(am, n, m, dtype=torch.float64, generator=g).add(0.5)
    want = _dense(s, t, h, adj, compare, fill, 0.2)
    weights = torch.randn(want.shape, dtype=torch.float64, generator=g)
    leaves = [s, t, h] + ([adj] if compare == "add" else [])
    want_grads = torch.autograd.grad((want * weights).sum(), leaves)
    with data_paths.forced(True):
        edges = kept_edges(adj.detach(), compare, 0.0, True)
    got = edge_attention(s, t, h, edges, mask_groups=am, fill=fill, slope=0.2,
                         added=adj if compare == "add" else None)
    got_grads = torch.autograd.grad((got * weights).sum(), leaves)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def test_the_edge_list_is_left_to_dense_adjacencies_past_its_bound():
    adj = torch.ones(1, 8, 8)
    assert kept_edges(adj, "gt", 0.0, True) is None  # 64 edges of 64 pairs: more than 1/16
    adj = torch.zeros(1, 8, 8)
    adj[0, 2, 3] = adj[0, 5, 1] = adj[0, 7, 7] = 1.0
    assert kept_edges(adj, "gt", 0.0, True).tolist() == [[2, 5, 7], [3, 1, 7]]


def _graph(n: int, per_row: float, fin: int, seed: int) -> list:
    """Node features and a symmetric 0/1 adjacency with self loops, about ``per_row`` edges a row."""
    g = torch.Generator().manual_seed(seed)
    adj = (torch.rand(n, n, generator=g) < per_row / n).float()
    adj = ((adj + adj.T + torch.eye(n)) > 0).float()
    return [torch.randn(n, fin, generator=g), adj]


def _same_outputs_and_gradients(model, opt, xs):
    for training in (True, False):
        runs = []
        for m in (copy.deepcopy(model).train(training), copy.deepcopy(opt).train(training)):
            out = m(*xs)
            out.sum().backward()
            runs.append([out.detach()] + [p.grad for _, p in sorted(m.named_parameters())])
        for a, b in zip(*runs):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def _equal_to_the_allocator(model, report, step, optimizer_of, graphs) -> None:
    """fxmem's forward (``report``; None: not checked) and training step (``step``) at each of
    ``graphs`` (inputs, dims) against the CPU allocator on real runs (the steps on a copy of ``model``)."""
    real = copy.deepcopy(model)
    optimizer = optimizer_of(real.parameters())
    for xs, dims in graphs:
        if report is not None:
            m = measure(lambda: model(*xs))
            ev = report.evaluate(**dims)
            assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained), dims
        train_step(real, xs, optimizer, default_loss)
        m = measure(lambda: train_step(real, xs, optimizer, default_loss))
        ev = step.evaluate(**dims)
        assert (ev["train_peak"] - ev["train_resident"], ev["train_retained"]) == (m.peak_above_start, m.retained), dims


@pytest.fixture(scope="module")
def two_head_gat():
    torch.manual_seed(0)
    model = P.PyGAT(12, hidden=4, classes=3, heads=2, dropout=0.0)
    specs = (("N", 12), ("N", "N"))
    opt = fxmem.optimize(model, *specs, settings=EDGES)
    return model, specs, opt


def test_optimize_runs_pygat_over_its_edge_list(two_head_gat):
    model, specs, opt = two_head_gat
    applied = [e for e in opt.meta["fxmem"] if e["rule"] == "fused-attention" and e["status"] == "applied"]
    assert len(applied) == 3  # both heads and the output layer
    assert all("kept entries of adj" in e["details"] for e in applied)
    assert all("adjacency too dense for an edge list" in e["decision"] for e in applied)  # both paths compared
    sparse, dense = _graph(160, 3, 12, seed=1), _graph(70, 40, 12, seed=2)
    for xs in (sparse, dense):
        _same_outputs_and_gradients(model, opt, xs)
    for xs, path in ((sparse, True), (dense, False)):  # the edge list on the sparse graph, row blocks on the dense
        with data_paths.asked() as taken:
            opt(*xs)
        assert taken == [path], taken


def test_formulas_in_the_edge_count_equal_the_allocator(two_head_gat):
    """Forward and training step at sparse graphs (the edge list's path; K1 from the data) and at a
    dense one (past the bound: evaluate() re-analyses the row blocks' path), none of them analysed."""
    _, specs, opt = two_head_gat
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    report = fxmem.analyze(opt, *specs)
    step = fxmem.analyze(opt, *specs, optimizer=sgd)
    assert "K1" in report.data_dims and "dense row blocks" in report.data_dims["K1"]
    graphs = [_graph(n, per_row, 12, seed) for n, per_row, seed in ((160, 3, 1), (233, 6, 4), (70, 40, 2))]
    _equal_to_the_allocator(opt, report, step, sgd, [(xs, {"N": xs[0].shape[0], "K1": int((xs[1] > 0).sum())})
                                                     for xs in graphs])


def test_one_edge_is_exact_or_refused(two_head_gat):
    """K1 = 1 makes one-element reductions (another kernel path with several threads): the number
    there equals a real run, or evaluate() refuses with the reason - never a wrong number."""
    _, specs, opt = two_head_gat
    report = fxmem.analyze(opt, *specs)
    xs = [torch.randn(100, 12), torch.zeros(100, 100)]
    xs[1][3, 4] = 1.0
    try:
        ev = report.evaluate(N=100, K1=1)
    except SpecError as exc:
        assert "one-element" in str(exc)
        return
    m = measure(lambda: opt(*xs))
    assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained)


def test_an_additive_connectivity_mask_runs_over_its_edges():
    """The tutorial's dense GAT (heads first, 0/-inf mask added): at a sparse graph the rewrite computes
    what the model does, and its real training step needs less than the model's."""
    torch.manual_seed(0)
    model = P.TutorialGATDense(10, fout=4, heads=2, dropout=0.0)
    opt = fxmem.optimize(model, ("N", 10), ("N", "N"), settings=EDGES)
    assert any(e["rule"] == "fused-attention" and e["status"] == "applied" for e in opt.meta["fxmem"])
    n = opt.fxmem_forms.condition.k + 100 if hasattr(opt, "fxmem_forms") else 700  # the rewritten side
    x, adj = _graph(n, 3, 10, seed=5)
    xs = [x, torch.where(adj > 0, 0.0, float("-inf"))]
    _same_outputs_and_gradients(model, opt, xs)

    def step(m):
        m.zero_grad(set_to_none=True)
        m(*xs).sum().backward()

    peaks = []
    for m in (model, opt):
        step(m)
        peaks.append(measure(lambda: step(m)).peak_above_start)
    assert peaks[1] * 4 < peaks[0], peaks


def test_edge_list_setting_is_checked():
    with pytest.raises(SpecError, match="edge_list.*True or False"):
        fxmem.optimize(P.PyGATLayer(6, 4), ("N", 6), ("N", "N"), settings={"fused-attention": {"edge_list": 1}})


# --- dropout over the edge list: the dense weights' own numbers -------------------------------------------

def _dense_dropped(s, t, h, adj, fill, p, heads_last):
    """The plain form with ``F.dropout`` on its weights, laid out [Gm, Gh, N, M] or heads last."""
    z = F.leaky_relu(s[..., :, None] + t[..., None, :], 0.2)
    weights = torch.softmax(torch.where((adj > 0).unsqueeze(1), z, torch.full_like(z, fill)), -1)
    if heads_last:
        return F.dropout(weights.permute(0, 2, 3, 1).contiguous(), p).permute(0, 3, 1, 2) @ h
    return F.dropout(weights, p) @ h


@IN_ORDER
@pytest.mark.parametrize("gm,gh,am,fill,empty_rows,block_bytes,heads_last", [
    (2, 3, 2, -9e15, (), 4 * 2**20, False),     # one block per group
    (1, 4, 1, -9e15, (0, 16), 600, False),      # rows without an edge (uniform weights), several blocks
    (2, 2, 2, 0.5, (), 500, False),             # a fill close to the scores: every row's masked entries weigh
    (2, 3, 1, -9e15, (3,), 4 * 2**20, True),    # heads last ([B, N, N, H]: PyG's DenseGATConv), a shared mask
    (1, 4, 1, -9e15, (0, 16), 900, True),       # heads last, several blocks, a partial last one
    (2, 2, 2, 0.5, (), 500, True),
])
def test_edge_list_dropout_is_the_dense_weights_own(gm, gh, am, fill, empty_rows, block_bytes, heads_last):
    """With the same seed, the edge list's dropout gives what F.dropout on the dense weights gives (the
    same numbers at the edges, and at the masked entries where they weigh), gradients included, and
    leaves the generator where dropout leaves it."""
    g = torch.Generator().manual_seed(7)
    n, f = 17, 4
    s = torch.randn(gm, gh, n, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randn(gm, gh, n, dtype=torch.float64, generator=g, requires_grad=True)
    h = torch.randn(gm, gh, n, f, dtype=torch.float64, generator=g, requires_grad=True)
    adj = (torch.rand(am, n, n, generator=g) < 0.25).double()
    adj[:, list(empty_rows)] = 0.0
    weights = torch.randn(gm, gh, n, f, dtype=torch.float64, generator=g)
    torch.manual_seed(11)
    want = _dense_dropped(s, t, h, adj, fill, 0.4, heads_last)
    after_want = torch.get_rng_state()
    want_grads = torch.autograd.grad((want * weights).sum(), (s, t, h))
    with data_paths.forced(True):
        edges = kept_edges(adj, "gt", 0.0, True)
    torch.manual_seed(11)
    got = edge_attention(s, t, h, edges, mask_groups=am, fill=fill, slope=0.2, dropout=0.4, heads_last=heads_last,
                         block_bytes=block_bytes)
    assert torch.equal(torch.get_rng_state(), after_want)
    got_grads = torch.autograd.grad((got * weights).sum(), (s, t, h))
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


class _EdgeDropoutOnly(torch.nn.Module):
    """s, t, h from one linear map; the edge-list attention with dropout on its weights (train mode)."""

    def __init__(self, heads: int, block_bytes: int, heads_last: bool, fill: float = -9e15) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, heads * 8)
        self.a, self.b = torch.nn.Parameter(torch.randn(heads, 8)), torch.nn.Parameter(torch.randn(heads, 8))
        self.heads, self.block_bytes, self.heads_last, self.fill = heads, block_bytes, heads_last, fill

    def forward(self, x, adj):
        n = x.shape[0]
        h = self.lin(x).view(1, n, self.heads, 8).permute(0, 2, 1, 3).contiguous()  # [1, H, N, 8]
        s, t = (h * self.a[:, None]).sum(-1), (h * self.b[:, None]).sum(-1)
        edges = kept_edges(adj.unsqueeze(0), "gt", 0.0, True, share=1)
        return edge_attention(s, t, h, edges, mask_groups=1, fill=self.fill, slope=0.2, dropout=0.5,
                              heads_last=self.heads_last, block_bytes=self.block_bytes).sum(1)


@pytest.mark.parametrize("heads,block_bytes,heads_last,fill,dtype", [
    (2, 4 * 2**20, False, -9e15, torch.float32),  # one block per head
    pytest.param(1, 40000, False, -9e15, torch.float32, marks=pytest.mark.slow),  # several blocks, partial last
    (2, 4 * 2**20, True, -9e15, torch.float32),   # heads last: a block is every head's rows, laid apart
    pytest.param(2, 90000, False, 0.5, torch.float64, marks=pytest.mark.slow),  # every row weighs, float64
    (2, 120000, True, 0.5, torch.float32),
])
def test_edge_dropout_rule_matches_real_runs(heads, block_bytes, heads_last, fill, dtype):
    """fxmem's formulas in N and the edge count K1 against the CPU allocator, forward and training
    step (train mode: dropout drawn), at graphs the analysis did not see, with rows without an edge."""
    torch.manual_seed(0)
    model = _EdgeDropoutOnly(heads, block_bytes, heads_last, fill).to(dtype)
    specs = (fxmem.TensorSpec(("N", 6), dtype=dtype), fxmem.TensorSpec(("N", "N"), dtype=dtype))
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    report = fxmem.analyze(model, *specs)
    step = fxmem.analyze(model, *specs, optimizer=sgd)
    graphs = []
    for n, per_row, seed in ((150, 2, 1), (211, 3, 4)):  # sparse: the block of numbers sets the peak
        x, adj = _graph(n, per_row, 6, seed)
        adj[[2, 5]] = 0.0  # rows without an edge
        graphs.append(([x.to(dtype), adj.to(dtype)], {"N": n, "K1": int((adj > 0).sum())}))
    _equal_to_the_allocator(model, report, step, sgd, graphs)


def _seeded_run(model, xs, training):
    """Outputs and parameter gradients of a copy of ``model`` from seed 3 (dropout draws the same)."""
    m = copy.deepcopy(model).train(training)
    torch.manual_seed(3)
    out = m(*xs)
    out.sum().backward()
    return [out.detach()] + [p.grad for _, p in sorted(m.named_parameters())]


def _batched(n: int, per_row: float, fin: int, seed: int) -> list:
    graphs = [_graph(n, per_row, fin, seed + k) for k in range(2)]
    return [torch.stack([g[0] for g in graphs]), torch.stack([g[1] for g in graphs])]


@IN_ORDER
@pytest.mark.parametrize("name", ["pyGAT", pytest.param("heads-last", marks=pytest.mark.slow)])
def test_optimize_draws_dropout_over_the_edge_list(name):
    """pyGAT's model (dropout 0.6 on each head's attention) and PyG DenseGATConv's spelling (heads
    last, a batch of graphs) with the edge-list setting: in train mode the edge list's kernel draws
    the model's own dropout mask - the same outputs and gradients as the model from the same seed, on
    sparse graphs (the edge list) and a dense one (row blocks) - its training step keeps nothing
    N x N, and fxmem's formulas in the edge count K1 equal the allocator at graphs not analysed."""
    torch.manual_seed(0)
    if name == "pyGAT":
        model = P.PyGAT(12, hidden=4, classes=3, heads=2, dropout=0.6)
        specs, make, at = (("N", 12), ("N", "N")), (lambda n, r, s: _graph(n, r, 12, s)), {}
    else:
        model = A.DenseGATLike(dropout=0.6)
        specs, make, at = A.DenseGATLike.SPECS, (lambda n, r, s: _batched(n, r, A.FIN, s)), {"B": 2}
    opt = rewritten(fxmem.optimize(model, *specs, settings=EDGES))
    applied = [e for e in opt.meta["fxmem"] if e["rule"] == "fused-attention" and e["status"] == "applied"]
    assert applied and all("over the edge list it draws the dense weights' numbers" in e["details"] for e in applied)
    sparse, dense = make(160, 3, 1), make(50, 30, 2)
    for xs, path in ((sparse, True), (dense, False)):
        for training in (True, False):
            for a, b in zip(_seeded_run(model, xs, training), _seeded_run(opt, xs, training)):
                # float32 sums in another order (over the edges): relative to the largest magnitude
                assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()), (training, path)
        with data_paths.asked() as taken:
            opt.train()(*xs)
        assert set(taken) == {path}, taken
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    step = fxmem.analyze(opt.train(), *specs, optimizer=sgd)
    assert not [s for s in step.storages if s.kind in ("activation", "gradient") and s.dtype.is_floating_point
                and "N**2" in str(sympy.expand(s.bytes))]
    graphs = [make(n, per_row, seed) for n, per_row, seed in ((190, 3, 4), (257, 2, 6))]
    dims = [{**at, "N": xs[0].shape[-2], "K1": int((xs[1] > 0).sum())} for xs in graphs]
    _equal_to_the_allocator(opt.train(), None, step, sgd, list(zip(graphs, dims)))
    xs = graphs[-1]
    peaks = []
    for m in (copy.deepcopy(model).train(), copy.deepcopy(opt).train()):
        optimizer = sgd(m.parameters())
        train_step(m, xs, optimizer, default_loss)
        peaks.append(measure(lambda: train_step(m, xs, optimizer, default_loss)).peak_above_start)
    assert peaks[1] * 4 < peaks[0], peaks
