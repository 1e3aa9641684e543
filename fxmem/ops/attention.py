"""GAT attention, fused: masked softmax over decomposed scores without any N x M float tensor kept.

    e_ij  = LeakyReLU(s_i + t_j)                      scores, decomposed (GAT: s = Wh·a1, t = Wh·a2)
    a_ij  = softmax_j(e_ij if keep_ij else fill)      keep_ij: adj_ij > threshold (or <, ==, ...), or not
            (or softmax_j(e_ij + adj_ij): an additive mask, compare="add", as 0 / -inf connectivity masks)
    out_i = sum_j a_ij h_j

Written out, autograd keeps the scores, the mask and the softmax, N x M each (seed 000's layer:
about 21·B·N² bytes after its pair tensor is gone). Here rows are processed in blocks of R rows:
a block holds complete rows, so its softmax is the plain one, computed by ``torch.softmax`` (no
online rescaling is needed when the blocks are rows), and nothing N x M is saved: the backward
recomputes each block's masked scores and softmax from ``s``, ``t`` and ``adj`` (FlashAttention's
scheme; dgNN's fused GAT kernel does the same on GPUs), bit for bit as the forward made them:

    P = softmax(masked scores),  dP = dout·hᵀ,  dh += Pᵀ·dout,  dE = P ⊙ (dP - rowsum(P ⊙ dP)),
    dE = 0 where not kept,  dE *= LeakyReLU'(s_i + t_j),  ds_i = sum_j dE_ij,  dt_j = sum_i dE_ij

``dE = 0 where not kept`` costs a masked pass; it is skipped for a block where it changes nothing:
where every row's largest masked score is so far above ``fill`` that the softmax gave the masked
entries exactly 0 (exp underflows), their dE is 0 already. The row maxima are the one row statistic
saved.

Layouts (the rewrite arranges the model's tensors so): ``s`` is [Gm, Gh, N], ``t`` [Gm, Gh, M],
``h`` [Gm, Gh, M, F], ``adj`` [Am, N, M] with Am = Gm or 1 (the mask is shared by the Gh heads),
``out`` [Gm, Gh, N, F]. The block rows R come from ``block_bytes``, the scratch one block may use
(:func:`block_rows`); per block the kernel allocates the scores and their softmax (R·M per group
each), a bool mask and the block's output rows in the forward, and one more score-sized block
(dP) and the block's gradient rows (when the gradient is expanded) in the backward - exactly, as
:mod:`fxmem.kernels.fused` says (its tests compare with the allocator on real runs).

The kernel is plain PyTorch, registered for every device. On CUDA, where Triton is installed,
:mod:`fxmem.ops.attention_triton` puts fused Triton kernels on the ``cuda`` key of the two ops without
dropout (float32, float16, bfloat16; float64 and the dropout ops keep this kernel), with their own
memory rule in :mod:`fxmem.kernels.fused`; they are taken with ``FXMEM_TRITON_ATTENTION=1`` (off until
checked on a GPU).

>>> out = masked_attention(s, t, h, adj, compare="gt", threshold=0.0, fill=-9e15, slope=0.2)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_BLOCK_BYTES = 4 * 2**20  # scratch of one block; small enough to stay in cache-sized chunks
# how the mask is read from adj: adj_ij <op> threshold, "true" for a bool adj itself, or "add": adj is
# added to the scores (an additive mask: 0 where kept, -inf where not, or any bias)
COMPARE = ("gt", "ge", "lt", "le", "eq", "ne", "true", "add")
_LEAKY_RELU_BACKWARD = torch.ops.aten.leaky_relu_backward.default
_COMPARE = {"gt": torch.gt, "ge": torch.ge, "lt": torch.lt, "le": torch.le, "eq": torch.eq, "ne": torch.ne}


# exp(x) is exactly 0 below these (float32: exp(-104) < the smallest subnormal; float64: exp(-746)),
# with a margin: a softmax gives a masked entry exactly 0 when fill is this far below its row's max
_UNDERFLOW = {torch.float64: -800.0}
_UNDERFLOW_DEFAULT = -120.0


def block_rows(n: Any, m: Any, f: Any, groups: Any, mask_groups: Any, element_size: int, block_bytes: int,
               score_blocks: int = 3) -> Any:
    """Rows per block: as many as keep the backward's scratch (``score_blocks`` float score blocks
    per group - the scores, their softmax or LeakyReLU's gradient, dP; with dropout also its noise
    and the dropped weights - 1 bool mask block per mask group, and the block's rows of the output
    or its gradient) within ``block_bytes``, at least 1, at most ``n``.

    Sizes may be symbolic: the comparisons then become guards of the analysis' region.
    """
    per_row = score_blocks * element_size * groups * m + mask_groups * m + element_size * groups * f
    rows = block_bytes // per_row
    if rows < 1:
        return 1
    return n if rows >= n else rows


def groups_merge(t: torch.Tensor) -> bool:
    """Whether [Gm, Gh, N, F] views as [Gm*Gh, N, F] (comparisons of symbolic strides are guards)."""
    gm, gh = t.shape[0], t.shape[1]
    return gm == 1 or gh == 1 or t.stride(0) == gh * t.stride(1)


def gemm_ready(t: torch.Tensor) -> bool:
    """Whether a batch of matrices [G, R, F] goes to BLAS as it is: rows of contiguous elements."""
    return t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1]


def _dropped(adj: torch.Tensor, r0: int, rows: int, compare: str, threshold: float, keep: bool) -> torch.Tensor:
    """Where the scores are replaced by ``fill``, for rows r0..r0+rows: [Am, 1, rows, M] bool.

    ``keep``: the comparison says which scores stay (``where(adj > 0, e, fill)``); otherwise which
    are replaced (``e.masked_fill(adj == 0, fill)``).
    """
    part = adj[:, r0:r0 + rows].unsqueeze(1)
    if compare == "true":
        return part.logical_not() if keep else part  # a bool adj that says what to replace is a view
    found = _COMPARE[compare](part, threshold)
    # not(keep) rather than the opposite comparison: NaN entries are dropped, as where(adj > 0, ...) does
    return found.logical_not_() if keep else found


def _scores(s3: torch.Tensor, t3: torch.Tensor, adj: torch.Tensor, heads: int, r0: int, rows: int,
            compare: str, threshold: float, keep: bool, fill: float, slope: float) -> tuple:
    """The masked scores of rows r0..r0+rows as [G, rows, M], and the drop mask."""
    z = s3[:, r0:r0 + rows, None] + t3[:, None, :]
    F.leaky_relu_(z, slope)
    if compare == "add":  # in place, from a view of adj's rows: nothing allocated
        z.view(-1, heads, rows, z.shape[-1]).add_(adj[:, r0:r0 + rows].unsqueeze(1))
        return z, None
    drop = _dropped(adj, r0, rows, compare, threshold, keep)
    z.view(-1, heads, rows, z.shape[-1]).masked_fill_(drop, fill)
    return z, drop


def _forward_buffers(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor) -> tuple:
    """The forward's operands as [G, ...] (contiguous copies where they are not), and its outputs
    ``out`` [Gm, Gh, N, F] and ``top`` [Gm, Gh, N, 1], allocated and as [G, ...] views."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    g = gm * gh
    s3, t3, h3 = s.contiguous().view(g, n), t.contiguous().view(g, m), h.contiguous().view(g, m, f)
    out = s.new_empty(gm, gh, n, f)
    top = s.new_empty(gm, gh, n, 1)
    return (s3, t3, h3), (out, top), (out.view(g, n, f), top.view(g, n, 1))


