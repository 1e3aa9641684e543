"""The replay of PyTorch's CUDA caching allocator (fxmem.accounting.caching_allocator).

Evidence, in order of weight: the allocator's own counters recorded on an H100
(``benchmarks/results/cuda_kernels.json``'s probe, and every recording under
``tests/accounting/allocator_recordings/`` that ``benchmarks/allocator_recordings.py`` writes on a
GPU), replayed byte for byte; then cases worked out by hand from c10/cuda/CUDACachingAllocator.cpp.
"""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.accounting import caching_allocator as ca
from fxmem.accounting.cuda_blocks import AllocatorConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
MiB = 2**20


def _probe_steps() -> list[tuple[str, list, dict]]:
    """The H100 probe: (tag, its allocations and frees, the counters after them)."""
    recorded = json.loads((ROOT / "benchmarks/results/cuda_kernels.json").read_text())
    stats = {row["tag"]: row for row in recorded["allocator"]}
    assert recorded["meta"]["gpu"].startswith("NVIDIA")
    # benchmarks/cuda_kernels.py's allocator_probe, step by step
    script = [("13.5MiB fresh", [("alloc", "x", int(13.5 * MiB))]),
              ("12.5MiB fresh", [("alloc", "y", int(12.5 * MiB))]),
              ("3MiB fresh (20MiB seg)", [("alloc", "z", 3 * MiB)]),
              ("a,b 4MiB", [("alloc", "a", 4 * MiB), ("alloc", "b", 4 * MiB)]),
              ("free 3MiB", [("free", "z", 3 * MiB)]),
              ("2.5MiB into freed 3MiB hole?", [("alloc", "c", int(2.5 * MiB))]),
              ("3.5MiB after freeing a 4MiB", [("free", "a", 4 * MiB), ("alloc", "d", int(3.5 * MiB))])]
    return [(tag, events, stats[tag]) for tag, events in script]


def _recordings() -> list[pathlib.Path]:
    return sorted((ROOT / "tests/accounting/allocator_recordings").glob("*.json"))


def test_the_h100_probe_replays_byte_for_byte():
    a = ca.CachingAllocator()
    live: dict = {}
    for tag, events, measured in _probe_steps():
        for action, what, nbytes in events:
            if action == "alloc":
                live[what] = a.malloc(nbytes)
            else:
                a.free(live.pop(what))
        got = {"allocated_bytes": a.allocated, "requested_bytes": a.requested, "reserved_bytes": a.reserved}
        assert got == {k: measured[k] for k in got}, tag


def test_recorded_runs_replay_byte_for_byte():
    """Every recording made on a GPU (its requests and frees in order, and the allocator's segments
    and peak counters at the end): the replay reserves the same segments and reaches the same peaks."""
    found = _recordings()
    for path in found:
        rec = json.loads(path.read_text())
        a = ca.replay([tuple(e) for e in rec["events"]], AllocatorConfig.parse(rec.get("conf", "")))
        assert a.max_reserved == rec["max_reserved"], path.name
        assert a.max_allocated == rec["max_allocated"], path.name
        assert sorted(size for _, size, _ in a.segments) == sorted(rec["segment_sizes"]), path.name
    # the probe is one such recording, in the same form
    events = [e for _, step, _ in _probe_steps() for e in step]
    a = ca.replay(events)
    assert a.reserved == _probe_steps()[-1][2]["reserved_bytes"] == 48 * MiB


def test_small_requests_share_2_mib_segments_and_split_to_512_bytes():
    a = ca.CachingAllocator()
    blocks = [a.malloc(1000) for _ in range(4)]  # 1000 B -> 1024 B blocks, one 2 MiB segment
    assert (a.allocated, a.requested, a.reserved) == (4096, 4000, 2 * MiB)
    a.free(blocks[1])
    a.free(blocks[2])  # merges with its free neighbour: one 2048 B hole
    assert a.malloc(1500).address == blocks[1].address  # best fit: the hole, not the segment's tail
    big = a.malloc(MiB)  # the small pool's largest request: fits the rest of the segment
    assert a.reserved == 2 * MiB and big.size == MiB
    a.malloc(MiB)  # no room left: a second 2 MiB segment
    assert a.reserved == 4 * MiB
    assert a.round_size(1) == 512


