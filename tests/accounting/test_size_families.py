"""Whole families of models fxmem refused (or crashed on) while their real runs worked (issue 44, item 4),
each now analysed and checked against the CPU allocator at sizes the analysis did not see, forward and
training step:

* ``F.interpolate(x, size=y.shape[-2:])`` (torchvision's DeepLabV3 head, timm's MobileViT, FPN necks):
  ATen's ``.vec`` composite refused a symbolic size, and with ``scale_factor=`` it fixed every dim
  at its example size (fxmem/kernels/real_paths.py, the upsampling rules of fxmem/kernels/symbolic.py);
* BLOOM's ALiBi ``baddbmm`` with a broadcast first argument: the meta kernel's ``expand`` reached a
  C++ composite that takes sizes as numbers (fxmem/_torch_compat/fake.py, ``_symbolic_inner_calls``);
  its training step then showed that a custom ``autograd.Function``'s Python backward wraps its
  numbers afresh (fxmem/kernels/scalars.py);
* chained data-dependent filters (Faster R-CNN's post-processing: ``keep = torch.where(s > t)[0]``
  then a second filter over what the first kept): a ``TypeError`` from ``int(None)`` inside fxmem
  (the second mask's size has no example value) - fxmem/simulation/data_dims.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmem
from conftest import check_against_real_run, check_training_against_real_run, threads
from fxmem.measure import measure
from fxmem.records import INEXACT
from fxmem.training import default_loss, train_step

ADAMW = lambda p: torch.optim.AdamW(p)  # noqa: E731 - the optimizer users reach for

# --- F.interpolate to another tensor's size ----------------------------------------------------------


class SegHead(nn.Module):
    """A downsampling conv, a 1x1 classifier, upsampled back to the input's size (DeepLabV3's head)."""

    def __init__(self, mode: str, align_corners: bool | None = None):
        super().__init__()
        self.down, self.cls = nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv2d(8, 4, 1)
        self.mode, self.align_corners = mode, align_corners

    def forward(self, x):
        y = self.cls(torch.relu(self.down(x)))
        return F.interpolate(y, size=x.shape[-2:], mode=self.mode, align_corners=self.align_corners)


class FPNNeck(nn.Module):
    """Two lateral levels, the coarser upsampled to the finer's size and added (an FPN top-down path)."""

    def __init__(self, mode: str = "nearest"):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 6, 1), nn.Conv2d(6, 6, 1)
        self.out = nn.Conv2d(6, 2, 1)
        self.mode = mode

    def forward(self, x):
        fine = self.c1(x)
        coarse = self.c2(F.max_pool2d(fine, 2))  # floor(H/2) x floor(W/2): not the fine size for odd sizes
        top = F.interpolate(coarse, size=fine.shape[-2:], mode=self.mode)
        return self.out(fine + top)


class Stretch1d(nn.Module):
    """A sequence pooled and stretched back to its length, the size given as one number."""

    def __init__(self):
        super().__init__()
        self.pre, self.post = nn.Conv1d(3, 4, 1), nn.Conv1d(4, 2, 1)

    def forward(self, x):
        h = F.avg_pool1d(self.pre(x), 2)
        return self.post(F.interpolate(h, size=x.shape[-1], mode="linear"))


class Scaled(nn.Module):
    """Upsampling by a scale factor."""

    def __init__(self, scale: float, mode: str = "bilinear"):
        super().__init__()
        self.pre, self.post = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 2, 1)
        self.scale, self.mode = scale, mode

    def forward(self, x):
        return self.post(F.interpolate(self.pre(x), scale_factor=self.scale, mode=self.mode))


IMAGE = (("B", 3, "H", "W"),)
# B=1 and small odd sizes (re-analysed: another region of the kernels), and one size in the region of
# the analysis at its example sizes (B=97, H=101, W=103: B >= 16, H + W >= 129), read off its formulas
IMAGE_SIZES = [dict(B=1, H=9, W=13), dict(B=3, H=16, W=11), dict(B=17, H=70, W=66)]


def _symbolic(report: fxmem.Report, *dims: str) -> None:
    """The formulas are formulas: in the user's dims, none fixed at an example size."""
    assert not any("fixed dim" in n for n in report.notes), report.notes
    assert set(dims) <= {str(s) for s in report.peak.free_symbols}, report.peak


