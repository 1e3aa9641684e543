"""fxmem's own example sizes (97, 101, ...) may lie outside what a model accepts: a text encoder
with 77 positions, a UNet whose skip connections need even sizes. Then the analysis is made at
other example sizes (powers of two, small primes) with a note, never blamed on the input specs;
where no size works, the error names the sizes tried and ``hints=``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import check_against_real_run


class TinyUNet(nn.Module):
    """Down by a stride-2 conv, up by a transposed conv, a skip concatenation: odd sizes fail."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.out = nn.Conv2d(2 * c, 3, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        u = self.up(torch.relu(self.down(h)))
        return self.out(torch.cat([h, u], dim=1))


class PositionTable(nn.Module):
    """Learned positions for at most 77 tokens (CLIP's text encoder)."""

    def __init__(self, n: int = 77, d: int = 16):
        super().__init__()
        self.pos = nn.Embedding(n, d)
        self.register_buffer("ids", torch.arange(n).unsqueeze(0), persistent=False)
        self.fc = nn.Linear(d, d)

    def forward(self, x):  # x: (B, L, d)
        length = x.shape[1]
        if length > self.ids.shape[1]:
            raise ValueError(f"Sequence length must be at most {self.ids.shape[1]}, got {length}")
        return self.fc(x + self.pos(self.ids[:, :length]))


def test_a_unet_with_odd_default_sizes_is_analysed_at_other_sizes_exactly():
    report = check_against_real_run(TinyUNet(), (("B", 3, "S", "S"),), [dict(B=2, S=24), dict(B=3, S=40)])
    assert report.hints["S"] % 2 == 0
    assert any("outside what the model accepts" in n and "hints=" in n for n in report.notes)


def test_a_position_table_of_77_is_analysed_inside_it_exactly():
    from fxmem.measure import measure
    model = PositionTable()
    report = fxmem.analyze(model, ("B", "L", 16))  # the length check is Python control flow: eager mode
    assert report.hints["L"] <= 77
    assert any("B=97, L=101" in n for n in report.notes)
    for b, length in ((2, 77), (5, 20)):
        x = torch.randn(b, length, 16)
        real = measure(lambda: model(x))
        at = report.evaluate(B=b, L=length)
        assert (at["peak_above_resident"], at["retained"]) == (real.peak_above_start, real.retained), (b, length)


def test_clip_text_encoder_is_analysed_inside_its_positions():
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0,
                                         eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.CLIPTextModel(config).eval()
    spec = fxmem.TensorSpec(("B", "L"), dtype=torch.int64)
    report = fxmem.analyze(model, spec, grad=False)
    assert report.hints["L"] <= 77 and "L <= 77" in report.region
    from fxmem.measure import measure
    for b, length in ((2, 77), (3, 50)):
        ids = torch.randint(2, 100, (b, length))
        with torch.no_grad():
            real = measure(lambda: model(ids))
        at = report.evaluate(B=b, L=length)
        assert (at["peak_above_resident"], at["retained"]) == (real.peak_above_start, real.retained), (b, length)


class NeedsExactly(nn.Module):
    def forward(self, x):
        if x.shape[1] != 5:
            raise ValueError("needs exactly 5 columns")
        return x * 2


def test_when_no_size_works_the_error_names_the_sizes_and_hints():
    with pytest.raises(fxmem.UserCodeError) as info:  # the forward's own ValueError: it raised, not torch
        fxmem.analyze(NeedsExactly(), ("B", "N"))
    text = str(info.value)
    assert "example sizes tried: B=97, N=101; B=32, N=64" in text and "hints=" in text


def test_the_user_s_own_hints_are_not_replaced():
    with pytest.raises(fxmem.UserCodeError) as info:  # the forward's own ValueError: it raised, not torch
        fxmem.analyze(PositionTable(), ("B", "L", 16), hints={"B": 4, "L": 90})
    assert "the example sizes tried: B=4, L=90" in str(info.value)
