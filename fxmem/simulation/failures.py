"""One translation of what went wrong in a simulated run into an error the user can act on.

Both runners (graph mode's fx nodes, eager mode's source lines) and the training step's phases
report failures through :func:`failure`: a missing fake kernel, a size that depends on tensor
values, a failure inside PyTorch, a library or fxmem (:func:`internal_cause`: never blamed on the
user's input), or a shape the model does not accept - each with where it happened and what to do.
The frame that raised decides the words (:func:`user_blame`): the user's own forward, optimizer
factory, loss or ``step=`` raising is a UserCodeError naming that party and its file:line.
Only a shape check (torch's own, or the model's ``assert``) blames the input specs; a fake kernel
that raises where the real one accepts the call is a limit of fake tensors
(:class:`~fxmem.kernels.FakeKernelFails`, decided by running the real kernel).

>>> raise failure(exc, "fx node 'matmul' from model.py:12", shapes="; operand shapes ...")   # doctest: +SKIP
"""
from __future__ import annotations

import dis
import os
import re
import traceback
import types
from typing import Callable, Mapping

import torch

from .. import _torch_compat as tc
from ..capture.source import is_user_file, short_path
from ..errors import (FxMemError, InternalError, KernelError, ModelError, ShapeError, UnsupportedOpError,
                      UserCodeError, recursion_limit_error)
