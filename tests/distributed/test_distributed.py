"""Many GPUs: one rank's memory under FSDP2, DDP and tensor parallelism (fxmem.distributed), against real runs.

Two kinds of evidence, both real runs measured by the allocator (fxmem.measure):
* the synchronous schedule, in this process: FSDP2's and DDP's own code on real tensors in torch's
  fake process group (collectives do nothing, every buffer around them is really allocated) -
  predicted == measured on every rank, at sizes the analysis did not see;
* gloo, one process per rank (spawned): DDP exact; FSDP2 between the synchronous numbers and the
  late-free bound the report states (gloo completes collectives asynchronously).
"""
import pytest
import sympy
import torch

import fxmem
from zoo.distributed import (D, Decoder, Elementwise, PartlyUsed, TPDecoder, accumulate_ddp, accumulate_fsdp, adamw,
                                analyse_wrapped, ddp_small, microbatches,
                                ddp_static, ddp_unused, ddp_view, fsdp, fsdp_bf16, fsdp_keep, fsdp_offload,
                                fsdp_reshard_2, fsdp_tp, fsdp_tuned, hsdp, real_forward, tp, tp_sequence)
from fxmem.distributed.parallel import dtensor_buffers, dtensor_late_bytes, late_bytes
from fxmem.distributed.real_runs import measure_ranks, measure_synchronous
from fxmem.errors import ModelError, SpecError

SIZES = [dict(B=5, L=7), dict(B=3, L=10)]
TP_D = 24  # TPDecoder's width


def analyse(fn, world_size, rank):
    return fxmem.analyze(Decoder(), ("B", "L", D), optimizer=adamw, world_size=world_size, parallelize=fn, rank=rank)


def predicted(report, dims):
    e = report.evaluate(**dims)
    return e["train_peak"] - e["train_resident"], e["train_retained"], e["train_resident"], e["optimizer_state"]


@pytest.mark.parametrize("fn, world_size, rank", [
    (fsdp, 3, 2), (fsdp_keep, 4, 3), (ddp_view, 3, 2),
    # reshard_after_forward=2 of 4 ranks: after forward each block keeps its parameters sharded over
    # a group of 2 (a sub-mesh FSDP2 builds), gathered from there for backward
    (fsdp_reshard_2, 4, 0), pytest.param(fsdp_reshard_2, 4, 3, marks=pytest.mark.slow),  # CI: one rank of it
    # CPU offload on a CPU mesh: FSDP2's host copies (to the "device", here the CPU too) each all-gather
    (fsdp_offload, 2, 1),
    # DDP(static_graph=True): its used-parameter map (two int32 tensors) is resident
    (ddp_static, 3, 1)])
def test_synchronous_schedule_exact_per_rank(fn, world_size, rank):
    torch.set_num_threads(1)
    report = analyse(fn, world_size, rank)
    for dims in SIZES:
        x = torch.randn(dims["B"], dims["L"], D)
        real = measure_synchronous(Decoder, (x,), fn, world_size, rank, adamw)
        assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(report, dims), \
            f"{fn.__name__} W={world_size} rank {rank} at {dims}"


def test_mixed_precision_exact():
    # MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): bfloat16 all-gathers and
    # unsharded parameters, float32 gradients. An elementwise model: CPU bfloat16 matmuls have
    # kernel scratch of their own, which fxmem's CPU kernel rules do not count for bfloat16 yet
    torch.set_num_threads(1)
    report = fxmem.analyze(Elementwise(), ("B", "L", D), optimizer=adamw, world_size=3, parallelize=fsdp_bf16, rank=2)
    for dims in SIZES:
        x = torch.randn(dims["B"], dims["L"], D)
        real = measure_synchronous(Elementwise, (x,), fsdp_bf16, 3, 2, adamw)
        assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(report, dims)
    assert any(s.dtype == torch.bfloat16 for s in report.storages if s.name.startswith("all-gather"))


@pytest.mark.parametrize("fn", [ddp_small, ddp_static])
def test_gloo_ddp_exact_on_every_rank(fn):
    torch.set_num_threads(1)
    x = torch.randn(5, 7, D)
    ranks = measure_ranks(Decoder, (x,), fn, 2, adamw)
    report = analyse(fn, 2, 0)
    peak, retained, resident, state = predicted(report, dict(B=5, L=7))
    for r in ranks:  # resident: storages and DDP's bucket count (gloo's late frees can reach the allocator's)
        assert (r.peak_above_start, r.retained, r.optimizer_state) == (peak, retained, state)
        assert r.extra["state_storages"] + r.extra["ddp_bucket_bytes"] + r.extra["ddp_used_map_bytes"] == resident


