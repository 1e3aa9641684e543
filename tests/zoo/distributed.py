"""Models and parallelisations for tests/distributed/test_distributed.py, at module level so that the gloo
processes (spawned) can import them. Sizes divide by no world size (uneven shards, padding)."""
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

D, H, V = 13, 22, 17


class Block(nn.Module):
    def __init__(self, d: int = D, h: int = H):
        super().__init__()
        self.ln, self.qkv, self.o = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d, bias=False)
        self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(1, 2) / 4, dim=-1) @ v
        x = x + self.o(a)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    """``n`` pre-norm blocks, a norm and a head (benchmarks/fsdp.py uses it at larger sizes)."""

    def __init__(self, n: int = 3, d: int = D, h: int = H, v: int = V):
        super().__init__()
        self.layers = nn.ModuleList([Block(d, h) for _ in range(n)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, v)

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


def ddp_static(model, mesh):  # the reducer keeps a used-parameter map (host and device) and rebuilds late
    return DistributedDataParallel(model, bucket_cap_mb=0.004, static_graph=True, gradient_as_bucket_view=True)


def ddp_unused(model, mesh):  # the reducer reads which parameters got a gradient after every backward
    return DistributedDataParallel(model, bucket_cap_mb=0.004, find_unused_parameters=True)


class PartlyUsed(nn.Module):
    """A decoder with a head the forward does not use: its parameter gets no gradient."""

    def __init__(self):
        super().__init__()
        self.decoder, self.spare = Decoder(), nn.Linear(D, 5)

    def forward(self, x):
        return self.decoder(x)


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


def fsdp_tuned(model, mesh):  # FSDPModule's setters after fully_shard: prefetching, no reshard after backward
    fsdp(model, mesh)
    layers = list(model.layers)
    for a, b in zip(layers, layers[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    model.set_reshard_after_backward(False)
    return model


def analyse_wrapped(model, inputs, optimizer, loss):
    """Run on each gloo rank after its measured step: fxmem's analysis of the model as the rank
    wrapped it (in the rank's own process group), then the rank's group and step used again."""
    import torch.distributed as dist

    import fxmem
    from fxmem.measure import measure
    from fxmem.training import train_step

    names = dict(dist.distributed_c10d._world.pg_names)
    report = fxmem.analyze(model, ("B", "L", D), optimizer=adamw)
    b, length = inputs[0].shape[:2]
    e = report.evaluate(B=b, L=length)
    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)  # the rank's own group, after the analysis
    again = measure(lambda: train_step(model, inputs, optimizer, loss), warmup=0)
    return {"predicted": (e["train_peak"] - e["train_resident"], e["train_retained"], e["train_resident"],
                          e["optimizer_state"]),
            "notes": report.notes, "all_reduce": total.item(), "groups_kept": names == dict(
                dist.distributed_c10d._world.pg_names), "peak_again": again.peak_above_start}