def _masked_attention_rows(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, adj: torch.Tensor, compare: str,
                        threshold: float, keep: bool, fill: float, slope: float, block_bytes: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, top)``: the attention output [Gm, Gh, N, F] and each row's largest masked score [Gm, Gh, N, 1]."""
    (s3, t3, h3), (out, top), (out3, top3) = _forward_buffers(s, t, h)
    n, m, f = s.shape[-1], t.shape[-1], h.shape[-1]
    step = block_rows(n, m, f, s.shape[0] * s.shape[1], adj.shape[0], s.element_size(), block_bytes)
    for r0 in range(0, n, step):
        _forward_block(s3, t3, h3, adj, s.shape[1], out3, top3, r0, min(step, n - r0), compare, threshold, keep, fill, slope)
    return out, top


masked_attention_op = torch.library.custom_op("fxmem::masked_attention", mutates_args=())(_masked_attention_rows)


def _forward_block(s3, t3, h3, adj, heads, out3, top3, r0, rows, compare, threshold, keep, fill, slope,
                   dropout: float = 0.0, heads_last: bool = False) -> None:
    # a function per block: its temporaries die when it returns, before the next block's are made
    z, drop = _scores(s3, t3, adj, heads, r0, rows, compare, threshold, keep, fill, slope)
    del drop
    torch.amax(z, -1, keepdim=True, out=top3[:, r0:r0 + rows])
    p = torch.softmax(z, -1)
    del z
    if dropout:  # F.dropout's own steps on the CPU (noise, bernoulli_, div_, multiply): the same numbers
        noise = _noise(p, dropout, None, heads_last)
        p.mul_(noise)
        del noise
    if rows == out3.shape[1]:  # one block: straight into the output
        torch.bmm(p, h3, out=out3)
    else:
        out3[:, r0:r0 + rows] = torch.bmm(p, h3)