SEG_MODES = {"nearest": ("nearest", None), "bilinear": ("bilinear", False),
             "bilinear-align-corners": ("bilinear", True), "nearest-exact": ("nearest-exact", None),
             "bicubic": ("bicubic", False)}


@pytest.mark.parametrize("name", sorted(SEG_MODES))
def test_interpolate_to_the_inputs_size_forward(name):
    torch.manual_seed(0)
    report = check_against_real_run(SegHead(*SEG_MODES[name]), IMAGE, IMAGE_SIZES)
    assert report.exact, report.notes
    _symbolic(report, "B", "H", "W")


@pytest.mark.parametrize("name", ["nearest", "bilinear"])
def test_interpolate_to_the_inputs_size_training_step(name):
    torch.manual_seed(0)
    report = check_training_against_real_run(SegHead(*SEG_MODES[name]), IMAGE, [IMAGE_SIZES[0], IMAGE_SIZES[2]],
                                             ADAMW)
    assert report.exact, report.notes
    _symbolic(report, "B", "H", "W")


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_fpn_top_down_path(mode):
    torch.manual_seed(0)
    sizes = [dict(B=1, H=9, W=13), dict(B=2, H=12, W=7)]
    report = check_against_real_run(FPNNeck(mode), IMAGE, sizes)
    assert report.exact, report.notes
    _symbolic(report, "B", "H", "W")
    report = check_training_against_real_run(FPNNeck(mode), IMAGE, sizes, ADAMW)
    assert report.exact, report.notes


def test_interpolate_1d_to_a_size_given_as_one_number():
    torch.manual_seed(0)
    specs, sizes = (("B", 3, "T"),), [dict(B=1, T=9), dict(B=4, T=30)]
    report = check_training_against_real_run(Stretch1d(), specs, sizes, ADAMW)
    assert report.exact, report.notes
    _symbolic(report, "B", "T")


@pytest.mark.parametrize("scale", [2, 1.5, 0.5])
def test_a_scale_factor_keeps_the_dims_symbolic(scale):
    """``scale_factor=`` used to fix B, H and W at their example sizes (ATen's composite reads them as
    numbers): one analysis per size. The output size ``int(H * scale)`` is now exact integer arithmetic."""
    torch.manual_seed(0)
    report = check_against_real_run(Scaled(scale), IMAGE, [dict(B=1, H=9, W=13), dict(B=20, H=70, W=75)])
    assert report.exact, report.notes
    _symbolic(report, "B", "H", "W")


def test_a_scale_a_float_rounds_is_still_exact():
    """0.3 * H in double precision may round up to the next integer: that size is left to ATen's
    composite, which fixes the dims at their example sizes (the report says so), exact at each size."""
    torch.manual_seed(0)
    report = check_against_real_run(Scaled(0.3, "nearest"), IMAGE, [dict(B=2, H=10, W=20), dict(B=3, H=33, W=7)])
    assert report.exact, report.notes


# --- baddbmm with a broadcast first argument (BLOOM's ALiBi) ---------------------------------------------


class AlibiScores(nn.Module):
    """Attention scores with a linear position bias of shape (B*heads, 1, L), broadcast over the queries."""

    def __init__(self, heads: int = 2, dim: int = 8):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(heads * dim, heads * dim) for _ in range(3))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2).reshape(b * self.heads, n, -1)
        k = self.k(x).view(b, n, self.heads, -1).permute(0, 2, 3, 1).reshape(b * self.heads, -1, n)
        v = self.v(x).view(b, n, self.heads, -1).transpose(1, 2).reshape(b * self.heads, n, -1)
        alibi = torch.arange(n, dtype=x.dtype).view(1, 1, n).expand(b * self.heads, 1, n) * 0.5
        scores = torch.baddbmm(alibi, q, k, beta=1.0, alpha=0.25)
        return torch.bmm(scores.softmax(-1), v)


def test_baddbmm_with_a_broadcast_bias():
    torch.manual_seed(0)
    specs, sizes = (("B", "L", 16),), [dict(B=1, L=5), dict(B=3, L=40)]
    report = check_against_real_run(AlibiScores(), specs, sizes)
    assert report.exact, report.notes
    _symbolic(report, "B", "L")
    report = check_training_against_real_run(AlibiScores(), specs, sizes, ADAMW)
    assert report.exact, report.notes