from ..kernels import FakeKernelFails, KernelRefuses


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
    if isinstance(exc, RecursionError):  # a RuntimeError, but never a check of the shapes
        return recursion_limit_error()
    text = rename(str(exc))
    chain, seen = exc, set()
    while chain is not None and id(chain) not in seen:  # (DTensor's dispatch re-raises what it ran into)
        seen.add(id(chain))
        if isinstance(chain, NotModelled) and (chain is exc or str(chain) in str(exc)):  # (that one, re-raised)
            return UnsupportedOpError(f"{where}: {rename(str(chain))}")
        chain = chain.__cause__ or chain.__context__
    if isinstance(exc, KernelRefuses) and exc.crashed:
        return KernelError(f"{where}: {text}.\n  this is not a problem of the input specs: the kernel dies instead "
                           f"of raising an error, so the model would crash at these sizes too.\n  what to do: fix or "
                           f"guard the kernel of {exc.op} (it must raise on inputs it cannot take), or analyse a "
                           f"model without it")
    if isinstance(exc, KernelRefuses):
        return KernelError(f"{where}: the model cannot run on these inputs: {text}.\n  what to do: check the "
                           f"dtypes (and layouts) of the input specs and parameters reaching this op")
    if isinstance(exc, TypeError) and "unhashable type: non-nested SymInt" in text:
        # a cache keyed by sizes (a dict, a set) in the user's code: torch's SymInt cannot be hashed
        # (its TypeError is load-bearing for einops), and a process-wide dict would keep fxmem's sizes
        return UnsupportedOpError(
            f"{where}: the code uses a size as a key of a dict or set (a cache keyed by sizes: "
            f"{first_line(text)}); Python cannot hash the symbolic sizes fxmem analyses in, so the steady state "
            f"of such a cache (built on a first call, read afterwards) is not simulated. What to do: analyse with "
            f"concrete inputs (real tensors as specs) for numbers at one size, or keep the cache in "
            f"functools.lru_cache (fxmem simulates those, see fxmem.caches)")
    blamed = user_blame(exc, rename)
    if blamed is not None:  # the user's own code raised: the frame that raised decides the words
        return blamed
    if isinstance(exc, tc.UNSUPPORTED_OP_ERRORS) or "fake impl" in text or "'Meta' backend" in text \
            or "meta kernel" in text.lower() or "register_fake" in text:
        op = getattr(exc, "func", None) or op
        if op is None:  # torch names the op only in its message (a custom op's CustomOpDef(ns::name))
            named = re.search(r"\b(\w+::[\w.]+)", text)
            op = named.group(1).rstrip(".") if named else None
        return UnsupportedOpError(
            f"{where}: {'op ' + str(op) if op is not None else 'an op'} has no meta/fake kernel, so fxmem cannot run it on symbolic shapes "
            f"({type(exc).__name__}: {first_line(text) if text.strip() else ''}). "
            f"Register one with torch.library.register_fake (it only computes output shapes).")
    if "with symbolic sizes" in text:  # C++ inside torch read a size as a number: torch's limit, not the shapes'
        return UnsupportedOpError(
            f"{where}: PyTorch's own C++ code here reads sizes as plain numbers ({first_line(text)}), so it cannot "
            f"run with the symbolic sizes fxmem analyses in; your shapes are not the problem. What to do: analyse "
            f"with concrete inputs (real tensors as specs) for numbers at one size, or without this part of the "
            f"model")
    if tc.is_pipelining_refusal(exc):  # the schedule refuses its set-up or how the step calls it
        return ModelError(f"{where}: torch's pipeline schedule refuses it: {first_line(text)}\n  this is not a problem "
                          f"of the input shapes: the schedule's stages or the step do not fit together.\n  what to do: "
                          f"check what each rank's step= passes to schedule.step(...): the inputs where the rank holds "
                          f"the first stage, target= where it holds the last (a V-shaped schedule's rank 0 holds "
                          f"both), and that each stage's outputs are what the next stage takes")
    for pattern, (why, todo) in _AUTOGRAD_LIMITS:
        if re.search(pattern, text):  # autograd cannot differentiate the model: not its shapes
            return UnsupportedOpError(f"{where}: {first_line(text)}\n  this is not a problem of the input shapes: "
                                      f"{why}.\n  what to do: {todo}")
    for pattern, (why, todo) in _NOT_SHAPES:
        if re.search(pattern, first_line(text)):  # a kernel refuses the dtypes, devices or backends: not the shapes
            return KernelError(f"{where}: {first_line(text)}\n  this is not a problem of the input shapes: {why}.\n"
                               f"  what to do: {todo}")
    if isinstance(exc, tc.DATA_DEPENDENT_ERRORS):
        # sizes the data decides are dims (K1, ...); what is left is a Python decision on values
        return UnsupportedOpError(
            f"{where}: the code decides on tensor values here ({type(exc).__name__}: "
            f"{re.sub(r'[(]unhinted.*', '', _SYMBOL.sub('<value>', first_line(text))).strip()}), which fake "
            f"tensors do not have; fxmem gives formulas in sizes. If the input's values are known, state them "
            f"(TensorSpec(..., fill=...)); otherwise analyse each branch as a model of its own.")
    cause = internal_cause(exc)
    if cause is not None:
        error = exc.error if isinstance(exc, FakeKernelFails) else exc
        return InternalError(
            f"{where}{detail}: {type(error).__name__}: {first_line(rename(str(error)))}\n  this is not your input: "
            f"{cause[0]}.\n  what to do: {cause[1]}")
    return ShapeError(f"{where} fails on the given input shapes{detail}: {first_line(text)}\n"
                      f"  what to do: {advice}.")


# fxmem's functions that call a user's function (the first fxmem frame outside the user's code)
# -> the party that function is; any other fxmem frame (the runners, the routed model) calls the forward
_CALL_SITES = {"make_optimizer": "optimizer factory", "train_step": "loss", "user_step": "step= function",
               "_warm_user_step": "step= function"}
_MODULE_CALLS = ("_call_impl", "_wrapped_call_impl")  # torch's nn.Module.__call__
# how each party is called, for its "what to do"
_CALLED_AS = {
    "forward": "check that the input specs are what your forward expects there (it raised this itself), or fix "
               "the code at that line",
    "optimizer factory": "optimizer= is called once as optimizer(params), with the list of parameters to train, and "
                         "must return a torch.optim.Optimizer, e.g. optimizer=lambda p: torch.optim.Adam(p, lr=1e-3)",
    "loss": "loss= is called as loss(output) with the model's output and must return a scalar tensor, e.g. "
            "loss=lambda out: out.float().pow(2).mean()",
    "step= function": "step= is called as step(model, optimizer, *inputs) and runs one whole training step",
}
# the exception types torch's kernels raise for a shape they refuse, at the line that called them
_TORCH_CHECKS = (RuntimeError, ValueError, IndexError, AssertionError)
_SIGNATURE = re.compile(r"^([\w<>.]+)\(\) (takes|missing|got an unexpected|got multiple)")