@masked_attention_op.register_fake
def _(s, t, h, adj, compare, threshold, keep, fill, slope, block_bytes):
    gm, gh, n = s.shape
    return s.new_empty(gm, gh, n, h.shape[-1]), s.new_empty(gm, gh, n, 1)


def _backward_buffers(grad, s, t, h, adj, top, need_adj: bool) -> tuple:
    """The backward's operands as [G, ...] (contiguous copies where they are not) and its results,
    allocated (``ds, dt, dh, dadj``) and as [G, ...] views (``ds2, dt2, dh3``)."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    g = gm * gh
    s3, t3, h3 = s.contiguous().view(g, n), t.contiguous().view(g, m), h.contiguous().view(g, m, f)
    grad3 = grad.view(g, n, f) if groups_merge(grad) else grad.reshape(g, n, f)  # the reshape copies
    ds = s.new_empty(gm, gh, n)
    dt = t.new_zeros(gm, gh, m)
    dh = h.new_zeros(gm, gh, m, f)
    dadj = adj.new_zeros(adj.shape) if need_adj else adj.new_empty(0)
    views = (ds.view(g, n), dt.view(g, m), dh.view(g, m, f), top.view(g, n, 1))
    return (s3, t3, h3, grad3), (ds, dt, dh, dadj), views


def _masked_attention_backward_rows(grad: torch.Tensor, s: torch.Tensor, t: torch.Tensor, h: torch.Tensor,
                                 adj: torch.Tensor, top: torch.Tensor, compare: str, threshold: float, keep: bool,
                                 fill: float, slope: float, block_bytes: int, need_adj: bool = False
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ds, dt, dh, dadj)`` from the gradient of ``out``, recomputing the scores block by block;
    ``dadj`` (an additive mask's gradient) is empty unless ``need_adj``."""
    gm, gh, n = s.shape
    m, f = t.shape[-1], h.shape[-1]
    (s3, t3, h3, grad3), (ds, dt, dh, dadj), (ds2, dt2, dh3, top3) = _backward_buffers(grad, s, t, h, adj, top,
                                                                                      need_adj)
    # the masked pass is needed only where a masked entry's softmax is not exactly 0
    below = fill - _UNDERFLOW.get(s.dtype, _UNDERFLOW_DEFAULT)
    step = block_rows(n, m, f, gm * gh, adj.shape[0], s.element_size(), block_bytes)
    for r0 in range(0, n, step):
        _backward_block(grad3, s3, t3, h3, adj, top3, gh, ds2, dt2, dh3, r0, min(step, n - r0), compare, threshold,
                        keep, fill, slope, below, dadj if need_adj else None)
    return ds, dt, dh, dadj


masked_attention_backward_op = torch.library.custom_op("fxmem::masked_attention_backward",
                                                       mutates_args=())(_masked_attention_backward_rows)


