"""Dot-product attention written the ways public code writes it (inductor's ``fuse_attention.py``
list among them), and its look-alikes.

Each spelling computes softmax(q·kᵀ·scale [+ mask]) [dropout] @ v and must become SDPA; each
look-alike is attention-shaped but is not that function, or not one SDPA can replace exactly.
``SPECS`` on each class; ``MASK`` marks an input mask (random values, or 0/1 for padding).
"""
from __future__ import annotations

import math

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F

C, H, D = 16, 2, 8


class Heads(nn.Module):
    """q, k, v as [B, H, L, D] from one linear map (view + permute), and an output projection."""

    SPECS: tuple = (("B", "L", C),)

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv, self.proj, self.p = nn.Linear(C, 3 * C), nn.Linear(C, C), dropout

    def split(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        return q, k, v

    def merge(self, out, x):
        return self.proj(out.transpose(1, 2).reshape(x.shape))


# --- spellings -----------------------------------------------------------------------------------------

class DivAfter(Heads):
    """inductor 1: matmul(q, kᵀ).div(inv_scale).softmax(dim=-1).matmul(v)."""

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge(torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(D)).softmax(dim=-1).matmul(v), x)


class ScaleOnQuery(Heads):
    """q scaled before the product by a number computed from its size; F.softmax; k.mT."""

    def forward(self, x):
        q, k, v = self.split(x)
        q = q * q.size(-1) ** -0.5
        return self.merge(F.softmax(q @ k.mT, dim=-1) @ v, x)


class ScaleOnBoth(Heads):
    """inductor 29: q and kᵀ each multiplied by scale**0.5; k transposed by permute."""

    def forward(self, x):
        q, k, v = self.split(x)
        s = D ** -0.25
        return self.merge(torch.softmax((q * s) @ (k.permute(0, 1, 3, 2) * s), -1) @ v, x)


class KeyLaidOut(Heads):
    """k built as [B, H, D, L] directly (no transpose node before the product); torch.full scale (inductor 18)."""

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, v = q.view(B, L, H, D).transpose(1, 2), v.view(B, L, H, D).transpose(1, 2)
        k = k.view(B, L, H, D).permute(0, 2, 3, 1)
        # a 0-dim constant exact in float32 (sqrt(64) = 8 in a real model): fx freezes it at float32, the
        # model in float64 (the verification) would compute sqrt(8) to more digits
        scores = torch.matmul(q, k).div(torch.full([], 4.0))
        return self.merge(scores.softmax(-1) @ v, x)


class Bmm(Heads):
    """inductor 13: heads flattened into the batch, bmm, F.dropout following self.training."""

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (t.reshape(B * H, L, D) for t in self.split(x))
        w = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
        w = F.dropout(w, p=self.p, training=self.training)
        return self.merge(torch.bmm(w, v).view(B, H, L, D), x)


class Einsum(Heads):
    """einsum with heads last, [B, L, H, D] (no permute at all), the scores divided after the product."""

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, H, D).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return self.proj(out.reshape(B, L, C))


class SeedRearrange(Heads):
    """seed 002's spelling: einops.rearrange into K B H L D, (q @ kᵀ) * scale, nn.Dropout module."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = einops.rearrange(self.qkv(x), "B L (K H D) -> K B H L D", K=3, H=H)
        attn = self.drop(((q @ k.transpose(-2, -1)) * D ** -0.5).softmax(dim=-1))
        return self.proj(einops.rearrange(attn @ v, "B H L D -> B L (H D)"))


class AdditiveMask(Heads):
    """inductor 5: (q @ kᵀ / inv_scale) + attn_mask, the mask an input [B, 1, L, L]."""

    SPECS = (("B", "L", C), ("B", 1, "L", "L"))

    def forward(self, x, mask):
        q, k, v = self.split(x)
        return self.merge(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D) + mask, dim=-1) @ v, x)


class PaddingMask(Heads):
    """inductor 15/17: masked_fill((mask == 0).view(B, 1, 1, L).expand_as(scores), full((), -inf)), dropout."""

    SPECS = (("B", "L", C), ("B", "L"))
    MASK = True

    def forward(self, x, mask):
        q, k, v = self.split(x)
        scores = (q @ k.transpose(-2, -1)).div(math.sqrt(D))
        holes = (mask == 0).view(x.shape[0], 1, 1, x.shape[1]).expand_as(scores)
        w = torch.softmax(scores.masked_fill(holes, torch.full((), -float("inf"))), dim=-1)
        return self.merge(F.dropout(w, self.p, training=self.training) @ v, x)


class CausalTriu(Heads):
    """A causal mask built from the length: triu(ones(L, L), 1), filled with -inf."""

    def forward(self, x):
        q, k, v = self.split(x)
        L = x.shape[1]
        holes = torch.triu(x.new_ones(L, L, dtype=torch.bool), diagonal=1)
        return self.merge((q @ k.transpose(-2, -1) * D ** -0.5).masked_fill(holes, float("-inf")).softmax(-1) @ v, x)


class CausalBuffer(Heads):
    """nanoGPT: a tril buffer sliced to the length, masked_fill(bias[:, :, :L, :L] == 0, -inf)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(256, 256)).view(1, 1, 256, 256))

    def forward(self, x):
        q, k, v = self.split(x)
        L = x.shape[1]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :L, :L] == 0, float("-inf")), dim=-1)
        return self.merge(att @ v, x)


