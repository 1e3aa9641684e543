"""Names for the buffers FSDP2 allocates around its collectives, from its own profiler labels.

FSDP2 wraps each step of its schedule in ``torch.profiler.record_function`` with the group's
module path (``"FSDP::all_gather (layers.0)"``); a storage allocated inside such a label is that
step's buffer, and is named after it for the report's rows: ``"all-gather layers.0"`` (the flat
buffer the collective writes), ``"unsharded parameters layers.0"`` (the per-parameter copies out
of it, freed at reshard), ``"reduce-scatter layers.0"`` (the gradient buffer and the sharded
gradient the collective writes).

>>> collective_name("FSDP::all_gather (layers.0)")
'all-gather layers.0'
>>> collective_name("FSDP::pre_forward (layers.0)") is None
True
"""
from __future__ import annotations

import re

_STEPS = {
    "all_gather": "all-gather",
    "all_gather_copy_out": "unsharded parameters",
    "post_backward_reduce": "reduce-scatter",
    "post_backward_accumulate": "gradient accumulation",
}
_LABEL = re.compile(r"^FSDP::(\w+)(?: \((.*)\))?$")


def collective_name(label: str) -> str | None:
    """The row name of buffers allocated under profiler label ``label`` (None: not a collective's)."""
    m = _LABEL.match(label)
    if m is None or m.group(1) not in _STEPS:
        return None
    return f"{_STEPS[m.group(1)]} {m.group(2) or '(root)'}"


def is_collective_buffer(name: str) -> bool:
    """Whether a storage's ``name`` is one :func:`collective_name` gave (the views show it as is)."""
    return any(name.startswith(step + " ") for step in _STEPS.values())