def _backward_block(grad3, s3, t3, h3, adj, top3, heads, ds2, dt2, dh3, r0, rows, compare, threshold, keep, fill,
                    slope, below, dadj=None, dropout: float = 0.0, generator: Any = None,
                    heads_last: bool = False) -> None:
    z, drop = _scores(s3, t3, adj, heads, r0, rows, compare, threshold, keep, fill, slope)
    p = torch.softmax(z, -1)  # the forward's softmax: the same op on the same scores
    g = grad3[:, r0:r0 + rows]
    if not gemm_ready(grad3):  # an expanded gradient (from a sum): the block's rows, copied once
        g = g.contiguous()
    dp = torch.bmm(g, h3.transpose(1, 2))
    if dropout:  # the forward's noise drawn again from its generator state: the weights it dropped
        noise = _noise(p, dropout, generator, heads_last)
        kept = p * noise
        dh3.baddbmm_(kept.transpose(1, 2), g)
        del kept
        dp.mul_(noise)  # dropout's backward: the gradient times the noise
        del noise
    else:
        dh3.baddbmm_(p.transpose(1, 2), g)
    dp.mul_(p)
    row = dp.sum(-1, keepdim=True)
    dp.addcmul_(p, row, value=-1.0)  # softmax backward: P ⊙ (dP - rowsum(P ⊙ dP))
    del row, p
    if dadj is not None:  # the additive mask's gradient: dE before LeakyReLU's, summed over the heads sharing it
        part = dp.view(-1, heads, rows, dp.shape[-1]).sum(1)
        if dadj.shape[0] == 1 and part.shape[0] > 1:
            part = part.sum(0, keepdim=True)
        dadj[:, r0:r0 + rows] += part
        del part
    if drop is not None and not bool(torch.gt(top3[:, r0:r0 + rows], below).all()):  # a masked entry got weight
        dp.view(-1, heads, rows, dp.shape[-1]).masked_fill_(drop, 0.0)  # where() sends nothing to them
    del drop
    torch.add(s3[:, r0:r0 + rows, None], t3[:, None, :], out=z)  # the scores before LeakyReLU, again
    de = _LEAKY_RELU_BACKWARD(dp, z, slope, False)  # the op the plain form's backward runs
    del dp, z
    ds2[:, r0:r0 + rows] = de.sum(-1)
    dt2.add_(de.sum(-2))


@masked_attention_backward_op.register_fake
def _(grad, s, t, h, adj, top, compare, threshold, keep, fill, slope, block_bytes, need_adj=False):
    return (s.new_empty(s.shape), t.new_empty(t.shape), h.new_empty(h.shape),
            adj.new_empty(adj.shape) if need_adj else adj.new_empty(0))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    s, t, h, adj, compare, threshold, keep, fill, slope, block_bytes = inputs
    ctx.options = (compare, threshold, keep, fill, slope, block_bytes)
    ctx.save_for_backward(s, t, h, adj, output[1])


def _backward(ctx: Any, grad: torch.Tensor, grad_top: Any) -> tuple:
    s, t, h, adj, top = ctx.saved_tensors
    need_adj = bool(ctx.needs_input_grad[3]) and ctx.options[0] == "add"  # only an added mask has one
    ds, dt, dh, dadj = torch.ops.fxmem.masked_attention_backward(grad, s, t, h, adj, top, *ctx.options, need_adj)
    return ds, dt, dh, (dadj if need_adj else None), None, None, None, None, None, None


masked_attention_op.register_autograd(_backward, setup_context=_setup)

# on CUDA, Triton kernels where a CUDA build has Triton (nothing changes elsewhere); what they do not take
# (float64) runs the loops above
from . import attention_triton as _triton  # noqa: E402 - registers on the ops defined above

_triton.register(masked_attention_op, masked_attention_backward_op, _masked_attention_rows,
                 _masked_attention_backward_rows)


# --- with dropout on the attention weights --------------------------------------------------------------
# F.dropout(a, p) on the CPU draws one Bernoulli number per element of ``a`` in memory order from the
# default generator, and a tensor drawn in pieces, in order, gets the same numbers as drawn whole
# (tests/passes/test_fused_attention.py checks it). So the kernel gets the model's own dropout mask when it
# visits the weights in their memory order: group by group, rows in order within a group - or, where
# the model lays its weights out heads last ([B, N, M, H], PyG's DenseGATConv), mask group by mask
# group, rows in order, all Gh heads of a row block at once (the rewrite checks at its probes that
# the model's weights are laid out one of these ways). The backward draws the same noise again
# from a copy of the generator's state taken before the forward's first draw.

