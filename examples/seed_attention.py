"""Seed 002: attention memory, which its author measured line by line - fxmem derives it.

The blog printed ``torch.cuda.memory_allocated()`` after every line of this module at B=64, L=32,
C=512, H=8 (math mode) and found: parameters 4 MB, 8 MB before the forward (parameters + x),
30 MB after it (22 MB of activations kept for backward), 44 MB peak. By hand it derived the
activations as ``BLC*8 + BHLL``. fxmem gives the exact formulas from the code.

Run:  python examples/seed_attention.py
"""
from __future__ import annotations

import einops
import torch
import torch.nn as nn

ATTENTION_MODE = "math"


class Attention(nn.Module):
    """Seed 002's module, as written (math mode is the one it measured)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_scale: float | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        qkv = self.qkv(x)
        if ATTENTION_MODE == "flash":
            qkv = einops.rearrange(qkv, "B L (K H D) -> K B H L D", K=3, H=self.num_heads).float()
            q, k, v = qkv[0], qkv[1], qkv[2]  # B H L D
            x = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            x = einops.rearrange(x, "B H L D -> B L (H D)")
        elif ATTENTION_MODE == "math":
            qkv = einops.rearrange(qkv, "B L (K H D) -> K B H L D", K=3, H=self.num_heads)
            q, k, v = qkv[0], qkv[1], qkv[2]  # B H L D
            attn = (q @ k.transpose(-2, -1)) * self.scale
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = (attn @ v).transpose(1, 2).reshape(B, L, C)
        else:
            raise NotImplementedError(ATTENTION_MODE)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


def main() -> None:
    import fxmem

    seed = dict(B=64, L=32)
    mib = 1024**2
    report = fxmem.analyze(Attention(dim=512, num_heads=8), ("B", "L", 512))
    print(report.summary(seed))
    n = report.evaluate(**seed)
    params = sum(p.numel() * p.element_size() for p in Attention(512).parameters())
    print()
    print(f"  parameters              {params / mib:6.2f} MiB   (seed: 4 MB)")
    print(f"  before forward          {n['resident'] / mib:6.2f} MiB   (seed: 8 MB = parameters + x)")
    print(f"  after forward           {(n['resident'] + n['retained']) / mib:6.2f} MiB   (seed: 30 MB)")
    print(f"  kept by the forward     {n['retained'] / mib:6.2f} MiB   (seed: 22 MB 'activation memory')")
    print(f"  peak (graph mode)       {n['peak'] / mib:6.2f} MiB   (seed: 44 MB, measured on CUDA running the"
          f" original forward, whose locals such as qkv stay alive)")
    attn = [s for s in report.storages if s.kind == "activation" and s.saved_by and s.freed_at is None]
    print("\n  what autograd keeps, and why:")
    for s in attn:
        print(f"    {str(s.bytes):>12} B  {s.op:<16} node {s.node:<10} saved by {', '.join(s.saved_by)}")


if __name__ == "__main__":
    main()