def user_blame(exc: BaseException, rename: Callable[[str], str] = lambda text: text) -> UserCodeError | None:
    """A :class:`UserCodeError` when the user's own code raised ``exc`` - their forward, optimizer
    factory, loss or ``step=`` function, named after the fxmem frame that called it - else None
    (torch's shape checks, fakes' limits and fxmem's bugs are decided by :func:`failure`).

    The user's code raised when its innermost frame raised itself (a ``raise`` statement, or a
    plain Python error such as a KeyError on its own line), when an optimizer factory failed at
    all (it never sees the input sizes), or when fxmem's call of the user's function does not fit
    its signature. A model's ``assert`` stays a check of its input shapes."""
    frames = list(traceback.walk_tb(exc.__traceback__))
    if not frames:
        return None
    user = [i for i, (frame, _) in enumerate(frames) if is_user_file(frame.f_code.co_filename)]
    if not user:
        return _signature_blame(exc, frames[-1][0])
    inner = user[-1]
    party = _party(frames, inner)
    if party is None:  # the user's code was called by torch or fxmem as something else (a fake kernel, a hook)
        return None
    tb = exc.__traceback__
    while tb.tb_next is not None:  # the raising frame: its instruction says whether it raised itself
        tb = tb.tb_next
    own = inner == len(frames) - 1 and _is_raise(tb.tb_frame.f_code, tb.tb_lasti)
    raised_here = own or inner == len(frames) - 1 and not isinstance(exc, _TORCH_CHECKS)
    if isinstance(exc, AssertionError) and party == "forward":
        return None  # the model's own check of its input: failure() blames the specs, as torch's checks do
    if not (raised_here or party == "optimizer factory"):
        return None
    frame, line = frames[inner]
    where = f"{short_path(frame.f_code.co_filename)}:{line}"
    # a Python error of a line that ran torch (not a raise statement) may come from a value fakes lack
    values = ("" if own or party == "optimizer factory" else
              "; if the line runs outside fxmem, it may read a tensor's values, which fxmem's fake tensors do not "
              "have: state them with TensorSpec(..., fill=...)")
    return UserCodeError(f"your {party} raised {type(exc).__name__} at {where}: {first_line(rename(str(exc)))}\n"
                         f"  this is your code's own error, not fxmem's or PyTorch's.\n"
                         f"  what to do: {_CALLED_AS[party]}{values}", party)


def _party(frames: list, inner: int) -> str | None:
    """The party whose code ``frames[inner]`` is: named by the innermost fxmem frame outside it. A
    call site of :data:`_CALL_SITES` must call the user's code directly (a user's autograd Function
    reached through ``backward()`` in ``train_step`` is not the loss); a runner calls the forward
    (through ``nn.Module.__call__``, or a leaf function directly). None: neither."""
    for i in range(inner - 1, -1, -1):
        frame = frames[i][0]
        if frame.f_code.co_name in _MODULE_CALLS and _in_torch(frame.f_code.co_filename):
            return "forward"  # a module's forward, even one a user's step calls
        if not frame.f_code.co_filename.startswith(_FXMEM_DIR):
            continue
        if frame.f_code.co_name in _CALL_SITES:
            direct = is_user_file(frames[i + 1][0].f_code.co_filename)
            return _CALL_SITES[frame.f_code.co_name] if direct else None
        calls_model = _runner(frame.f_code.co_filename) or os.path.basename(frame.f_code.co_filename) in (
            "user_step.py", "training.py")  # (a user's step calls the model through the router)
        return "forward" if calls_model else None
    return None


def _is_raise(code: types.CodeType, lasti: int) -> bool:
    """Whether the instruction at ``lasti`` of ``code`` is a ``raise`` (not a call that raised)."""
    for ins in dis.get_instructions(code):
        if ins.offset == lasti:
            return ins.opname in ("RAISE_VARARGS", "RERAISE")
    return False