def _bloom() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4)
    return transformers.BloomForCausalLM(config)


TOKENS = fxmem.TensorSpec(("B", "L"), dtype=torch.long)


def test_bloom_forward():
    torch.manual_seed(0)
    model = _bloom().eval()
    report = fxmem.analyze(model, TOKENS, check=False)
    assert report.exact, report.notes
    _symbolic(report, "B", "L")
    for dims in (dict(B=1, L=5), dict(B=3, L=37), dict(B=2, L=130)):
        x = torch.randint(0, 90, (dims["B"], dims["L"]))
        m = measure(lambda: model(x))
        ev = report.evaluate(**dims)
        assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained), dims


def test_bloom_training_step():
    """The step runs BLOOM's GeLUFunction, a custom autograd.Function whose Python backward multiplies by
    Python numbers: each is wrapped into a new 8-byte tensor (a C++ formula reuses the one it saved)."""
    torch.manual_seed(0)
    report = check_training_against_real_run(_bloom().train(), (TOKENS,), [dict(B=1, L=5), dict(B=3, L=37)],
                                             ADAMW)
    assert report.exact, report.notes


class PythonBackward(torch.autograd.Function):
    """A GELU whose backward is written in Python with Python numbers (BLOOM's GeLUFunction)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * g


class CustomGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(PythonBackward.apply(self.up(x)))


def test_a_python_backward_wraps_its_numbers_afresh():
    torch.manual_seed(0)  # eager: fx traces into a custom Function's forward (under no_grad) and refuses it
    report = check_training_against_real_run(CustomGelu(), (("B", "L", 8),), [dict(B=1, L=5), dict(B=3, L=37)],
                                             ADAMW, mode="eager")
    assert report.exact, report.notes


# --- chained data-dependent filters (Faster R-CNN's post-processing) -------------------------------------


class Filters(nn.Module):
    """Boxes kept by score, refined, then kept again by area (and by aspect with ``three``): each
    filter a ``torch.where(...)[0]``, a ``nonzero`` or a boolean mask over what the last one kept."""

    def __init__(self, how: str, three: bool = False):
        super().__init__()
        self.score, self.refine = nn.Linear(4, 1), nn.Linear(4, 4)
        self.how, self.three = how, three

    def keep(self, ok):
        if self.how == "where":
            return torch.where(ok)[0]
        if self.how == "nonzero":
            return ok.nonzero().squeeze(1)
        return ok

    def forward(self, boxes):
        boxes = boxes[self.keep(self.score(boxes).squeeze(-1) > 0)]
        boxes = self.refine(boxes)
        boxes = boxes[self.keep(boxes[:, 2] * boxes[:, 3] > 0)]
        if self.three:
            boxes = boxes[self.keep(boxes[:, 0] > boxes[:, 1])]
        return boxes.sum()


@torch.no_grad()
def _counts(net: nn.Module, boxes: torch.Tensor, three: bool) -> dict:
    """K1, K2 (, K3): how many boxes each filter keeps, as ``net``'s weights now compute them (``net``:
    the model, or its traced copy, which holds the same submodules)."""
    first = net.score(boxes).squeeze(-1) > 0
    refined = net.refine(boxes[first])
    second = refined[:, 2] * refined[:, 3] > 0
    out = dict(K1=int(first.sum()), K2=int(second.sum()))
    if three:
        kept = refined[second]
        out["K3"] = int((kept[:, 0] > kept[:, 1]).sum())
    return out


BOXES = (("N", 4),)


def _boxes(n: int) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(n))


def _check_filters(model: Filters, mode: str, sizes=(1, 7, 40, 300)) -> None:
    """Forward and AdamW step at each N, with the counts the model's weights give right then (the step
    changes the weights, and so how many boxes the next step keeps).

    On several threads a full reduction over kept boxes (``boxes.sum()``, the loss) keeps a per-thread
    buffer from 32768 elements on: a count the data decides, which the report flags (the only flag
    allowed here); on one thread the reports are exact."""
    report = fxmem.analyze(model, *BOXES, mode=mode, check=False)
    step = fxmem.analyze(model, *BOXES, mode=mode, check=False, optimizer=ADAMW)
    for r in (report, step):
        flags = [n for n in r.notes if INEXACT in n]
        assert all("two-pass buffer" in n and "decided by the data" in n for n in flags), flags
        assert r.exact or torch.get_num_threads() > 1, flags
    names = {"K1", "K2", "K3"} if model.three else {"K1", "K2"}
    assert set(report.data_dims) == names
    assert "K2 <= K1" in report.data_dims["K2"], report.data_dims["K2"]  # the second filter sees K1 boxes
    forward = report.graph_module if mode == "graph" else model
    trained = copy.deepcopy(forward)
    opt = ADAMW(trained.parameters())
    for n in sizes:
        x = _boxes(n)
        m = measure(lambda: forward(x))
        ev = report.evaluate(N=n, **_counts(forward, x, model.three))
        assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained), n
        train_step(trained, [x], opt, default_loss)
        counts = _counts(trained, x, model.three)  # after the warm-up step, before the measured one
        m = measure(lambda: train_step(trained, [x], opt, default_loss))
        ev = step.evaluate(N=n, **counts)
        assert (ev["train_peak"] - ev["train_resident"], ev["train_retained"]) == (m.peak_above_start, m.retained), n


@pytest.mark.parametrize("how", ["where", "nonzero", "mask"])
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_two_chained_filters(how, mode):
    torch.manual_seed(0)
    _check_filters(Filters(how), mode)


def test_three_chained_filters():
    torch.manual_seed(0)
    with threads(1):
        _check_filters(Filters("where", three=True), "eager")


class PostProcess(nn.Module):
    """torchvision's detection post-processing without NMS: a score threshold, ``remove_small_boxes``
    over what it kept, boxes sorted by score and clipped."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 1)

    def forward(self, boxes):
        scores = self.score(boxes).squeeze(-1).sigmoid()
        keep = torch.where(scores > 0.3)[0]
        boxes, scores = boxes[keep], scores[keep]
        ws, hs = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        keep = torch.where((ws >= -1.0) & (hs >= -1.0))[0]
        boxes, scores = boxes[keep], scores[keep]
        order = scores.sort(descending=True).indices
        return boxes[order].clamp(min=0), scores[order]


