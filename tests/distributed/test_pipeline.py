"""Pipeline parallelism (fxmem.distributed.pipeline): each rank's stage of a torch.distributed.pipelining
schedule, predicted by running torch's schedule code on fake tensors, against real runs.

Evidence, both real runs measured by the allocator (fxmem.measure), at sizes the analysis did not see:
* the same code with real tensors in torch's fake process group, one rank in this process (the stage's
  start-up messages from the other ranks' own steps, as the analysis gets them; the micro-batches'
  sends and receives do nothing: the values are garbage, the buffers real);
* gloo, one process per rank (spawned): the ranks exchange everything for real.
GPipe holds every micro-batch's activations before the first backward, 1F1B at most stages - rank; the
looped, interleaved and zero-bubble schedules run two stages a rank (in a V for ZBV and DualPipeV).
"""
import math
import re

import pytest
import sympy
import torch

import fxmem
from fxmem.distributed.real_runs import measure_ranks, measure_synchronous
from fxmem.errors import ModelError, SpecError
from zoo.distributed import D, V
from zoo.pipeline import (TP_D, PipeDecoder, PipeTPDecoder, adam, dualpipe_v, gpipe, interleaved,
                          interleaved_zero_bubble, looped_bfs, one_f_one_b, pp_ddp, pp_fsdp, pp_fsdp_tp, pp_hsdp, pp_tp,
                          train,
                          train_held, train_staged, zbv)

SIZES = [dict(B=8, L=5), dict(B=12, L=7)]  # (the analysis runs at fxmem's example sizes; B divides by 4 micro-batches)
_reports: dict = {}
# the schedules of two stages a rank: the step torchtitan writes (the stages held say what step() is handed)
TWO_A_RANK = (interleaved, looped_bfs, interleaved_zero_bubble, zbv, dualpipe_v)


def step_of(fn):
    return train_held if fn in TWO_A_RANK else train


def analyse(fn, world_size, rank):
    """The report of rank ``rank`` (cached), its model checked untouched by the analysis."""
    key = (fn.__name__, world_size, rank)
    if key not in _reports:
        model = PipeDecoder()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        _reports[key] = fxmem.analyze(model, ("B", "L", D), ("B", "L", V), optimizer=adam, step=step_of(fn),
                                      world_size=world_size, rank=rank, parallelize=fn, check=False)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert all(type(m).__module__.startswith(("torch.nn", "zoo")) for m in model.modules())
    return _reports[key]


def predicted(report, dims):
    e = report.evaluate(**dims)
    return e["train_peak"] - e["train_resident"], e["train_retained"], e["train_resident"], e["optimizer_state"]


def measured(real):
    return real.peak_above_start, real.retained, real.resident, real.optimizer_state


def inputs(dims):
    torch.manual_seed(1)
    return torch.randn(dims["B"], dims["L"], D), torch.randn(dims["B"], dims["L"], V)


@pytest.mark.parametrize("fn, world_size, rank", [
    (gpipe, 2, 0), (gpipe, 2, 1), pytest.param(one_f_one_b, 2, 1, marks=pytest.mark.slow),
    (interleaved, 2, 0), pytest.param(interleaved, 2, 1, marks=pytest.mark.slow),
    pytest.param(one_f_one_b, 3, 0, marks=pytest.mark.slow),  # CI: 1F1B on gloo, below
    pytest.param(one_f_one_b, 3, 1, marks=pytest.mark.slow),
    pytest.param(one_f_one_b, 3, 2, marks=pytest.mark.slow),
    (zbv, 2, 0),  # zero bubble in a V: rank 0 holds the first and the last stage
    pytest.param(zbv, 2, 1, marks=pytest.mark.slow),
    pytest.param(looped_bfs, 2, 0, marks=pytest.mark.slow), pytest.param(looped_bfs, 2, 1, marks=pytest.mark.slow),
    pytest.param(interleaved_zero_bubble, 2, 0, marks=pytest.mark.slow),
    pytest.param(interleaved_zero_bubble, 2, 1, marks=pytest.mark.slow),
    pytest.param(dualpipe_v, 2, 0, marks=pytest.mark.slow), pytest.param(dualpipe_v, 2, 1, marks=pytest.mark.slow)])
def test_synchronous_run_exact_per_rank(fn, world_size, rank):
    torch.set_num_threads(1)
    report = analyse(fn, world_size, rank)
    assert report.region and any("Mod(B, 4)" in r for r in report.region)  # the micro-batches divide B evenly
    sent_bound(report, links(fn, rank, world_size), SIZES[0])
    for dims in SIZES:
        real = measure_synchronous(PipeDecoder, inputs(dims), fn, world_size, rank, adam, step=step_of(fn))
        assert measured(real) == predicted(report, dims), f"{fn.__name__} {world_size} stages, rank {rank} at {dims}"


