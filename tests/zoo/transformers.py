"""Small GPT-style decoders for tests and benchmarks: a chain of alike blocks (what repeats= cuts to
four), dropout in attention and MLP, token ids in."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem

class GPTBlock(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, p: float = 0.1):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = self.drop((q @ k.transpose(-1, -2) * (C // self.heads) ** -0.5).softmax(-1))
        x = x + self.drop(self.proj((a @ v).transpose(1, 2).reshape(B, L, C)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, depth: int = 6, dim: int = 32, vocab: int = 50):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


TOKENS = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