def test_large_requests_new_segments_and_when_blocks_stay_whole():
    a = ca.CachingAllocator()
    x = a.malloc(MiB + 512)  # large pool: a 20 MiB segment, split (more than 1 MiB remains)
    assert a.reserved == 20 * MiB and x.size == MiB + 512
    y = a.malloc(int(18.5 * MiB))  # the rest is 18.9995 MiB: leaves under 1 MiB, so taken whole
    assert y.size == 20 * MiB - (MiB + 512) and a.allocated == 20 * MiB
    z = a.malloc(10 * MiB + 1)  # 10 MiB and more: its own segment rounded up to 2 MiB (12 MiB), split
    assert a.reserved == 32 * MiB and z.size == 10 * MiB + 512
    a.free(y)
    a.free(x)  # x and y merge back into one free 20 MiB block
    w = a.malloc(20 * MiB)
    assert w.size == 20 * MiB and a.reserved == 32 * MiB


def test_max_split_size_keeps_big_blocks_for_big_requests():
    config = AllocatorConfig.parse("max_split_size_mb:16")
    a = ca.CachingAllocator(config)
    big = a.malloc(32 * MiB)
    a.free(big)
    small = a.malloc(4 * MiB)  # under max_split: may not take the cached 32 MiB block -> new segment
    assert small.segment == 1 and a.reserved == 52 * MiB
    mid = a.malloc(20 * MiB)  # 16 MiB and more: takes the 32 MiB block whole? only if under 20 MiB larger
    assert mid.segment == 0 and mid.size == 32 * MiB
    a2 = ca.CachingAllocator(config)
    a2.free(a2.malloc(64 * MiB))
    assert a2.malloc(40 * MiB).segment == 1  # 64 MiB is 24 MiB more than asked: not handed out


def test_power_of_two_divisions_round_requests():
    a = ca.CachingAllocator(AllocatorConfig.parse("roundup_power2_divisions:4"))
    assert a.round_size(1200 * 1024) == 1280 * 1024  # between 1 and 2 MiB in steps of 256 KiB
    assert a.round_size(5 * MiB + 1) == 6 * MiB  # between 4 and 8 MiB in steps of 1 MiB
    assert a.round_size(4 * MiB) == 4 * MiB and a.round_size(1000) == 1024


def test_settings_the_replay_does_not_model_are_refused_by_name():
    for text, words in (("expandable_segments:True", "expandable_segments"),
                        ("roundup_power2_divisions:[256:1,512:2,>:4]", "list of intervals"),
                        ("garbage_collection_threshold:0.6", "garbage_collection_threshold")):
        config = AllocatorConfig.parse(text)
        with pytest.raises(fxmem.FxMemError, match=words):
            ca.CachingAllocator(config)
    assert AllocatorConfig.parse("max_split_size_mb:64,expandable_segments:False").unreplayable == ""


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(10))  # the parent's own, registered before its children
        self.inner = nn.Sequential(nn.Linear(64, 256), nn.ReLU())
        self.head = nn.Linear(256, 10)
        self.register_buffer("scale", torch.ones(10))

    def forward(self, x):
        return self.head(self.inner(x)) * self.scale + self.shift


def test_parameters_reach_the_device_in_the_order_model_to_moves_them():
    report = fxmem.analyze(_Mlp(), ("B", 64))
    order = [s.name for s in ca.moved_order(report._plan.rec.storages)]
    m = _Mlp()
    ids = {id(t): n for n, t in [*m.named_parameters(), *m.named_buffers()]}
    seen: list = []
    m._apply(lambda t: seen.append(ids[id(t)]) or t)  # torch's own order, read off a real module
    assert seen[0] == "inner.0.weight" and seen[-2:] == ["shift", "scale"]  # children first
    assert order[:len(seen)] == seen and order[-1] == "x"