def links(fn, rank, world_size):
    """How many stage boundaries this rank's stages send across (one [B/4, L, D] tensor per micro-batch
    each): the next stage's activation and the gradient for the one before. Two stages a rank of 2:
    looped, 3 of 4 boundaries' sends on each rank; in a V, stages 1 and 2 share rank 1 and pass their
    tensors without a send, so 2 on each."""
    if fn in (zbv, dualpipe_v):
        return 2
    if fn in TWO_A_RANK:
        return 3
    return (rank > 0) + (rank < world_size - 1)


def sent_bound(report, neighbours, dims, width=D):
    """The bound the notes state for what gloo may hold late (bytes at ``dims``), checked against the
    sends the split makes: each micro-batch's [B/4, L, D] float32 activation to the next stage and its
    gradient to the one before, 4 * width * B * L bytes per link over the 4 micro-batches (width: D)."""
    stated = re.search(r"up to (\S+) bytes \(the step's \d+ sent", " ".join(report.notes))
    assert stated, report.notes
    bound = sympy.sympify(stated.group(1), locals={n: sympy.Symbol(n, integer=True, positive=True) for n in "BL"})
    assert sympy.simplify(bound - neighbours * 4 * 4 * width * sympy.floor(sympy.Symbol("B", integer=True,
                          positive=True) / 4) * sympy.Symbol("L", integer=True, positive=True)) == 0, bound
    return neighbours * 4 * width * dims["B"] * dims["L"]


@pytest.mark.parametrize("fn", [gpipe] + [pytest.param(fn, marks=pytest.mark.slow) for fn in (
    one_f_one_b, interleaved, looped_bfs, interleaved_zero_bubble, zbv, dualpipe_v)])  # CI: GPipe
def test_gloo_ranks_within_the_stated_bound(fn):
    # gloo completes the sends asynchronously: each rank's state exact, its peak and what its step keeps
    # between the synchronous numbers and them + every sent tensor held late (1F1B's rank 0 was seen
    # 1,092 B above, one micro-batch's activation, sent in a batch_isend_irecv with the gradient it receives)
    torch.set_num_threads(1)
    dims = SIZES[1]
    for real in measure_ranks(PipeDecoder, inputs(dims), fn, 2, adam, step=step_of(fn)):
        report = analyse(fn, 2, real.rank)
        peak, retained, resident, state = predicted(report, dims)
        assert (real.resident, real.optimizer_state) == (resident, state), f"rank {real.rank}"
        late = sent_bound(report, links(fn, real.rank, 2), dims)
        for what, got, sync in (("peak", real.peak_above_start, peak), ("retained", real.retained, retained)):
            assert sync <= got <= sync + late, (f"{fn.__name__} rank {real.rank} {what}: gloo {got:,} B, synchronous "
                                                f"{sync:,} B, stated bound {late:,} B")


def test_gpipe_holds_more_microbatches_than_1f1b():
    # on stage 0 of 2, GPipe runs all 4 forwards before the first backward, 1F1B two: its step peak is
    # lower by the saved activations of two micro-batches, as the real runs say
    torch.set_num_threads(1)
    dims = SIZES[1]
    real = {fn: measure_synchronous(PipeDecoder, inputs(dims), fn, 2, 0, adam, step=train).peak_above_start
            for fn in (gpipe, one_f_one_b)}  # (GPipe's: also in test_synchronous_run_exact_per_rank)
    ours = {fn: predicted(analyse(fn, 2, 0), dims)[0] for fn in (gpipe, one_f_one_b)}
    assert ours == real and ours[gpipe] > ours[one_f_one_b]


def test_a_pipeline_needs_its_step():
    with pytest.raises(SpecError, match="pipeline schedule runs from your own step: pass step=fn"):
        fxmem.analyze(PipeDecoder(), ("B", "L", D), ("B", "L", V), optimizer=adam, world_size=2, parallelize=gpipe)


def test_schedules_not_modelled_are_refused_by_name():
    from torch.distributed.pipelining import ScheduleGPipe

    class OwnGPipe(ScheduleGPipe):  # a schedule of one's own: its order of micro-batches is not torch's
        pass

    def own(model, mesh):
        return OwnGPipe(gpipe(model, mesh)._stage, n_microbatches=4, loss_fn=gpipe(model, mesh)._loss_fn)

    with pytest.raises(ModelError, match="OwnGPipe, a pipeline schedule fxmem does not model yet"):
        fxmem.analyze(PipeDecoder(), ("B", "L", D), ("B", "L", V), optimizer=adam, step=train, world_size=2,
                      parallelize=own)


