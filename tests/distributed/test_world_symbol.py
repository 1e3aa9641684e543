"""The world size as a symbol (fxmem.distributed.world_symbol): one rank's formulas in W, made from
three world sizes, against real steps at world sizes the analysis did not run (the synchronous
schedule: FSDP2's and DDP's own code on real tensors in torch's fake process group, measured by the
allocator), on ranks it did not run either; uneven world sizes analysed when asked."""
import pytest
import torch

import fxmem
from zoo.distributed import Decoder, TPDecoder, adamw, ddp_small, fsdp, fsdp_tp, hsdp, real_forward
from fxmem.distributed.real_runs import measure_ranks, measure_synchronous
from fxmem.errors import ModelError, SpecError
from fxmem.specs import dim_symbol

# every sharded size a multiple of 12 (12, 24, 36, 72 ...): W = 2, 3, 4 are analysed, 6 and 12 are not
D, H, V = 12, 24, 36


def even_decoder():
    return Decoder(2, D, H, V)


def tp_decoder():  # whole heads and MLP features per tensor-parallel rank; a head of 24 rows
    return TPDecoder(2, 24, 48, 24)


def real(make, fn, world_size, rank, dims, width, mesh=None):
    x = torch.randn(dims["B"], dims["L"], width)
    r = measure_synchronous(make, (x,), fn, world_size, rank, adamw, mesh=mesh)
    return r.resident + r.peak_above_start, r.resident, r.optimizer_state


def predicted(report, **dims):
    e = report.evaluate(**dims)
    return e["train_peak"], e["train_resident"], e["optimizer_state"]


def test_fsdp_formulas_in_w_exact_at_world_sizes_and_ranks_not_analysed():
    torch.set_num_threads(1)
    report = fxmem.analyze(even_decoder(), ("B", "L", D), optimizer=adamw, world_size="W", parallelize=fsdp)
    W = dim_symbol("W")
    assert report.train_resident.has(W) and "12 divisible by W" in report.region
    assert report.optimizer_state.coeff(W, -1) > 0 and not report.optimizer_state.subs(W, 10**9).is_zero
    for w, rank in ((6, 5), (12, 0), (12, 7)):
        for dims in (dict(B=5, L=7), dict(B=3, L=10)):
            assert predicted(report, W=w, **dims) == real(even_decoder, fsdp, w, rank, dims, D), (w, rank, dims)
    # the largest batch at 12 ranks: it fits, one more does not (what a real run of it holds)
    budget = real(even_decoder, fsdp, 12, 0, dict(B=6, L=7), D)[0]
    assert report.max_size("B", budget, train=True, L=7, W=12) == 6
    # the fewest ranks whose step fits a budget (among those dividing the shards evenly): a real step
    # there fits, and one on the next fewer such ranks does not
    budget = real(even_decoder, fsdp, 6, 0, dict(B=5, L=7), D)[0] + 1000
    fewest = report.min_size("W", budget, train=True, B=5, L=7)
    assert fewest == 6 and real(even_decoder, fsdp, 4, 0, dict(B=5, L=7), D)[0] > budget
    with pytest.raises(SpecError, match="min_size"):
        report.max_size("W", budget, train=True, B=5, L=7)
    with pytest.warns(UserWarning, match="none fits"):
        assert report.min_size("W", 1000, train=True, B=5, L=7) == 0


def test_an_uneven_world_size_is_analysed_there():
    torch.set_num_threads(1)
    report = fxmem.analyze(even_decoder(), ("B", "L", D), optimizer=adamw, world_size="W", parallelize=fsdp)
    assert predicted(report, W=5, B=5, L=7) == real(even_decoder, fsdp, 5, 0, dict(B=5, L=7), D)
    assert any("W == 5" in region for region, _ in report.regions())


def test_ddp_answer_is_the_same_at_every_world_size_and_exact_on_gloo_processes():
    torch.set_num_threads(1)
    report = fxmem.analyze(even_decoder(), ("B", "L", D), optimizer=adamw, world_size="W", parallelize=ddp_small,
                           rank=1)
    assert not report.train_peak.has(dim_symbol("W"))
    assert predicted(report, W=7, B=5, L=7) == real(even_decoder, ddp_small, 7, 1, dict(B=5, L=7), D)
    # 5 gloo processes (W = 2, 3, 4 were analysed): every rank's step as the formulas say
    e = report.evaluate(W=5, B=5, L=7)
    for r in measure_ranks(even_decoder, (torch.randn(5, 7, D),), ddp_small, 5, adamw):
        assert (r.peak_above_start, r.retained, r.optimizer_state) == \
            (e["train_peak"] - e["train_resident"], e["train_retained"], e["optimizer_state"])


@pytest.mark.parametrize("fn, mesh, at, layout", [
    (fsdp_tp, {"dp": "D", "tp": 2}, {"D": 6}, {"dp": 6, "tp": 2}),  # FSDP2's dim of torchtitan's 2-D mesh
    (hsdp, {"replicate": 2, "shard": "S"}, {"S": 6}, {"replicate": 2, "shard": 6})])