def _draws_in_pieces() -> bool:
    """Whether this machine's ``bernoulli_`` gives a tensor drawn in pieces the numbers of one draw
    (the kernels' dropout relies on it). PyTorch's CPU kernel draws one number after another from
    the generator's stream, except in builds with MKL on Intel CPUs, where each call takes one seed
    from the generator and draws an MKL stream of its own (ATen's ``bernoulli_scalar_kernel``): a
    tensor drawn in pieces then gets other numbers than ``F.dropout`` draws for the whole. Checked
    once, on real tensors with generators of its own (the user's random stream is not touched)."""
    whole = torch.empty(64).bernoulli_(0.5, generator=torch.Generator().manual_seed(20261128))
    pieces = torch.empty(64)
    generator = torch.Generator().manual_seed(20261128)
    pieces[:24].bernoulli_(0.5, generator=generator)
    pieces[24:].bernoulli_(0.5, generator=generator)
    return bool(torch.equal(whole, pieces))


# the fused kernels draw dropout's mask themselves only where this holds (else the rewritten graph
# runs the model's own attention while dropout is on); made at import, outside any fake mode
DRAWS_IN_PIECES = _draws_in_pieces()


def _noise(p: torch.Tensor, dropout: float, generator: Any, heads_last: bool = False) -> torch.Tensor:
    """What ``F.dropout(p, dropout)`` multiplies ``p`` [G, rows, M] by: Bernoulli(1 - dropout) /
    (1 - dropout), drawn as [rows, M, G] when the model's weights have their heads last."""
    noise = p.new_empty(p.shape[1], p.shape[2], p.shape[0]) if heads_last else torch.empty_like(p)
    noise.bernoulli_(1 - dropout, generator=generator)
    noise.div_(1 - dropout)
    return noise.permute(2, 0, 1) if heads_last else noise


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _groups(s: torch.Tensor, adj: torch.Tensor, heads_last: bool):
    """(first group, end, its mask group) of each visit, in the weights' memory order: one group at
    a time, Gm-major then the Gh heads; heads last: the Gh heads of one Gm group at once."""
    gm, gh = s.shape[0], s.shape[1]
    width = gh if heads_last else 1
    for k in range(0, gm * gh, width):
        yield k, k + width, (k // gh if adj.shape[0] > 1 else 0)


@torch.library.custom_op("fxmem::masked_attention_dropout", mutates_args=())
def masked_attention_dropout_op(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, adj: torch.Tensor, compare: str,
                                threshold: float, keep: bool, fill: float, slope: float, block_bytes: int,
                                dropout: float, heads_last: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, top, state)``: as :func:`masked_attention_op`, with ``F.dropout(weights, dropout)``
    before the product, one group at a time (``heads_last``: the Gh heads of a Gm group at once, for
    weights laid out [Gm, N, M, Gh]); ``state`` is the generator's state before the first draw (the
    backward draws the same noise from it)."""
    (s3, t3, h3), (out, top), (out3, top3) = _forward_buffers(s, t, h)
    state = _rng_state(s.device)
    n, m, f = s.shape[-1], t.shape[-1], h.shape[-1]
    heads = s.shape[1] if heads_last else 1
    step = block_rows(n, m, f, heads, 1, s.element_size(), block_bytes, score_blocks=5)
    for k, e, a in _groups(s, adj, heads_last):
        for r0 in range(0, n, step):
            _forward_block(s3[k:e], t3[k:e], h3[k:e], adj[a:a + 1], heads, out3[k:e], top3[k:e], r0,
                           min(step, n - r0), compare, threshold, keep, fill, slope, dropout, heads_last)
    return out, top, state


@masked_attention_dropout_op.register_fake
def _(s, t, h, adj, compare, threshold, keep, fill, slope, block_bytes, dropout, heads_last=False):
    gm, gh, n = s.shape
    size = 16 if s.device.type == "cuda" else 5056  # the generator's state: Philox seed and offset / MT19937
    return (s.new_empty(gm, gh, n, h.shape[-1]), s.new_empty(gm, gh, n, 1),
            torch.empty(size, dtype=torch.uint8, device="cpu"))


@torch.library.custom_op("fxmem::masked_attention_dropout_backward", mutates_args=())
def masked_attention_dropout_backward_op(grad: torch.Tensor, s: torch.Tensor, t: torch.Tensor, h: torch.Tensor,
                                         adj: torch.Tensor, top: torch.Tensor, state: torch.Tensor, compare: str,
                                         threshold: float, keep: bool, fill: float, slope: float, block_bytes: int,
                                         dropout: float, need_adj: bool = False, heads_last: bool = False
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ds, dt, dh, dadj)`` of :func:`masked_attention_dropout_op`, its noise drawn again from ``state``."""
    n, m, f = s.shape[-1], t.shape[-1], h.shape[-1]
    (s3, t3, h3, grad3), (ds, dt, dh, dadj), (ds2, dt2, dh3, top3) = _backward_buffers(grad, s, t, h, adj, top,
                                                                                      need_adj)
    generator = torch.Generator(device=s.device)
    generator.set_state(state)
    below = fill - _UNDERFLOW.get(s.dtype, _UNDERFLOW_DEFAULT)
    heads = s.shape[1] if heads_last else 1
    step = block_rows(n, m, f, heads, 1, s.element_size(), block_bytes, score_blocks=5)
    for k, e, a in _groups(s, adj, heads_last):
        for r0 in range(0, n, step):
            _backward_block(grad3[k:e], s3[k:e], t3[k:e], h3[k:e], adj[a:a + 1], top3[k:e], heads, ds2[k:e],
                            dt2[k:e], dh3[k:e], r0, min(step, n - r0), compare, threshold, keep, fill, slope, below,
                            dadj[a:a + 1] if need_adj else None, dropout, generator, heads_last)
    return ds, dt, dh, dadj