@pytest.mark.parametrize("fn", [ddp_unused, ddp_static])
def test_ddp_that_reads_which_parameters_got_gradients(fn):
    # find_unused_parameters=True and static_graph=True: after each backward DDP's reducer reads its
    # used-parameter map (values fake tensors do not have); a parameter the forward does not use gets
    # no gradient and its .grad stays None - on every rank, at sizes the analysis did not see
    torch.set_num_threads(1)
    report = fxmem.analyze(PartlyUsed(), ("B", "L", D), optimizer=adamw, world_size=3, parallelize=fn, rank=2)
    maps = [s for s in report.storages if s.name.startswith("DDP used-parameter map")]
    assert len(maps) == 2 and all(int(s.bytes) == 4 * 39 for s in maps)  # int32, one per parameter (+2 spare)
    for dims in SIZES:
        x = torch.randn(dims["B"], dims["L"], D)
        real = measure_synchronous(PartlyUsed, (x,), fn, 3, 2, adamw)
        assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(report, dims), \
            f"{fn.__name__} at {dims}"


@pytest.mark.parametrize("fn, rebuilt", [(ddp_small, 1), (ddp_static, 2)])
def test_ddp_notes_the_step_that_rebuilds_its_buckets(fn, rebuilt):
    """The report is DDP's steady state; the step that rebuilds the buckets is higher by what the
    note says, on a real run (steps counted from 0)."""
    import re

    from fxmem import _torch_compat as tc
    from fxmem.distributed.ddp import _allreduce
    from fxmem.measure import measure
    from fxmem.training import default_loss, train_step

    torch.set_num_threads(1)
    report = analyse(fn, 2, 0)
    (note,) = [n for n in report.notes if n.startswith("DDP: the steady state")]
    more = int(re.search(r"([\d,]+) bytes more", note).group(1).replace(",", ""))
    x = torch.randn(5, 7, D)
    with tc.fake_process_group(2, 0) as mesh:
        torch.manual_seed(0)
        model = fn(Decoder(), mesh)
        model.register_comm_hook(None, _allreduce)  # the Python form of its all-reduce (measure_synchronous's)
        opt = adamw(model.parameters())
        peaks = [measure(lambda: train_step(model, (x,), opt, default_loss), warmup=0).peak_above_start
                 for _ in range(4)]
    steady = predicted(report, dict(B=5, L=7))[0]
    assert peaks[rebuilt] == steady + more and peaks[3] == steady, (peaks, steady, more)


def test_ddp_forward_counts_the_buckets_as_resident():
    # a forward alone (evaluation under DDP) touches no bucket; DDP allocated them when it was built
    from fxmem import _torch_compat as tc
    from fxmem.measure import measure
    torch.set_num_threads(1)
    report = fxmem.analyze(Decoder(), ("B", "L", D), world_size=2, parallelize=ddp_small, rank=1)
    for dims in SIZES:
        x = torch.randn(dims["B"], dims["L"], D)
        with tc.fake_process_group(2, 1):
            torch.manual_seed(0)
            built = measure(lambda: ddp_small(Decoder(), None), warmup=0, keep_result=True)
            model = built.result
            real = measure(lambda: model(x), warmup=0)
        e = report.evaluate(**dims)
        assert built.retained + x.nbytes == e["resident"]  # parameters, buckets and the input
        assert real.peak_above_start == e["peak"] - e["resident"]


def test_gloo_fsdp_within_the_stated_late_bound():
    torch.set_num_threads(1)
    x = torch.randn(5, 7, D)
    ranks = measure_ranks(Decoder, (x,), fsdp, 2, adamw)
    for r in ranks:
        report = analyse(fsdp, 2, r.rank)
        peak, retained, resident, state = predicted(report, dict(B=5, L=7))
        gathers = [int(s.bytes) for s in report.storages if s.name.startswith("all-gather ")]
        reduces = [int(s.bytes) for s in report.storages if s.name.startswith("reduce-scatter ")]
        late = late_bytes(gathers, reduces)
        assert f"{late:,} bytes" in " ".join(report.notes)
        assert r.extra["state_storages"] == resident and r.optimizer_state == state
        assert peak <= r.peak_above_start <= peak + late, f"rank {r.rank}"
        assert retained <= r.retained <= retained + late


@pytest.mark.parametrize("make, fn, step, world_size, rank", [
    (Decoder, fsdp, accumulate_fsdp, 3, 2),  # set_requires_gradient_sync(False) for the first micro-batch
    (Decoder, ddp_small, accumulate_ddp, 2, 1),  # no_sync() for the first micro-batch
    # CI: FSDP2's and DDP's accumulation; tensor parallelism's micro-batches (~55 s) with the slow tests
    pytest.param(TPDecoder, tp, microbatches, 2, 1, marks=pytest.mark.slow)])