def _signature_blame(exc: BaseException, raising: types.FrameType) -> UserCodeError | None:
    """The UserCodeError for fxmem's call of a user's function that does not fit its signature (the
    TypeError is raised at fxmem's call site, so no user frame is in the traceback)."""
    party = _CALL_SITES.get(raising.f_code.co_name)
    named = _SIGNATURE.match(str(exc)) if isinstance(exc, TypeError) else None
    if party is None or named is None:
        return None
    fn = _CALLED_FUNCTION[raising.f_code.co_name](raising.f_locals)
    if getattr(fn, "__name__", None) != named.group(1).rsplit(".", 1)[-1]:
        return None  # a TypeError of another call on that line
    code = getattr(fn, "__code__", None)
    at = f" ({short_path(code.co_filename)}:{code.co_firstlineno})" if code is not None else ""
    return UserCodeError(f"your {party} {getattr(fn, '__qualname__', named.group(1))}{at} does not take the arguments "
                         f"fxmem calls it with: TypeError: {first_line(str(exc))}\n  what to do: {_CALLED_AS[party]}",
                         party)


# the user's function each call site calls, read off the call site's locals
_CALLED_FUNCTION = {
    "make_optimizer": lambda f: getattr(f.get("self"), "optimizer", None),
    "train_step": lambda f: f.get("loss"),
    "user_step": lambda f: f.get("step"),
    "_warm_user_step": lambda f: getattr(f.get("training"), "step", None),
}


# autograd's refusals of a model's ops, whatever the shapes: (pattern of torch's message, (why, what to do))
_AUTOGRAD_LIMITS = (
    (r"no autograd formula was registered",
     ("a custom op in the model has no backward, so a real training step fails too",
      "register one with torch.library.register_autograd (or analyse the forward only, without optimizer=)")),
    (r"derivative for .* is not implemented",
     ("PyTorch has no derivative for an op the model uses, so a real training step fails too",
      "analyse the forward only (without optimizer=), or replace the op")),
)
# kernels' refusals that are about dtypes, devices or the enabled backends, whatever the shapes:
# (pattern of the message's first line, (why, what to do)); a real run fails the same way
_NOT_SHAPES = (
    (r"[Ee]xpected inputs of \w+ type|expected scalar type|must have the same dtype|not implemented for '\w+'|"
     r"[Ee]xpected .*dtype|dtype.* (is )?not supported|[Uu]nsupported dtype",
     ("the op does not take these dtypes (a real run refuses them too)",
      "give the inputs and parameters a dtype this op takes (TensorSpec(..., dtype=...), the model's .to(dtype), "
      "or analyze(dtype=...))")),
    (r"[Ee]xpected all tensors to be on the same device",
     ("the op got tensors on two devices: the model makes a tensor on another device than its inputs",
      "create that tensor on the inputs' device (device=x.device), or analyse on the device the model runs on")),
    (r"does not have a sharding strategy",
     ("PyTorch's DTensor has no sharding rule for this op on these placements: a real run of the same sharded "
      "code fails the same way (torch's context_parallel, for one, shards CUDA's fused attention only)",
      "keep that op's inputs replicated, register a rule (torch.distributed.tensor.experimental."
      "register_sharding), or analyse without that parallelism")),
    (r"No available kernel",
     ("no scaled_dot_product_attention kernel takes these inputs with the backends allowed here (sdpa_kernel or "
      "torch.backends.cuda flags); without a visible GPU, only the math path exists on fake CUDA tensors",
      "allow the math backend, or analyse where a GPU is visible")),
)
_FXMEM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# texts of PyTorch's C++ kernels that cannot work on symbolic sizes (a limit of fake tensors)
_SYMBOLIC_LIMITS = ("symbolic sizes", "symbolic shapes", "SymInt", "SymIntArrayRef", "FakeTensor", "fake tensor",
                    "Cannot access data pointer", "meta tensor", "Meta device", "'meta'")
_REPORT = "please report it to fxmem with this message"
_OP_ADVICE = (f"nothing in the input specs; try other example sizes (hints=), or describe the op to fxmem "
              f"(fxmem.kernels.register); {_REPORT}")


