"""The real-kernel probes (fxmem/kernels/accepts.py) stay inside the model's domain and can never
kill the process that runs fxmem.

Families: a patchify stem (``Conv2d(3, C, 4, stride=4)``) whose tokens are made into an image
again (``((S//4)**2)//(S//4)`` divides by zero at S=1); PVT / SegFormer attention whose keys are
reduced by a strided conv (at S=1 the keys are empty, and flash attention's CPU kernel dies with
SIGFPE on them); a custom op whose real kernel dies instead of raising.
"""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from conftest import check_against_real_run, check_training_against_real_run
from corpus.models import PatchifyStem  # ConvNeXt's stem
from fxmem.kernels.isolated import can_isolate, run_isolated

needs_fork = pytest.mark.skipif(not can_isolate(), reason="isolated probes need os.fork")


class ReducedKeyAttention(nn.Module):
    """PVT-v2 / SegFormer efficient self-attention: keys and values from a strided conv of the image."""

    def __init__(self, dim: int = 16, heads: int = 2, sr: int = 2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.sr = nn.Conv2d(dim, dim, sr, stride=sr)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.heads, c // self.heads).permute(0, 2, 1, 3)
        image = x.permute(0, 2, 1).reshape(b, c, h, w)
        reduced = self.norm(self.sr(image).reshape(b, c, -1).permute(0, 2, 1))
        kv = self.kv(reduced).reshape(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1])
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class PatchifyPVT(nn.Module):
    """A patchify stem (4x4, stride 4) whose tokens go through reduced-key attention."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 4, stride=4)
        self.block = ReducedKeyAttention(dim)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.embed(image)
        b, c, h, w = x.shape
        return self.block(x.flatten(2).transpose(1, 2), h, w)


class ImageKeyAttention(nn.Module):
    """Queries from every pixel, keys from the image reduced by a stride-2 conv (no division)."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.sr = nn.Conv2d(dim, dim, 2, stride=2)
        self.proj = nn.Linear(dim, dim)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        b, c = image.shape[:2]
        q = self.q(image.flatten(2).transpose(1, 2)).reshape(b, -1, self.heads, c // self.heads).transpose(1, 2)
        kv = self.kv(self.sr(image).flatten(2).transpose(1, 2))
        kv = kv.reshape(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1])
        return self.proj(out.transpose(1, 2).reshape(b, -1, c))


def test_reduced_key_attention_with_a_symbolic_image_size_is_exact():
    # at "every dim 1" the keys are empty: the probe must not hand them to the real kernel
    check_against_real_run(ImageKeyAttention(), (("B", 16, "S", "S"),), [dict(B=2, S=48), dict(B=3, S=20)])


def test_reduced_key_attention_training_step_is_exact():
    check_training_against_real_run(ImageKeyAttention(), (("B", 16, "S", "S"),), [dict(B=2, S=48)],
                                    lambda p: torch.optim.Adam(p), num_threads=1)


@pytest.mark.parametrize("model", [PatchifyPVT, PatchifyStem])
def test_patchify_stem_with_a_symbolic_image_size_is_exact(model):
    # tokens made into an image again: (S//4)**2 // (S//4) divides by zero at S=1, outside the model
    check_against_real_run(model(), (("B", 3, "S", "S"),), [dict(B=2, S=64), dict(B=3, S=96)])


def _pid_guarded(kill):
    """A kernel that kills its process - but only a child of this one (the test process must live)."""
    parent = os.getpid()

    def kernel(*args: object) -> torch.Tensor:
        if os.getpid() != parent:
            kill()
        raise RuntimeError("the test's guard: this kernel only ever runs in the probe's child")
    return kernel


_CRASHERS = {
    "sigfpe": lambda: os.kill(os.getpid(), signal.SIGFPE),
    "abort": os.abort,
}


@needs_fork
@pytest.mark.parametrize("how", sorted(_CRASHERS))
def test_a_kernel_that_kills_its_process_is_a_refusal_naming_the_op(how):
    name = f"fxmem_probe_test::dies_{how}"
    lib_op = torch.library.custom_op(name, mutates_args=())(_annotated(_pid_guarded(_CRASHERS[how])))
    lib_op.register_fake(lambda x: torch.empty_like(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return lib_op(self.fc(x)) + 1

    with pytest.raises(fxmem.KernelError) as info:
        fxmem.analyze(Model(), ("B", 4))
    text = str(info.value)
    assert f"fxmem_probe_test.dies_{how}" in text and "kills the process" in text
    assert "SIGFPE" in text if how == "sigfpe" else "SIGABRT" in text
    assert "not a problem of the input specs" in text and "lib_op(self.fc(x))" in text  # the source line


def _annotated(fn):
    def kernel(x: torch.Tensor) -> torch.Tensor:
        return fn(x)
    return kernel


@needs_fork
def test_run_isolated_reports_what_the_child_did():
    assert run_isolated(lambda: torch.ones(3).sum()) == ("ok", "")
    kind, text = run_isolated(lambda: torch.ones(3) @ torch.ones(4))
    assert kind == "raises" and text.startswith("RuntimeError:")
    assert run_isolated(_pid_guarded(lambda: os.kill(os.getpid(), signal.SIGFPE))) == ("crash", "signal SIGFPE")
    assert run_isolated(_pid_guarded(lambda: os._exit(7))) == ("crash", "exit status 7")


@needs_fork
def test_a_crashing_probe_leaves_no_core_file(tmp_path, monkeypatch):
    """A probe's child is a copy of the user's process: where core dumps are on, a kernel dying there
    would write one as large as the process into the working directory (CI ran out of disk on such
    files). The child is forbidden core files, whatever the parent's limit."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if hard == 0:
        pytest.skip("this machine forbids core files outright; nothing to check")
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))  # as on a machine that keeps core dumps
    monkeypatch.chdir(tmp_path)
    try:
        limit = run_isolated(lambda: (_ for _ in ()).throw(RuntimeError(resource.getrlimit(resource.RLIMIT_CORE)[0])))
        assert limit == ("raises", "RuntimeError: 0")  # what the child itself may write
        assert run_isolated(_pid_guarded(lambda: os.kill(os.getpid(), signal.SIGABRT))) == ("crash", "signal SIGABRT")
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    assert not list(tmp_path.iterdir())