def test_users_own_step_exact_per_rank(make, fn, step, world_size, rank):
    """step= with parallelize=: gradient accumulation as training scripts write it, every rank's
    step against its real synchronous run, at sizes the analysis did not see (B=5 splits 3 + 2)."""
    torch.set_num_threads(1)
    d = TP_D if make is TPDecoder else D
    report = fxmem.analyze(make(), ("B", "L", d), optimizer=adamw, world_size=world_size, parallelize=fn,
                           step=step, rank=rank)
    assert not any("your step keeps" in n for n in report.notes)  # FSDP2's own tensors are not step state
    for dims in SIZES:
        x = torch.randn(dims["B"], dims["L"], d)
        real = measure_synchronous(make, (x,), fn, world_size, rank, adamw, step=step)
        assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(report, dims), \
            f"{fn.__name__} with {step.__name__}, W={world_size} rank {rank} at {dims}"


def test_gloo_fsdp_gradient_accumulation_within_the_stated_late_bound():
    torch.set_num_threads(1)
    x = torch.randn(5, 7, D)
    for r in measure_ranks(Decoder, (x,), fsdp, 2, adamw, step=accumulate_fsdp):
        report = fxmem.analyze(Decoder(), ("B", "L", D), optimizer=adamw, world_size=2, parallelize=fsdp,
                               step=accumulate_fsdp, rank=r.rank)
        peak, retained, resident, state = predicted(report, dict(B=5, L=7))
        gathers = [int(s.bytes) for s in report.storages if s.name.startswith("all-gather ")]
        reduces = [int(s.bytes) for s in report.storages if s.name.startswith("reduce-scatter ")]
        late = late_bytes(gathers, reduces)
        assert r.extra["state_storages"] == resident and r.optimizer_state == state
        assert peak <= r.peak_above_start <= peak + late, f"rank {r.rank}"
        assert retained <= r.retained <= retained + late


@pytest.mark.parametrize("make, fn, world_size, rank, mesh", [
    (Decoder, fsdp, 3, 2, None), (TPDecoder, tp, 2, 1, None), (TPDecoder, fsdp_tp, 4, 1, {"dp": 2, "tp": 2})])
def test_forward_exact_per_rank(make, fn, world_size, rank, mesh):
    """A forward (no optimizer), every rank against its real synchronous forward in torch's fake
    group after one forward before it (FSDP2 initialises itself in the first and keeps the root's
    unsharded parameters from then on), at sizes the analysis did not see."""
    torch.set_num_threads(1)
    d = TP_D if make is TPDecoder else D
    report = fxmem.analyze(make(), ("B", "L", d), grad=False, world_size=world_size, parallelize=fn, rank=rank,
                           mesh=mesh)
    for dims in SIZES:
        e = report.evaluate(**dims)
        real = real_forward(make, fn, world_size, rank, torch.randn(dims["B"], dims["L"], d), mesh)
        assert real == (e["peak"] - e["resident"], e["retained"], e["resident"]), f"{fn.__name__} at {dims}"


def test_a_pipeline_stage_built_by_the_step_is_refused_by_name():
    import torch.distributed.pipelining as pipelining

    def pipelined(model, opt, x):
        stage = pipelining.PipelineStage(model, 0, 2, torch.device("cpu"))
        pipelining.ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: out.sum()).step(x)
        opt.step()

    with pytest.raises(ModelError, match="builds a pipeline stage .*on every call.*return the schedule"):
        fxmem.analyze(Decoder(), ("B", "L", D), optimizer=adamw, world_size=2, parallelize=lambda m, mesh: m,
                      step=pipelined)


def test_user_state_untouched_and_no_group_left():
    import torch.distributed as dist
    model = Decoder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    analyse(fsdp, 2, 0)
    assert not dist.is_initialized()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(hasattr(m, "_get_fsdp_state") for m in model.modules())


def test_refusals():
    from torch.distributed.fsdp import FullyShardedDataParallel
    with pytest.raises(SpecError, match="world_size= and parallelize= go together"):
        fxmem.analyze(Decoder(), ("B", "L", D), world_size=2)
    with pytest.raises(SpecError, match="rank=2"):
        fxmem.analyze(Decoder(), ("B", "L", D), world_size=2, parallelize=fsdp, rank=2)
    with pytest.raises(SpecError, match="device='tpu' with parallelize=: use 'cpu' or 'cuda'"):
        fxmem.analyze(Decoder(), ("B", "L", D), world_size=2, parallelize=fsdp, device="tpu")
    with pytest.raises(SpecError, match="mode='graph'"):
        fxmem.analyze(Decoder(), ("B", "L", D), world_size=2, parallelize=fsdp, mode="graph")
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # FSDP1 needs a GPU to be built
    torch.nn.Module.__init__(fsdp1)
    with pytest.raises(ModelError, match="'1' is FSDP1's FullyShardedDataParallel"):
        fxmem.analyze(torch.nn.Sequential(torch.nn.Linear(3, 3), fsdp1), ("B", 3))
    with pytest.raises(ModelError, match="'0' is wrapped in DistributedDataParallel"):
        from fxmem import _torch_compat as tc
        with tc.fake_process_group(2, 0):
            wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))
        fxmem.analyze(torch.nn.Sequential(wrapped), ("B", 3))  # DDP inside a model: not the model's wrapping


