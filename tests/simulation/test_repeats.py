"""Identical repeated blocks are simulated four at a time and their events repeated
(fxmem/simulation/repeats.py, unroll.py).

The evidence is independent of the reuse: the recording made by repeating the blocks' events is
compared, event by event and storage by storage, with the recording of simulating every block
(``repeats=False``), and the predictions of models whose blocks were repeated are compared with
real training steps on the CPU allocator at sizes the analysis did not see.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import fxmem
from zoo.transformers import GPT, TOKENS
from conftest import check_against_real_run, check_training_against_real_run, load_example
from fxmem.capture import trace
from fxmem.records import FREE, STEP, Placed
from fxmem.simulation.repeats import find_chain

llama = load_example("llama")
REPEATED = "run the same code on tensors of the same sizes"


def canonical(rec) -> tuple:
    """A recording with storages named by when they were made: frees noticed at one poll as a set
    (they happen at one moment), steps, node ends and storages with every field that matters."""
    label = {s.index: ("resident", s.name) for s in rec.storages if s.step is None}
    made = 0
    for kind, i in rec.events:
        if kind == STEP:
            for a in rec.steps[i].allocs:
                label[a] = ("made", made)
                made += 1
    out, frees = [], []
    for k, (kind, i) in enumerate(rec.events):
        if k == rec.forward_end or kind != FREE:
            if frees:
                out.append(("free", tuple(sorted(frees, key=repr))))
                frees = []
        if k == rec.forward_end:
            out.append(("forward ends",))
        if kind == FREE:
            frees.append(label[i])
        elif kind == STEP:
            st = rec.steps[i]
            out.append(("step", st.index, st.node, st.op, st.phase, tuple(label[a] for a in st.allocs),
                        tuple(label[p.storage] if isinstance(p, Placed) else str(p) for p in st.program),
                        tuple(label[r] for r in st.reads)))
        else:
            nd = rec.nodes[i]
            out.append(("node", nd.name, nd.op, nd.target, nd.module, nd.first_step, nd.end_step,
                        tuple(label.get(o) for o in nd.outputs), str(nd.shapes), str(nd.value)))
    if frees:
        out.append(("free", tuple(sorted(frees, key=repr))))
    storages = sorted((label[s.index], str(s.bytes), str(s.dtype), str(s.shape), s.role.value, s.name, s.node, s.op,
                       s.step, s.phase.value, s.is_output, tuple(sorted(map(str, s.saved_by))),
                       label.get(s.copy_of)) for s in rec.storages)
    return out, storages


def both(model, *specs, **kw):
    # what is asserted is that the two recordings are equal event by event (real steps, where a caller
    # runs them, at other sizes); the reports' own self-checks (a profiled real step each) decide
    # none of that, so they are skipped here
    kw.setdefault("check", False)
    fast = fxmem.analyze(model, *specs, **kw)
    slow = fxmem.analyze(model, *specs, repeats=False, **kw)
    return fast, slow


def assert_same(fast, slow, count: int):
    assert any(REPEATED in n and f"the {count} blocks" in n for n in fast.notes), fast.notes
    assert not any(REPEATED in n for n in slow.notes)
    a, b = canonical(fast._plan.rec), canonical(slow._plan.rec)
    assert len(a[0]) == len(b[0])
    for x, y in zip(a[0], b[0]):
        assert x == y
    assert a[1] == b[1]
    assert fast.formulas() == slow.formulas()
    for dims in ({"B": 2, "L": 9}, {"B": 5, "L": 33}):
        assert dict(fast.evaluate(**dims)) == dict(slow.evaluate(**dims))
    assert [n.name for n in fast.nodes] == [n.name for n in slow.nodes]


def tiny_llama(layers: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return llama.Llama(dataclasses.replace(llama.TINY, layers=layers))


@pytest.mark.parametrize("optimizer", [None, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                       pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                                    marks=pytest.mark.slow)],
                         ids=["forward", "adamw", "sgd-momentum"])
def test_llama_recording_equals_simulating_every_block(optimizer):
    fast, slow = both(tiny_llama(6), TOKENS, optimizer=optimizer)
    assert_same(fast, slow, 6)


def test_gpt_with_dropout_in_training_and_inference():
    model = GPT(6).train()
    assert_same(*both(model, TOKENS, optimizer=lambda p: torch.optim.Adam(p)), 6)
    assert_same(*both(model, TOKENS, grad=False), 6)


def test_sequential_of_blocks_with_an_input_that_needs_no_grad():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16)) for _ in range(7)])
    fast, slow = both(model, ("B", "L", 16), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert_same(fast, slow, 7)


def test_reused_blocks_match_real_training_steps():
    model = tiny_llama(6)
    report = check_training_against_real_run(model, (TOKENS,), [{"B": 2, "L": 7}, {"B": 3, "L": 16}],
                                             lambda p: torch.optim.AdamW(p, lr=1e-3),
                                             makers={"tokens": lambda shape, sizes: torch.randint(0, 256, shape)})
    assert any(REPEATED in n for n in report.notes)
    report = check_against_real_run(GPT(7).eval(), (TOKENS,), [{"B": 3, "L": 11}],
                                    makers={"tokens": lambda shape, sizes: torch.randint(0, 50, shape)})
    assert any(REPEATED in n for n in report.notes)


def test_foreach_optimizer_steps_are_not_split_per_block_and_every_block_is_simulated():
    fast, slow = both(tiny_llama(5), TOKENS, optimizer=lambda p: torch.optim.Adam(p, foreach=True))
    assert not any(REPEATED in n for n in fast.notes)  # one step over every block's tensors: no reuse
    assert canonical(fast._plan.rec) == canonical(slow._plan.rec)


class Dense(nn.Module):
    """Each block reads the two before it: not a chain."""

    def __init__(self, n: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        prev, cur = x, x
        for b in self.blocks:
            prev, cur = cur, b(cur) + prev
        return cur


class Widening(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8 * (i + 1), 8 * (i + 2)) for i in range(6))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Collecting(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        seen = []
        for b in self.blocks:
            x = b(x)
            seen.append(x)
        return torch.stack(seen)


class Tied(nn.Module):
    """ALBERT-style: one layer's weights used by every block."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(shared, nn.ReLU()) for _ in range(6))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Stem(nn.Module):
    """A container whose first child differs from the six alike ones after it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 16)] + [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(6)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_alike_children_after_one_that_differs_are_a_chain_and_match_real_steps():
    torch.manual_seed(0)
    chain = find_chain(trace(Stem()))
    assert chain is not None and chain.indices == (1, 2, 3, 4, 5, 6)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    assert_same(*both(Stem(), ("B", "L", 8), optimizer=sgd), 6)
    report = check_training_against_real_run(Stem(), (("B", "L", 8),), [{"B": 3, "L": 5}], sgd)
    assert any(REPEATED in n for n in report.notes)


def _recomputing(model: nn.Module, plan: list) -> torch.fx.GraphModule:
    """``model`` traced, its blocks recomputed in backward as ``plan`` says (None: kept)."""
    from fxmem.passes.segments import blocks, extract

    gm = trace(model)
    return extract(gm, [(b, how) for b, how in zip(blocks(gm), plan) if how])


S, W = "selective", "whole"


# a plan that treats one block otherwise (its run of alike blocks: _runs) is also checked, faster, by
# test_alike_children_after_one_that_differs_are_a_chain_and_match_real_steps: these two run in the slow set
@pytest.mark.parametrize("plan, count", [([S] * 6, 6), pytest.param([W] + [S] * 5, 5, marks=pytest.mark.slow),
                                         pytest.param([S] * 5 + [W], 5, marks=pytest.mark.slow)],
                         ids=["all-selective", "whole-first", "whole-last"])
def test_blocks_recomputed_in_backward_still_repeat_and_match_real_steps(plan, count):
    """optimize(budget=)'s plans: each block a torch.utils.checkpoint call of its own module, so
    alike blocks recomputed alike are one chain (a plan that treats one block otherwise: the rest)."""
    torch.manual_seed(0)
    gm = _recomputing(GPT(6).train(), plan)
    assert find_chain(gm).count == count
    adam = lambda p: torch.optim.Adam(p)  # noqa: E731
    assert_same(*both(gm, TOKENS, optimizer=adam), count)
    makers = {"tokens": lambda shape, sizes: torch.randint(0, 50, shape)}
    report = check_training_against_real_run(gm, (TOKENS,), [{"B": 3, "L": 12}], adam, makers=makers)
    assert any(REPEATED in n for n in report.notes)


@pytest.mark.parametrize("model", [Dense(), Widening(), Collecting(), Tied()], ids=lambda m: type(m).__name__)
def test_what_is_not_a_chain_of_identical_blocks_is_simulated_whole(model):
    assert find_chain(trace(model)) is None
    report = fxmem.analyze(model, ("B", 8))
    assert not any(REPEATED in n for n in report.notes)


def test_reanalysis_outside_the_region_keeps_repeating_blocks():
    fast, slow = both(GPT(5), TOKENS, hints={"B": 4, "L": 40})
    assert dict(fast.evaluate(B=1, L=1)) == dict(slow.evaluate(B=1, L=1))


@pytest.mark.slow  # ~60 s; in CI the shortcut is checked by the GPT and Llama tests above, optimize on alike
# layers by tests/passes/test_sdpa.py::test_alike_layers_are_decided_in_one_trial
def test_blocks_rewritten_by_optimize_still_repeat_and_match_real_steps():
    """A rewrite holds a graph per site (the original attention that runs while dropout is on): the
    held graphs compute the same in every block, so the rewritten model's blocks still repeat."""
    torch.manual_seed(0)
    opt = fxmem.optimize(GPT(6).train(), TOKENS)
    assert [e["status"] for e in opt.meta["fxmem"] if e["rule"] == "sdpa"] == ["applied"] * 6
    assert any(k.startswith("_fxmem_original_") for k in vars(opt))
    adam = lambda p: torch.optim.Adam(p)  # noqa: E731
    assert_same(*both(opt.train(), TOKENS, optimizer=adam), 6)
    assert_same(*both(opt.eval(), TOKENS, grad=False), 6)
    makers = {"tokens": lambda shape, sizes: torch.randint(0, 50, shape)}
    report = check_training_against_real_run(opt.train(), (TOKENS,), [{"B": 2, "L": 7}, {"B": 3, "L": 12}], adam,
                                             makers=makers)
    assert any(REPEATED in n for n in report.notes)
