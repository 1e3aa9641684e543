"""Seeded random models for checking fxmem against real runs: 5-25 ops over 1-3 symbolic dims.

``generate(seed)`` returns a :class:`Case`: an ``nn.Module`` whose ``forward`` runs a random
program (linear, matmul, bmm, transpose/permute, view/reshape, contiguous, cat, stack,
split/chunk, repeat, expand, softmax, layer_norm, activations, dropout, masked_fill, where,
reductions, broadcast scalars, indexing and slicing, in-place ops, conv1d/conv2d, batch_norm,
embedding, detach, argmax), its input specs, and the sizes to check it at. Every program is
valid at every size >= 1 of its dims (shapes are tracked symbolically while generating), so a
real run never fails; what fxmem says about it must equal what the allocator sees.

>>> case = generate(7)
>>> case.specs, case.dims                                 # doctest: +SKIP
((('B', 'N', 12),), ['B', 'N'])
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM_NAMES = ("B", "N", "L")
Shape = tuple  # entries: a dim name, an int, or a tuple of them (a product, after flatten)


def _prod(entry: Any) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)


def _symbolic(entry: Any) -> bool:
    return any(isinstance(f, str) for f in _prod(entry))


def _const(entry: Any) -> int | None:
    if _symbolic(entry):
        return None
    out = 1
    for f in _prod(entry):
        out *= f
    return out


@dataclasses.dataclass
class Value:
    index: int  # position in the program's value list
    shape: Shape
    grad: bool  # may carry a gradient (not detached, float)
    dtype: str = "float"  # float | long | bool


@dataclasses.dataclass
class Case:
    seed: int
    model: nn.Module
    specs: tuple
    dims: list
    sizes: list  # held-out sizes to check at (include every dim at 1 and at 2)
    program: list  # the ops, for messages

    def describe(self) -> str:
        return f"seed {self.seed}: inputs {self.specs}; " + "; ".join(self.program)


class Program(nn.Module):
    """Runs ``steps``: each ``(fn, [input value indices])`` appends ``fn(self, *inputs)`` to the values."""

    def __init__(self, steps: list, modules: dict, outputs: list):
        super().__init__()
        self.steps = steps
        self.mods = nn.ModuleDict(modules)
        self.outputs = outputs

    def forward(self, x):
        values = [x]
        for fn, inputs in self.steps:
            values.append(fn(self, *[values[i] for i in inputs]))
        if len(self.outputs) == 1:
            return values[self.outputs[0]]
        return tuple(values[i] for i in self.outputs)


class _Builder:
    def __init__(self, rng: random.Random, dims: list):
        self.rng = rng
        self.dims = dims
        self.values: list[Value] = []
        self.steps: list = []
        self.modules: dict = {}
        self.text: list[str] = []

    def add(self, fn: Callable, inputs: list[Value], shape: Shape, text: str, grad: bool | None = None,
            dtype: str = "float") -> Value:
        v = Value(len(self.values), tuple(shape), any(i.grad for i in inputs) if grad is None else grad, dtype)
        self.values.append(v)
        self.steps.append((fn, [i.index for i in inputs]))
        self.text.append(f"v{v.index} = {text}(" + ", ".join(f"v{i.index}" for i in inputs) + f") {shape}")
        return v

    def module(self, m: nn.Module) -> str:
        name = f"m{len(self.modules)}"
        self.modules[name] = m
        return name


def _feature(rng: random.Random) -> int:
    return rng.choice([3, 4, 5, 6, 8, 12, 16])


# --- the op vocabulary: each returns a new Value or None when it does not apply --------------------
def op_linear(b: _Builder, v: Value) -> Value | None:
    last = _const(v.shape[-1]) if v.shape else None
    if last is None or v.dtype != "float":
        return None
    out = _feature(b.rng)
    name = b.module(nn.Linear(last, out, bias=b.rng.random() < 0.8))
    return b.add(lambda s, x, name=name: s.mods[name](x), [v], v.shape[:-1] + (out,), f"Linear({last},{out})", grad=True)


def op_matmul(b: _Builder, v: Value) -> Value | None:
    if len(v.shape) < 2 or v.dtype != "float":
        return None
    kind = b.rng.choice(["gram", "param"])
    if kind == "gram":  # x @ x^T
        return b.add(lambda s, x: x @ x.transpose(-1, -2), [v], v.shape[:-1] + (v.shape[-2],), "gram")
    last = _const(v.shape[-1])
    if last is None:
        return None
    out = _feature(b.rng)
    name = b.module(_Weight(last, out))
    return b.add(lambda s, x, name=name: torch.matmul(x, s.mods[name].w), [v], v.shape[:-1] + (out,),
                 f"matmul(w{last}x{out})", grad=True)


class _Weight(nn.Module):
    def __init__(self, *shape: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape) * 0.3)


def op_bmm(b: _Builder, v: Value) -> Value | None:
    if len(v.shape) != 3 or v.dtype != "float":
        return None
    return b.add(lambda s, x: torch.bmm(x.transpose(1, 2), x), [v], (v.shape[0], v.shape[2], v.shape[2]), "bmm(xT,x)")


def op_transpose(b: _Builder, v: Value) -> Value | None:
    if len(v.shape) < 2:
        return None
    perm = list(range(len(v.shape)))
    b.rng.shuffle(perm)
    if perm == sorted(perm):
        perm = perm[::-1]
    shape = tuple(v.shape[i] for i in perm)
    return b.add(lambda s, x, perm=tuple(perm): x.permute(*perm), [v], shape, f"permute{tuple(perm)}")


def op_flatten(b: _Builder, v: Value) -> Value | None:
    if len(v.shape) < 2:
        return None
    i = b.rng.randrange(len(v.shape) - 1)
    rank = len(v.shape)
    shape = v.shape[:i] + (_prod(v.shape[i]) + _prod(v.shape[i + 1]),) + v.shape[i + 2:]
    how = b.rng.choice(["reshape", "flatten", "view-contiguous"])

    def sizes(x: Any, i: int = i, rank: int = rank) -> list:  # fx proxies cannot be unpacked: index them
        return [x.shape[j] for j in range(i)] + [-1] + [x.shape[j] for j in range(i + 2, rank)]

    if how == "reshape":
        fn = lambda s, x: x.reshape(*sizes(x))  # noqa: E731
    elif how == "flatten":
        fn = lambda s, x, i=i: x.flatten(i, i + 1)  # noqa: E731
    else:
        fn = lambda s, x: x.contiguous().view(*sizes(x))  # noqa: E731
    return b.add(fn, [v], shape, f"{how}({i},{i + 1})")


def op_contiguous(b: _Builder, v: Value) -> Value | None:
    return b.add(lambda s, x: x.contiguous(), [v], v.shape, "contiguous")


def op_cat(b: _Builder, v: Value) -> Value | None:
    if not v.shape:
        return None
    d = b.rng.randrange(len(v.shape))
    if b.rng.random() < 0.5:
        shape = v.shape[:d] + (_prod(v.shape[d]) + (2,),) + v.shape[d + 1:]
        return b.add(lambda s, x, d=d: torch.cat([x, x * 0.5], dim=d), [v], shape, f"cat(dim={d})")
    shape = v.shape[:d] + (2,) + v.shape[d:]
    return b.add(lambda s, x, d=d: torch.stack([x, x.sigmoid()], dim=d), [v], shape, f"stack(dim={d})")


def op_split(b: _Builder, v: Value) -> Value | None:
    even = [i for i, e in enumerate(v.shape) if (c := _const(e)) is not None and c % 2 == 0 and c >= 2]
    if not even:
        return None
    d = b.rng.choice(even)
    half = _const(v.shape[d]) // 2
    shape = v.shape[:d] + (half,) + v.shape[d + 1:]
    if b.rng.random() < 0.5:
        return b.add(lambda s, x, d=d: x.chunk(2, dim=d)[0] * x.chunk(2, dim=d)[1], [v], shape, f"chunk(2,{d}) a*b")
    return b.add(lambda s, x, d=d, h=half: x.split(h, dim=d)[1], [v], shape, f"split({half},{d})[1]")


def op_repeat(b: _Builder, v: Value) -> Value | None:
    if not v.shape or len(v.shape) > 4:
        return None
    reps = [b.rng.choice([1, 1, 2]) for _ in v.shape]
    shape = tuple(e if r == 1 else (_prod(e) + (r,)) for e, r in zip(v.shape, reps))
    return b.add(lambda s, x, reps=tuple(reps): x.repeat(*reps), [v], shape, f"repeat{tuple(reps)}")


def op_expand(b: _Builder, v: Value) -> Value | None:
    if len(v.shape) > 3:
        return None
    d = b.rng.randrange(len(v.shape) + 1)
    size = b.rng.choice(b.dims + [3])
    src = None
    if isinstance(size, str):  # expand to an input dim: read it from the input's shape
        src = b.values[0].shape.index(size) if size in b.values[0].shape else None
        if src is None:
            size = 3
    shape = v.shape[:d] + (size,) + v.shape[d:]
    rank = len(v.shape)
    if src is None:
        fn = lambda s, x, d=d, r=rank: x.unsqueeze(d).expand(*([-1] * d), 3, *([-1] * (r - d))) * 1.0  # noqa: E731
    else:
        fn = lambda s, x, x0, d=d, src=src, r=rank: (  # noqa: E731
            x.unsqueeze(d).expand(*([-1] * d), x0.shape[src], *([-1] * (r - d))) + 0.0)
        return b.add(fn, [v, b.values[0]], shape, f"expand(dim={d},{size})")
    return b.add(fn, [v], shape, f"expand(dim={d},3)")


def op_softmax(b: _Builder, v: Value) -> Value | None:
    if not v.shape or v.dtype != "float":
        return None
    d = b.rng.randrange(len(v.shape))
    how = b.rng.choice(["softmax", "log_softmax"])
    return b.add(lambda s, x, d=d, how=how: getattr(x, how)(d), [v], v.shape, f"{how}({d})")


def op_layer_norm(b: _Builder, v: Value) -> Value | None:
    last = _const(v.shape[-1]) if v.shape else None
    if last is None or v.dtype != "float":
        return None
    name = b.module(nn.LayerNorm(last))
    return b.add(lambda s, x, name=name: s.mods[name](x), [v], v.shape, f"LayerNorm({last})", grad=True)


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu,
               "elu": F.elu, "leaky_relu": lambda x: F.leaky_relu(x, 0.1), "exp": lambda x: x.clamp(max=5).exp(),
               "abs": torch.abs, "square": lambda x: x * x}


def op_activation(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float":
        return None
    name = b.rng.choice(sorted(ACTIVATIONS))
    return b.add(lambda s, x, f=ACTIVATIONS[name]: f(x), [v], v.shape, name)


def op_dropout(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float":
        return None
    p = b.rng.choice([0.1, 0.5])
    return b.add(lambda s, x, p=p: F.dropout(x, p, training=True), [v], v.shape, f"dropout({p})")


def op_masked(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float":
        return None
    if b.rng.random() < 0.5:
        return b.add(lambda s, x: x.masked_fill(x > 0.3, -1.0), [v], v.shape, "masked_fill")
    return b.add(lambda s, x: torch.where(x > 0, x, x * 0.1), [v], v.shape, "where")


def op_reduce(b: _Builder, v: Value) -> Value | None:
    if not v.shape or v.dtype != "float":
        return None
    d = b.rng.randrange(len(v.shape))
    keep = b.rng.random() < 0.4
    how = b.rng.choice(["sum", "mean", "amax"])
    shape = v.shape[:d] + ((1,) if keep else ()) + v.shape[d + 1:]
    return b.add(lambda s, x, d=d, keep=keep, how=how: getattr(x, how)(d, keepdim=keep), [v], shape, f"{how}({d},{keep})")


def op_scalar(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float":
        return None
    how = b.rng.choice(["mul", "add", "div", "rsub", "pow"])
    fns = {"mul": lambda x: x * 0.5, "add": lambda x: x + 1, "div": lambda x: x / 3, "rsub": lambda x: 1.0 - x,
           "pow": lambda x: x ** 2}
    return b.add(lambda s, x, f=fns[how]: f(x), [v], v.shape, f"scalar-{how}")


def op_broadcast(b: _Builder, v: Value) -> Value | None:
    if len(v.shape) < 2 or v.dtype != "float":
        return None
    return b.add(lambda s, x: x * x.mean(0, keepdim=True) + x[..., :1], [v], v.shape, "broadcast")


def op_index(b: _Builder, v: Value) -> Value | None:
    if not v.shape:
        return None
    d = b.rng.randrange(len(v.shape))
    how = b.rng.choice(["slice", "select", "narrow", "step"])
    if how == "select":
        return b.add(lambda s, x, d=d: x.select(d, 0), [v], v.shape[:d] + v.shape[d + 1:], f"select({d},0)")
    if how == "step" and _const(v.shape[d]) is None:
        return b.add(lambda s, x, d=d: x[(slice(None),) * d + (slice(None, None, 2),)] * 2, [v],
                     v.shape[:d] + ((_prod(v.shape[d]) + ("half",)),) + v.shape[d + 1:], f"[::2]({d})")
    c = _const(v.shape[d])
    if c is None or c < 2:
        return None
    k = b.rng.randrange(1, c)
    if how == "narrow":
        return b.add(lambda s, x, d=d, k=k: x.narrow(d, 1, k - 1 if k > 1 else 1) * 1.5, [v],
                     v.shape[:d] + (max(k - 1, 1),) + v.shape[d + 1:], f"narrow({d},1,{max(k - 1, 1)})")
    return b.add(lambda s, x, d=d, k=k: x[(slice(None),) * d + (slice(0, k),)], [v],
                 v.shape[:d] + (k,) + v.shape[d + 1:], f"[:{k}]({d})")


def op_inplace(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float":
        return None
    how = b.rng.choice(["relu_", "mul_", "add_", "clamp_", "sigmoid_", "iadd"])
    fns = {"relu_": lambda y: y.relu_(), "mul_": lambda y: y.mul_(2.0), "add_": lambda y: y.add_(1.0),
           "clamp_": lambda y: y.clamp_(-1, 1), "sigmoid_": lambda y: y.sigmoid_(), "iadd": lambda y: y.add_(y)}
    # on a fresh tensor (never an input, a view or a tensor autograd saved)
    return b.add(lambda s, x, f=fns[how]: f(x * 1.0), [v], v.shape, f"{how}")


def op_conv(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float" or len(v.shape) not in (3, 4):
        return None
    chans = _const(v.shape[1])
    if chans is None or chans > 16:
        return None
    out = _feature(b.rng)
    k = b.rng.choice([1, 3])
    stride = b.rng.choice([1, 1, 2])
    conv = (nn.Conv1d if len(v.shape) == 3 else nn.Conv2d)(chans, out, k, stride=stride, padding=k // 2,
                                                           bias=b.rng.random() < 0.7)
    name = b.module(conv)
    spatial = tuple(e if stride == 1 else (_prod(e) + ("s2",)) for e in v.shape[2:])
    return b.add(lambda s, x, name=name: s.mods[name](x), [v], (v.shape[0], out) + spatial,
                 f"Conv{len(v.shape) - 2}d({chans},{out},k{k},s{stride})", grad=True)


def op_batch_norm(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float" or len(v.shape) not in (2, 3, 4):
        return None
    chans = _const(v.shape[1])
    if chans is None or chans > 32:
        return None
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[len(v.shape)]
    name = b.module(cls(chans))
    # batch norm in training needs more than one value per channel: a size-1 batch with no
    # spatial extent fails for real, so the model normalises in eval mode there (running stats)
    return b.add(lambda s, x, name=name: s.mods[name](x), [v], v.shape, f"BatchNorm({chans})", grad=True)


def op_embedding(b: _Builder, v: Value) -> Value | None:
    if not v.shape or v.dtype != "float" or len(v.shape) > 3:
        return None
    last = _const(v.shape[-1])
    if last is None:
        return None
    dim = _feature(b.rng)
    name = b.module(nn.Embedding(last, dim))
    return b.add(lambda s, x, name=name: s.mods[name](x.argmax(-1)), [v], v.shape[:-1] + (dim,),
                 f"Embedding(argmax,{last}->{dim})", grad=True)


def op_detach(b: _Builder, v: Value) -> Value | None:
    return b.add(lambda s, x: x.detach(), [v], v.shape, "detach", grad=False)


def op_argmax(b: _Builder, v: Value) -> Value | None:
    if not v.shape or v.dtype != "float":
        return None
    d = b.rng.randrange(len(v.shape))
    shape = v.shape[:d] + v.shape[d + 1:]
    return b.add(lambda s, x, d=d: x.argmax(d).float(), [v], shape, f"argmax({d}).float", grad=False)


def op_combine(b: _Builder, v: Value) -> Value | None:
    """Add an earlier value of the same shape (a residual)."""
    same = [w for w in b.values if w.shape == v.shape and w.index != v.index and w.dtype == "float"]
    if not same:
        return None
    w = b.rng.choice(same)
    return b.add(lambda s, x, y: x + y, [v, w], v.shape, "add")


OPS = [op_linear, op_matmul, op_bmm, op_transpose, op_flatten, op_contiguous, op_cat, op_split, op_repeat,
       op_expand, op_softmax, op_layer_norm, op_activation, op_dropout, op_masked, op_reduce, op_scalar,
       op_broadcast, op_index, op_inplace, op_conv, op_batch_norm, op_embedding, op_detach, op_argmax, op_combine]


# --- more op families (issue 25): used by ``generate(seed, ops=EXTENDED_OPS)`` only, so the seeds of
# OPS keep their programs -------------------------------------------------------------------------
def _float(v: Value) -> bool:
    return v.dtype == "float" and bool(v.shape)


def op_sort(b: _Builder, v: Value) -> Value | None:
    if not _float(v):
        return None
    d = b.rng.randrange(len(v.shape))
    how = b.rng.choice(["sort", "argsort", "topk", "kthvalue", "msort"])
    if how == "sort":
        return b.add(lambda s, x, d=d: x.sort(dim=d, descending=True)[0], [v], v.shape, f"sort({d})")
    if how == "argsort":
        return b.add(lambda s, x, d=d: x.argsort(dim=d).float(), [v], v.shape, f"argsort({d}).float", grad=False)
    if how == "kthvalue":  # k=1 exists at every size
        return b.add(lambda s, x, d=d: x.kthvalue(1, d)[0], [v], v.shape[:d] + v.shape[d + 1:], f"kthvalue(1,{d})")
    if how == "msort":
        return b.add(lambda s, x: torch.msort(x), [v], v.shape, "msort")
    c = _const(v.shape[d])
    if c is None:
        return None
    k = b.rng.randint(1, c)
    return b.add(lambda s, x, d=d, k=k: x.topk(k, dim=d)[0], [v], v.shape[:d] + (k,) + v.shape[d + 1:], f"topk({k},{d})")


def op_cumulative(b: _Builder, v: Value) -> Value | None:
    if not _float(v):
        return None
    d = b.rng.randrange(len(v.shape))
    how = b.rng.choice(["cumsum", "cumprod", "cummax", "logcumsumexp"])
    fns = {"cumsum": lambda x, d: x.cumsum(d), "cumprod": lambda x, d: x.tanh().cumprod(d),
           "cummax": lambda x, d: x.cummax(d)[0], "logcumsumexp": lambda x, d: x.logcumsumexp(d)}
    return b.add(lambda s, x, d=d, f=fns[how]: f(x, d), [v], v.shape, f"{how}({d})")


def op_flip_roll(b: _Builder, v: Value) -> Value | None:
    if not v.shape:
        return None
    d = b.rng.randrange(len(v.shape))
    if b.rng.random() < 0.5:
        return b.add(lambda s, x, d=d: x.flip(d), [v], v.shape, f"flip({d})")
    return b.add(lambda s, x, d=d: x.roll(1, d), [v], v.shape, f"roll(1,{d})")


def op_one_hot(b: _Builder, v: Value) -> Value | None:
    last = _const(v.shape[-1]) if _float(v) else None
    if last is None or len(v.shape) > 3:
        return None
    return b.add(lambda s, x, n=last: F.one_hot(x.argmax(-1), n).float(), [v], v.shape[:-1] + (last,),
                 f"one_hot(argmax,{last})", grad=False)


def op_gather_scatter(b: _Builder, v: Value) -> Value | None:
    if not _float(v):
        return None
    d = b.rng.randrange(len(v.shape))
    if b.rng.random() < 0.5:
        return b.add(lambda s, x, d=d: x.gather(d, x.argsort(d)), [v], v.shape, f"gather({d},argsort)")
    return b.add(lambda s, x, d=d: torch.zeros_like(x).scatter_add(d, x.argsort(d), x), [v], v.shape,
                 f"scatter_add({d},argsort)")


def op_pool(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float" or len(v.shape) not in (3, 4):
        return None
    two = len(v.shape) == 4
    how = b.rng.choice(["max", "avg", "adaptive"])
    if how == "adaptive":
        n = b.rng.choice([1, 2, 4])
        fn = (lambda s, x, n=n: F.adaptive_avg_pool2d(x, n)) if two else (lambda s, x, n=n: F.adaptive_max_pool1d(x, n))
        return b.add(fn, [v], v.shape[:2] + (n,) * (len(v.shape) - 2), f"adaptive_pool({n})")
    pool = {("max", True): F.max_pool2d, ("max", False): F.max_pool1d, ("avg", True): F.avg_pool2d,
            ("avg", False): F.avg_pool1d}[(how, two)]
    return b.add(lambda s, x, f=pool: f(x, 3, 1, 1), [v], v.shape, f"{how}_pool(3,1,1)")


def op_group_norm(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float" or len(v.shape) not in (3, 4):
        return None
    chans = _const(v.shape[1])
    if chans is None:
        return None
    groups = b.rng.choice([g for g in (1, 2, 4) if chans % g == 0])
    name = b.module(nn.GroupNorm(groups, chans))
    return b.add(lambda s, x, name=name: s.mods[name](x), [v], v.shape, f"GroupNorm({groups},{chans})", grad=True)


def op_depthwise(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float" or len(v.shape) not in (3, 4):
        return None
    chans = _const(v.shape[1])
    if chans is None or chans > 16:
        return None
    cls = nn.Conv1d if len(v.shape) == 3 else nn.Conv2d
    groups = b.rng.choice([g for g in (chans, 2) if chans % g == 0])
    name = b.module(cls(chans, chans, 3, padding=1, groups=groups))
    return b.add(lambda s, x, name=name: s.mods[name](x), [v], v.shape, f"GroupedConv({chans},g{groups})", grad=True)


def op_interpolate(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float" or len(v.shape) not in (3, 4):
        return None
    mode = b.rng.choice(["nearest", "linear" if len(v.shape) == 3 else "bilinear"])
    shape = v.shape[:2] + tuple(_prod(e) + (2,) for e in v.shape[2:])
    return b.add(lambda s, x, mode=mode: F.interpolate(x, scale_factor=2, mode=mode), [v], shape,
                 f"interpolate(x2,{mode})")


def op_unfold(b: _Builder, v: Value) -> Value | None:
    consts = [i for i, e in enumerate(v.shape) if (c := _const(e)) is not None and c >= 2 and c % 2 == 0]
    if not consts or len(v.shape) > 3:
        return None
    d = b.rng.choice(consts)
    half = _const(v.shape[d]) // 2
    return b.add(lambda s, x, d=d: x.unfold(d, 2, 2) * 1.0, [v], v.shape[:d] + (half,) + v.shape[d + 1:] + (2,),
                 f"unfold({d},2,2)")


def op_cdist(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float" or len(v.shape) not in (2, 3) or _const(v.shape[-1]) is None:
        return None
    return b.add(lambda s, x: torch.cdist(x, x), [v], v.shape[:-1] + (v.shape[-2],), "cdist(x,x)")


def op_cast(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float":
        return None
    how = b.rng.choice(["double", "bfloat16", "half"])
    dt = {"double": torch.float64, "bfloat16": torch.bfloat16, "half": torch.float16}[how]
    return b.add(lambda s, x, dt=dt: (x.to(dt) * 2).float(), [v], v.shape, f"to({how})*2")


def op_view_inplace(b: _Builder, v: Value) -> Value | None:
    if not _float(v) or len(v.shape) < 2:
        return None
    how = b.rng.choice(["slice", "transpose", "select"])
    fns = {"slice": lambda y: y[..., :1].mul_(2.0), "transpose": lambda y: y.transpose(0, 1).add_(1.0),
           "select": lambda y: y.select(0, 0).clamp_(-1, 1)}

    def fn(s: Any, x: Any, f: Callable = fns[how]) -> Any:
        y = x * 1.0  # a fresh tensor, written through a view of it
        f(y)
        return y

    return b.add(fn, [v], v.shape, f"inplace-through-{how}")


def op_rnn(b: _Builder, v: Value) -> Value | None:
    if v.dtype != "float" or len(v.shape) != 3 or _const(v.shape[-1]) is None or _const(v.shape[-1]) > 16:
        return None
    if isinstance(v.shape[1], tuple):  # a sequence of N*L steps: ~10,000 at the example sizes, each one
        return None                    # simulated (PyTorch fixes the length: no formula in it)
    feat, hidden = _const(v.shape[-1]), _feature(b.rng)
    cls = b.rng.choice([nn.GRU, nn.LSTM, nn.RNN])
    name = b.module(cls(feat, hidden, batch_first=True))
    return b.add(lambda s, x, name=name: s.mods[name](x)[0], [v], v.shape[:-1] + (hidden,),
                 f"{cls.__name__}({feat},{hidden})", grad=True)


EXTENDED_OPS = OPS + [op_sort, op_cumulative, op_flip_roll, op_one_hot, op_gather_scatter, op_pool, op_group_norm,
                      op_depthwise, op_interpolate, op_unfold, op_cdist, op_cast, op_view_inplace, op_rnn]


def _numel_ok(shape: Shape, big: int = 40) -> bool:
    """Keep programs small: at most 4 dims, and few symbolic factors per tensor."""
    factors = [f for e in shape for f in _prod(e)]
    sym = sum(isinstance(f, str) for f in factors)
    const = 1
    for f in factors:
        if isinstance(f, int):
            const *= f
    return len(shape) <= 4 and sym <= 4 and const <= 4096


def generate(seed: int, ops: list | None = None) -> Case:
    """A random model, its input spec and the held-out sizes to check it at; ``ops``: the op
    vocabulary (:data:`OPS`, or :data:`EXTENDED_OPS` for the newer families)."""
    rng = random.Random(seed)
    dims = list(DIM_NAMES[: rng.randint(1, 3)])
    feature = _feature(rng)
    layout = rng.choice(["seq", "image", "flat"]) if len(dims) >= 1 else "flat"
    if layout == "image" and len(dims) >= 2:
        spec = (dims[0], rng.choice([3, 4]), *dims[1:3]) if len(dims) == 3 else (dims[0], rng.choice([3, 4]), dims[1], 5)
    elif layout == "seq" or len(dims) > 1:
        spec = tuple(dims) + (feature,)
    else:
        spec = (dims[0], feature)
    b = _Builder(rng, dims)
    b.values.append(Value(0, tuple(spec), False))
    n_ops = rng.randint(5, 25)
    tries = 0
    while len(b.steps) < n_ops and tries < 400:
        tries += 1
        # prefer recent values, sometimes an older one
        v = b.values[-1] if rng.random() < 0.7 else rng.choice(b.values)
        op = rng.choice(ops or OPS)
        before = len(b.values)
        try:
            out = op(b, v)
        except (IndexError, ValueError):
            out = None
        if out is None:
            continue
        if not _numel_ok(out.shape):
            b.values.pop()
            b.steps.pop()
            b.text.pop()
            assert len(b.values) == before
    if not any(w.grad for w in b.values[1:]) or not b.values[-1].grad and rng.random() < 0.5:
        # a training step needs an output that depends on a parameter
        name = b.module(_Weight(1))
        v = b.values[-1] if b.values[-1].dtype == "float" else b.values[0]
        b.add(lambda s, x, name=name: x * s.mods[name].w, [v], v.shape, "scale", grad=True)
    grad_values = [w for w in b.values[1:] if w.grad]
    last = b.values[-1]
    outputs = [last.index]
    if not last.grad and grad_values:  # a training step needs an output that requires grad
        outputs.append(grad_values[-1].index)
    model = Program(b.steps, b.modules, outputs)
    sizes = [{d: 1 for d in dims}, {d: 2 for d in dims}, {d: rng.randint(3, 13) for d in dims}]
    return Case(seed, model, (spec,), dims, sizes, b.text)