class _Attention(torch.nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.qkv, self.o, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, l, d))


_MESH = {}


def _keep_mesh(model, mesh):
    _MESH["mesh"] = mesh
    return model


def _context_parallel_step(model, optimizer, x):
    from torch.distributed.tensor.experimental import context_parallel
    with context_parallel(_MESH["mesh"], buffers=[x], buffer_seq_dims=[1]):
        model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_context_parallelism_is_refused_by_name():
    pytest.importorskip("torch.distributed.tensor.experimental")
    with pytest.raises(fxmem.errors.UnsupportedOpError, match="context parallelism .* is not modelled yet"):
        fxmem.analyze(_Attention(), ("B", "L", 16), optimizer=adamw, world_size=2, parallelize=_keep_mesh,
                      step=_context_parallel_step)


@pytest.mark.parametrize("world_size, rank", [(2, 1), pytest.param(4, 3, marks=pytest.mark.slow)])  # CI: 2 ranks
def test_tensor_parallel_exact_per_rank(world_size, rank):
    """parallelize_module (column-wise q, k, v and up; row-wise o and down): every rank's step
    against its real synchronous run, at sizes the analysis did not see."""
    torch.set_num_threads(1)
    report = fxmem.analyze(TPDecoder(), ("B", "L", TP_D), optimizer=adamw, world_size=world_size, parallelize=tp,
                           rank=rank)
    for dims in SIZES:
        x = torch.randn(dims["B"], dims["L"], TP_D)
        real = measure_synchronous(TPDecoder, (x,), tp, world_size, rank, adamw)
        assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(report, dims)
    shards = {s.name for s in report.storages if s.role.name == "PARAMETER"}
    assert "layers.0.up.weight" in shards  # a rank's shard of the column-wise weight, under its own name
    assert sum(int(s.bytes) for s in report.storages if s.name == "layers.0.up.weight") == 4 * 48 * TP_D // world_size


def stated_late_bound(report, group, dims=None) -> int:
    """The bound the notes state for DTensor's collectives (bytes at ``dims``), checked to be in them."""
    late = sympy.expand(dtensor_late_bytes(*dtensor_buffers(report.storages), group))
    shown = f"{int(late):,}" if late.is_number else str(late)
    assert f"up to {shown} bytes" in " ".join(report.notes), report.notes
    return int(late.subs({s: dims[s.name] for s in late.free_symbols}))


def assert_within_bound(r, sync, late):
    """A gloo rank between its synchronous numbers and them + ``late``; the message shows how much
    gloo held beyond them (so a bound too small for what gloo held shows by how much)."""
    for what, real, base in (("peak", r.peak_above_start, sync[0]), ("retained", r.retained, sync[1])):
        assert base <= real <= base + late, (f"rank {r.rank} {what}: gloo {real:,} B, synchronous {base:,} B, "
                                             f"excess {real - base:,} B, stated bound {late:,} B")


def test_gloo_tensor_parallel_within_the_stated_bound_on_every_rank():
    """gloo completes the all-reduces asynchronously: each rank between its synchronous numbers and
    them + the bound the notes state (every all-reduce's buffer late at once)."""
    torch.set_num_threads(1)
    x = torch.randn(5, 7, TP_D)
    ranks = measure_ranks(TPDecoder, (x,), tp, 2, adamw)
    for r in ranks:
        report = fxmem.analyze(TPDecoder(), ("B", "L", TP_D), optimizer=adamw, world_size=2, parallelize=tp,
                               rank=r.rank)
        peak, retained, resident, state = predicted(report, dict(B=5, L=7))
        assert (r.optimizer_state, r.extra["state_storages"]) == (state, resident)
        late = stated_late_bound(report, 2, dict(B=5, L=7))
        assert late == 12 * 5 * 7 * TP_D * 4  # 2 blocks x (2 all-reduces forward + 4 backward), [B, L, D] float32
        assert_within_bound(r, (peak, retained), late)


