"""Eager mode: run the model's own ``forward`` and attribute memory to the source lines that ran.

No tracing: the original Python code runs (on fake tensors), so its local variables stay alive
until the function returns - seed 002's ``qkv`` is held through the whole call - and models that
``torch.fx`` cannot trace (Python control flow on sizes, say) work too. A line tracer follows the
user's own frames (torch's are skipped, their work counts to the user line that called them); each
executed line becomes a record, so a line run twice in a loop gets two. The memory freed when a
function returns (its locals) is recorded as that function's ``(return)``.

>>> runner = LineRunner(recorder)                     # doctest: +SKIP
>>> out = runner.run(fake_model, inputs)              # doctest: +SKIP
>>> [r.name for r in runner.records][:3]              # doctest: +SKIP
['attention.py:21', 'attention.py:22', 'attention.py:24']
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..capture import SourceLine, is_user_file, raised_at, statement_of, statement_text
from ..errors import FxMemError
from ..records import Node
from .failures import failure
from .recorder import Recorder


@dataclasses.dataclass
class _Open:
    """A user frame being executed and the line currently running in it."""

    frame: Any
    label: str | None = None
    source: SourceLine | None = None
    first_step: int = 0
    module: str = ""  # the module running when the line started (eager mode's module paths)


class LineRunner:
    """Runs a module call with a line tracer; one :class:`~fxmem.records.Node` per executed line."""

    def __init__(self, recorder: Recorder, model_files: frozenset = frozenset(), name_backward: bool = False):
        self.recorder, self.log = recorder, recorder.log
        self.model_files = model_files
        self.name_backward = name_backward
        self._stack: list[_Open] = []
        self._seen: dict[str, int] = {}
        self._user: dict[str, bool] = {}
        self.module_now: Any = lambda: ""  # which module is running (set by the simulation)

    # --- the tracer ------------------------------------------------------------------------------
    def _is_user(self, filename: str) -> bool:
        hit = self._user.get(filename)
        if hit is None:
            hit = self._user[filename] = is_user_file(filename, self.model_files)
        return hit

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "call" or not self._is_user(frame.f_code.co_filename):
            return None
        self._stack.append(_Open(frame))
        return self._local

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        top = self._stack[-1] if self._stack else None
        if top is None or top.frame is not frame:
            return self._local
        if event == "line":
            if top.source and statement_of(top.source.file, frame.f_lineno)[0] == top.source.line:
                return self._local  # another physical line of the statement already running
            self._end(top)
            self._start(top, frame)
        elif event == "return":
            self._end(top)
            self._stack.pop()
            caller = self._stack[-1] if self._stack else None
            self.log.enter(caller.label if caller and caller.label else "<call>")
        return self._local

    def _start(self, top: _Open, frame: Any) -> None:
        code = frame.f_code
        line = statement_of(code.co_filename, frame.f_lineno)[0]
        base = f"{os.path.basename(code.co_filename)}:{line}"
        n = self._seen.get(base, 0)
        self._seen[base] = n + 1
        top.label = base if n == 0 else f"{base}#{n + 1}"
        text = statement_text(code.co_filename, line)
        top.source = SourceLine(code.co_filename, line, code.co_name, text)
        top.first_step = self.log.next_step
        top.module = self.module_now()
        self.log.enter(top.label)

    def _end(self, top: _Open) -> None:
        if top.label is None:
            return
        self.recorder.end_node()
        self._close(top.label, top.source, top.first_step, top.module)
        top.label = None

    def _close(self, name: str, source: SourceLine | None, first: int, module: str = "") -> None:
        target = source.code if source else name
        self.log.ended(Node(name, "line", target, module, source, [], [], [], first, self.log.next_step))

    # --- running ---------------------------------------------------------------------------------
    def run(self, module: torch.nn.Module, inputs: list) -> Any:
        """Call ``module(*inputs)`` under the tracer; frees at the call's return form a last record."""
        previous = sys.gettrace()
        self.log.enter("<call>")
        named = _BackwardNames(self.recorder, self.log) if self.name_backward else contextlib.nullcontext()
        sys.settrace(self._global)
        try:
            with named:
                out = module(*inputs)
        except FxMemError:
            raise
        except Exception as exc:
            raise _line_error(exc, self.recorder.rename, self.model_files) from exc
        finally:
            sys.settrace(previous)
            self._stack.clear()
        # the forward's locals die as it returns: record what that frees
        first = self.log.next_step
        self.log.enter("(return)")
        self.recorder.end_node()
        self._close("(return)", None, first)
        return out


class _BackwardNames(TorchFunctionMode):
    """Each torch call's autograd node is named after the line running it: its backward steps are
    then ``line (backward)`` (as graph mode names them after fx nodes), so a training step's
    backward is attributed to the lines, and to the blocks of a repeated chain (:mod:`.unroll`).
    Nodes a call makes inside (a composite's) run under the name of the one before them."""

    def __init__(self, recorder: Recorder, log: Any):
        super().__init__()
        self.autograd, self.log = recorder.autograd, log

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            # what was kept until a node's backward is released as eager mode always has (bound to
            # the op's grad_fn, see Autograd.keep): naming changes no number
            self.autograd.name_backward(self.log.node, out, release=False)
        return out


def _line_error(exc: BaseException, rename: Any, files: frozenset = frozenset()) -> FxMemError:
    where = raised_at(exc, files) or "(inside torch, called from the model's forward)"
    return failure(exc, where, advice="check the input specs against what this line expects", rename=rename)
