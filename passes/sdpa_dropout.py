"""The SDPA rule's opt-in, ``settings={"sdpa": {"same_distribution": True}}``: SDPA's own dropout for the model's.

By default the rewritten graph runs the original attention while dropout on the weights is on
(train mode): the model's own random bits, bit for bit, and no memory saved in training. With the
opt-in it calls ``F.scaled_dot_product_attention(..., dropout_p=p)`` there instead: SDPA drops
each weight with probability p and scales the kept ones by 1 / (1 - p), as ``F.dropout`` does -
the same distribution, drawn by SDPA: train-mode outputs are not promised to be the model's bit
for bit (on CUDA they are not; on the CPU SDPA's math path draws as ``F.dropout`` over weights laid
out ``[.., L, S]`` contiguous, so there the bits happen to be the model's, not elsewhere). The flag
is read as the model reads it (``nn.Dropout``'s ``training`` and ``p`` when the graph runs;
``training=self.training``): in eval mode ``dropout_p`` is 0.

Where SDPA's dropout runs on the CPU it takes the math path (CPU flash attention has no dropout),
which keeps the L x S weights and dropout's noise for backward as the original does. There the call
runs under ``torch.utils.checkpoint`` (the generator's state kept, so backward draws the forward's
mask again): it keeps q, k, v and 5 KB of generator state, and builds the weights of one attention
at a time in backward - lower where several attentions' weights were kept at once (a model's
layers); for a single attention the step holds as much (and the generator's state), and the
formulas decline the rewrite. On CUDA its fused kernels draw the mask from a seed and keep no
weights: called directly.

How the rewrite is checked, since outputs cannot be compared bit for bit with p > 0:

* exactly, as every rewrite: eval mode (``dropout_p`` = 0), and train mode with the model's own
  bits - while :func:`model_bits` is entered (``optimize`` verifies under it) the rewritten graph
  runs the original attention where dropout is on, so everything around it (later dropouts read
  the same random stream) is compared exactly;
* as a distribution (:func:`check_distribution`), at each probe, on the very call the graph makes:
  ``DRAWS`` draws (fixed seeds) against the model's dropout, whose first two moments are known
  exactly - mean: the attention without dropout; variance of out[i, d]: sum_j w_ij² v_jd² p/(1-p)
  (each kept weight is w/(1-p) with probability 1-p). Three statistics of the draws, each checked
  within ``SIGMAS`` standard errors estimated from the draws themselves: the deviation from the
  mean projected on the mean (a wrong scale) and on fixed random weights (mean 0 both), and the
  squared deviation summed over the output (mean: the summed variance). A wrong p, a missing
  1/(1-p), or no dropout at all moves one of them by many standard errors (tests/passes/
  test_sdpa_dropout.py makes each of these mistakes); deterministic (fixed seeds), so a rewrite is
  either kept or not, every time;
* backward uses the forward's mask: with one seed, the gradient's directional derivative
  ``<grad, delta>`` equals ``(L(x + eps delta) - L(x - eps delta)) / 2 eps`` (both drawn from
  that seed), in float64. A backward that drew a fresh mask fails it.

Refused, with a record: dropout that is not on the softmax weights directly before the product
with v (on the scores, before the softmax; or another op between it and the product), and dropout
written with ``training=True`` (on in eval mode too: no mode would run SDPA without dropout, where
the rewrite is checked exactly).

>>> opt = fxmem.optimize(model, ("B", "L", 16), settings={"sdpa": {"same_distribution": True}})  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils.checkpoint as checkpointing

from fxmem.passes.base import Probe

SETTING = "same_distribution"
DESCRIPTION = ("True: while dropout on the attention weights is on (train mode) SDPA's own dropout_p replaces it - "
               "the same distribution, other random bits, lower training memory (default False: the original "
               "attention runs while dropout is on, the model's own bits)")
NAMED = f"settings={{'sdpa': {{'{SETTING}': True}}}}"
DRAWS = 256  # draws of the distribution check at each probe (tiny sizes: milliseconds each)
SIGMAS = 5.0  # how far a statistic may lie from its expected value, in standard errors of the draws
_SEED = 20261205  # the distribution check's fixed seed: the same decision on every call

_MODEL_BITS = contextvars.ContextVar("fxmem_sdpa_model_bits", default=False)


@contextlib.contextmanager
def model_bits() -> Iterator[None]:
    """While entered, a rewritten graph runs the original attention where dropout is on, also where
    SDPA's own dropout was opted in: the model's random bits, so a run compares bit for bit."""
    token = _MODEL_BITS.set(True)
    try:
        yield
    finally:
        _MODEL_BITS.reset(token)


def own_dropout() -> bool:
    """Whether SDPA's own dropout runs where it was opted in (not within :func:`model_bits`)."""
    return not _MODEL_BITS.get()