def test_a_step_the_schedule_refuses_is_not_blamed_on_the_shapes():
    # ZBV's rank 0 holds the last stage too: a step that hands it no target= is refused by torch's schedule,
    # at any batch size (it was a ShapeError, "fails on the given input shapes")
    with pytest.raises(ModelError, match="torch's pipeline schedule refuses it: Stage 3: loss_fn and target "
                                         "required for last stage") as info:
        fxmem.analyze(PipeDecoder(), ("B", "L", D), ("B", "L", V), optimizer=adam, step=train, world_size=2,
                      parallelize=zbv)
    assert "not a problem of the input shapes" in str(info.value) and "target=" in str(info.value)


def test_pipeline_stages_with_ddps_map_of_used_parameters_are_refused_by_name():
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    def ddp_stages(model, mesh):
        pp, dp = mesh["pp"], mesh["dp"]
        rank = pp.get_local_rank()
        part = DistributedDataParallel(model.layers[:2] if rank == 0 else model.layers[2:],
                                       process_group=dp.get_group(), find_unused_parameters=True)
        return ScheduleGPipe(PipelineStage(part, rank, 2, torch.device("cpu"), group=pp.get_group()),
                             n_microbatches=4, loss_fn=None)

    with pytest.raises(ModelError, match="wrapped by DistributedDataParallel with find_unused_parameters=True"):
        fxmem.analyze(PipeDecoder(), ("B", "L", D), ("B", "L", V), optimizer=adam, step=train_staged, world_size=4,
                      mesh={"pp": 2, "dp": 2}, parallelize=ddp_stages)


# Pipelines on a mesh of several dims (torchtitan's layouts): stages over "pp", FSDP2 over "dp" (or HSDP over
# "replicate" and "shard"), tensor parallelism over "tp". Each rank's stage against the same code's real run,
# synchronous and on gloo.
MESHES = {pp_fsdp: {"pp": 2, "dp": 2}, pp_tp: {"pp": 2, "tp": 2}, pp_fsdp_tp: {"pp": 2, "dp": 2, "tp": 2},
          pp_hsdp: {"pp": 2, "replicate": 2, "shard": 2}, pp_ddp: {"pp": 2, "dp": 2}}


def analyse_mesh(fn, rank):
    key = (fn.__name__, "mesh", rank)
    if key not in _reports:
        mesh = MESHES[fn]
        model = PipeTPDecoder()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        _reports[key] = fxmem.analyze(model, ("B", "L", TP_D), ("B", "L", V), optimizer=adam, step=train_staged,
                                      world_size=math.prod(mesh.values()), mesh=mesh, rank=rank, parallelize=fn,
                                      check=False)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert all(type(m).__module__.startswith(("torch.nn", "zoo")) for m in model.modules())
    return _reports[key]


def mesh_inputs(dims):
    torch.manual_seed(1)
    return torch.randn(dims["B"], dims["L"], TP_D), torch.randn(dims["B"], dims["L"], V)


@pytest.mark.parametrize("fn, rank", [
    (pp_fsdp, 0), pytest.param(pp_fsdp, 3, marks=pytest.mark.slow),
    pytest.param(pp_tp, 0, marks=pytest.mark.slow), pytest.param(pp_tp, 3, marks=pytest.mark.slow),
    pytest.param(pp_fsdp_tp, 0, marks=pytest.mark.slow), (pp_fsdp_tp, 7),  # CI: 2-D FSDP2, 3-D
    pytest.param(pp_hsdp, 0, marks=pytest.mark.slow), pytest.param(pp_hsdp, 7, marks=pytest.mark.slow),
    (pp_ddp, 3), pytest.param(pp_ddp, 0, marks=pytest.mark.slow)])  # CI: DDP stages
def test_pipeline_on_a_mesh_exact_per_rank(fn, rank):
    # the stage's FSDP2 shards (over "dp") and tensor-parallel shards (over "tp"), its micro-batches in
    # flight (1F1B) and the collectives of both inside the schedule's forwards and backwards
    torch.set_num_threads(1)
    report = analyse_mesh(fn, rank)
    mesh = MESHES[fn]
    if fn is pp_ddp:  # the stage's buckets are DDP's, and the notes say how the bucket-rebuilding step differs
        assert any(s.name.startswith("DDP gradient bucket ") for s in report.storages)
        assert any(n.startswith("DDP: the steady state's numbers") for n in report.notes), report.notes
    for dims in SIZES:
        real = measure_synchronous(PipeTPDecoder, mesh_inputs(dims), fn, math.prod(mesh.values()), rank, adam,
                                   step=train_staged, mesh=mesh)
        assert measured(real) == predicted(report, dims), f"{fn.__name__} rank {rank} at {dims}"


