"""Small models that exercise what decides exactness: aliasing, in-place ops, several outputs,
buffers, dropout, convolutions with symbolic spatial sizes, integer/bool inputs, einops."""
from __future__ import annotations

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F


class Views(nn.Module):
    """Views and aliases: nothing here allocates except the ops that must copy."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop0 = nn.Dropout(0.0)  # p=0 returns its input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # [B, N, 8]
        t = h.transpose(1, 2)  # view
        e = t.unsqueeze(1).expand(-1, 3, -1, -1)  # view
        v = self.drop0(e)  # alias
        c = v.reshape(v.shape[0], 3, -1)  # reshape of a non-contiguous view: copies
        s = h[:, :2].contiguous()  # slice is a view, contiguous copies
        n = h.narrow(1, 0, 1).view(h.shape[0], -1)  # views
        a, b = h.chunk(2, dim=-1)  # views
        return c.sum(-1) + s.sum((1, 2)).unsqueeze(1) + n.sum(-1, keepdim=True) + (a * b).mean((1, 2)).unsqueeze(1)


class InPlace(nn.Module):
    """In-place ops reuse their input's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = torch.relu(h)
        g = h * 2.0
        g.add_(1.0)
        g.mul_(h)
        g.masked_fill_(mask.unsqueeze(-1), 0.0)
        g += h
        g.clamp_(min=-3.0, max=3.0)
        return g.sigmoid_()


class MultiOut(nn.Module):
    """Several outputs, one of them an alias of an input, one a dict entry."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor):  # noqa: ANN201 - tuple of mixed outputs
        ya = torch.tanh(self.a(x))
        yb = self.b(x)
        top = ya.max(dim=-1)  # values and indices
        return ya, {"b": yb.exp(), "idx": top.indices}, x.view(-1)


class BatchNorms(nn.Module):
    """Buffers updated in place (BatchNorm in training), 1d and 2d."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm1d(12)
        self.lin = nn.Linear(12, 6)
        self.bn2 = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.bn1(x))  # x: [B, 12]
        img = h.unsqueeze(-1).unsqueeze(-1).expand(-1, -1, 4, 5)
        return self.bn2(img).relu()


class Dropouts(nn.Module):
    """Dropout with p > 0 keeps a mask (a float noise tensor on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 20)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x))
        return F.dropout(F.gelu(h), p=0.1, training=self.training)


class ConvPool(nn.Module):
    """Convolutions and pooling over symbolic spatial sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, stride=2)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.c3 = nn.Conv1d(4, 5, 3, padding=2, dilation=2)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        y = F.avg_pool2d(self.c2(y), 2)
        y = F.adaptive_avg_pool2d(y, 1).flatten(1)  # [B, 16]
        z = F.max_pool1d(self.c3(s), 2).mean(-1)  # [B, 5]
        return torch.cat([y, z], dim=1)


class GraphIndex(nn.Module):
    """Integer and bool inputs: an edge list (gather -> message -> scatter-add) and a bool mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # [N, 16]
        src, dst = edge_index[0], edge_index[1]
        msg = h.index_select(0, src) * 0.5  # [E, 16] - the edge-sized message tensor
        out = torch.zeros_like(h).index_add_(0, dst, msg)
        out = out.masked_fill(~keep.unsqueeze(-1), 0.0)
        return F.relu(out)


class Einops(nn.Module):
    """einops.rearrange / reduce / repeat become single nodes and run on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # [B, L, 24]
        heads = einops.rearrange(h, "b l (h d) -> b h l d", h=4)
        pooled = einops.reduce(heads, "b h l d -> b h d", "mean")
        tiled = einops.repeat(pooled, "b h d -> b h r d", r=2)
        return einops.rearrange(tiled, "b h r d -> b (h r d)")


class Block(nn.Module):
    """A pre-norm transformer block (LayerNorm, attention, GELU MLP)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2) / (C // self.heads) ** 0.5).softmax(-1)
        x = x + self.proj((a @ v).transpose(1, 2).reshape(B, L, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 32, heads: int = 4, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x).log_softmax(-1)


class TorchMHA(nn.Module):
    """nn.MultiheadAttention stays a leaf module; it runs on fake tensors as a whole."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.mha(x, x, x, need_weights=False)
        return out


class CachesActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.last = None

    def forward(self, x):
        h = self.fc(x)
        self.last = h * 2  # kept alive by the module after the call: B*64 bytes
        return h.relu()


class ParallelResidual(nn.Module):
    """GPT-NeoX's parallel residual, ``mlp(ln2(x)) + attn(ln1(x)) + x``: the sum's backward hands one
    gradient tensor, unchanged, to all three summands."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        x = x * 2
        return self.mlp(self.ln2(x)) + self.attn(self.ln1(x)) + x


class StridedNet(nn.Module):
    """Two convolutions (one strided) with batch norm: its AdamW step was 27 % under the allocator at
    B=16, 96x80 while its convolution backward's workspace was unknown (tests/kernels/test_measured.py)."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.head(x.mean((2, 3)))


class ScaledOp(nn.Module):
    """``fn(x * w, w)`` with a parameter ``w`` of 6 features: an op under test on a tensor that
    autograd records, as in training."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.fn(x * self.w, self.w)


class Logits(nn.Module):
    """A Hugging Face model's ``.logits``: one tensor to compare and take a loss of (its
    ModelOutput holds other things, a cache, the loss)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(ids).logits