def test_one_dim_of_a_mesh_as_a_symbol(fn, mesh, at, layout):
    torch.set_num_threads(1)
    report = fxmem.analyze(tp_decoder(), ("B", "L", 24), optimizer=adamw, mesh=mesh, parallelize=fn)
    name = next(iter(at))
    assert report.train_resident.has(dim_symbol(name))
    ranks = layout["dp" if "dp" in layout else "replicate"] * layout["tp" if "tp" in layout else "shard"]
    assert predicted(report, B=5, L=7, **at) == real(tp_decoder, fn, ranks, 0, dict(B=5, L=7), 24, mesh=layout)


def shard_from_three(model, mesh):  # a layout that changes with the world size: no formula holds across
    if mesh.size() >= 3:
        for layer in model.layers:
            torch.distributed.fsdp.fully_shard(layer, mesh=mesh)
    return torch.distributed.fsdp.fully_shard(model, mesh=mesh)


def test_refusals():
    with pytest.raises(SpecError, match="head.weight 17"):  # Decoder's default sizes: prime, no world size divides
        fxmem.analyze(Decoder(), ("B", "L", 13), optimizer=adamw, world_size="W", parallelize=fsdp)
    with pytest.raises(ModelError, match="differ beyond their sizes"):
        fxmem.analyze(even_decoder(), ("B", "L", D), optimizer=adamw, world_size="W", parallelize=shard_from_three)
    with pytest.raises(SpecError, match="also a dim of the inputs"):
        fxmem.analyze(even_decoder(), ("W", "L", D), world_size="W", parallelize=fsdp)
    with pytest.raises(SpecError, match="one dim of the mesh"):
        fxmem.analyze(tp_decoder(), ("B", "L", 24), mesh={"dp": "D", "tp": "T"}, parallelize=fsdp_tp)
    with pytest.raises(SpecError, match="pipeline stages cannot be a symbol"):
        fxmem.analyze(tp_decoder(), ("B", "L", 24), mesh={"pp": "P", "dp": 2}, parallelize=fsdp_tp)
    with pytest.raises(SpecError, match="name the dim that varies in the mesh"):
        fxmem.analyze(tp_decoder(), ("B", "L", 24), world_size="W", mesh={"dp": 2, "tp": 2}, parallelize=fsdp_tp)
    with pytest.raises(SpecError, match="dim name"):
        fxmem.analyze(even_decoder(), ("B", "L", D), world_size="2 ranks", parallelize=fsdp)


def test_the_world_sizes_analysed():
    """Three that divide the sharded sizes' gcd, from the smallest a rank allows; the example given
    (hints={"W": n}) first where it is one; any three where nothing is sharded (DDP)."""
    from fxmem.distributed.world_symbol import _points
    assert _points(256, 2, 2, "W", {}) == [2, 4, 8] and _points(256, 2, 64, "W", {}) == [64, 2, 4]
    assert _points(12, 4, 5, "W", {}) == [4, 6, 12]  # rank 3: W >= 4; the guess 5 was uneven
    assert _points(0, 2, 8, "W", {}) == [8, 2, 3]
    with pytest.raises(SpecError, match="head.weight 17"):
        _points(17, 2, 2, "W", {17: "head.weight"})


def test_a_forward_in_w_against_real_forwards():
    """A forward alone (no optimizer): what the rank keeps between forwards (FSDP2's root, unsharded:
    its name carries the shape, 12/W rows of it) and the forward's peak, at 6 ranks (2, 3 and 4 analysed)."""
    torch.set_num_threads(1)
    report = fxmem.analyze(even_decoder(), ("B", "L", D), grad=False, world_size="W", parallelize=fsdp)
    assert any("/W" in s.name for s in report.storages)
    e = report.evaluate(B=5, L=7, W=6)
    assert real_forward(even_decoder, fsdp, 6, 1, torch.randn(5, 7, D)) == \
        (e["peak"] - e["resident"], e["retained"], e["resident"])


def test_a_model_the_user_wrapped_in_w():
    """A training script's model, sharded by FSDP2 in its own group (rank 2 of 3): world_size="W"
    reads the wrapping and gives rank 0's formulas in W; the user's group is left as it was."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    try:
        wrapped = fsdp(even_decoder(), init_device_mesh("cpu", (3,)))
        report = fxmem.analyze(wrapped, ("B", "L", D), optimizer=adamw, world_size="W")
        assert dist.get_rank() == 2 and dist.get_world_size() == 3
    finally:
        dist.destroy_process_group()
    assert predicted(report, W=6, B=5, L=7) == real(even_decoder, fsdp, 6, 0, dict(B=5, L=7), D)
    with pytest.raises(SpecError, match="needs parallelize=fn .* or a model you wrapped"):
        fxmem.analyze(even_decoder(), ("B", "L", D), world_size="W")
