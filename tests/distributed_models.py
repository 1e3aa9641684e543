"""Models and parallelisations for tests/test_distributed.py, at module level so that the gloo
processes (spawned) can import them. Sizes divide by no world size (uneven shards, padding)."""
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

D, H, V = 13, 22, 17


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.qkv, self.o = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D, bias=False)
        self.ln2, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(1, 2) / 4, dim=-1) @ v
        x = x + self.o(a)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(n)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def fsdp(model, mesh):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp_keep(model, mesh):  # blocks stay unsharded from forward to backward
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh)


def fsdp_reshard_2(model, mesh):  # after forward, reshard to groups of 2 ranks (world size 4)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    return fully_shard(model, mesh=mesh)


def fsdp_bf16(model, mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def ddp_small(model, mesh):
    return DistributedDataParallel(model, bucket_cap_mb=0.004)


def ddp_view(model, mesh):
    return DistributedDataParallel(model, bucket_cap_mb=0.004, gradient_as_bucket_view=True)


class Scale(nn.Module):  # elementwise only: no matmul, whose CPU bfloat16 kernels have scratch of their own
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(7, D)), nn.Parameter(torch.randn(D))

    def forward(self, x):
        return torch.tanh(x * self.w.sum(0) + self.b)


class Elementwise(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList([Scale() for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def fsdp_offload(model, mesh):  # CPUOffloadPolicy: sharded parameters, gradients and state kept on the host
    from torch.distributed.fsdp import CPUOffloadPolicy
    policy = CPUOffloadPolicy(pin_memory=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    return fully_shard(model, mesh=mesh, offload_policy=policy)