@pytest.mark.slow  # ~45 s (2 analyses, 2 processes); CI: the stated bound at numeric sizes, below
def test_gloo_sequence_parallel_within_the_stated_bound_on_every_rank():
    torch.set_num_threads(1)
    x = torch.randn(5, 12, TP_D)
    ranks = measure_ranks(TPDecoder, (x,), tp_sequence, 2, adamw)
    for r in ranks:
        report = fxmem.analyze(TPDecoder(), (5, 12, TP_D), optimizer=adamw, world_size=2, parallelize=tp_sequence,
                               rank=r.rank)
        e = report.evaluate()
        assert (r.optimizer_state, r.extra["state_storages"]) == (e["optimizer_state"], e["train_resident"])
        assert_within_bound(r, (e["train_peak"] - e["train_resident"], e["train_retained"]),
                            stated_late_bound(report, 2))


def test_sequence_parallel_exact_at_numeric_sizes_and_symbolic_ones_refused_as_torchs_limit():
    """torchtitan's layout (SequenceParallel norms, all-gathers into and reduce-scatters out of each
    sub-block): DTensor's sharding rules need the flattened sizes as numbers, so symbolic dims are
    refused as torch's limit - never blamed on the shapes - and numeric specs are exact."""
    torch.set_num_threads(1)
    with pytest.raises(fxmem.FxMemError, match="DTensor cannot propagate this sharding with symbolic sizes") as err:
        fxmem.analyze(TPDecoder(), ("B", "L", TP_D), optimizer=adamw, world_size=3, parallelize=tp_sequence, rank=0)
    assert "given input shapes" not in str(err.value)
    report = fxmem.analyze(TPDecoder(), (5, 12, TP_D), optimizer=adamw, world_size=3, parallelize=tp_sequence,
                           rank=2)
    real = measure_synchronous(TPDecoder, (torch.randn(5, 12, TP_D),), tp_sequence, 3, 2, adamw)
    e = report.evaluate()
    assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == (
        e["train_peak"] - e["train_resident"], e["train_retained"], e["train_resident"], e["optimizer_state"])
    # gloo's late buffers (checked against gloo runs with the slow tests): the step's 11 all-gathers
    # into [B, L, D] and 8 reduce-scatters into [B, L/3, D] (forward and backward), each of whose
    # inputs gloo copies (3 ranks), and the optimizer's 24 all-reduces of the norms' Partial gradients
    gather, scatter = 5 * 12 * TP_D * 4, 5 * 4 * TP_D * 4
    assert stated_late_bound(report, 3) == 3 * 11 * gather + (1 + 3) * 8 * scatter + 24 * 96


@pytest.mark.parametrize("fn, mesh, rank", [(fsdp_tp, {"dp": 2, "tp": 2}, 1), (hsdp, {"replicate": 2, "shard": 2}, 2)])
def test_two_dimensional_meshes_exact_per_rank(fn, mesh, rank):
    """FSDP2 with tensor parallelism on torchtitan's ("dp", "tp") mesh, and HSDP: the mesh fxmem
    builds from mesh= is the one the real run's fn gets; uneven shards (rank 1's and 2's differ)."""
    torch.set_num_threads(1)
    report = fxmem.analyze(TPDecoder(), ("B", "L", TP_D), optimizer=adamw, world_size=4, parallelize=fn, rank=rank,
                           mesh=mesh)
    assert f"over the mesh {mesh}" in report.notes[0]
    for dims in SIZES:
        x = torch.randn(dims["B"], dims["L"], TP_D)
        real = measure_synchronous(TPDecoder, (x,), fn, 4, rank, adamw, mesh=mesh)
        assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(report, dims)


@pytest.mark.slow  # ~60 s (4 analyses, 4 processes); CI: every rank's synchronous schedule on the 2 x 2 mesh
def test_gloo_fsdp_with_tensor_parallelism_on_a_2x2_mesh_within_the_stated_bound():
    torch.set_num_threads(1)
    mesh = {"dp": 2, "tp": 2}
    x = torch.randn(5, 7, TP_D)
    ranks = measure_ranks(TPDecoder, (x,), fsdp_tp, 4, adamw, mesh=mesh)
    for r in ranks:
        report = fxmem.analyze(TPDecoder(), ("B", "L", TP_D), optimizer=adamw, world_size=4, parallelize=fsdp_tp,
                               rank=r.rank, mesh=mesh)
        peak, retained, resident, state = predicted(report, dict(B=5, L=7))
        gathers = [int(s.bytes) for s in report.storages if s.name.startswith("all-gather ")]
        reduces = [int(s.bytes) for s in report.storages if s.name.startswith("reduce-scatter ")]
        # FSDP2's buffers and tensor parallelism's all-reduces (on the "tp" dim), late at once
        late = sympy.expand(late_bytes(gathers, reduces) + dtensor_late_bytes(*dtensor_buffers(report.storages), 2))
        assert late.free_symbols and f"up to {late} bytes" in " ".join(report.notes)
        assert (r.optimizer_state, r.extra["state_storages"]) == (state, resident)
        at = {s: {"B": 5, "L": 7}[s.name] for s in late.free_symbols}
        assert_within_bound(r, (peak, retained), int(late.subs(at)))


