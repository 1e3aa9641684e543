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


def accumulate_fsdp(model, opt, x):  # step=: two micro-batches, FSDP2 reduce-scatters after the last only
    for i, xb in enumerate(x.chunk(2)):
        model.set_requires_gradient_sync(i == 1)
        model(xb).sum().backward()
    opt.step()
    opt.zero_grad()


def accumulate_ddp(model, opt, x):  # step=: two micro-batches, DDP all-reduces after the last only
    first, last = x.chunk(2)
    with model.no_sync():
        model(first).sum().backward()
    model(last).sum().backward()
    opt.step()
    opt.zero_grad()


def microbatches(model, opt, x):  # step=: two micro-batches (tensor parallelism's collectives in each)
    for xb in x.chunk(2):
        model(xb).sum().backward()
    opt.step()
    opt.zero_grad()


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


class Attention(nn.Module):
    """Heads of ``hd`` features: q, k, v and o as separate Linears, so tensor parallelism splits heads
    (every world size of 2, 3 or 4 gets whole heads at the default sizes)."""

    def __init__(self, d: int = 24, hd: int = 2):
        super().__init__()
        self.hd = hd
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t = x.shape[:2]
        q, k, v = (p(x).view(b, t, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


class TPBlock(nn.Module):
    def __init__(self, d: int = 24, h: int = 48):
        super().__init__()
        self.ln, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class TPDecoder(nn.Module):
    """A decoder whose blocks tensor parallelism can split into 2, 3 or 4: whole heads and MLP
    features per rank (DTensor's ``from_local`` between a column- and a row-wise Linear assumes
    even shards: an uneven split fails in torch itself)."""

    def __init__(self, n: int = 2, d: int = 24, h: int = 48, v: int = V):
        super().__init__()
        self.layers = nn.ModuleList([TPBlock(d, h) for _ in range(n)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, v)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _block_plan(sequence: bool = False) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    if not sequence:  # Megatron's: activations replicated between blocks, one all-reduce per row-wise Linear
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    # torchtitan's Llama layout: norms on sequence shards, an all-gather into each sub-block and a
    # reduce-scatter out of it
    into = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"ln": SequenceParallel(), "ln2": SequenceParallel(), "attn": into,
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)), "up": ColwiseParallel(),
            "down": RowwiseParallel(output_layouts=Shard(1))}


def tp(model, mesh):
    """Megatron-style tensor parallelism of every block (parallelize_module); norms and head replicated."""
    from torch.distributed.tensor.parallel import parallelize_module
    for layer in model.layers:
        parallelize_module(layer, mesh, _block_plan())
    return model


def tp_sequence(model, mesh):
    """Tensor and sequence parallelism (torchtitan's layout): the blocks' inputs and outputs are
    sequence shards, as are the norms' activations; the final norm and the head see the whole
    sequence again."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module
    first, last = model.layers[0], model.layers[-1]
    for layer in model.layers:
        parallelize_module(layer, mesh, _block_plan(sequence=True))
    parallelize_module(first, mesh, PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                         use_local_output=True))
    parallelize_module(last, mesh, PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)))
    return model


def fsdp_tp(model, mesh):
    """FSDP2 over a 2-D mesh's "dp" dim and tensor parallelism over its "tp" dim (torchtitan's
    Llama layout, without sequence parallelism): each block's plan, then fully_shard of it."""
    from torch.distributed.tensor.parallel import parallelize_module
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], _block_plan())
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def hsdp(model, mesh):
    """HSDP: FSDP2 over a 2-D mesh (replicated over its first dim, sharded over its second)."""
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def real_forward(make, fn, world_size, rank, x, mesh=None):
    """``(peak above start, retained, resident)`` bytes of rank ``rank``'s real forward (no grad) in
    torch's fake process group, after a first one (FSDP2 initialises itself there and keeps the root's
    unsharded parameters from then on); resident: what the first left allocated, and ``x``."""
    from fxmem import _torch_compat as tc
    from fxmem.measure import measure

    layout = tuple(mesh.items()) if mesh else None
    with tc.fake_process_group(world_size, rank, dims=layout) as device_mesh, torch.no_grad():
        def first():
            torch.manual_seed(0)
            model = fn(make(), device_mesh)
            model(x)
            return model
        made = measure(first, warmup=0, keep_result=True)
        model = made.result
        real = measure(lambda: model(x), warmup=0)
    return real.peak_above_start, real.retained, made.retained + x.untyped_storage().nbytes()
