"""The per-module table (torchinfo's summary, exact) against the allocator on real runs.

Evidence: the original model runs for real with a hook on every module that allocates a marker
tensor of a unique size on entry and on exit. The CPU allocator's own event stream (the
profiler's memory events, in order) then says which module was running when each block was
allocated, and which blocks are still allocated when the forward returns: the bytes each module
keeps, with nothing of fxmem's analysis involved.
"""
from __future__ import annotations

import sys

import pytest
import sympy
import torch

import fxmem
from conftest import ROOT, load_example, real_inputs
from fxmem.measure import allocator_events, cpu_memory_profile

MARKER = 1_000_003  # bytes of the first marker; no tensor of these models has an odd size this large


def kept_by_module_on_a_real_run(model: torch.nn.Module, inputs: list[torch.Tensor]) -> dict[str, int]:
    """Module path -> bytes allocated while it (not a submodule) ran and still allocated at the return."""
    markers, held, handles = {}, [], []
    for i, (path, module) in enumerate(model.named_modules()):
        enter, leave = MARKER + 4 * i, MARKER + 4 * i + 2
        markers[enter], markers[leave] = (path, True), (path, False)
        handles.append(module.register_forward_pre_hook(
            lambda m, a, n=enter: held.append(torch.empty(n, dtype=torch.uint8))))
        handles.append(module.register_forward_hook(
            lambda m, a, o, n=leave: held.append(torch.empty(n, dtype=torch.uint8))))
    try:
        model(*inputs)  # warm-up: oneDNN and friends set up their caches
        held.clear()
        with cpu_memory_profile() as prof:
            out = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    stack, alive = [], {}
    for addr, nbytes in allocator_events(prof):
        if nbytes > 0 and nbytes in markers:
            path, entering = markers[nbytes]
            stack.append(path) if entering else stack.pop()
        elif nbytes > 0:
            alive[addr] = (nbytes, stack[-1] if stack else "")
        else:
            alive.pop(addr, None)
    assert not stack and out is not None
    kept: dict[str, int] = {}
    for nbytes, path in alive.values():
        kept[path] = kept.get(path, 0) + nbytes
    return kept


def check_modules(model: torch.nn.Module, specs: tuple, sizes: list[dict], **analyze_kw) -> fxmem.Report:
    report = fxmem.analyze(model, *specs, **analyze_kw)
    symbolic = report.modules()
    for dims in sizes:
        assert all(dims[k] != report.hints[k] for k in dims)  # sizes the analysis did not see
        table = report.modules(dims)
        real = kept_by_module_on_a_real_run(model, real_inputs(report, dims))
        params = dict(model.named_modules())
        for row, formula in zip(table, symbolic):
            inside = [p for p in real if row.path == "" or p == row.path or p.startswith(row.path + ".")]
            assert row.kept == sum(real[p] for p in inside), (row.path, dims)
            assert row.kept == report.at(formula.kept, **dims)  # the formula gives the same number
            module = params[row.path]
            assert row.parameters == sum(p.numel() for p in module.parameters())
            assert row.parameter_bytes == sum(p.numel() * p.element_size() for p in module.parameters())
        if "optimizer" not in analyze_kw:  # a training step's retained is what the step returns with
            assert table[0].kept == report.evaluate(**dims)["retained"]
    return report


def test_attention_module_table_matches_the_allocator():
    attention = load_example("seed_attention").Attention(64, 4)
    report = check_modules(attention, (("B", "L", 64),), [dict(B=3, L=7), dict(B=2, L=19)])
    table = report.modules(dict(B=3, L=7))
    # output shapes in the user's dims, as the real module returns them
    x = torch.randn(3, 7, 64)
    assert [r.path for r in table] == ["", "qkv", "attn_drop", "proj", "proj_drop"]
    assert report.modules()[1].output_shape == (sympy.Symbol("B", positive=True, integer=True),
                                                sympy.Symbol("L", positive=True, integer=True), 192)
    assert table[1].output_shape == tuple(attention.qkv(x).shape)
    assert table[0].output_shape == tuple(attention(x).shape)
    text = str(report.modules())
    assert "qkv" in text and "Linear" in text and "(B, L, 192)" in text


def test_module_table_of_a_training_step_is_the_forwards():
    """With optimizer= the report records backward too (which frees what the forward kept); the
    table still says what each module keeps when the forward returns, as the allocator shows it."""
    attention = load_example("seed_attention").Attention(64, 4)
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    report = check_modules(attention, (("B", "L", 64),), [dict(B=3, L=7), dict(B=2, L=19)], optimizer=adam)
    assert report.modules(dict(B=3, L=7))[0].kept > 0
    plain = fxmem.analyze(attention, ("B", "L", 64))
    assert [r.kept for r in report.modules()] == [r.kept for r in plain.modules()]


def test_transformer_blocks_match_the_allocator():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from analyze_speed import Stack
    finally:
        sys.path.pop(0)
    report = check_modules(Stack(depth=2, dim=32, heads=4), (("B", "L", 32),), [dict(B=2, L=9)])
    table = report.modules(dict(B=2, L=9))
    assert {r.path for r in table} >= {"blocks", "blocks.0", "blocks.0.fc1", "blocks.1.ln2", "ln"}
    drop = next(r for r in table if r.path == "blocks.0.drop")
    assert drop.calls == 3  # one Dropout module called three times per block


def test_eager_and_graph_mode_tables_agree():
    # the eager table comes from hooks on fxmem's copy, the graph one from fx's module stacks
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    eager = fxmem.analyze(model, ("B", 4), mode="eager").modules(dict(B=5))
    graph = fxmem.analyze(model, ("B", 4), mode="graph").modules(dict(B=5))
    assert [(r.path, r.kind, r.output_shape, r.parameters, r.kept, r.calls) for r in eager] == \
        [(r.path, r.kind, r.output_shape, r.parameters, r.kept, r.calls) for r in graph]
    assert not model._forward_hooks and not model[0]._forward_pre_hooks  # hooks only on fxmem's copy