def call(q: Any, k: Any, v: Any, mask: Any, scale: Any, causal: bool, dropout_p: float = 0.0) -> Any:
    """``F.scaled_dot_product_attention``; with ``dropout_p`` > 0 on CPU tensors under autograd,
    under ``torch.utils.checkpoint`` (see the module doc). Works on fx proxies with ``dropout_p`` 0."""
    if dropout_p and _recomputes(q, k, v, mask):
        return checkpointing.checkpoint(_sdpa, q, k, v, mask, scale, causal, dropout_p, use_reentrant=False,
                                        preserve_rng_state=True)
    return _sdpa(q, k, v, mask, scale, causal, dropout_p)


def _sdpa(q: Any, k: Any, v: Any, mask: Any, scale: Any, causal: bool, dropout_p: float) -> Any:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale)


def _recomputes(*tensors: Any) -> bool:
    """SDPA's dropout on the CPU (its math path) with autograd recording for one of ``tensors``."""
    held = [t for t in tensors if isinstance(t, torch.Tensor)]
    return torch.is_grad_enabled() and held[0].device.type == "cpu" and any(t.requires_grad for t in held)


# --- where the opt-in is refused ------------------------------------------------------------------------

def always_on(p: float) -> str:
    """Why the opt-in is refused for dropout written with ``training=True``."""
    return (f"dropout (p={p:g}) is always on here (training=True written in the code, eval mode too): "
            f"{SETTING}=True is refused - no mode would run SDPA without dropout, where the rewrite is checked "
            f"exactly against the original; and without it SDPA's dropout draws another random mask than the "
            f"model's, so the rewrite could not give the same numbers")


def misplaced(weights: Any, is_dropout: Callable[[torch.fx.Node], bool], is_softmax: Callable[[torch.fx.Node], bool],
              passed: Callable[[torch.fx.Node], bool], is_product: Callable[[torch.fx.Node], bool],
              steps: int = 4) -> str | None:
    """Why the opt-in does not apply to the attention whose product with v reads ``weights``: within
    ``steps`` ops back from that product to a softmax there is a dropout with another op next to it
    (not directly on the softmax weights before the product), or a dropout between the scores
    product and the softmax (on the scores); None where neither is found. ``passed``: casts that
    change nothing, looked through."""
    node, path = weights, []
    for _ in range(steps):
        if not _single(node):
            return None
        if passed(node):
            node = node.args[0]
            continue
        if is_softmax(node):
            break
        path.append(node)
        node = node.args[0]
    else:
        return None
    drops = [n for n in path if is_dropout(n)]
    if drops and len(path) > 1:
        other = next(n for n in path if not is_dropout(n))
        return (f"the dropout {drops[0].name} is not directly on the softmax weights before the product with v "
                f"({other.name} comes between): SDPA's dropout_p drops the softmax weights right before that "
                f"product, so {SETTING}=True does not apply here; left as it is")
    if drops:
        return None
    below = node.args[0]
    for _ in range(steps):
        if not _single(below) or is_product(below):
            return None
        if is_dropout(below):
            return (f"the dropout {below.name} is on the scores, before the softmax {node.name}: SDPA's dropout_p "
                    f"drops the weights after it, so {SETTING}=True does not apply here; left as it is")
        below = below.args[0]
    return None


def _single(node: Any) -> bool:
    """A node that computes from a tensor in its first argument (walked back along it)."""
    return isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method", "call_module") \
        and bool(node.args) and isinstance(node.args[0], torch.fx.Node)


# --- the distribution check ----------------------------------------------------------------------------

def check_distribution(run: Callable[[Callable[[torch.fx.Node], Any], float], torch.Tensor], reads: Sequence[Any],
                       weights: torch.fx.Node, values: torch.fx.Node, letters: tuple[str, str, str], p: float,
                       probes: Sequence[Probe]) -> str | None:
    """Why SDPA's dropout, as ``run(lookup, dropout_p)`` calls it on each probe's values (``lookup``:
    a node's value; ``reads``: the nodes it reads), is not the model's dropout ``p`` on ``weights``
    before the product with ``values`` (einsum ``letters``); None where it is (see the module doc)."""
    try:
        return _check_distribution(run, reads, weights, values, letters, p, probes)
    except RuntimeError as exc:  # SDPA refuses the float64 operands (a mask cast to the scores' dtype)
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"SDPA's dropout could not be checked at the probes ({first}); {SETTING}=True not applied"


