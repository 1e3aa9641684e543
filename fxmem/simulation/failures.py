"""One translation of what went wrong in a simulated run into an error the user can act on.

Both runners (graph mode's fx nodes, eager mode's source lines) and the training step's phases
report failures through :func:`failure`: a missing fake kernel, a size that depends on tensor
values, or a shape the model does not accept - each with where it happened and what to do.

>>> raise failure(exc, "fx node 'matmul' from model.py:12", shapes="; operand shapes ...")   # doctest: +SKIP
"""
from __future__ import annotations

import re
from typing import Callable, Mapping

from .. import _torch_compat as tc
from ..errors import FxMemError, KernelError, ShapeError, UnsupportedOpError
from ..kernels import KernelRefuses


class NotModelled(RuntimeError):
    """Something the simulation saw that fxmem does not model (raised inside a run, so that the
    runner names the fx node or source line; :func:`failure` makes it an UnsupportedOpError)."""

_SYMBOL = re.compile(r"\b(?:zuf|zf|[su])\d+\b")  # backed (s41), unbacked (u3) and float (zuf0) symbols


def renamer(names: Mapping[str, str]) -> Callable[[str], str]:
    """A function that writes torch's size symbols (``s41``) in a text as the user's dims (``B``)."""
    if not names:
        return lambda text: text
    return lambda text: _SYMBOL.sub(lambda m: names.get(m.group(0), m.group(0)), text)


def first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else "(no message)"


def failure(exc: BaseException, where: str, *, op: object = None, detail: str = "",
            advice: str = "check the rank and sizes of the input specs against what the model expects",
            rename: Callable[[str], str] = lambda text: text) -> FxMemError:
    """The FxMemError for ``exc`` raised at ``where`` (``op``: the function that ran); ``rename``
    writes torch's size symbols as the user's dims."""
    if isinstance(exc, FxMemError):
        return exc
    text = rename(str(exc))
    if isinstance(exc, NotModelled):
        return UnsupportedOpError(f"{where}: {text}")
    if isinstance(exc, KernelRefuses):
        return KernelError(f"{where}: the model cannot run on these inputs: {text}.\n  what to do: check the "
                           f"dtypes (and layouts) of the input specs and parameters reaching this op")
    if isinstance(exc, tc.UNSUPPORTED_OP_ERRORS) or "fake impl" in text or "'Meta' backend" in text \
            or "meta kernel" in text.lower() or "register_fake" in text:
        op = getattr(exc, "func", None) or op
        return UnsupportedOpError(
            f"{where}: op {op} has no meta/fake kernel, so fxmem cannot run it on symbolic shapes "
            f"({type(exc).__name__}: {first_line(text) if text.strip() else ''}). "
            f"Register one with torch.library.register_fake (it only computes output shapes).")
    if "with symbolic sizes" in text:  # C++ inside torch read a size as a number: torch's limit, not the shapes'
        return UnsupportedOpError(
            f"{where}: PyTorch's own C++ code here reads sizes as plain numbers ({first_line(text)}), so it cannot "
            f"run with the symbolic sizes fxmem analyses in; your shapes are not the problem. Known cases: "
            f"nn.LSTM, nn.GRU and nn.RNN (their CPU kernels), not modelled yet. What to do: analyse the model "
            f"without the recurrent layer, or with concrete inputs (real tensors as specs) for numbers at one size "
            f"(exact for nn.GRU and nn.RNN; nn.LSTM's oneDNN workspace is not modelled and is marked so)")
    if isinstance(exc, tc.DATA_DEPENDENT_ERRORS):
        # sizes the data decides are dims (K1, ...); what is left is a Python decision on values
        return UnsupportedOpError(
            f"{where}: the code decides on tensor values here ({type(exc).__name__}: "
            f"{re.sub(r'[(]unhinted.*', '', _SYMBOL.sub('<value>', first_line(text))).strip()}), which fake "
            f"tensors do not have; fxmem gives formulas in sizes. If the input's values are known, state them "
            f"(TensorSpec(..., fill=...)); otherwise analyse each branch as a model of its own.")
    return ShapeError(f"{where} fails on the given input shapes{detail}: {first_line(text)}\n"
                      f"  what to do: {advice}.")


SPARSE_GRADS = ("sparse gradients (nn.Embedding(sparse=True), nn.EmbeddingBag(sparse=True), torch.optim.SparseAdam) "
                "are not modelled: a sparse gradient has index and value storages whose sizes the data decides; "
                "analyse with sparse=False and a dense optimizer (Adam) for the dense figures")


def optimizer_failure(optimizer: object, exc: BaseException) -> FxMemError | None:
    """The error for an optimizer whose ``step()`` cannot run on fake tensors, in the user's words
    (None: not an optimizer's own limitation)."""
    name = type(optimizer).__name__
    if isinstance(exc, tc.DATA_DEPENDENT_ERRORS):
        return UnsupportedOpError(
            f"torch.optim.{name}: its step() decides on the values of its own tensors (a step count, learning "
            f"rate or norm it keeps as a tensor and reads into Python), which fake tensors do not have, so fxmem "
            f"cannot simulate this optimizer. What to do: analyse with an optimizer of the same state size "
            f"(e.g. Adam keeps two tensors per parameter, SGD with momentum one) or measure with "
            f"fxmem.validate(..., optimizer=...) on a real device")
    if "sparse" in str(exc).lower():
        return UnsupportedOpError(
            f"torch.optim.{name} with sparse gradients: {SPARSE_GRADS}")
    return None