def test_mesh_arguments_are_checked():
    with pytest.raises(SpecError, match=r"mesh=\{'dp': 2, 'tp': 3\} has 6 ranks, but world_size=4"):
        fxmem.analyze(TPDecoder(), ("B", "L", TP_D), world_size=4, parallelize=fsdp_tp, mesh={"dp": 2, "tp": 3})
    with pytest.raises(SpecError, match="mesh= is the DeviceMesh parallelize= is given"):
        fxmem.analyze(TPDecoder(), ("B", "L", TP_D), mesh={"dp": 2, "tp": 2})
    with pytest.raises(SpecError, match="a name and a positive size"):
        fxmem.analyze(TPDecoder(), ("B", "L", TP_D), world_size=4, parallelize=fsdp_tp, mesh={"dp": 4, "tp": 1.0})
    with pytest.raises(SpecError, match="world_sizes\\(\\) takes the meshes in sizes="):
        fxmem.world_sizes(TPDecoder(), ("B", "L", TP_D), parallelize=fsdp_tp, sizes=[4], mesh={"dp": 2, "tp": 2})


def test_a_model_placed_with_tensor_parallelism_already_is_refused_with_what_to_pass():
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fxmem import _torch_compat as tc
    with tc.fake_process_group(2, 0) as mesh:
        placed = parallelize_module(Decoder(), mesh, {"head": ColwiseParallel()})
    with pytest.raises(ModelError, match="'head.weight' is a DTensor already .* parallelize=lambda m, mesh"):
        fxmem.analyze(placed, ("B", "L", D), optimizer=adamw, world_size=2, rank=0)


@pytest.fixture
def users_group():
    """A default process group of the user's (rank 2 of 3), as a training script has one."""
    import sys

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    hook = sys.excepthook
    try:
        yield dist.distributed_c10d._world.pg_names.copy(), hook
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _state(group) -> tuple:
    import sys

    import torch.distributed as dist
    return (dist.get_world_size(), dist.get_rank(), dist.distributed_c10d._world.pg_names == group[0],
            sys.excepthook is group[1])


def test_the_users_own_group_is_set_aside_and_back_untouched(users_group):
    import torch.distributed as dist
    report = analyse(fsdp, 2, 1)  # fxmem's group of 2 ranks, while the user's of 3 exists
    assert "rank 1 of 2" in report.notes[0]
    assert _state(users_group) == (3, 2, True, True)
    t = torch.ones(2)
    dist.all_reduce(t)  # the user's group still runs its collectives
    assert torch.equal(t, torch.ones(2))


@pytest.mark.parametrize("fn, world_size, rank, model, step", [
    (fsdp_keep, 3, 2, Decoder, None), (fsdp_tuned, 3, 2, Decoder, None), (ddp_view, 3, 2, Decoder, None),
    (fsdp_bf16, 3, 2, Elementwise, None),
    pytest.param(fsdp, 3, 2, Decoder, accumulate_fsdp, marks=pytest.mark.slow)])  # CI: step= unwrapped, above
def test_a_model_the_user_wrapped_is_analysed_as_that_wrapping(users_group, fn, world_size, rank, model, step):
    # the user's script: its own group (rank 2 of 3), its model wrapped in it; fxmem is given the wrapped
    # model alone and must find the wrapping, the world size and the rank
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    torch.manual_seed(0)
    wrapped = fn(model(), init_device_mesh("cpu", (3,))) or model
    before = {k: tc_local(v).clone() for k, v in wrapped.state_dict().items()}
    report = fxmem.analyze(wrapped, ("B", "L", D), optimizer=adamw, step=step)
    assert f"rank {rank} of {world_size}, parallelised by your " in report.notes[0]
    assert _state(users_group) == (3, 2, True, True)
    assert all(torch.equal(before[k], tc_local(v)) for k, v in wrapped.state_dict().items())
    for dims in SIZES:  # the same wrapping's real step, at sizes the analysis did not see
        x = torch.randn(dims["B"], dims["L"], D)
        real = measure_synchronous(model, (x,), fn, world_size, rank, adamw, step=step)
        assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(report, dims), \
            f"{fn.__name__} at {dims}"


