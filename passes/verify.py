"""Verification: do two modules compute the same thing? Same outputs, gradients and state on real inputs,
in every mode.

:func:`fxmem.optimize` returns a rewrite only if it passes this check against the original model:
for each set of inputs and each mode - train mode and eval mode with autograd recording, and both
under ``torch.no_grad()`` - the outputs must agree, and (with autograd) so must the gradients of
``loss = sum(output * random weights)`` with respect to every parameter and every floating point
input, and the buffers after the call (batch-norm running statistics). Both modules draw the same
random numbers: the generator is seeded the same before each call, so dropout keeps the same
elements in both. The check runs in float64 on deep copies (so the user's module, its parameters,
buffers, flags and random state are left untouched), where a change of summation order is
invisible; models that cannot run in float64 are compared in their own dtype with float32 tolerances.

>>> diff = compare(original, rewritten, [(torch.randn(2, 5, 6), torch.rand(2, 5, 5))])   # doctest: +SKIP
>>> diff.ok, diff.max_abs, diff.where                                                     # doctest: +SKIP
(True, 1.7e-16, 'gradient of a (train mode)')
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Iterator, Sequence

import torch

from fxmem import _torch_compat as tc
from fxmem.progress import phased

# (rtol, atol) by the dtype the comparison runs in
TOLERANCES = {torch.float64: (1e-6, 1e-9), torch.float32: (1e-4, 1e-5)}


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a module is called: its ``training`` flag and whether autograd records."""

    name: str
    training: bool
    grad: bool


# Every way a user calls a module; a rewrite must agree with the original in each.
MODES = (Mode("train mode", True, True), Mode("eval mode", False, True),
         Mode("eval mode, no_grad", False, False), Mode("train mode, no_grad", True, False))


@dataclasses.dataclass
class Difference:
    """The largest absolute difference found (``max_abs``), where (``"output 0"``,
    ``"gradient of a"``, ``"gradient of input 1"``) and whether everything was within tolerance."""

    ok: bool
    max_abs: float
    where: str
    dtype: torch.dtype


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # constants made inside forward (torch.ones(...)) must follow the comparison's dtype
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class _Copies:
    """Private copies of one module on ``device``, one per dtype, each made once per comparison and
    put back to its first state (parameters and buffers) before every run: a call that changes a
    buffer (batch-norm statistics) does not leak into the next run. (A deep copy of a GraphModule
    recompiles its code: one copy per run was most of what a comparison cost.) What a run may have
    changed is put back, from the module itself (which no run touches): every buffer, and each
    parameter whose version counter says it was written in place, so a model's parameters are not
    copied again per run."""

    def __init__(self, module: torch.nn.Module, device: str):
        self.module, self.device = module, device
        self._made: dict = {}  # dtype -> (copy, {name: (shape, dtype, id, version)} before any run)

    def get(self, dtype: torch.dtype | None) -> torch.nn.Module:
        made = self._made.get(dtype)
        if made is None:
            twin = copy.deepcopy(self.module).to(self.device)
            if dtype is not None:
                twin = twin.to(dtype)
            made = self._made[dtype] = (twin, {k: _stamp(v) for k, v in _tensors(twin)})
            self.buffer_names = {k for k, _ in twin.named_buffers(remove_duplicate=False)}
            return twin
        twin, state = made
        now = dict(_tensors(twin))
        if now.keys() != state.keys() or any(now[k].shape != v[0] or now[k].dtype != v[1] for k, v in state.items()):
            del self._made[dtype]  # a run replaced a buffer by another kind of tensor: copy again
            return self.get(dtype)
        # buffers always (batch norm's kernel writes its running statistics without counting a write),
        # parameters where a run wrote them
        changed = [k for k, v in state.items() if k in self.buffer_names or _stamp(now[k]) != v]
        if changed:
            source = dict(_tensors(self.module))
            with torch.no_grad():
                for k in changed:
                    now[k].copy_(source[k])
            state.update({k: _stamp(now[k]) for k in changed})
        return twin


def _stamp(t: torch.Tensor) -> tuple:
    """What says whether a run changed a module's tensor: its kind, the object, its in-place writes."""
    return t.shape, t.dtype, id(t), tc.write_count(t)


