"""Every aten op the fuzzer's models run, checked for the layout its fake kernel gives: each call of
a real run (forward and backward, small sizes) is run again on fake copies of its arguments, and
the output strides must equal the real kernel's. A torch upgrade that changes a layout fails here,
with the op's name, instead of silently changing a user's numbers (copies that follow from it)."""
from __future__ import annotations

import pytest
import torch

from fuzz.generator import generate
from fxmem import _torch_compat as tc
from fxmem.capture import forward_parameters
from fxmem.inputs import random_inputs
from fxmem.specs import parse_specs

SEEDS = range(0, 60)
# ops whose fake kernel is known to differ and that fxmem follows another way (kernels/real_paths.py)
FOLLOWED = {"aten.max_pool1d"}


def _layout_rules(func, args, kwargs, fake):
    """The fake output as the simulation sees it: with fxmem's OUTPUT_LAYOUT rules applied."""
    from fxmem import kernels

    outs = list(fake) if isinstance(fake, (tuple, list)) else [fake]
    tensors = [t for t in outs if isinstance(t, torch.Tensor)]
    wanted = kernels.output_layout(kernels.Call(func, args, kwargs, tuple(tensors), "cpu"))
    k = -1
    for i, t in enumerate(outs):
        if isinstance(t, torch.Tensor):
            k += 1
            if k in wanted:
                outs[i] = t.contiguous(memory_format=wanted[k])
    return outs


class LayoutCheck(tc.DispatchMode):
    """Runs each real call, then the same call on fake copies of its arguments; collects mismatches."""

    def __init__(self):
        super().__init__()
        self.seen: set = set()
        self.mismatches: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = tc.op_name(func)
        if name.split(".")[0] + "." + name.split(".")[1] in FOLLOWED or getattr(func, "is_view", False):
            return out
        real = list(out) if isinstance(out, (tuple, list)) else [out]  # by position (None: not computed)
        if not any(isinstance(t, torch.Tensor) for t in real) or func in (torch.ops.aten.empty_strided.default,):
            return out
        self.seen.add(name)
        try:
            with tc.real_mode():
                mode, _ = tc.new_fake_mode()
                with mode:
                    fake_args = _to_fake(mode, args)
                    fake_kwargs = _to_fake(mode, kwargs)
                    fake = _layout_rules(func, fake_args, fake_kwargs, func(*fake_args, **fake_kwargs))
        except Exception:  # noqa: BLE001 - ops fake tensors cannot run are refused elsewhere
            return out
        fakes = fake
        for i, (r, f) in enumerate(zip(real, fakes)):
            if not isinstance(r, torch.Tensor) or not isinstance(f, torch.Tensor):
                continue
            # a size-1 dim's stride never matters
            real_strides = tuple(s for s, d in zip(r.stride(), r.shape) if d != 1)
            fake_strides = tuple(int(s) for s, d in zip(f.stride(), f.shape) if d != 1)
            if r.numel() > 1 and r.layout == torch.strided and real_strides != fake_strides:
                self.mismatches.append(f"{name} output {i}: real strides {tuple(r.stride())}, fake "
                                       f"{tuple(int(s) for s in f.stride())} (shape {tuple(r.shape)})")
        return out


def _to_fake(mode, tree):
    if isinstance(tree, torch.Tensor):
        return mode.from_tensor(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_fake(mode, t) for t in tree)
    if isinstance(tree, dict):
        return {k: _to_fake(mode, v) for k, v in tree.items()}
    return tree


CHUNKS = 6


@pytest.mark.parametrize("chunk", [0] + [pytest.param(k, marks=pytest.mark.slow) for k in range(1, CHUNKS)])
def test_fake_kernels_give_the_real_layouts(chunk):  # CI: a sixth of the seeds; the slow set all
    check = LayoutCheck()
    for seed in [s for s in SEEDS if s % CHUNKS == chunk]:
        case = generate(seed)
        torch.manual_seed(seed)
        specs, _ = parse_specs(case.specs, forward_parameters(case.model), torch.float32, "Program")
        for dims in case.sizes[1:]:  # sizes 2 and a random one (size 1 hides strides)
            xs = random_inputs(specs, dims, seed=seed)
            model = case.model.train()
            with check:
                try:
                    out = model(*xs)
                except Exception:  # noqa: BLE001 - a model that fails at this size fails for real too
                    continue
                outs = [t for t in tc.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                if outs:
                    sum(t.sum() for t in outs).backward()
    assert len(check.seen) > 20
    assert not check.mismatches, "\n".join(sorted(set(check.mismatches)))