def tc_local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def test_a_wrapped_model_at_another_world_size(users_group):
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    wrapped = fsdp(Decoder(), init_device_mesh("cpu", (3,)))
    report = fxmem.analyze(wrapped, ("B", "L", D), optimizer=adamw, world_size=4, rank=3)
    assert "rank 3 of 4" in report.notes[0]
    x = torch.randn(5, 7, D)
    real = measure_synchronous(Decoder, (x,), fsdp, 4, 3, adamw)
    assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(report, dims=dict(
        B=5, L=7))
    # world_sizes() re-applies the same wrapping at each size (rank 0 of each)
    table = fxmem.world_sizes(wrapped, ("B", "L", D), optimizer=adamw, sizes=[2, 4])
    assert set(table) == {2, 4} and "rank 0 of 2" in table[2].notes[0]
    real = measure_synchronous(Decoder, (x,), fsdp, 2, 0, adamw)
    assert (real.peak_above_start, real.retained, real.resident, real.optimizer_state) == predicted(table[2], dims=dict(
        B=5, L=7))


def test_what_a_wrapping_cannot_be_recreated_from_is_refused(users_group):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.device_mesh import init_device_mesh
    with tc_ddp_on_fake():
        ddp = torch.nn.parallel.DistributedDataParallel(Decoder())
    ddp.register_comm_hook(None, allreduce_hook)
    with pytest.raises(ModelError, match="uses a communication hook"):
        fxmem.analyze(ddp, ("B", "L", D), optimizer=adamw)
    from fxmem.distributed import adopt, adopted_parallel
    wrapped = fsdp(Decoder(), init_device_mesh("cpu", (3,)))
    with pytest.raises(SpecError, match="keeps its parameters on cpu: pass device='cpu'"):
        adopted_parallel(adopt(wrapped), fxmem.AnalysisOptions(device="cuda"))
    with pytest.raises(SpecError, match="needs world_size= and parallelize="):
        fxmem.analyze(Decoder(), ("B", "L", D), rank=1)


def tc_ddp_on_fake():
    from fxmem import _torch_compat as tc
    return tc.ddp_on_fake_tensors()


@pytest.mark.parametrize("fn, world_size", [(ddp_small, 2), pytest.param(fsdp, 3, marks=pytest.mark.slow)])
def test_gloo_ranks_analyse_the_model_they_wrapped(fn, world_size):  # CI: DDP; FSDP2 wrapped, synchronous, above
    # real processes, each with its own gloo group: after its measured step each rank hands fxmem
    # its wrapped model and nothing else; then its group and its step run again as before
    torch.set_num_threads(1)
    x = torch.randn(5, 7, D)
    for r in measure_ranks(Decoder, (x,), fn, world_size, adamw, probe=analyse_wrapped):
        e = r.extra
        peak, retained, resident, state = e["predicted"]
        assert f"rank {r.rank} of {world_size}" in e["notes"][0]
        assert e["groups_kept"] and e["all_reduce"] == world_size * (world_size + 1) / 2
        assert r.optimizer_state == state
        if fn is ddp_small:  # DDP: exact (resident: storages and DDP's own bucket count)
            assert (r.peak_above_start, r.retained) == (peak, retained) and e["peak_again"] == r.peak_above_start
            assert e["state_storages"] + e["ddp_bucket_bytes"] == resident
        else:  # FSDP2 on gloo: between the synchronous numbers and the bound the report states
            late = int(e["notes"][1].split("by up to ")[1].split(" bytes")[0].replace(",", ""))
            assert e["state_storages"] == resident
            assert peak <= r.peak_above_start <= peak + late, f"rank {r.rank}"
            assert retained <= r.retained <= retained + late


@pytest.mark.slow  # the per-W numbers are also checked one by one above; this checks the table's plumbing
def test_world_sizes_table_against_real_runs():
    torch.set_num_threads(1)
    table = fxmem.world_sizes(Decoder(), ("B", "L", D), parallelize=fsdp, sizes=[2, 3], optimizer=adamw)
    assert "world size" in str(table) and "resident per rank" in str(table.at(B=5, L=7))
    x = torch.randn(5, 7, D)
    for w, report in table.items():
        real = measure_synchronous(Decoder, (x,), fsdp, w, 0, adamw)
        e = report.evaluate(B=5, L=7)
        assert (e["train_resident"], e["train_peak"]) == (real.resident, real.resident + real.peak_above_start)
    for w, b in table.max_size("B", 150_000, L=7).items():  # per rank: the largest batch fits, the next does not
        assert table[w].evaluate(B=b, L=7)["train_peak"] <= 150_000 < table[w].evaluate(B=b + 1, L=7)["train_peak"]


