"""HF vision transformers (tiny configs, random weights): their numbers equal real runs, byte for
byte, at sizes the analysis never saw - forward and an AdamW training step.

Two families that fxmem got wrong before (issue 44, item 4):

* **First-call caches.** BEiT keeps its relative position index in a ``functools.lru_cache``
  (``BeitRelativePositionBias.generate_relative_position_index``): the first call builds it, later
  calls get it back. fxmem put its fake tensor into that process-wide cache - the user's next call
  returned FakeTensors, and the self-check compared against that broken run ("2.8-3.4x high").
  Now the cache is private while fxmem runs, and the analysis is of the steady state (a call after
  the first), with the cached index counted as resident (see :mod:`fxmem.caches`). The same holds
  for a cache on the model's own modules (``if self._table is None: ...``) and an lru cache in the
  model's file; a forward that stores anew on every call is analysed as a first call and says so,
  and a dict keyed by a size is refused naming its line (see :mod:`fxmem.simulation.first_calls`).
* **Position embeddings interpolated to the image size** (DINOv2; ViT and DeiT with
  ``interpolate_pos_encoding=True``): ``F.interpolate(..., size=(H // 14, W // 14), mode="bicubic")``
  at symbolic sizes, which evaluate() at another image size re-analyses, was refused.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import fxmem
from fxmem.measure import measure
from fxmem.training import default_loss, train_step

transformers = pytest.importorskip("transformers")

ADAMW = lambda p: torch.optim.AdamW(p)  # noqa: E731 - the optimizer factory fxmem is given
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _forward_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(peak above start, retained) bytes of a real forward after a first one (the steady state)."""
    m = measure(lambda: model(x), warmup=1)
    return m.peak_above_start, m.retained


