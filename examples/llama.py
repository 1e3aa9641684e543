"""A Llama-architecture decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention) for
sizing models that do not fit in memory: built under ``torch.device("meta")`` its parameters take
no memory, and fxmem analyses it all the same (shapes and dtypes are all it needs).

    with torch.device("meta"):
        model = Llama(LLAMA_7B)
    report = fxmem.analyze(model, TensorSpec(("B", "L"), dtype=torch.int64))

Written after Meta's reference ``llama/model.py`` (no KV cache: a training / prefill forward).

Run:  python examples/llama.py          (the 7B configuration's formulas; a few seconds)
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32000
    dim: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    hidden: int = 11008
    max_len: int = 4096
    eps: float = 1e-5


LLAMA_7B = Config()
TINY = Config(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, hidden=172, max_len=128)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, L, -1))


class FeedForward(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(c.dim, c.eps), Attention(c)
        self.ffn_norm, self.feed_forward = RMSNorm(c.dim, c.eps), FeedForward(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.norm = RMSNorm(c.dim, c.eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        head_dim = c.dim // c.heads
        freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(c.max_len).float(), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        L = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = torch.narrow(self.cos, 0, 0, L), torch.narrow(self.sin, 0, 0, L)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def main() -> None:
    import fxmem

    tokens = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    with torch.device("meta"):  # 6.7 billion parameters, no memory
        model = Llama(LLAMA_7B).to(torch.bfloat16)
    print(f"Llama-7B configuration: {sum(p.numel() for p in model.parameters()):,} parameters, bfloat16, "
          "built on the meta device")
    start = time.perf_counter()
    forward = fxmem.analyze(model, tokens, dtype=torch.bfloat16)
    took = time.perf_counter() - start
    print(f"\n== one forward with autograd (analysed in {took:.1f} s) ==")
    print(forward.summary(dict(B=1, L=2048)))
    start = time.perf_counter()
    train = fxmem.analyze(model, tokens, dtype=torch.bfloat16, grad=True,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    took = time.perf_counter() - start
    print(f"\n== one AdamW training step (analysed in {took:.1f} s) ==")
    print(train.summary(dict(B=4, L=128)).split("\n  note")[0])


if __name__ == "__main__":
    main()