@torch.no_grad()
def _post_counts(net: nn.Module, boxes: torch.Tensor) -> dict:
    first = net.score(boxes).squeeze(-1).sigmoid() > 0.3
    kept = boxes[first]
    second = (kept[:, 2] - kept[:, 0] >= -1.0) & (kept[:, 3] - kept[:, 1] >= -1.0)
    return dict(K1=int(first.sum()), K2=int(second.sum()))


def test_detection_post_processing_in_eval():
    torch.manual_seed(0)
    model = PostProcess().eval()
    report = fxmem.analyze(model, *BOXES, grad=False, check=False)
    assert report.exact, report.notes
    gm = report.graph_module
    for n in (1, 5, 40, 300, 2000):
        x = _boxes(n)
        with torch.no_grad():
            m = measure(lambda: gm(x))
        ev = report.evaluate(N=n, **_post_counts(gm, x))
        assert (ev["peak_above_resident"], ev["retained"]) == (m.peak_above_start, m.retained), n


class KeptConv(nn.Module):
    """A convolution over the feature maps of the kept boxes (Mask R-CNN's mask head)."""

    def __init__(self):
        super().__init__()
        self.score, self.conv = nn.Linear(4, 1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, feats):
        keep = torch.where(self.score(feats.mean((2, 3))).squeeze(-1) > 0)[0]
        return self.conv(feats[keep]).relu()


def test_a_fitted_workspace_over_a_size_the_data_decides_is_flagged():
    """oneDNN's convolution workspace is fitted to sizes and checked at the example sizes; a batch the
    data decides (K1) has no example size, so the report says its numbers may not be exact (it crashed
    on ``int(None)`` before). What does not depend on the workspace still equals a real run."""
    torch.manual_seed(0)
    report = fxmem.analyze(KeptConv(), ("N", 4, 14, 14), check=False)
    assert not report.exact
    assert any("aten.convolution" in n and "decided by the data" in n for n in report.notes), report.notes
    gm = report.graph_module
    for n in (3, 20):
        x = torch.randn(n, 4, 14, 14, generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            k1 = int((gm.score(x.mean((2, 3))).squeeze(-1) > 0).sum())
        m = measure(lambda: gm(x))
        ev = report.evaluate(N=n, K1=k1)
        assert ev["retained"] == m.retained and ev["resident"] > 0, n