def _step_bytes(model: nn.Module, x: torch.Tensor) -> tuple[tuple[int, int], int]:
    """((peak above start, retained), optimizer state) bytes of a real AdamW step after a first one."""
    optimizer = torch.optim.AdamW(model.parameters())
    train_step(model, [x], optimizer, default_loss)  # makes the optimizer's state: steady state
    m = measure(lambda: train_step(model, [x], optimizer, default_loss), warmup=0)
    state = _bytes([t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
    model.zero_grad(set_to_none=True)
    return (m.peak_above_start, m.retained), state


def _image(b: int, h: int, w: int) -> torch.Tensor:
    return torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(0))


# --- first-call caches: BEiT ---------------------------------------------------------------------

def _beit(shared: bool, head: bool) -> nn.Module:
    """A tiny BEiT at 32 x 32 images (patch 8: a 4 x 4 window, so a 17 x 17 int64 index, 2,312 B)."""
    from transformers import BeitConfig, BeitForImageClassification, BeitModel

    torch.manual_seed(0)
    config = BeitConfig(image_size=32, patch_size=8, num_labels=3, use_relative_position_bias=not shared,
                        use_shared_relative_position_bias=shared, **TINY)
    return (BeitForImageClassification if head else BeitModel)(config)


INDEX_BYTES = 17 * 17 * 8  # the cached relative position index (bytes), one per window size


def _cache_of_beit():
    """transformers' lru cache behind ``generate_relative_position_index`` (in its wrapper's closure)."""
    from transformers.models.beit.modeling_beit import BeitRelativePositionBias

    wrapper = BeitRelativePositionBias.generate_relative_position_index
    return next(c.cell_contents for c in wrapper.__closure__ if hasattr(c.cell_contents, "cache_info"))


@pytest.mark.parametrize("shared, head", [(False, False), (True, True)], ids=["per-layer-bias", "shared-bias-head"])
def test_beit_is_analysed_in_its_steady_state_and_exact(shared, head):
    """The forward at batches the analysis did not see equals a real second call; the cached index
    is resident (parameters + input + the index), and the report says why."""
    model = _beit(shared, head)
    report = fxmem.analyze(model, ("B", 3, 32, 32))
    assert report.exact, report.notes
    assert "checked" in report.checked and "equal" in report.checked, report.checked
    note = " ".join(report.notes)
    assert "generate_relative_position_index" in note and "caches tensors between calls" in note, report.notes
    params = _bytes([*model.parameters(), *model.buffers()])
    for b in (3, 7):
        x = _image(b, 32, 32)
        at = report.evaluate(B=b)
        assert (at["peak_above_resident"], at["retained"]) == _forward_bytes(model, x), b
        assert at["resident"] == params + x.nbytes + INDEX_BYTES, b


def test_beit_training_step_is_exact():
    """A steady-state AdamW step: peak above resident, retained, optimizer state and resident."""
    model = _beit(shared=True, head=True)
    report = fxmem.analyze(model, ("B", 3, 32, 32), optimizer=ADAMW)
    assert report.exact, report.notes
    params = _bytes([*model.parameters(), *model.buffers()])
    for b in (3, 6):
        x = _image(b, 32, 32)
        at = report.evaluate(B=b)
        measured, state = _step_bytes(model, x)
        assert (at["train_peak"] - at["train_resident"], at["train_retained"]) == measured, b
        assert at["optimizer_state"] == state
        assert at["train_resident"] == params + state + x.nbytes + INDEX_BYTES


def test_the_analysis_leaves_the_libraries_cache_alone():
    """Nothing fxmem computes reaches transformers' process-wide cache: the user's next call gets
    real tensors (it got fxmem's FakeTensor before), and an entry the user's own call made stays."""
    cache = _cache_of_beit()
    cache.cache_clear()
    model = _beit(shared=False, head=False)
    fxmem.analyze(model, ("B", 3, 32, 32), check=False)
    assert cache.cache_info().currsize == 0
    out = model(_image(2, 32, 32)).last_hidden_state
    assert type(out) is torch.Tensor
    kept = cache((4, 4))
    fxmem.analyze(model, ("B", 3, 32, 32))  # with the self-check: a real run, on a cache of its own
    assert cache((4, 4)) is kept and cache.cache_info().currsize == 1


# --- first-call caches of the model's own code ---------------------------------------------------

@functools.lru_cache(maxsize=8)
def _angles(n: int) -> torch.Tensor:
    """A (n, 16) float32 table (64 * n bytes), built once per length: a module-level lru cache."""
    return torch.sin(torch.arange(n, dtype=torch.float32)[:, None] * torch.arange(1.0, 17.0))


class _RotaryLike(nn.Module):
    """Builds a position table on its first call (and again for a longer sequence), reads it after:
    the cache on the module that rotary embeddings used to keep."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self._table = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if self._table is None or self._table.shape[0] < n:
            self._table = torch.sin(torch.arange(n, dtype=torch.float32)[:, None] * torch.ones(16))
        return self.fc(x) * self._table[:n]


class _GlobalCache(nn.Module):
    """Reads its table from a module-level ``functools.lru_cache`` keyed by the sequence length."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * _angles(x.shape[1])


class _DictCache(_RotaryLike):
    """A cache keyed by the size itself: Python cannot hash a symbolic size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        tables = self.__dict__.setdefault("_tables", {})
        if n not in tables:
            tables[n] = torch.ones(n, 16)
        return self.fc(x) * tables[n]


@pytest.mark.parametrize("cls", [_RotaryLike, _GlobalCache], ids=["on-the-module", "lru-cache-in-the-file"])
def test_a_cache_of_the_models_own_code_is_analysed_in_its_steady_state(cls):
    """Each size's steady state (a fresh model called twice at that size) equals the analysis; the
    (L, 16) table (64 * L bytes) is resident; the user's model and cache are untouched."""
    torch.manual_seed(0)
    model = cls()
    _angles.cache_clear()
    report = fxmem.analyze(model, ("B", "L", 16))
    assert report.exact, report.notes
    assert "caches tensors between calls" in " ".join(report.notes), report.notes
    assert getattr(model, "_table", None) is None and _angles.cache_info().currsize == 0
    params = _bytes(model.parameters())
    for b, n in [(3, 9), (5, 33), (2, 4)]:
        fresh = copy.deepcopy(model)
        _angles.cache_clear()  # a loop at this size: its first call builds the table
        x = torch.randn(b, n, 16)
        at = report.evaluate(B=b, L=n)
        assert (at["peak_above_resident"], at["retained"]) == _forward_bytes(fresh, x), (b, n)
        assert at["resident"] == params + x.nbytes + 64 * n, (b, n)


def test_a_forward_that_stores_anew_on_every_call_says_it_is_a_first_call():
    """Not a cache (``self.last = h * 2`` replaced by every call): a first call is analysed, and the
    note says why."""
    from zoo import CachesActivation  # stores self.last = h * 2 on every call

    report = fxmem.analyze(CachesActivation(), ("B", 16), check=False)
    assert any("self.last anew on every call: analysed is a first call" in n for n in report.notes), report.notes


def test_a_cache_keyed_by_a_size_is_refused_naming_the_line():
    """A dict keyed by the size: refused with the line and why (not as fxmem's or the user's bug)."""
    with pytest.raises(fxmem.errors.UnsupportedOpError) as info:
        fxmem.analyze(_DictCache(), ("B", "L", 16))
    text = str(info.value)
    assert "test_vision_transformers.py:" in text and "if n not in tables" in text and "key of a dict" in text


# --- position embeddings interpolated to the image size ------------------------------------------

class _Interpolating(nn.Module):
    """An HF model called with ``interpolate_pos_encoding=True`` (a forward keyword: the specs are
    positional), as users run ViT and DeiT at other image sizes."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.inner(pixel_values, interpolate_pos_encoding=True).last_hidden_state


def _dinov2() -> nn.Module:
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    return Dinov2Model(Dinov2Config(image_size=28, patch_size=14, **TINY))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    return _Interpolating(ViTModel(ViTConfig(image_size=32, patch_size=8, **TINY), add_pooling_layer=False))


def _deit() -> nn.Module:
    from transformers import DeiTConfig, DeiTModel

    torch.manual_seed(0)
    return _Interpolating(DeiTModel(DeiTConfig(image_size=32, patch_size=8, **TINY), add_pooling_layer=False))


# (B, H, W) the analysis did not see: the first two inside the region of the first analysis (its
# formulas answer), then the configured size (no interpolation at all where the grid equals the
# table's), batch 1, small grids (other regions: evaluate re-analyses there); square and not, and
# sizes that are no multiple of the patch (the patch conv drops the rest)
IMAGE_SIZES = {
    "dinov2": (_dinov2, [(2, 112, 84), (3, 70, 126), (3, 28, 28), (1, 42, 70), (2, 99, 60)]),
    "vit": (_vit, [(2, 56, 48), (3, 72, 41), (3, 32, 32), (1, 24, 56), (2, 20, 20)]),
    "deit": (_deit, [(2, 56, 48), (3, 72, 41), (3, 32, 32), (1, 24, 56), (2, 20, 20)]),
}


@pytest.mark.parametrize("name", sorted(IMAGE_SIZES))
def test_interpolated_position_embeddings_at_other_image_sizes(name):
    """evaluate() at image sizes the analysis did not see (which may re-analyse there) equals a real
    forward; resident is parameters + input."""
    build, sizes = IMAGE_SIZES[name]
    model = build()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), check=False)  # the real runs below are the check
    params = _bytes([*model.parameters(), *model.buffers()])
    for b, h, w in sizes:
        x = _image(b, h, w)
        at = report.evaluate(B=b, H=h, W=w)
        assert (at["peak_above_resident"], at["retained"]) == _forward_bytes(model, x), (b, h, w)
        assert at["resident"] == params + x.nbytes, (b, h, w)


def test_dinov2_training_step_at_other_image_sizes():
    """A steady-state AdamW step of DINOv2 at image sizes the analysis did not see."""
    model = _dinov2()
    report = fxmem.analyze(model, ("B", 3, "H", "W"), optimizer=ADAMW, check=False)
    params = _bytes([*model.parameters(), *model.buffers()])
    for b, h, w in [(2, 56, 42), (3, 70, 70)]:
        x = _image(b, h, w)
        at = report.evaluate(B=b, H=h, W=w)
        measured, state = _step_bytes(model, x)
        assert (at["train_peak"] - at["train_resident"], at["train_retained"]) == measured, (b, h, w)
        assert at["optimizer_state"] == state
        assert at["train_resident"] == params + state + x.nbytes, (b, h, w)