class CausalWhere(Heads):
    """HF GPT-2 (inductor 18): where(tril bool buffer, scores, finfo.min) after a division by a 0-dim tensor."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(256, 256, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        q, k, v = self.split(x)
        L = x.shape[1]
        w = torch.matmul(q, k.permute(0, 1, 3, 2)) / torch.full([], 2.0)
        w = torch.where(self.causal[:L, :L], w, torch.full((), torch.finfo(torch.float32).min))
        return self.merge(w.softmax(dim=-1).matmul(v), x)


class CausalAdditive(Heads):
    """An additive causal mask: full(-inf).triu(1) added to the scores."""

    def forward(self, x):
        q, k, v = self.split(x)
        L = x.shape[1]
        bias = x.new_full((L, L), float("-inf")).triu(1)
        return self.merge(torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + bias, -1) @ v, x)


class CastsAround(Heads):
    """inductor 21 in a model's own dtype: score + mask, type_as(q), softmax(-1).type_as(q), no scale."""

    SPECS = (("B", "L", C), ("L", "L"))

    def forward(self, x, mask):
        q, k, v = self.split(x)
        score = (torch.matmul(q, k.permute(0, 1, 3, 2)) + mask).type_as(q)
        return self.merge(score.softmax(dim=-1).to(q.dtype).matmul(v), x)


class TwoLayersOneMask(nn.Module):
    """Two attention layers reading one causal mask, built once: both must go for the mask to go."""

    SPECS = (("B", "L", C),)

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Heads(), Heads()

    def forward(self, x):
        L = x.shape[1]
        holes = torch.triu(x.new_ones(L, L, dtype=torch.bool), diagonal=1)
        for layer in (self.first, self.second):
            q, k, v = layer.split(x)
            x = x + layer.merge((q @ k.transpose(-2, -1) * D ** -0.5).masked_fill(holes, -math.inf).softmax(-1) @ v, x)
        return x


class SharedMaskDropout(nn.Module):
    """Two layers with attention dropout reading one causal mask built once (a GPT's blocks); the
    train-mode fallback must read the mask, not build a second one beside it."""

    SPECS = (("B", "L", C),)

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.first, self.second, self.p = Heads(), Heads(), dropout

    def forward(self, x):
        L = x.shape[1]
        holes = torch.triu(x.new_ones(L, L, dtype=torch.bool), diagonal=1)
        for layer in (self.first, self.second):
            q, k, v = layer.split(x)
            w = (q @ k.transpose(-2, -1) * D ** -0.5).masked_fill(holes, -math.inf).softmax(-1)
            x = x + layer.merge(F.dropout(w, self.p, self.training) @ v, x)
        return x


