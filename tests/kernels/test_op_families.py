"""Op families the fuzzer found wrong numbers in (flip/roll, SDPA, one_hot, repeat_interleave), in
several layouts and dtypes, forward and training, against real runs at unseen sizes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import check_against_real_run, check_training_against_real_run
from zoo import ScaledOp as Op


def _attend(x, **kw):
    q = x.unsqueeze(1)
    return F.scaled_dot_product_attention(q, q, q, **kw).squeeze(1)


OPS = {
    "flip": lambda x, w: x.flip(1),
    "flip-transposed-two-dims": lambda x, w: x.transpose(0, 1).flip(0, 2),
    "flip-float64": lambda x, w: x.double().flip(-1).float(),
    "roll-one-dim": lambda x, w: x.roll(2, 1),
    "roll-flattened": lambda x, w: x.roll(3),
    "roll-two-dims": lambda x, w: x.roll((1, 2), (0, 1)),  # recursive: an input-sized intermediate
    "roll-three-dims-transposed": lambda x, w: x.transpose(1, 2).roll((1, 2, 3), (0, 1, 2)),
    "roll-bool": lambda x, w: (x > 0).roll((1, 1), (1, 2)).float() * w,
    "one-hot": lambda x, w: F.one_hot(x.argmax(-1), 6).float() * w,
    "repeat-interleave": lambda x, w: x.repeat_interleave(2, dim=1),
    "repeat-interleave-transposed": lambda x, w: x.transpose(1, 2).repeat_interleave(3, dim=2),
    "sdpa": lambda x, w: _attend(x),
    "sdpa-causal": lambda x, w: _attend(x, is_causal=True),
    "sdpa-transposed": lambda x, w: _attend(x.transpose(1, 2)[..., :5]),
}
SIZES = [dict(B=2, N=5), dict(B=3, N=11)]


@pytest.mark.parametrize("name", sorted(OPS))
def test_forward_matches_real_run(name):
    torch.manual_seed(0)
    check_against_real_run(Op(OPS[name]), (("B", "N", 6),), SIZES)


@pytest.mark.parametrize("name", sorted(OPS))
def test_training_step_matches_real_run(name):
    torch.manual_seed(0)
    # CPU flash attention's per-thread buffers: the profiler hears only the calling thread's
    threads = 1 if name.startswith("sdpa") else None
    check_training_against_real_run(Op(OPS[name]), (("B", "N", 6),), SIZES, lambda p: torch.optim.Adam(p, lr=1e-3),
                                    num_threads=threads)
