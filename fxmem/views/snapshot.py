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
report's peak. On ``device="cuda"`` the blocks are where PyTorch's caching allocator puts them
(:mod:`fxmem.accounting.caching_allocator`): ``segment_alloc`` events, and ``segments`` with the
blocks it keeps cached, as a real ``_snapshot()`` has them.

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
             train: bool, meta: Mapping[str, Any], path: str | None = None, allocator: Any = None,
             first: list | None = None) -> dict:
    """A PyTorch memory snapshot (a dict) of one predicted run, written as the pickle memory_viz
    opens when ``path`` is given.

    ``events`` and ``forward`` are :meth:`fxmem.accounting.MemoryPlan.trace`'s (the run's
    allocations and frees, and how many the forward made); ``sizes`` the bytes of each storage
    (512-byte blocks on CUDA); ``storages``/``steps`` the recording's, ``nodes`` the report's (for
    the source lines); ``train``: the training step, else the forward alone. ``allocator`` (CUDA):
    a :class:`~fxmem.accounting.caching_allocator.CachingAllocator` that places every block - its
    addresses, ``segment_alloc`` events and the ``segments`` at the end (blocks ``active_allocated``
    or ``inactive``: cached) are then the caching allocator's; without it each allocation is its own
    segment, laid out one after another. ``first``: the storage indices of the tensors that exist
    before the run, in the order they reached the device (default: the recording's).
    """
    events = events if train else events[:forward]
    nodes = {n.name: n for n in nodes}
    resident = [s for s in storages if s.step is None and (train or s.role.value != "optimizer_state")]
    if first is not None:
        place = {i: k for k, i in enumerate(first)}
        resident.sort(key=lambda s: place.get(s.index, len(place)))
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

    blocks: dict[Any, Any] = {}  # what -> the allocator's block (with ``allocator``)

    def alloc(what: Any, nbytes: int, frames: list) -> None:
        if allocator is not None:
            if nbytes <= 0:  # CUDA hands out no block for 0 bytes
                return
            made = len(allocator.segments)
            block = blocks[what] = allocator.malloc(nbytes)
            for seg_addr, seg_size, _ in allocator.segments[made:]:
                clock[0] += 1
                trace.append({"action": "segment_alloc", "addr": seg_addr, "size": seg_size, "stream": 0,
                              "time_us": clock[0], "frames": frames})
            addr = block.address
        else:
            addr = top[0]
            top[0] += max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        addresses[what] = (addr, nbytes, frames)
        clock[0] += 1
        trace.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": 0, "time_us": clock[0],
                      "frames": frames})

    def free(what: Any) -> None:
        if allocator is not None and what not in addresses and what in zero:
            return
        if what not in addresses:
            raise FxMemError(f"snapshot: the event log frees {what!r}, which it never allocated (an fxmem bug)")
        addr, nbytes, frames = addresses.pop(what)
        if allocator is not None:
            allocator.free(blocks.pop(what))
        for action in ("free_requested", "free_completed"):
            clock[0] += 1
            trace.append({"action": action, "addr": addr, "size": nbytes, "stream": 0, "time_us": clock[0],
                          "frames": frames})

    zero = {what for action, what, nbytes, _ in events if action == "alloc" and nbytes <= 0}
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

    if allocator is not None:
        segments = _allocator_segments(allocator, {blocks[w].address: f for w, (_, _, f) in addresses.items()})
    else:
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



def _allocator_segments(allocator: Any, frames: dict) -> list[dict]:
    """The caching allocator's segments at the end, in ``_snapshot()``'s form: every block of each,
    allocated (with the frames that made it) or cached (``inactive``)."""
    out = []
    by_segment: dict[int, list] = {}
    for b in allocator.blocks():
        by_segment.setdefault(b.segment, []).append(b)
    for k, (addr, size, small) in enumerate(allocator.segments):
        blocks = by_segment.get(k, [])
        used = [b for b in blocks if b.allocated]
        out.append({"device": 0, "address": addr, "total_size": size, "stream": 0,
                    "segment_type": "small" if small else "large",
                    "allocated_size": sum(b.size for b in used), "active_size": sum(b.size for b in used),
                    "requested_size": sum(b.requested for b in used),
                    "blocks": [{"address": b.address, "size": b.size,
                                "requested_size": b.requested if b.allocated else 0,
                                "state": "active_allocated" if b.allocated else "inactive",
                                "frames": frames.get(b.address, []) if b.allocated else []} for b in blocks]})
    return out
