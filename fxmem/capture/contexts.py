"""Global modes that ``torch.fx`` symbolic tracing runs through but does not record.

``with torch.autocast(...)``, ``with torch.no_grad()``, ``torch.inference_mode()``,
``sdpa_kernel(...)``, ``torch.use_deterministic_algorithms`` and saved-tensor hooks
(``torch.utils.checkpoint``, ``save_on_cpu``) inside ``forward`` are executed while fx traces, and
leave no trace in the graph: the graph's matmul then runs in float32 instead of bfloat16, or saves
tensors for backward that the real forward never saves (a checkpointed block at B=48: the graph
would keep 49,344 B for backward, the model keeps 5,248 B). Analysing such a
graph would give the numbers of a different program, silently. So the tracer watches these modes
and stops at the first operation traced under a mode other than the one tracing began in, naming
the line; the caller then captures another way (or the user analyses with ``mode="eager"``).

>>> watch = ModeWatch()
>>> with torch.no_grad():
...     watch.changed()
['grad mode (torch.no_grad / enable_grad / set_grad_enabled)']
>>> watch.changed()
[]
"""
from __future__ import annotations

import traceback
from typing import Callable

import torch

from .. import _torch_compat as tc
from ..errors import TraceError
from .source import is_user_file


def _autocast(device: str) -> Callable[[], object]:
    def state() -> object:
        try:
            return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        except (TypeError, RuntimeError, AttributeError):  # a device type this build does not know
            return None
    return state


def _sdpa_backends() -> object:
    cuda = torch.backends.cuda
    flags = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled")
    return tuple(getattr(cuda, f)() for f in flags if hasattr(cuda, f))


# what each mode is called in a message -> how to read it (public torch API only)
MODES: tuple[tuple[str, Callable[[], object]], ...] = (
    ("grad mode (torch.no_grad / enable_grad / set_grad_enabled)", torch.is_grad_enabled),
    ("inference mode (torch.inference_mode)", torch.is_inference_mode_enabled),
    ("autocast on cpu (torch.autocast)", _autocast("cpu")),
    ("autocast on cuda (torch.autocast)", _autocast("cuda")),
    ("the attention backends (torch.nn.attention.sdpa_kernel)", _sdpa_backends),
    ("deterministic algorithms (torch.use_deterministic_algorithms)", torch.are_deterministic_algorithms_enabled),
    ("the saved-tensor hooks (torch.utils.checkpoint, save_on_cpu, saved_tensors_hooks)",
     tc.saved_tensor_hooks_in_effect),
)


class ModeWatch:
    """The modes as they were when tracing began; :meth:`changed` lists those that differ now."""

    def __init__(self) -> None:
        self._start = [read() for _, read in MODES]

    def changed(self) -> list[str]:
        return [name for (name, read), was in zip(MODES, self._start) if read() != was]

    def check(self, model_name: str) -> None:
        """Raise :class:`TraceError` naming the user's line when an operation is being traced under
        a mode the graph would not record."""
        changed = self.changed()
        if not changed:
            return
        frames = [f for f in traceback.extract_stack()[:-1] if is_user_file(f.filename)]
        where = f"{frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()}" if frames else "forward"
        raise TraceError(
            f"cannot trace {model_name} faithfully at {where}\n  forward changes {' and '.join(changed)} "
            f"around this operation; fx tracing runs the change but its graph does not record it, so the graph "
            f"would compute (and use memory) differently from the model\n  what to do: analyse with "
            f"mode='eager' (the model's own forward, modes included)")
