"""Who is blamed for a failure: only a real shape mismatch (torch's own shape checks, confirmed by
the real kernel, or the model's own ``assert``) blames the input specs. Failures inside PyTorch
(an internal assert, a fake kernel that rejects what the real kernel accepts, a NotImplementedError
of a meta kernel), a library wrapper (FSDP) or fxmem itself are InternalErrors that say so.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.errors import InternalError, ShapeError


def _not_blaming_the_specs(text: str) -> None:
    assert "this is not your input" in text and "what to do" in text
    assert "check the rank and sizes" not in text and "fails on the given input shapes" not in text


@pytest.fixture
def without_the_trilinear_rule():
    """fxmem's own rule for aten._trilinear taken away: torch's fake kernel is what runs."""
    from fxmem.kernels import REGISTRY, Kind
    rule = REGISTRY.lookup(Kind.SYMBOLIC, torch.ops.aten._trilinear.default, "cpu")
    REGISTRY.remove(rule)
    try:
        yield
    finally:
        REGISTRY.add(rule)


def test_a_fake_kernel_that_rejects_what_the_real_kernel_accepts_is_not_the_input(without_the_trilinear_rule):
    # torch's fake kernel of aten._trilinear hits an internal assert on symbolic sizes (torch 2.13);
    # the real kernel accepts the same shapes
    try:
        report = fxmem.analyze(nn.Bilinear(6, 5, 4), ("B", 6), ("B", 5))
    except InternalError as exc:
        text = str(exc)
        _not_blaming_the_specs(text)
        assert "aten._trilinear" in text and "fx node 'bilinear'" in text and "real kernel accepts" in text
    else:  # a torch whose fake kernel works: then it must not be a ShapeError either, and give numbers
        assert report.peak is not None


def test_bilinear_forward_is_exact_and_its_backward_flagged():
    from conftest import check_against_real_run
    for bias in (True, False):
        check_against_real_run(nn.Bilinear(6, 5, 4, bias=bias), (("B", 6), ("B", 5)), [dict(B=5), dict(B=33)])
    check_against_real_run(nn.Bilinear(6, 5, 3), (("B", "L", 6), ("B", "L", 5)), [dict(B=2, L=5), dict(B=3, L=17)],
                           grad=False)
    report = fxmem.analyze(nn.Bilinear(6, 5, 3), ("B", 6), ("B", 5), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert not report.exact and any("aten._trilinear" in n and "Bilinear's forward only" in n for n in report.notes)


def test_a_meta_kernel_that_is_not_implemented_is_not_the_input():
    @torch.library.custom_op("fxmem_blame_test::unimplemented_fake", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @op.register_fake
    def _(x):
        raise NotImplementedError("no symbolic rule for this case")

    class Model(nn.Module):
        def forward(self, x):
            return op(x + 1)

    with pytest.raises((InternalError, fxmem.UnsupportedOpError)) as info:
        fxmem.analyze(Model(), ("B", 3))
    text = str(info.value)
    assert "check the rank and sizes" not in text and "unimplemented_fake" in text


def test_a_failure_inside_fxmem_is_reported_as_fxmem_s(monkeypatch):
    from fxmem.simulation import recorder
    monkeypatch.setattr(recorder.kernels, "hidden_program", functools.partial(dict.__getitem__, {}))  # raises in fxmem's frame
    with pytest.raises(InternalError) as info:
        fxmem.analyze(nn.Linear(6, 4), ("B", 6))
    text = str(info.value)
    _not_blaming_the_specs(text)
    assert "fxmem itself failed at" in text and "recorder.py:" in text


def test_a_library_wrapper_that_fails_on_fake_tensors_is_not_the_input():
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs a fresh torch.distributed")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        fsdp.fully_shard(model)
        # an FSDP2-wrapped model is read and wrapped again in fxmem's own fake group (its fake
        # tensors never reach the user's group's collectives), never a blame of the specs
        report = fxmem.analyze(model, ("B", 8), optimizer=torch.optim.SGD)
        assert "rank 0 of 2, parallelised by your fully_shard on" in report.notes[0]
        assert dist.get_world_size() == 2 and dist.get_rank() == 0  # the user's group is back
    finally:
        dist.destroy_process_group()


def test_a_real_shape_mismatch_still_blames_the_specs():
    with pytest.raises(ShapeError) as info:
        fxmem.analyze(nn.Linear(6, 4), ("B", 5))
    assert "check the rank and sizes of the input specs" in str(info.value)


class ChecksItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        assert x.shape[-1] == 8, "expects 8 features"
        return self.fc(x)


def test_the_model_s_own_assert_blames_the_specs():
    with pytest.raises(ShapeError) as info:
        fxmem.analyze(ChecksItsInput(), ("B", 7), mode="eager")
    assert "expects 8 features" in str(info.value)


@torch.library.custom_op("fxmem_test_blame::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


class _CustomOpWithoutBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return _twice(self.fc(x))


def test_a_custom_op_without_a_backward_is_named_not_the_shapes():
    model = _CustomOpWithoutBackward()
    fxmem.analyze(model, ("B", 4))  # its forward is analysed (flagged: the op's own scratch is unknown)
    with pytest.raises(fxmem.UnsupportedOpError) as info:
        fxmem.analyze(model, ("B", 4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    text = str(info.value)
    assert "fxmem_test_blame.twice" in text and "register_autograd" in text
    assert "not a problem of the input shapes" in text and "fails on the given input shapes" not in text
    with pytest.raises(RuntimeError, match="no autograd formula"):  # as the real step does
        model(torch.randn(3, 4)).sum().backward()


@pytest.mark.parametrize("message", [
    "Expected inputs of BF16 type but got mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32.",
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "No available kernel. Aborting execution.",
    # DTensor without a sharding rule (torch's context_parallel on CPU attention): real tensors fail alike
    "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered.",
    '"addmm_impl_cpu_" not implemented for \'Half\'',
])
def test_dtype_device_and_backend_refusals_are_not_blamed_on_the_shapes(message):
    """A kernel that refuses dtypes, mixed devices or the enabled SDPA backends (CUDA's grouped_mm in
    float32, a CPU-made workspace on CUDA, sdpa_kernel without a GPU) fails the same at any shapes."""
    from fxmem.errors import KernelError
    from fxmem.simulation.failures import failure

    err = failure(RuntimeError(message), "model.py:12")
    assert isinstance(err, KernelError) and not isinstance(err, fxmem.ShapeError), err
    assert "not a problem of the input shapes" in str(err) and "what to do" in str(err)
    shape = failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)"), "model.py:12")
    assert isinstance(shape, fxmem.ShapeError)


def test_a_recursion_limit_inside_torch_is_not_the_input(monkeypatch):
    """Python's RecursionError is a RuntimeError, like torch's shape checks, but never one: when sympy
    or PyTorch's symbolic shapes recurse too deep (a ResNet-18's training step once did), the report
    says it is a limit of the analysis, not the user's shapes."""
    from fxmem.simulation import recorder

    def deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded while calling a Python object")

    monkeypatch.setattr(recorder.kernels, "hidden_program", deep)
    with pytest.raises(fxmem.ModelError) as info:
        fxmem.analyze(nn.Linear(6, 4), ("B", 6))
    text = str(info.value)
    assert not isinstance(info.value, fxmem.ShapeError) and "fails on the given input shapes" not in text
    assert "recursion limit" in text and "your input shapes are not the problem" in text