def stated_bounds(report, dims):
    """Every bound the notes state on what gloo may hold beyond the synchronous numbers, in bytes at ``dims``."""
    symbols = {n: sympy.Symbol(n, integer=True, positive=True) for n in "BL"}
    found = re.findall(r"by up to (\S+) bytes", " ".join(report.notes))
    assert found, report.notes
    return sum(int(sympy.sympify(f.replace(",", ""), locals=symbols).subs({symbols[k]: v for k, v in dims.items()}))
               for f in found)


@pytest.mark.parametrize("fn", [pp_fsdp, pytest.param(pp_tp, marks=pytest.mark.slow),
                                pytest.param(pp_hsdp, marks=pytest.mark.slow), pytest.param(pp_ddp, marks=pytest.mark.slow)])
def test_gloo_pipeline_on_a_mesh_within_the_stated_bound(fn):
    # 4 processes (HSDP: 8), 2 stages: each rank's state exact; its resident count, peak and what its step keeps
    # between the synchronous numbers and them + the notes' bounds (the stage's sends, FSDP2's or tensor
    # parallelism's buffers)
    torch.set_num_threads(1)
    dims, mesh = SIZES[1], MESHES[fn]
    world = math.prod(mesh.values())
    for real in measure_ranks(PipeTPDecoder, mesh_inputs(dims), fn, world, adam, step=train_staged, mesh=mesh):
        report = analyse_mesh(fn, real.rank)
        peak, retained, resident, state = predicted(report, dims)
        # the allocator's resident count includes FSDP2's buffers gloo frees late: the rank's own storages
        # (parameter shards, optimizer state, inputs) counted one by one, beside what the stage keeps (its
        # receive buffers; the last stage's outputs of the step before)
        stage = sum(s.bytes for s in report.storages if s.name.startswith(f"stage {real.rank // (world // 2)} "))
        buckets = report.at(sum(s.bytes for s in report.storages if s.name.startswith("DDP gradient bucket ")), **dims)
        assert real.extra["ddp_bucket_bytes"] == buckets  # DDP's own count of its stage's buckets (0 without DDP)
        assert (real.extra["state_storages"], real.optimizer_state) == (resident - report.at(stage, **dims) - buckets,
                                                                        state)
        sent_bound(report, 1, dims, TP_D)  # one link: the other stage's activations or gradients
        late = stated_bounds(report, dims)
        for what, got, sync in (("resident", real.resident, resident), ("peak", real.peak_above_start, peak),
                                ("retained", real.retained, retained)):
            assert sync <= got <= sync + late, (f"{fn.__name__} rank {real.rank} {what}: gloo {got:,} B, synchronous "
                                                f"{sync:,} B, stated bounds {late:,} B")


@pytest.mark.slow  # CI: the stages' ranks above; this checks that world_sizes picks them and their largest batch
def test_world_sizes_of_a_pipeline_has_a_row_per_stage():
    # each stage's first rank (stage 1 of a "pp" 2 x "dp" 2 mesh is rank 2), against its real run; the largest
    # batch is a multiple of the 4 micro-batches that fits, and the next multiple does not
    torch.set_num_threads(1)
    table = fxmem.world_sizes(PipeTPDecoder(), ("B", "L", TP_D), ("B", "L", V), parallelize=pp_fsdp,
                              sizes=[{"pp": 2, "dp": 2}], optimizer=adam, step=train_staged, check=False)
    assert list(table) == ["pp 2 x dp 2, stage 0", "pp 2 x dp 2, stage 1"]
    dims = SIZES[1]
    for (key, report), rank in zip(table.items(), (0, 2)):
        real = measure_synchronous(PipeTPDecoder, mesh_inputs(dims), pp_fsdp, 4, rank, adam, step=train_staged,
                                   mesh=MESHES[pp_fsdp])
        assert measured(real) == predicted(report, dims), key
    budget = 400_000
    best = table.max_size("B", budget, L=7)
    for key, report in table.items():
        b = best[key]
        assert b % 4 == 0 and report.evaluate(B=b, L=7)["train_peak"] <= budget < \
            report.evaluate(B=b + 4, L=7)["train_peak"], key
    assert "pp 2 x dp 2, stage 1" in str(table)
