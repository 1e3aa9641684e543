"""The predicted run in PyTorch's memory-snapshot format, for the viewer everyone already uses.

``torch.cuda.memory._snapshot()`` returns a dict that pytorch.org/memory_viz and
``torch.cuda._memory_viz`` (``trace_plot``, ``segment_plot``, ``memory``, ``segments``, ``segsum``,
``trace``) read: ``segments`` (the allocator's memory at the end, each with its ``blocks``) and
``device_traces`` (one list of events per device: ``alloc``, ``free_requested``,
``free_completed``, each with ``addr``, ``size`` in bytes and the ``frames`` of the Python stack
that made it). :func:`snapshot` writes fxmem's prediction in that shape: every storage the
analysis counts (parameters, buffers and inputs first, then each allocation and free of the
forward - and of the training step with ``train=True`` - in order, kernels' hidden scratch
included), with the user's source line and the fx node in its frames. Sizes are the report's:
bytes on the CPU, 512-byte blocks on ``device="cuda"``. Replaying the events gives exactly the
report's peak.

Reports call it: ``report.snapshot(dims, path=None, train=False)``. ``trace_plot``'s page fetches
its viewer from the web (blank offline); ``report.memory_viz(dims)`` draws the same timeline in a
self-contained page (:mod:`fxmem.views.memory_viz`).

>>> snap = report.snapshot({"B": 4, "N": 500}, path="gat.pickle")     # doctest: +SKIP
>>> from torch.cuda import _memory_viz
>>> html = _memory_viz.trace_plot(snap)                               # doctest: +SKIP
"""
from __future__ import annotations

import pickle
from typing import Any, Mapping

from ..errors import FxMemError

__all__ = ["snapshot"]

_ALIGN = 512  # addresses are laid out in 512-byte steps, as the CUDA caching allocator aligns blocks


def snapshot(events: list, forward: int, sizes: list, storages: list, steps: list, nodes: list, *,
             train: bool, meta: Mapping[str, Any], path: str | None = None) -> dict:
    """A PyTorch memory snapshot (a dict) of one predicted run, written as the pickle memory_viz
    opens when ``path`` is given.

    ``events`` and ``forward`` are :meth:`fxmem.accounting.MemoryPlan.trace`'s (the run's
    allocations and frees, and how many the forward made); ``sizes`` the bytes of each storage
    (512-byte blocks on CUDA); ``storages``/``steps`` the recording's, ``nodes`` the report's (for
    the source lines); ``train``: the training step, else the forward alone.
    """
    events = events if train else events[:forward]
    nodes = {n.name: n for n in nodes}
    resident = [s for s in storages if s.step is None and (train or s.role.value != "optimizer_state")]
    rec_steps, rec_storages = steps, storages

    trace: list[dict] = []
    addresses: dict[Any, tuple[int, int, list]] = {}  # what -> (address, bytes, frames)
    top = [0]
    clock = [0]

    def frames_of(storage_index: int | None, step: int | None) -> list[dict]:
        node_name = rec_steps[step].node if step is not None else (
            rec_storages[storage_index].node if storage_index is not None else None)
        op = rec_steps[step].op if step is not None else None
        node = nodes.get(node_name) if node_name else None
        out = []
        if node is not None and node.source is not None:
            out.append({"filename": node.source.file, "line": int(node.source.line),
                        "name": f"{node.source.function} (fx node {node.name}{', ' + op if op else ''})"})
        elif node_name:
            out.append({"filename": "<fxmem>", "line": 0, "name": f"fx node {node_name}{', ' + op if op else ''}"})
        if storage_index is not None and step is None:
            s = rec_storages[storage_index]
            out.append({"filename": "<fxmem>", "line": 0, "name": f"{s.role.value} {s.name}"})
        return out

    def alloc(what: Any, nbytes: int, frames: list) -> None:
        addr = top[0]
        top[0] += max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        addresses[what] = (addr, nbytes, frames)
        clock[0] += 1
        trace.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": 0, "time_us": clock[0],
                      "frames": frames})

    def free(what: Any) -> None:
        if what not in addresses:
            raise FxMemError(f"snapshot: the event log frees {what!r}, which it never allocated (an fxmem bug)")
        addr, nbytes, frames = addresses.pop(what)
        for action in ("free_requested", "free_completed"):
            clock[0] += 1
            trace.append({"action": action, "addr": addr, "size": nbytes, "stream": 0, "time_us": clock[0],
                          "frames": frames})

    for s in resident:
        alloc(s.index, sizes[s.index], frames_of(s.index, None))
    for action, what, nbytes, step in events:
        if action == "alloc":
            index = what if isinstance(what, int) else None
            frames = frames_of(index, step)
            if index is None:
                frames = frames + [{"filename": "<fxmem>", "line": 0, "name": "a kernel's hidden scratch"}]
            alloc(what, nbytes, frames)
        elif action == "free":
            free(what)

    segments = [{"device": 0, "address": addr, "total_size": max(_ALIGN, -(-n // _ALIGN) * _ALIGN), "stream": 0,
                 "segment_type": "large" if n > 1 << 20 else "small", "allocated_size": n, "active_size": n,
                 "requested_size": n,
                 "blocks": [{"address": addr, "size": max(_ALIGN, -(-n // _ALIGN) * _ALIGN), "requested_size": n,
                             "state": "active_allocated", "frames": frames}]}
                for addr, n, frames in sorted(addresses.values())]
    snap = {"segments": segments, "device_traces": [trace], "fxmem": {**dict(meta), "train": train}}
    if path is not None:
        try:
            with open(path, "wb") as f:
                pickle.dump(snap, f)
        except OSError as exc:
            raise FxMemError(f"snapshot(path={path!r}): cannot write the file: {exc.strerror or exc}") from exc
    return snap

