"""The sdpa-flags rule (passes/sdpa_flags.py): an SDPA call given the causal triangle as a mask, or
key/value heads repeated for grouped-query attention, is given ``is_causal=True`` /
``enable_gqa=True`` instead.

Independent evidence: the real training step of the result, measured by the CPU allocator, is
lower than the model's own (also measured) and equal to fxmem's prediction; outputs and gradients
equal the model's in train and eval mode. Look-alikes are declined with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from conftest import check_training_against_real_run
from equivalence import assert_same_in_every_mode
from test_recompute import _measured_step_peak, sgd

SPEC = ("B", "L", 32)


class GroupedAttention(nn.Module):
    """Grouped-query causal attention written as the mask and heads are built by hand (and by Hugging
    Face's code under tracing): ``mask`` picks the mask, ``repeat`` how the key/value heads are copied."""

    def __init__(self, mask: str = "tril-buffer", repeat: str = "interleave", dim: int = 32, heads: int = 4,
                 groups: int = 2) -> None:
        super().__init__()
        self.mask, self.repeat, self.heads, self.groups = mask, repeat, heads, groups
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim * groups // heads)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("tril", torch.tril(torch.ones(256, 256, dtype=torch.bool)), persistent=False)

    def _mask(self, x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor | None:
        L = x.shape[1]
        if self.mask == "tril-buffer":  # True: kept
            return self.tril[:L, :L]
        if self.mask == "float":  # added: 0 kept, -inf masked, built from sizes
            return torch.full((L, L), float("-inf"), device=x.device).triu(1)
        if self.mask == "window":  # a constant mask that is not the triangle: a sliding window of 4
            return self.tril[:L, :L] & ~self.tril[:L, :L].tril(-4)
        if self.mask == "padding":  # data: the caller's padding mask
            return self.tril[:L, :L] & (pad[:, None, None, :] > 0)
        return None

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        B, L, C = x.shape
        D = C // self.heads
        q = self.q(x).view(B, L, self.heads, D).transpose(1, 2)
        k, v = self.kv(x).view(B, L, 2, self.groups, D).permute(2, 0, 3, 1, 4).unbind(0)
        n = self.heads // self.groups
        if self.repeat == "interleave":
            k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        elif self.repeat == "expand":  # Hugging Face's repeat_kv
            k = k[:, :, None].expand(B, self.groups, n, L, D).reshape(B, self.heads, L, D)
            v = v[:, :, None].expand(B, self.groups, n, L, D).reshape(B, self.heads, L, D)
        elif self.repeat == "whole":  # another pairing of query and key heads: not grouped-query attention
            k, v = k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(x, pad))
        return self.out(y.transpose(1, 2).reshape(B, L, C))


def _flags(opt) -> list[dict]:
    return [e for e in opt.meta["fxmem"] if e["rule"] == "sdpa-flags"]


@pytest.mark.parametrize("mask,repeat", [("tril-buffer", "interleave"), ("float", "expand")])
def test_a_causal_mask_and_repeated_heads_become_flags_and_the_real_step_is_lower(mask, repeat):
    torch.manual_seed(0)
    model = GroupedAttention(mask, repeat)
    opt = fxmem.optimize(model, SPEC)
    (entry,) = _flags(opt)
    assert entry["status"] == "applied", entry
    assert "is_causal=True" in entry["details"] and "enable_gqa=True" in entry["details"], entry
    calls = [n for n in opt.graph.nodes if n.target is F.scaled_dot_product_attention]
    assert [(c.kwargs.get("is_causal"), c.kwargs.get("enable_gqa"), c.kwargs.get("attn_mask")) for c in calls] \
        == [(True, True, None)]
    dims = dict(B=4, L=200)
    own = fxmem.analyze(model, SPEC, optimizer=sgd)
    report = check_training_against_real_run(opt, (SPEC,), [dict(B=3, L=37)], sgd, num_threads=1)
    assert _measured_step_peak(opt, report, dims) < _measured_step_peak(model, own, dims)
    assert_same_in_every_mode(model, opt, [torch.randn(2, 11, 32)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask,why", [("window", "other entries than those above the diagonal"),
                                      ("padding", "computed from an input")])
def test_a_mask_that_is_not_the_causal_triangle_stays_and_says_why(mask, why):
    torch.manual_seed(0)
    model = GroupedAttention(mask, "whole")
    specs = (SPEC,) if mask != "padding" else (SPEC, fxmem.TensorSpec(("B", "L"), dtype=torch.int64))
    opt = fxmem.optimize(model, *specs)
    (entry,) = _flags(opt)
    assert entry["status"] == "declined" and why in entry["reason"] + (entry["details"] or ""), entry
    assert any(n.kwargs.get("attn_mask") is not None for n in opt.graph.nodes
               if n.target is F.scaled_dot_product_attention)


def test_heads_repeated_as_a_whole_are_no_grouped_query_attention():
    # k.repeat(1, n, 1, 1) pairs query head h with key head h % groups, not h // (heads / groups):
    # enable_gqa would compute something else; with no mask there is nothing to do, and the record
    # names the call it looked at
    torch.manual_seed(0)
    model = GroupedAttention("none", "whole")
    opt = fxmem.optimize(model, SPEC)
    (entry,) = _flags(opt)
    assert entry["status"] == "no match" and "nearest" in entry["reason"], entry
    assert not any(n.kwargs.get("enable_gqa") for n in opt.graph.nodes)
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(opt(x), model(x))