def _tensors(module: torch.nn.Module) -> list:
    """Every parameter and buffer by name, non-persistent buffers too (a rotary cache)."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _run(module: "torch.nn.Module | _Copies", inputs: Sequence[Any], dtype: torch.dtype | None, seed: int,
         device: str = "cpu", mode: Mode = MODES[0]) -> dict[str, Any]:
    """Outputs, gradients and buffers after the call of ``module`` (a copy of it on ``device``,
    cast to ``dtype`` when given, in ``mode``)."""
    module = (module if isinstance(module, _Copies) else _Copies(module, device)).get(dtype)
    module.train(mode.training)
    xs = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x = x.detach().clone().to(device)
            if x.is_floating_point():
                x = x.to(dtype) if dtype is not None else x
                x.requires_grad_(mode.grad)
        xs.append(x)
    ctx = _default_dtype(dtype) if dtype is not None else contextlib.nullcontext()
    grad = contextlib.nullcontext() if mode.grad else torch.no_grad()
    with ctx, grad, torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        torch.manual_seed(seed)  # dropout draws the same masks in both modules
        out = module(*xs)
    leaves = tc.tree_leaves(out)
    # copies: an output may be a module's tensor (or a view of it), which the next run's restore overwrites
    result: dict[str, Any] = {f"output {k}": v.detach().clone() if isinstance(v, torch.Tensor) else v
                              for k, v in enumerate(leaves)}
    # copies: the module's own buffers are put back before its next run, and these are kept
    result.update({f"buffer {n} after the call": b.detach().clone() for n, b in module.named_buffers()})
    if not mode.grad:
        return result
    weights = torch.Generator().manual_seed(seed + 1)
    terms = [(t * torch.randn(t.shape, generator=weights, dtype=t.dtype).to(t.device)).sum() for t in leaves
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    # every name of a tied parameter (wte.weight and lm_head.weight): which one named_parameters() keeps
    # depends on the order the modules were registered in, which a graph's copy need not share
    named = [(f"gradient of {n}", p) for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
    named += [(f"gradient of input {k}", x) for k, x in enumerate(xs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if terms and named:
        grads = torch.autograd.grad(sum(terms), [t for _, t in named], allow_unused=True)
        for (name, t), g in zip(named, grads):
            result[name] = torch.zeros_like(t) if g is None else g
    return result


def _compare_runs(ref: dict, got: dict, dtype: torch.dtype) -> Difference:
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    worst, where = 0.0, ""
    for name, a in ref.items():
        b = got.get(name)
        if not isinstance(a, torch.Tensor):
            if a != b:
                return Difference(False, float("inf"), f"{name}: {b!r} != {a!r}", dtype)
            continue
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            found = f"{tuple(b.shape)} {b.dtype}" if isinstance(b, torch.Tensor) else repr(b)
            return Difference(False, float("inf"), f"{name}: {found} instead of {tuple(a.shape)} {a.dtype}", dtype)
        if a.numel() == 0:
            continue
        if not a.is_floating_point():
            same, diff = torch.equal(a, b), 0.0 if torch.equal(a, b) else float("inf")
        elif torch.equal(a, b):  # bit for bit (most tensors a rewrite does not touch): one cheap pass
            same, diff = True, 0.0
        else:  # torch.allclose(b, a, rtol, atol, equal_nan=True), and the largest finite difference
            a, b = a.detach(), b.detach()
            d = (a - b).abs()  # NaN where either is, inf where one is infinite
            close = d.isfinite() & (d <= atol + rtol * a.abs())  # inf - inf is not close, as in allclose
            same = bool((close | (a == b) | (a.isnan() & b.isnan())).all())
            diff = float(d.nan_to_num(0.0, posinf=0.0).max())
        if not same:
            return Difference(False, diff, name, dtype)
        if diff >= worst:
            worst, where = diff, name
    return Difference(True, worst, where, dtype)


@phased("verification")
def compare(reference: torch.nn.Module, candidate: torch.nn.Module, inputs: Sequence[Sequence[Any]],
            seed: int = 0, device: str = "cpu", modes: Sequence[Mode] = MODES,
            references: dict | None = None) -> Difference:
    """Compare outputs, gradients and buffers of ``candidate`` with ``reference`` on each tuple of
    ``inputs`` (run on ``device``), in each of ``modes`` (default: train and eval mode, with
    autograd and under ``no_grad``).

    Parameters and buffers are matched by name (``candidate`` must have every one ``reference``
    has). Returns the first failing :class:`Difference`, or the largest one when all agree.
    ``references``: a dict kept by the caller for as long as ``reference`` and ``inputs`` do not
    change (one ``optimize`` call): ``reference``'s runs are kept there and not made again.
    """
    worst: Difference | None = None
    reference_copies, candidate_copies = _Copies(reference, device), _Copies(candidate, device)
    for k, xs in enumerate(inputs):
        for mode in modes:
            key = (id(reference), id(xs), k, mode.name, seed, device)
            if references is not None and key in references:
                ref, dtype = references[key]
            else:
                try:
                    ref = _run(reference_copies, xs, torch.float64, seed + k, device, mode)
                    dtype: torch.dtype | None = torch.float64
                except Exception:  # some op has no float64 kernel: compare in the model's own dtype
                    ref, dtype = _run(reference_copies, xs, None, seed + k, device, mode), None
                if references is not None:
                    references[key] = (ref, dtype)
            try:
                got = _run(candidate_copies, xs, dtype, seed + k, device, mode)
            except Exception as exc:  # noqa: BLE001 - the original runs here and the candidate does not
                where = f"{mode.name}, {str(dtype or 'its own dtype').replace('torch.', '')}: {type(exc).__name__}: " \
                        f"{(str(exc).strip().splitlines() or [''])[0][:160]}"
                return Difference(False, float("inf"), f"the rewrite fails where the original runs ({where})",
                                  dtype or torch.float32)
            diff = _compare_runs(ref, got, dtype or torch.float32)
            diff = dataclasses.replace(diff, where=f"{diff.where} ({mode.name})" if diff.where else mode.name)
            if not diff.ok:
                return diff
            if worst is None or diff.max_abs >= worst.max_abs:
                worst = diff
    return worst or Difference(True, 0.0, "", torch.float64)
