"""report.modules() for eager-mode analyses (Hugging Face models, which torch.fx cannot trace).

Evidence: a real forward of the same model, its CPU allocator events split by module with marker
allocations made in forward pre/post hooks (a marker of a size the model never allocates, freed at
once: it sits in the event stream exactly where the module starts or ends), each allocation
belonging to the innermost module running; a module's "kept after forward" is what its (and its
submodules') allocations still hold when the forward returns. Sizes the analysis did not see.
"""
from __future__ import annotations

import copy

import pytest
import torch

import fxmem
from fxmem.measure import allocator_events, cpu_memory_profile

transformers = pytest.importorskip("transformers")

_MARK = 1_000_003  # marker sizes: _MARK + 2*i (module i starts), + 1 (it ends); odd, above any tensor here


def _real_kept_by_module(model: torch.nn.Module, x: torch.Tensor, grad: bool) -> dict[str, int]:
    """Bytes each module's forward allocations still hold after a real forward (with submodules')."""
    model = copy.deepcopy(model)
    names = {id(m): n for n, m in model.named_modules()}
    index = {n: k for k, n in enumerate(names.values())}
    handles = []

    def marker(size: int):
        def hook(module, *args):
            del args
            torch.empty(size, dtype=torch.uint8)
        return hook

    for m in model.modules():
        k = index[names[id(m)]]
        handles.append(m.register_forward_pre_hook(marker(_MARK + 2 * k)))
        handles.append(m.register_forward_hook(marker(_MARK + 2 * k + 1), always_call=True))
    with torch.set_grad_enabled(grad):
        model(x)  # warm-up: lazy buffers, caches
        with cpu_memory_profile() as prof:
            out = model(x)
    for h in handles:
        h.remove()
    path = {_MARK + 2 * k: n for n, k in index.items()}
    stack, owner, live, markers = [], {}, {}, set()
    for address, size in allocator_events(prof):
        if size > 0 and size >= _MARK and size - _MARK < 2 * len(index) + 2:
            markers.add(address)
            if (size - _MARK) % 2 == 0:
                stack.append(path[size])
            else:
                stack.pop()
            continue
        if size < 0 and address in markers:
            markers.discard(address)
            continue
        if size > 0:
            live[address], owner[address] = size, stack[-1] if stack else ""
        else:
            live.pop(address, None)
    del out
    kept: dict[str, int] = {}
    for address, size in live.items():
        parts = owner[address].split(".") if owner[address] else []
        for i in range(len(parts) + 1):
            p = ".".join(parts[:i])
            kept[p] = kept.get(p, 0) + size
    return kept


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=256)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_eager_module_rows_match_a_real_forward(make, grad):
    torch.manual_seed(0)
    model = make().eval()
    report = fxmem.analyze(model, fxmem.TensorSpec(("B", "L"), dtype=torch.long), grad=grad)
    assert report.mode == "eager"
    for dims in (dict(B=3, L=37), dict(B=2, L=53)):
        x = torch.randint(0, 90, (dims["B"], dims["L"]))
        real = _real_kept_by_module(model, x, grad)
        rows = {r.path: r for r in report.modules(dims)}
        checked = 0
        for path, row in rows.items():
            assert row.kept == real.get(path, 0), (path, dims)
            checked += row.kept > 0
        assert checked >= (8 if grad else 3)  # the table is not all zeros
        assert rows[""].kept == report.evaluate(**dims)["retained"]
    # parameters per module: the model's own count (a tied weight - GPT-2's lm_head - counts once, to the
    # module named first, as model.named_parameters() lists it)
    table = report.modules()
    for row in table:
        assert row.parameters == sum(p.numel() for name, p in model.named_parameters()
                                     if not row.path or name.startswith(row.path + ".")), row.path
    assert "LlamaDecoderLayer" in str(table) or "GPT2Block" in str(table)


def test_eager_diagram_draws_lines_with_their_data_flow_and_folds_by_module():
    import re

    torch.manual_seed(0)
    model = _llama()
    report = fxmem.analyze(model, fxmem.TensorSpec(("B", "L"), dtype=torch.long))
    dims = dict(B=2, L=40)
    every = report.diagram(dims, group=None)
    allocating = [n.name for n in report.nodes if n.op == "line" and n.allocations]
    svg = every.svg()  # rendered by dot
    assert all(f">{name}<" in svg or name in every.source for name in allocating)
    assert every.source.count("->") > len(allocating) // 2  # lines connected by what they read
    assert "PEAK" in svg
    # the DOT is wired: node ids are ids (eager names are file.py:12, which DOT reads as a port), every
    # edge joins two drawn boxes, and most boxes are joined to another
    node_id = r'("(?:[^"\\]|\\.)*"|[\w.]+)'
    declared = set(re.findall(rf"^\s*{node_id} \[", every.source, re.M))
    edges = re.findall(rf"^\s*{node_id} -> {node_id}[ \n]", every.source, re.M)
    assert edges and all(a in declared and b in declared for a, b in edges), edges[:5]
    joined = {x for edge in edges for x in edge}
    assert len(joined) > 0.8 * len(declared), (len(joined), len(declared))
    grouped = report.diagram(dims, group="module").source
    assert {"model.layers.0", "model.layers.1"} <= set(re.findall(r"<B>(model\.layers\.\d+)</B>", grouped))
    # a layer's box allocates what its lines allocate
    for layer in ("model.layers.0", "model.layers.1"):
        total = sum(report.at(s.bytes, **dims) for n in report.nodes if n.op == "line"
                    and (n.module == layer or n.module.startswith(layer + ".")) for s in n.allocations)
        assert f"allocates {fxmem.format_bytes(total)}" in report.diagram(dims, group="module").svg()
