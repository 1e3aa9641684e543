"""The examples' and the zoo's models with the sizes their real runs are compared at (name ->
(factory, specs, sizes, keyword arguments for check_against_real_run)): tests/exactness/test_exactness.py
checks each against the allocator, benchmarks/reorder.py and benchmarks/gpu_validate.py run them too."""
from __future__ import annotations

import torch

import fxmem
import zoo
from conftest import load_example

gat = load_example("seed_gat")
attention = load_example("seed_attention")


def edges(shape, dims):
    return torch.randint(0, dims["N"], shape)


CASES = {
    "seed000-layer-as-written": (lambda: gat.GraphAttentionLayer(6, 16, dropout=0.0), (("B", "N", 6), ("B", "N", "N")),
                                 [dict(B=2, N=30), dict(B=3, N=17), dict(B=5, N=4)], {}),
    "seed000-layer-fixed-dropout": (lambda: gat.GraphAttentionLayerFixed(6, 16, dropout=0.6), (("B", "N", 6), ("B", "N", "N")),
                                    [dict(B=2, N=30), dict(B=3, N=17), dict(B=4, N=9)], {}),
    "seed000-network": (lambda: gat.GAT(6, 8, 5, nheads=3), (("B", "N", 6), ("B", "N", "N")),
                        [dict(B=2, N=12), dict(B=3, N=7), dict(B=2, N=20)], {}),
    "seed002-attention": (lambda: attention.Attention(64, 8), (("B", "L", 64),),
                          [dict(B=4, L=32), dict(B=3, L=9), dict(B=2, L=50)], {}),
    "views": (zoo.Views, (("B", "N", 8),), [dict(B=2, N=5), dict(B=3, N=11), dict(B=7, N=4)], {}),
    "inplace": (zoo.InPlace, (("B", "N", 6), fxmem.TensorSpec(("B", "N"), dtype=torch.bool)),
                [dict(B=2, N=5), dict(B=4, N=13), dict(B=6, N=3)], {}),
    "multi-output": (zoo.MultiOut, (("B", "L", 5),), [dict(B=2, L=9), dict(B=5, L=3), dict(B=3, L=31)], {}),
    "batchnorm": (zoo.BatchNorms, (("B", 12),), [dict(B=4), dict(B=9), dict(B=33)], {}),
    "dropout": (zoo.Dropouts, (("B", "N", 10),), [dict(B=2, N=7), dict(B=3, N=20), dict(B=8, N=5)], {}),
    "conv-pool": (zoo.ConvPool, (("B", 3, "H", "W"), ("B", 4, "T")),
                  [dict(B=2, H=32, W=40, T=21), dict(B=3, H=21, W=19, T=17), dict(B=4, H=45, W=23, T=30)], {}),
    "graph-index": (zoo.GraphIndex, (("N", 16), fxmem.TensorSpec((2, "E"), dtype=torch.int64),
                                     fxmem.TensorSpec(("N",), dtype=torch.bool)),
                    [dict(N=10, E=40), dict(N=33, E=7), dict(N=5, E=64)], {"makers": {"edge_index": edges}}),
    "einops": (zoo.Einops, (("B", "L", 12),), [dict(B=2, L=6), dict(B=3, L=17), dict(B=9, L=4)], {}),
    "transformer": (lambda: zoo.Transformer(depth=2), (fxmem.TensorSpec(("B", "L"), dtype=torch.int64),),
                    [dict(B=2, L=9), dict(B=3, L=16), dict(B=4, L=5)], {}),
    "torch-mha": (zoo.TorchMHA, (("B", "L", 16),), [dict(B=2, L=8), dict(B=3, L=5), dict(B=5, L=12)], {}),
}
