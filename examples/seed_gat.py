"""Seed 000: why GAT takes so much memory - fxmem derives the blog's numbers from the trace.

The blog (a batched pyGAT layer) computed by hand that the attention's pair tensor
``a_input`` of shape [B, N, N, 2F] costs 4*B*N*N*2F bytes: 0.95 GB at B=4, N=500, F=128, and
11.9 GB for an output head with 1600 classes. fxmem gets these from the code itself.

Run:  python examples/seed_gat.py
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GraphAttentionLayer(nn.Module):
    """Seed 000's batched GAT layer, exactly as written in the blog.

    NOTE: the blog concatenates on ``dim=1`` (the N*N axis), not on the feature axis. The result
    is then viewed as [B, N, N, 2F], so its "pairs" are not (h_i, h_j): row (i, j) holds two
    consecutive rows of the stacked [repeat-interleaved; tiled] tensor. This scrambles the
    attention (the same mistake exists in public code); ``GraphAttentionLayerFixed`` is the
    intended computation. Memory is the same either way.
    """

    def __init__(self, in_features: int = 6, out_features: int = 128, dropout: float = 0.6,
                 alpha: float = 0.2, concat: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dropout, self.alpha, self.concat = dropout, alpha, concat
        self.W = nn.Parameter(torch.empty(in_features, out_features))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.empty(2 * out_features, 1))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(self.alpha)

    def pairs(self, h: torch.Tensor, N: int) -> torch.Tensor:
        return torch.cat([h.repeat(1, 1, N).view(-1, N * N, self.out_features),
                          h.repeat(1, N, 1)], dim=1).view(-1, N, N, 2 * self.out_features)

    def forward(self, inp: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(inp, self.W)  # [B, N, out_features]
        N = h.size()[1]
        a_input = self.pairs(h, N)  # [B, N, N, 2*out_features] - the memory hog
        e = self.leakyrelu(torch.matmul(a_input, self.a).squeeze(3))  # [B, N, N]
        zero_vec = -9e15 * torch.ones_like(e)
        attention = torch.where(adj > 0, e, zero_vec)
        attention = F.softmax(attention, dim=2)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, h)
        return F.elu(h_prime) if self.concat else h_prime


class GraphAttentionLayerFixed(GraphAttentionLayer):
    """The same layer with the concatenation on the feature axis: row (i, j) is (Wh_i || Wh_j)."""

    def pairs(self, h: torch.Tensor, N: int) -> torch.Tensor:
        return torch.cat([h.repeat(1, 1, N).view(-1, N * N, self.out_features),
                          h.repeat(1, N, 1)], dim=2).view(-1, N, N, 2 * self.out_features)


class GAT(nn.Module):
    """The seed's network: 8 heads of 128 features concatenated, then an output head (1600 classes)."""

    def __init__(self, nfeat: int = 6, nhid: int = 128, nclass: int = 1600, nheads: int = 8,
                 dropout: float = 0.6, alpha: float = 0.2, layer: type = GraphAttentionLayerFixed):
        super().__init__()
        self.dropout = dropout
        self.attentions = nn.ModuleList([layer(nfeat, nhid, dropout, alpha, concat=True) for _ in range(nheads)])
        self.out_att = layer(nhid * nheads, nclass, dropout, alpha, concat=False)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout, training=self.training)
        x = torch.cat([att(x, adj) for att in self.attentions], dim=2)
        x = F.dropout(x, self.dropout, training=self.training)
        x = F.elu(self.out_att(x, adj))
        return F.log_softmax(x, dim=2)


def main() -> None:
    import fxmem

    specs = (("B", "N", 6), ("B", "N", "N"))
    seed = dict(B=4, N=500)

    print("== Seed 000's layer, as written (cat on dim=1; 6 -> 128 features) ==")
    layer = fxmem.analyze(GraphAttentionLayer(6, 128), *specs)
    print(layer.summary(seed))
    pair = next(s for s in layer.storages if s.op == "aten.cat")
    print(f"\n  pair tensor a_input: {pair.shape} -> {pair.bytes} bytes")
    pair_bytes = layer.at(pair.bytes, **seed)
    print(f"  at B=4, N=500: {pair_bytes:,} B = {pair_bytes / 1024**3:.2f} GiB   (seed: 0.95 GB)")

    print("\n== The seed's network: 8 heads x 128 features + a 1600-class output head ==")
    net = fxmem.analyze(GAT(6, 128, 1600, 8), *specs)
    print(net.summary(seed))
    head = next(s for s in net.storages if s.op == "aten.cat" and s.module == "out_att")
    hb = net.at(head.bytes, **seed)
    print(f"\n  output head pair tensor: {head.bytes} bytes = {hb / 1024**3:.1f} GiB at B=4, N=500 (seed: 11.9 GB)")
    saved_pairs = [s for s in net.storages if s.op == "aten.cat" and s.saved_by and s.freed_at is None]
    print(f"  pair tensors autograd keeps for backward: {len(saved_pairs)} of 9 "
          f"(the seed expected each head's to be freed; that holds only without grad)")
    node = next(n for n in net.nodes if n.name == net.peak_node(**seed))
    print(f"  the peak is reached in node {node.name} ({node.module}, {node.source}: {node.source.code})")

    print("\n== How large a batch fits a 32 GB card (N=500)? ==")
    adam = lambda params: torch.optim.Adam(params, lr=5e-3)  # noqa: E731 - pyGAT's optimizer
    for label, model in (("the layer (6 -> 128, corrected)", GraphAttentionLayerFixed(6, 128)),
                         ("the network (8 heads + 1600-class head)", GAT(6, 128, 1600, 8))):
        r = fxmem.analyze(model, *specs, optimizer=adam)
        forward = r.max_size("B", budget="32GiB", N=500)
        train = r.max_size("B", budget="32GiB", train=True, N=500)
        print(f"  {label}: forward B <= {forward}, Adam training step B <= {train}")
    print("  (after fxmem.optimize removes the pair tensor: see examples/gat_optimize.py)")


if __name__ == "__main__":
    main()