def test_a_training_step_reserves_at_least_its_peak_and_replays_to_a_steady_state():
    """A training step on the CPU (its requests are the same numbers): the steps after the first
    reserve nothing new, reserved covers the allocated peak, and a larger batch reserves more."""
    report = fxmem.analyze(_Mlp(), ("B", 64), optimizer=lambda p: torch.optim.AdamW(p))
    plan = report._plan
    last = None
    for b in (8, 3000, 20000):
        values = {report.symbols["B"]: b}
        events, forward = plan.trace(values, raw=True)
        got = ca.predicted_reserved(plan.rec, events, forward, plan.bytes_at(values, raw=True), True,
                                    AllocatorConfig())
        ev = report.evaluate(B=b)
        assert got["train_reserved"] >= ev["train_peak"] and got["reserved"] >= ev["peak"]
        assert got["train_reserved"] % (2 * MiB) == 0
        assert last is None or got["train_reserved"] >= last
        last = got["train_reserved"]


@pytest.mark.cuda_sim
def test_cuda_reports_give_reserved_memory_and_max_size_on_it():
    """device="cuda": evaluate() has ``reserved``, worked out by hand for an MLP at B=20000: the
    parameters (80 KiB) in one 2 MiB small segment, the 5.12 MB input in a 20 MiB segment (split), each
    20.48 MB activation its own 20 MiB segment taken whole (the 491,520 B left is under 1 MiB), the
    800 KB output back in the small segment; max_size(on="reserved") is exact against it."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    report = fxmem.analyze(model, ("B", 64), device="cuda")
    ev = report.evaluate(B=20000)
    assert ev["reserved"] == (2 + 20 + 20 + 20) * MiB
    assert report.evaluate(B=8)["reserved"] == 2 * MiB
    b = report.max_size("B", "100MiB", on="reserved")
    assert report.evaluate(B=b)["reserved"] <= 100 * MiB < report.evaluate(B=b + 1)["reserved"]
    assert report.max_size("B", "100MiB") > b  # allocated bytes fit a larger batch than segments do


@pytest.mark.cuda_sim
def test_llama_forward_reserves_whole_segments():
    """The README's figure: the tiny Llama's forward at B=8, L=128 on device="cuda"."""
    from conftest import load_example
    llama = load_example("llama")
    ids = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    ev = fxmem.analyze(llama.Llama(llama.TINY), ids, device="cuda").evaluate(B=8, L=128)
    assert fxmem.format_bytes(ev["peak"]) == "16.64 MiB" and ev["reserved"] == 34 * MiB
    assert ev["reserved"] % (2 * MiB) == 0 and ev["reserved"] >= ev["peak"]


@pytest.mark.cuda_sim
def test_a_cuda_snapshot_has_the_allocators_segments():
    """report.snapshot() on CUDA: blocks where the caching allocator puts them, its segments (the
    cached blocks included) adding up to ``reserved``; torch's own memory_viz reads them."""
    from torch.cuda import _memory_viz as viz
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    report = fxmem.analyze(model, ("B", 64), device="cuda")
    snap = report.snapshot({"B": 20000})
    assert sum(s["total_size"] for s in snap["segments"]) == report.evaluate(B=20000)["reserved"] == 62 * MiB
    made = [e["size"] for e in snap["device_traces"][0] if e["action"] == "segment_alloc"]
    assert sorted(made) == sorted(s["total_size"] for s in snap["segments"])
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    states = {b["state"] for s in snap["segments"] for b in s["blocks"]}
    assert states == {"active_allocated", "inactive"}  # cached blocks are drawn too
    live = peak = 0
    for e in snap["device_traces"][0]:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, live)
    assert peak == report.evaluate(B=20000)["peak"]
    assert "segments: 4" in viz.segsum(snap) and "total_reserved: 62.0MiB" in viz.segsum(snap)


@pytest.mark.cuda_sim
def test_a_replay_that_cannot_follow_the_log_gives_no_number_and_says_why(monkeypatch):
    report = fxmem.analyze(nn.Linear(8, 8), ("B", 8), device="cuda")

    def broken(*args, **kwargs):
        raise KeyError(("scratch", 3, 0))
    monkeypatch.setattr(ca, "predicted_reserved", broken)
    with pytest.warns(UserWarning, match="could not replay the caching allocator"):
        ev = report.evaluate(B=3)
    assert "reserved" not in ev and ev["peak"] > 0