def internal_cause(exc: BaseException) -> tuple[str, str] | None:
    """``(why, what to do)`` when ``exc`` is a failure inside PyTorch, a library or fxmem rather
    than a problem of the user's input; None when it is torch's or the model's own check of the
    shapes it was given.

    Shape checks raise RuntimeError / ValueError / IndexError (torch's kernels and ``torch._check``)
    or AssertionError (the model's own ``assert``). Anything else - an internal assert, a
    NotImplementedError of a meta kernel, an AttributeError in a library wrapper (FSDP's
    ``'FSDPParam' object has no attribute 'param_dtype'``), an error raised in fxmem's own code - is
    not about the shapes."""
    if isinstance(exc, FakeKernelFails):
        return (f"PyTorch's fake (meta) kernel of {exc.op} rejects a call that its real kernel accepts at the same "
                f"shapes (run for real at {exc.sizes}): a limit of fake tensors", _OP_ADVICE)
    text = str(exc)
    if "INTERNAL ASSERT" in text:
        return "an internal assertion of PyTorch failed on fake tensors (a PyTorch bug)", _OP_ADVICE
    if isinstance(exc, NotImplementedError):
        return ("PyTorch (or a library) does not implement this case for fake (meta) tensors",
                f"nothing in the input specs; register a fake kernel for the op (torch.library.register_fake), or "
                f"try mode='eager' / other example sizes (hints=); {_REPORT}")
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    last = frames[-1] if frames else None
    if last is not None and last.filename.startswith(_FXMEM_DIR) and not _runner(last.filename):
        return (f"fxmem itself failed at {short_path(last.filename)}:{last.lineno} (a bug of fxmem)",
                f"try mode='eager' (or mode='graph'); {_REPORT}")
    if any(_in_dtensor(f.filename) for f in frames) and re.search(r"symbolic|unbacked|SymInt", text):
        # sequence parallelism: a dim sharded over the ranks that a view then flattens with a
        # symbolic one (B*L) is a _StridedShard whose split factor DTensor wants as a number
        return ("PyTorch's DTensor cannot propagate this sharding with symbolic sizes (its sharding rules need "
                "some sizes as numbers: sequence parallelism's shards of a dim a view flattens with another)",
                "give every size as a number (input specs such as (8, 512, 4096), or real tensors) for the memory "
                "at that size, or analyse without sequence parallelism (SequenceParallel and the layouts around "
                "it)")
    if any(t in text for t in _SYMBOLIC_LIMITS) and not isinstance(exc, AssertionError):
        return "PyTorch's kernel cannot run this call on fake tensors with symbolic sizes", _OP_ADVICE
    if isinstance(exc, (RuntimeError, ValueError, IndexError)):
        return None
    user = last is not None and is_user_file(last.filename)
    if isinstance(exc, AssertionError) and (user or last is None):
        return None  # the model's own check of its input
    if last is not None and not user:
        return (f"{'PyTorch' if _in_torch(last.filename) else 'library code'} fails on fxmem's fake tensors at "
                f"{short_path(last.filename)}:{last.lineno} ({type(exc).__name__} is not a shape check)",
                "analyse the model without that wrapper or library layer (e.g. the module before fully_shard / "
                f"DDP), or with mode='eager'; {_REPORT}")
    return (f"the model's code fails on fxmem's fake tensors ({type(exc).__name__} is not a shape check: the code "
            f"may need real values, a data pointer or a real device)",
            "state values the code reads with TensorSpec(..., fill=...), or analyse the parts around this line as "
            "models of their own")


def _in_torch(filename: str) -> bool:
    return filename.startswith(os.path.dirname(torch.__file__))


def _in_dtensor(filename: str) -> bool:
    return filename.startswith(os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor", ""))


def _runner(filename: str) -> bool:
    """fxmem's frames that only call the model, or a torch function in its place (their errors are the
    model's or torch's: conv_backend.py calls ATen's convolution checks, which raise for the shapes)."""
    return os.path.basename(filename) in ("graph_runner.py", "line_runner.py", "simulate.py", "real_paths.py",
                                          "conv_backend.py")


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