@pytest.mark.slow  # ~36 s; CI: each layout per rank above, the table as the README prints it
def test_world_sizes_table_of_mesh_layouts_against_real_runs():
    """Layouts of the same 4 ranks side by side: FSDP2 alone (tensor parallelism of 1) and 2 x 2."""
    torch.set_num_threads(1)
    layouts = [{"dp": 4, "tp": 1}, {"dp": 2, "tp": 2}]
    table = fxmem.world_sizes(TPDecoder(), ("B", "L", TP_D), parallelize=fsdp_tp, sizes=layouts, optimizer=adamw)
    assert list(table) == ["dp 4 x tp 1", "dp 2 x tp 2"] and "4 (dp 2 x tp 2)" in str(table.at(B=5, L=7))
    x = torch.randn(5, 7, TP_D)
    for mesh, report in zip(layouts, table.values()):
        real = measure_synchronous(TPDecoder, (x,), fsdp_tp, 4, 0, adamw, mesh=mesh)
        e = report.evaluate(B=5, L=7)
        assert (e["train_resident"], e["train_peak"]) == (real.resident, real.resident + real.peak_above_start)
    best = table.max_size("B", 400_000, L=7)
    assert best["dp 2 x tp 2"] > best["dp 4 x tp 1"]  # the activations of a block are split too


def _cpu_forward_in_cuda_blocks(make_model, parallelize, world_size, rank, dims):
    """(peak above start, retained) bytes of a real forward (no grad) of rank ``rank`` on the CPU in
    torch's fake process group, after a first one (FSDP2 initialises itself there and keeps the
    root's unsharded parameters), its allocator events replayed in CUDA's caching-allocator blocks
    (each allocation rounded up to 512 bytes)."""
    from fxmem import _torch_compat as tc
    from fxmem.measure import allocator_events, cpu_memory_profile

    with tc.fake_process_group(world_size, rank) as mesh:
        torch.manual_seed(0)
        model = parallelize(make_model(), mesh)
        x = torch.randn(dims["B"], dims["L"], D)
        with torch.no_grad():
            model(x)
        with torch.no_grad(), cpu_memory_profile() as prof:
            out = model(x)
        del out
    live, now, peak = {}, 0, 0
    for address, size in allocator_events(prof):
        if size > 0:
            live[address] = -(-size // 512) * 512
            now += live[address]
            peak = max(peak, now)
        else:
            now -= live.pop(address, 0)
    return peak, now


@pytest.mark.cuda_sim
def test_fsdp_forward_on_cuda_is_the_real_cpu_allocations_in_cuda_blocks():
    # No GPU here: the evidence is FSDP2's own code on real CPU tensors (fake process group), whose
    # allocator events are replayed in the CUDA caching allocator's 512-byte blocks; the model is
    # elementwise, so its CPU and CUDA kernels allocate the same tensors
    report = fxmem.analyze(Elementwise(), ("B", "L", D), world_size=3, parallelize=fsdp, rank=1, device="cuda",
                           grad=False)
    for dims in (dict(B=40, L=37), dict(B=9, L=103)):  # activations of several blocks, not multiples of 512
        at = report.evaluate(**dims)
        assert (at["peak_above_resident"], at["retained"]) == _cpu_forward_in_cuda_blocks(Elementwise, fsdp, 3, 1, dims)
    assert any("NCCL" in note for note in report.notes)


@pytest.mark.cuda_sim
def test_cuda_training_step_without_a_gpu_is_refused_as_torchs_limit():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the training step is simulated (tests/gpu)")
    from fxmem.errors import DeviceError
    with pytest.raises(DeviceError, match="needs a GPU in this process.*not your model or shapes"):
        fxmem.analyze(Elementwise(), ("B", "L", D), world_size=2, parallelize=fsdp, device="cuda", optimizer=adamw)
    with pytest.raises(DeviceError, match="needs a GPU in this process"):
        fxmem.analyze(torch.nn.Linear(4, 4), ("B", 4), device="cuda", optimizer=torch.optim.SGD)


@pytest.mark.cuda_sim
def test_ddp_on_cuda_is_refused_by_name():
    with pytest.raises(ModelError, match="DistributedDataParallel with device='cuda'"):
        fxmem.analyze(Decoder(), ("B", "L", D), world_size=2, parallelize=ddp_view, device="cuda")


def test_module_table_of_a_rank():
    # the per-module table of an FSDP2 rank: each module's parameters are this rank's shards, as FSDP2
    # makes them on a real model (fake process group, real tensors); the collectives' buffers are rows
    from fxmem import _torch_compat as tc
    report = analyse(fsdp, 3, 2)
    table = report.modules(dict(B=5, L=7))
    with tc.fake_process_group(3, 2) as mesh:
        real = fsdp(Decoder(), mesh)
        shards = {name: tc.local_tensor(p).numel() for name, p in real.named_parameters()}
    for row in table:
        if not row.path.startswith("("):
            assert row.parameters == sum(n for name, n in shards.items()
                                         if not row.path or name.startswith(row.path + ".")), row.path
    assert {"(all-gather buffers)", "(reduce-scatter buffers)"} <= {r.path for r in table}
    assert "layers.0" in str(table)