@masked_attention_dropout_backward_op.register_fake
def _(grad, s, t, h, adj, top, state, compare, threshold, keep, fill, slope, block_bytes, dropout, need_adj=False,
      heads_last=False):
    return (s.new_empty(s.shape), t.new_empty(t.shape), h.new_empty(h.shape),
            adj.new_empty(adj.shape) if need_adj else adj.new_empty(0))


def _setup_dropout(ctx: Any, inputs: tuple, output: tuple) -> None:
    s, t, h, adj, compare, threshold, keep, fill, slope, block_bytes, dropout, heads_last = inputs
    ctx.options = (compare, threshold, keep, fill, slope, block_bytes, dropout)
    ctx.heads_last = heads_last
    ctx.save_for_backward(s, t, h, adj, output[1], output[2])


def _backward_dropout(ctx: Any, grad: torch.Tensor, grad_top: Any, grad_state: Any) -> tuple:
    s, t, h, adj, top, state = ctx.saved_tensors
    need_adj = bool(ctx.needs_input_grad[3]) and ctx.options[0] == "add"
    ds, dt, dh, dadj = torch.ops.fxmem.masked_attention_dropout_backward(grad, s, t, h, adj, top, state, *ctx.options,
                                                                         need_adj, ctx.heads_last)
    return ds, dt, dh, (dadj if need_adj else None), None, None, None, None, None, None, None, None


masked_attention_dropout_op.register_autograd(_backward_dropout, setup_context=_setup_dropout)


def masked_attention(s: torch.Tensor, t: torch.Tensor, h: torch.Tensor, adj: torch.Tensor, *, compare: str = "gt",
                     threshold: float = 0.0, keep: bool = True, fill: float = -9e15, slope: float = 0.2,
                     block_bytes: int = DEFAULT_BLOCK_BYTES, dropout: float = 0.0,
                     heads_last: bool = False) -> torch.Tensor:
    """softmax_j(LeakyReLU(s_i + t_j) where kept, else fill) @ h, fused; [Gm, Gh, N, F] (see module doc).

    The mask: ``adj <compare> threshold`` (``compare="true"``: a bool ``adj`` itself) says which scores
    stay (``keep=True``) or which are replaced by ``fill`` (``keep=False``); ``compare="add"`` adds
    ``adj`` to the scores instead (an additive mask, whose gradient is computed where it needs one).
    ``dropout``: ``F.dropout(weights, dropout)`` (training) before the product, the same mask as
    dropout over the weights ``[Gm, Gh, N, M]`` laid out contiguously draws (see above), or with
    ``heads_last`` over weights laid out ``[Gm, N, M, Gh]`` - where :data:`DRAWS_IN_PIECES` holds;
    elsewhere a mask drawn as dropout draws, not its numbers.
    """
    if compare not in COMPARE:
        raise ValueError(f"compare={compare!r}: use one of {COMPARE}")
    if dropout:
        return torch.ops.fxmem.masked_attention_dropout(s, t, h, adj, compare, float(threshold), bool(keep),
                                                        float(fill), float(slope), int(block_bytes), float(dropout),
                                                        bool(heads_last))[0]
    return torch.ops.fxmem.masked_attention(s, t, h, adj, compare, float(threshold), bool(keep), float(fill),
                                            float(slope), int(block_bytes))[0]
