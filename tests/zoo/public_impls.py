"""Public GAT, GCN and attention implementations as their authors wrote them, restated here from their
published form (not copied): what ``fxmem.optimize`` meets on other people's code.

Each class names the implementation it restates. Graph layers take a node feature matrix and the
graph as its authors pass it (a dense adjacency, an additive connectivity mask or an edge list);
attention layers take (B, L, C) tokens.

>>> layer = PyGATLayer(1433, 8)            # doctest: +SKIP
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# --- graphs -----------------------------------------------------------------------------------------
class PyGATLayer(nn.Module):
    """pyGAT's ``GraphAttentionLayer`` (Diego999/pyGAT, layers.py, current form): the two halves of
    ``a`` applied to Wh separately, their broadcast sum masked by the dense adjacency with -9e15."""

    def __init__(self, fin: int, fout: int, dropout: float = 0.6, alpha: float = 0.2, concat: bool = True):
        super().__init__()
        self.W = nn.Parameter(torch.empty(fin, fout))
        self.a = nn.Parameter(torch.empty(2 * fout, 1))
        nn.init.xavier_uniform_(self.W, gain=1.414)
        nn.init.xavier_uniform_(self.a, gain=1.414)
        self.fout, self.dropout, self.concat = fout, dropout, concat
        self.leakyrelu = nn.LeakyReLU(alpha)

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        Wh = torch.mm(h, self.W)
        e = self.leakyrelu(torch.matmul(Wh, self.a[:self.fout, :]) + torch.matmul(Wh, self.a[self.fout:, :]).T)
        attention = torch.where(adj > 0, e, -9e15 * torch.ones_like(e))
        attention = F.dropout(F.softmax(attention, dim=1), self.dropout, training=self.training)
        h_prime = torch.matmul(attention, Wh)
        return F.elu(h_prime) if self.concat else h_prime


class PyGAT2017Layer(PyGATLayer):
    """pyGAT's first published layer: every (i, j) pair's features concatenated by
    repeat_interleave/repeat into an N x N x 2F tensor, then multiplied by ``a``."""

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        Wh = torch.mm(h, self.W)
        N = Wh.size(0)
        pairs = torch.cat([Wh.repeat_interleave(N, dim=0), Wh.repeat(N, 1)], dim=1).view(N, N, 2 * self.fout)
        e = self.leakyrelu(torch.matmul(pairs, self.a).squeeze(2))
        attention = torch.where(adj > 0, e, -9e15 * torch.ones_like(e))
        attention = F.dropout(F.softmax(attention, dim=1), self.dropout, training=self.training)
        h_prime = torch.matmul(attention, Wh)
        return F.elu(h_prime) if self.concat else h_prime


class PyGAT(nn.Module):
    """pyGAT's ``GAT`` model (models.py): dropout, 8 heads concatenated, dropout, an output layer,
    ELU, log-softmax."""

    def __init__(self, fin: int, hidden: int = 8, classes: int = 7, heads: int = 8, dropout: float = 0.6,
                 layer: type = PyGATLayer):
        super().__init__()
        self.dropout = dropout
        self.attentions = nn.ModuleList([layer(fin, hidden, dropout) for _ in range(heads)])
        self.out_att = layer(hidden * heads, classes, dropout, concat=False)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout, training=self.training)
        x = torch.cat([att(x, adj) for att in self.attentions], dim=1)
        x = F.dropout(x, self.dropout, training=self.training)
        return F.log_softmax(F.elu(self.out_att(x, adj)), dim=1)


class TutorialGATDense(nn.Module):
    """The dense implementation of a well-known PyTorch GAT tutorial (gordicaleksa/pytorch-GAT,
    implementation #3): heads first, source and target scores summed by broadcasting, an additive
    connectivity mask (0 or -inf), softmax, dropout, then the heads' aggregation."""

    def __init__(self, fin: int, fout: int = 8, heads: int = 8, dropout: float = 0.6):
        super().__init__()
        self.heads, self.fout = heads, fout
        self.proj = nn.Linear(fin, heads * fout, bias=False)
        self.scoring_source = nn.Parameter(torch.empty(heads, fout, 1))
        self.scoring_target = nn.Parameter(torch.empty(heads, fout, 1))
        nn.init.xavier_uniform_(self.scoring_source)
        nn.init.xavier_uniform_(self.scoring_target)
        self.leaky = nn.LeakyReLU(0.2)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, connectivity_mask: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        proj = self.proj(self.drop(x)).view(-1, self.heads, self.fout).transpose(0, 1)  # (H, N, F)
        source = torch.bmm(proj, self.scoring_source)  # (H, N, 1)
        target = torch.bmm(proj, self.scoring_target)
        scores = self.leaky(source + target.transpose(1, 2))  # (H, N, N)
        attention = self.drop(torch.softmax(scores + connectivity_mask, dim=-1))
        out = torch.bmm(attention, proj).transpose(0, 1)  # (N, H, F)
        return out.reshape(n, self.heads * self.fout)


class TutorialGATEdges(nn.Module):
    """The edge-list implementation of the same tutorial (implementation #1): scores lifted to the
    edges with index_select, a neighbourhood softmax by scatter_add_, messages summed by
    scatter_add_ (memory linear in E)."""

    def __init__(self, fin: int, fout: int = 8, heads: int = 8, dropout: float = 0.6):
        super().__init__()
        self.heads, self.fout = heads, fout
        self.proj = nn.Linear(fin, heads * fout, bias=False)
        self.scoring_source = nn.Parameter(torch.empty(1, heads, fout))
        self.scoring_target = nn.Parameter(torch.empty(1, heads, fout))
        nn.init.xavier_uniform_(self.scoring_source)
        nn.init.xavier_uniform_(self.scoring_target)
        self.leaky = nn.LeakyReLU(0.2)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        proj = self.proj(self.drop(x)).view(-1, self.heads, self.fout)
        source = (proj * self.scoring_source).sum(dim=-1)  # (N, H)
        target = (proj * self.scoring_target).sum(dim=-1)
        src, dst = edge_index[0], edge_index[1]
        scores = self.leaky(source.index_select(0, src) + target.index_select(0, dst))  # (E, H)
        scores = (scores - scores.max()).exp()
        denominator = torch.zeros(n, self.heads, dtype=scores.dtype).scatter_add_(
            0, dst.unsqueeze(-1).expand_as(scores), scores)
        attention = self.drop(scores / (denominator.index_select(0, dst) + 1e-16))
        messages = proj.index_select(0, src) * attention.unsqueeze(-1)  # (E, H, F)
        out = torch.zeros(n, self.heads, self.fout, dtype=messages.dtype).scatter_add_(
            0, dst.view(-1, 1, 1).expand_as(messages), messages)
        return out.reshape(n, self.heads * self.fout)


class HandGCN(nn.Module):
    """A GCN layer as people write it by hand: a linear map, each edge's weighted message gathered
    and summed into its target with index_add_."""

    def __init__(self, fin: int, fout: int = 64):
        super().__init__()
        self.lin = nn.Linear(fin, fout)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        src, dst = edge_index[0], edge_index[1]
        return torch.zeros_like(h).index_add_(0, dst, h[src] * weight[:, None])


class HandSAGE(nn.Module):
    """GraphSAGE's mean aggregator by hand: neighbours summed with scatter_add_, divided by the
    in-degree, concatenated with the node's own features and mapped."""

    def __init__(self, fin: int, fout: int = 64):
        super().__init__()
        self.lin = nn.Linear(2 * fin, fout)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index[0], edge_index[1]
        total = torch.zeros_like(x).scatter_add_(0, dst[:, None].expand(-1, x.shape[1]), x[src])
        degree = torch.zeros(x.shape[0], dtype=x.dtype).index_add_(0, dst, torch.ones_like(dst, dtype=x.dtype))
        return self.lin(torch.cat([x, total / degree.clamp(min=1)[:, None]], dim=1))


# --- attention --------------------------------------------------------------------------------------
class NanoGPTAttention(nn.Module):
    """nanoGPT's ``CausalSelfAttention`` on its manual path (no flash): a causal ``bias`` buffer
    of ``block_size`` sliced to the sequence, masked_fill with -inf, softmax, dropout (minGPT's is
    the same computation)."""

    def __init__(self, n_embd: int = 768, n_head: int = 12, block_size: int = 1024, dropout: float = 0.0):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT`` (pre-norm blocks of its attention and a GELU MLP, tied embeddings), with its
    ``assert t <= self.config.block_size``: the model bounds its own sequence length."""

    def __init__(self, vocab: int = 64, n_layer: int = 2, n_embd: int = 32, n_head: int = 4, block_size: int = 48,
                 dropout: float = 0.0):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(n_embd), attn=NanoGPTAttention(n_embd, n_head, block_size, dropout),
            ln_2=nn.LayerNorm(n_embd), mlp=nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                                         nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))))
            for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = x + block["attn"](block["ln_1"](x))
            x = x + block["mlp"](block["ln_2"](x))
        return self.lm_head(self.ln_f(x))


class ViTAttention(nn.Module):
    """vit-pytorch's ``Attention``: a LayerNorm, one qkv map chunked in three, heads split with
    einops, scaled dot products, softmax, dropout, heads merged, an output map."""

    def __init__(self, dim: int = 768, heads: int = 12, dim_head: int = 64, dropout: float = 0.0):
        super().__init__()
        inner = dim_head * heads
        self.heads, self.scale = heads, dim_head ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.attend, self.dropout = nn.Softmax(dim=-1), nn.Dropout(dropout)
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        x = self.norm(x)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        attn = self.dropout(self.attend(torch.matmul(q, k.transpose(-1, -2)) * self.scale))
        return self.to_out(rearrange(torch.matmul(attn, v), "b h n d -> b n (h d)"))


class TimmAttention(nn.Module):
    """timm's ``Attention`` with ``fused_attn=False``: one qkv map reshaped and permuted to
    (3, B, H, N, D), q scaled before the product, softmax, dropout, an output map."""

    def __init__(self, dim: int = 768, num_heads: int = 12, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop, self.proj, self.proj_drop = nn.Dropout(attn_drop), nn.Linear(dim, dim), nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q * self.scale
        attn = self.attn_drop((q @ k.transpose(-2, -1)).softmax(dim=-1))
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))
