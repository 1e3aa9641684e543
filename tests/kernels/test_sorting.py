"""Sorting, selection and reductions on CPU: the scratch their real kernels take through the
allocator (sort's index arange, kthvalue's clone and index tensor, median's contiguous copy, a
reduction's cast to the output dtype and two-pass buffer), checked against real runs at sizes the
analysis never saw, forward and training; and the one path fxmem cannot follow is flagged."""
from __future__ import annotations

import pytest
import torch

import fxmem
from conftest import check_against_real_run, check_training_against_real_run
from zoo import ScaledOp as Op


SORTING = {
    "sort-dim1": lambda x, w: x.sort(dim=1)[0],
    "sort-last-descending-stable": lambda x, w: x.sort(dim=-1, descending=True, stable=True)[0],
    "sort-transposed": lambda x, w: x.transpose(1, 2).sort(dim=1)[0],
    "argsort": lambda x, w: x.argsort(dim=1).float() + w,
    "msort": lambda x, w: x.msort(),
    "kthvalue": lambda x, w: x.kthvalue(2, dim=1)[0],
    "kthvalue-keepdim-transposed": lambda x, w: x.transpose(0, 2).kthvalue(3, dim=0, keepdim=True)[0],
    "median-dim0": lambda x, w: x.median(dim=0)[0],
    "median-last": lambda x, w: x.median(dim=2)[0],
    "nanmedian-dim1": lambda x, w: x.nanmedian(dim=1)[0],
    "median-all": lambda x, w: x.median() + w,
    "topk": lambda x, w: x.topk(2, dim=1)[0],
    "quantile": lambda x, w: x.quantile(0.3, dim=1),
}
REDUCTIONS = {
    "bool-sum": lambda x, w: x.gt(0).sum(1) * w,
    "int-cumsum": lambda x, w: x.int().cumsum(1).float() + w,
    "sum-float64": lambda x, w: x.sum(1, dtype=torch.float64),
    "mean-float64": lambda x, w: x.mean(dtype=torch.float64) * w,
    "full-sum-amax-prod": lambda x, w: (x.sum() + x.amax() + x.detach().prod()) * w,
    "any-bool-prod": lambda x, w: x.gt(0).any() * x.gt(-3).prod() * w,
}
# B*N*6 crosses at::internal::GRAIN_SIZE (32768) between the sizes: the two-pass buffer of a full
# reduction appears above it when torch runs more than one thread
SIZES = [dict(B=2, N=5), dict(B=3, N=11), dict(B=1500, N=7)]


@pytest.mark.parametrize("name", sorted(SORTING) + sorted(REDUCTIONS))
def test_forward_matches_real_run(name):
    fn = {**SORTING, **REDUCTIONS}[name]
    torch.manual_seed(0)
    check_against_real_run(Op(fn), (("B", "N", 6),), SIZES if name in REDUCTIONS else SIZES[:2])


@pytest.mark.parametrize("name", ["sort-dim1", "kthvalue", "median-dim0", "topk", "quantile", "bool-sum",
                                  "full-sum-amax-prod"])
def test_training_step_matches_real_run(name):
    fn = {**SORTING, **REDUCTIONS}[name]
    torch.manual_seed(0)
    check_training_against_real_run(Op(fn), (("B", "N", 6),), [dict(B=3, N=5), dict(B=2, N=13)],
                                    lambda p: torch.optim.Adam(p, lr=1e-3))


@pytest.mark.parametrize("reduce", ["max", "min", "median", "nanmedian", "prod"])
def test_backward_on_another_path_is_flagged(reduce):
    """evenly_distribute_backward and prod_backward take other ops for real tensors than for fake ones
    (fake tensors count as subclasses): the training step is flagged, never silently off; the
    forward is exact."""
    model = Op(lambda x, w: getattr(x, reduce)() * w)
    train = fxmem.analyze(model, ("B", "N", 6), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert not train.exact
    why = "prod_backward" if reduce == "prod" else "evenly_distribute_backward"
    assert any(f"aten.{reduce}" in n and why in n for n in train.notes)
    check_against_real_run(model, (("B", "N", 6),), [dict(B=3, N=5)], grad=False)