def _check_distribution(run: Callable, reads: Sequence[Any], weights: torch.fx.Node, values: torch.fx.Node,
                        letters: tuple[str, str, str], p: float, probes: Sequence[Probe]) -> str | None:
    for at, probe in enumerate(probes):
        look = _float64(probe.env, reads)
        sizes = ", ".join(f"{k}={v}" for k, v in probe.sizes.items())
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED + at)
            mean = run(look.__getitem__, 0.0)  # the attention without dropout: dropout's mean
            w, v = probe.env[weights].double(), probe.env[values].double()
            variance = torch.einsum(f"{letters[0]},{letters[1]}->{letters[2]}", w * w, v * v) * (p / (1 - p))
            project = torch.randn(mean.shape, dtype=mean.dtype)
            draws = [run(look.__getitem__, p) - mean for _ in range(DRAWS)]
        bad = _off("the deviation along the mean", [float((d * mean).sum()) for d in draws], 0.0) \
            or _off("the deviation from the mean, projected", [float((d * project).sum()) for d in draws], 0.0) \
            or _off("the summed squared deviation", [float((d * d).sum()) for d in draws], float(variance.sum()))
        if bad:
            return (f"SDPA's dropout (p={p:g}) does not draw the model's dropout distribution at {sizes}: {bad}; "
                    f"{SETTING}=True not applied")
    return _same_mask_in_backward(run, reads, p, probes[0])


def _float64(env: Mapping, reads: Sequence[Any]) -> dict:
    """``env`` with the floating tensors among ``reads`` in float64 (no rounding hides a wrong statistic)."""
    look = dict(env)
    for n in reads:
        value = env.get(n) if isinstance(n, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            look[n] = value.double()
    return look


def _off(what: str, samples: Sequence[float], expected: float) -> str | None:
    """Where the mean of ``samples`` lies more than ``SIGMAS`` standard errors from ``expected``."""
    n = len(samples)
    mean = sum(samples) / n
    spread = math.sqrt(sum((s - mean) ** 2 for s in samples) / (n - 1) / n)
    # a spread of 0 (every draw alike: no dropout drawn) passes only where nothing is expected to vary
    if abs(mean - expected) <= SIGMAS * spread + 1e-9 * max(1.0, abs(expected)):
        return None
    return (f"{what} averages {mean:.4g} over {n} draws, expected {expected:.4g} (standard error {spread:.2g}, "
            f"at most {SIGMAS:g} allowed)")


def _same_mask_in_backward(run: Callable, reads: Sequence[Any], p: float, probe: Probe) -> str | None:
    """Why the backward of SDPA's dropout does not use the mask its forward drew: the gradient's
    directional derivative against a central difference drawn from the same seed (float64)."""
    look = _float64(probe.env, reads)
    leaves = [n for n in dict.fromkeys(reads) if isinstance(look.get(n), torch.Tensor)
              and look[n].is_floating_point() and look[n].dim() > 0]
    gen = torch.Generator().manual_seed(_SEED)
    deltas = {n: torch.randn(look[n].shape, generator=gen, dtype=torch.float64) for n in leaves}
    weights: list = []

    def loss(shift: float, grad: bool) -> Any:
        moved = {**look, **{n: (look[n] + shift * deltas[n]).requires_grad_(grad) for n in leaves}}
        with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(grad):
            torch.manual_seed(_SEED)
            out = run(moved.__getitem__, p)
        if not weights:
            weights.append(torch.randn(out.shape, generator=gen, dtype=out.dtype))
        return (out * weights[0]).sum(), [moved[n] for n in leaves]

    value, tensors = loss(0.0, True)
    grads = torch.autograd.grad(value, tensors, allow_unused=True)
    along = sum(float((g * deltas[n]).sum()) for g, n in zip(grads, leaves) if g is not None)
    eps = 1e-6
    ahead, behind = loss(eps, False)[0], loss(-eps, False)[0]
    numeric = float(ahead - behind) / (2 * eps)
    if abs(numeric - along) <= 1e-6 * max(1.0, abs(numeric)):
        return None
    return (f"the backward of SDPA's dropout (p={p:g}) does not use the mask its forward drew: a directional "
            f"derivative {along:.6g}, {numeric:.6g} by differences with the same random draws; {SETTING}=True not "
            f"applied")