class FloatMaskDropout(Heads):
    """HF GPT-2's eager attention: a [B, 1, L, L] float mask made from the input, added to the
    scores (and freed once added), then dropout; the train-mode fallback must free it there too."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__(dropout)

    def forward(self, x):
        q, k, v = self.split(x)
        B, L = x.shape[:2]
        bias = x.new_full((B, 1, L, L), float("-inf")).triu(1)
        w = torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + bias, -1)
        return self.merge(F.dropout(w, self.p, self.training) @ v, x)


SPELLINGS = [DivAfter, ScaleOnQuery, ScaleOnBoth, KeyLaidOut, Bmm, Einsum, SeedRearrange, AdditiveMask,
             PaddingMask, CausalTriu, CausalBuffer, CausalWhere, CausalAdditive, CastsAround]
CAUSAL = [CausalTriu, CausalBuffer, CausalWhere, CausalAdditive]


# --- look-alikes ------------------------------------------------------------------------------------------

class SoftmaxOverQueries(Heads):
    """softmax over dim -2: each key's weights add up to 1, not each query's."""

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge((q @ k.transpose(-2, -1) * D ** -0.5).softmax(dim=-2) @ v, x)


class WeightsReturned(Heads):
    """The attention weights are returned too (output_attentions)."""

    def forward(self, x):
        q, k, v = self.split(x)
        w = (q @ k.transpose(-2, -1) * D ** -0.5).softmax(-1)
        return self.merge(w @ v, x), w


class ScoresUsedElsewhere(Heads):
    """The raw scores feed a second output (a logging statistic)."""

    def forward(self, x):
        q, k, v = self.split(x)
        s = q @ k.transpose(-2, -1)
        return self.merge((s * D ** -0.5).softmax(-1) @ v, x) + s.mean()


class MaskWidensScores(nn.Module):
    """One query/key head, a per-head mask [B, H, L, L]: adding it makes the scores H times larger."""

    SPECS = (("B", "L", C), ("B", H, "L", "L"))

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(C, 3 * D)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).unsqueeze(1).split(D, dim=-1)  # [B, 1, L, D]
        return torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + mask, -1) @ v


class LearnedTemperature(Heads):
    """A learned scale (a Parameter): SDPA's scale is a number, and the parameter needs its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge(((q @ k.transpose(-2, -1)) * self.temperature).softmax(-1) @ v, x)


class FiniteFillPadding(PaddingMask):
    """masked_fill(padding, -1e9): a query whose keys are all padding gets uniform weights here."""

    def forward(self, x, mask):
        q, k, v = self.split(x)
        scores = (q @ k.transpose(-2, -1)) * D ** -0.5
        w = scores.masked_fill((mask == 0)[:, None, None, :], -1e9).softmax(-1)
        return self.merge(w @ v, x)


class SoftmaxInFloat32(CastsAround):
    """inductor 21 as written: .float() before the softmax - in a float64 model that rounds to float32."""

    def forward(self, x, mask):
        q, k, v = self.split(x)
        score = torch.matmul(q, k.permute(0, 1, 3, 2)) + mask
        return self.merge(score.float().softmax(dim=-1).type_as(q).matmul(v), x)


class SharedKeys(nn.Module):
    """Multi-query attention: one k and v head broadcast over the query heads."""

    SPECS = (("B", "L", C),)

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(C, C), nn.Linear(C, 2 * D)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, H, D).transpose(1, 2)
        k, v = self.kv(x).unsqueeze(1).split(D, dim=-1)  # [B, 1, L, D]
        return (torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, -1) @ v).transpose(1, 2).reshape(B, L, C)


class CausalThenAdded(CausalWhere):
    """inductor 19 (HF GPT-2 with a padding mask): where(causal, w, finfo.min) + attn_mask - two masks."""

    SPECS = (("B", "L", C), ("B", 1, 1, "L"))

    def forward(self, x, mask):
        q, k, v = self.split(x)
        L = x.shape[1]
        w = torch.where(self.causal[:L, :L], q @ k.transpose(-2, -1) * D ** -0.5, torch.finfo(torch.float32).min)
        return self.merge((w + mask).softmax(-1) @ v, x)


class ScaleAfterSoftmax(Heads):
    """The scale applied to the weights, after the softmax: they no longer add up to 1."""

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge(((q @ k.transpose(-2, -1)).softmax(-1) * D ** -0.5) @ v, x)


class DropoutAlwaysOn(Heads):
    """F.dropout(w, 0.1) with its default training=True: on in eval mode too."""

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge(F.dropout((q @ k.transpose(-2, -1) * D ** -0.5).softmax(-1), 0.1) @ v, x)
