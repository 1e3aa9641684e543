"""PyTorch's CUDA caching allocator, replayed on a predicted run: the memory it *reserves* (bytes).

An out-of-memory error comes from the caching allocator, and it fails on reserved memory - the
segments it took from the driver with ``cudaMalloc`` - not on the tensors' bytes. This module runs
the allocator's algorithm (``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp) on the
allocations and frees fxmem predicts, one stream, nothing else on the device:

* a request is rounded up to 512 B (``round_size``; with ``roundup_power2_divisions:N`` to the next
  of N steps between two powers of two);
* up to 1 MiB it is served from the small pool, above from the large pool; the pool's smallest
  cached block that fits is taken (ties: the lowest address), except that a request under
  ``max_split_size_mb`` never takes a block of that size or more, and a request of that size or more
  takes no block ``max_non_split_rounding_mb`` (default 20 MiB) larger than itself;
* with no block, a new segment: 2 MiB for the small pool, 20 MiB for requests under 10 MiB,
  else the request rounded up to 2 MiB (``get_allocation_size``);
* the block is split when what remains would be 512 B or more (small pool) or more than 1 MiB
  (large pool, and the request under ``max_split_size_mb``) - else the request gets the whole block
  and ``memory_allocated`` counts all of it (``should_split``);
* a freed block merges with free neighbours of its segment and goes back to its pool. Segments are
  kept (no ``empty_cache``): reserved memory only grows.

New segments get increasing addresses (``cudaMalloc``'s order; only which of two equal free blocks
is taken depends on it). Not modelled, so refused by :class:`AllocatorConfig`'s reader:
``expandable_segments:True`` and a ``roundup_power2_divisions`` list; the allocator's behaviour near
the device's capacity (freeing cached segments to retry a failed ``cudaMalloc``, the
``garbage_collection_threshold`` with a memory fraction) is not modelled either: the replay is of a
device with room, which is what the answer to "does it fit" needs up to the last segment.

The H100 probe in ``benchmarks/results/cuda_kernels.json`` (allocated and reserved bytes after each
step of a fixed sequence) is replayed byte for byte by ``tests/accounting/test_caching_allocator.py``.

>>> a = CachingAllocator()
>>> x = a.malloc(int(13.5 * 2**20)); y = a.malloc(int(12.5 * 2**20))
>>> a.allocated, a.reserved      # 13.5 MiB keeps its whole 14 MiB segment; 12.5 MiB is split off one
(27787264, 29360128)
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable

from .cuda_blocks import LARGE_BUFFER, SMALL, AllocatorConfig

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of it
SMALL_BUFFER = 2 << 20  # kSmallBuffer: the small pool's segments
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are rounded up to it
_POWER2_FIRST = 20  # roundup_power2_divisions' intervals start at 1 MiB (2**20) ...
_POWER2_INTERVALS = 16  # ... and there are 16 of them (up to 64 GiB)

__all__ = ["CachingAllocator", "Block", "replay"]


@dataclasses.dataclass(eq=False)
class Block:
    """One block of a segment: ``size`` bytes at ``address``; ``requested`` bytes of it in use."""

    address: int
    size: int
    segment: int
    small: bool
    allocated: bool = False
    requested: int = 0
    prev: "Block | None" = None
    next: "Block | None" = None


class CachingAllocator:
    """The caching allocator of one device and one stream; numbers in bytes, as ``memory_stats``
    names them: ``allocated`` (blocks handed out, whole), ``requested`` (what was asked for),
    ``reserved`` (segments), each with its ``max_`` since the start."""

    def __init__(self, config: AllocatorConfig | None = None):
        self.config = config or AllocatorConfig()
        self.config.check_replayable()
        self._free: dict[bool, list] = {True: [], False: []}  # small? -> sorted [(size, address, block)]
        self.segments: list[tuple[int, int, bool]] = []  # (address, bytes, small pool?)
        self._next_address = 0
        self.allocated = self.requested = self.reserved = 0
        self.max_allocated = self.max_requested = self.max_reserved = 0
        self._blocks: set[Block] = set()  # every block of every segment, free or not

    # --- the allocator's rules ------------------------------------------------------------------
    def round_size(self, size: int) -> int:
        """``round_size``: what a request of ``size`` bytes is rounded up to."""
        if size < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self._divisions(size)
        if divisions > 1 and size > MIN_BLOCK * divisions:
            return _next_division(size, divisions)
        return -(-size // MIN_BLOCK) * MIN_BLOCK

    def _divisions(self, size: int) -> int:
        if not self.config.power2_divisions:
            return 0
        index = max(size.bit_length() - 1 - _POWER2_FIRST, 0)
        return self.config.power2_divisions[min(index, _POWER2_INTERVALS - 1)]

    @staticmethod
    def segment_size(size: int) -> int:
        """``get_allocation_size``: the segment ``cudaMalloc`` is asked for when no cached block fits."""
        if size <= SMALL:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:  # kLargeBuffer
            return LARGE_BUFFER
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def _max_split(self) -> int:
        return self.config.max_split if self.config.max_split is not None else 1 << 64

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= MIN_BLOCK
        return size < self._max_split() and remaining > SMALL

    def _take_free(self, size: int, small: bool) -> Block | None:
        """``get_free_block``: the smallest cached block of the pool that fits (lowest address first)."""
        pool = self._free[small]
        k = bisect.bisect_left(pool, (size, -1))
        if k == len(pool):
            return None
        block = pool[k][2]
        max_split = self._max_split()
        if size < max_split and block.size >= max_split:  # no oversize block for a small request
            return None
        if size >= max_split and block.size >= size + self.config.non_split_rounding:
            return None
        del pool[k]
        return block

    def _insert_free(self, block: Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.address, block))

    def _remove_free(self, block: Block) -> None:
        pool = self._free[block.small]
        k = bisect.bisect_left(pool, (block.size, block.address))
        if k == len(pool) or pool[k][2] is not block:
            raise ValueError(f"a free block of {block.size} B at {block.address} is not in its pool")
        del pool[k]

    # --- malloc and free -------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        """Allocate ``nbytes`` (a tensor's storage or a kernel's buffer); returns its block."""
        size = self.round_size(nbytes)
        small = size <= SMALL
        block = self._take_free(size, small)
        if block is None:  # a new segment
            grant = self.segment_size(size)
            block = Block(self._next_address, grant, len(self.segments), small)
            self.segments.append((self._next_address, grant, small))
            # cudaMalloc's addresses, in order; 2 MiB apart at least, as the driver aligns segments
            self._next_address += -(-grant // ROUND_LARGE) * ROUND_LARGE
            self.reserved += grant
            self._blocks.add(block)
            self.max_reserved = max(self.max_reserved, self.reserved)
        if self._should_split(block, size):  # the request takes the front, the rest stays cached
            rest = Block(block.address + size, block.size - size, block.segment, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._blocks.add(rest)
            self._insert_free(rest)
        block.allocated, block.requested = True, nbytes
        self.allocated += block.size
        self.requested += nbytes
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_requested = max(self.max_requested, self.requested)
        return block

    def free(self, block: Block) -> None:
        """Give ``block`` back: it merges with its free neighbours and returns to its pool."""
        if not block.allocated:
            raise ValueError("block freed twice")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        for other in (block.prev, block.next):
            if other is None or other.allocated:
                continue
            self._remove_free(other)
            self._blocks.discard(other)
            if other is block.prev:
                block.address, block.prev = other.address, other.prev
                if other.prev is not None:
                    other.prev.next = block
            else:
                block.next = other.next
                if other.next is not None:
                    other.next.prev = block
            block.size += other.size
        self._insert_free(block)

    def blocks(self) -> list[Block]:
        """Every block of every segment, by address (a snapshot's ``segments``)."""
        return sorted(self._blocks, key=lambda b: b.address)


def _next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` rounded up to the next of ``divisions`` equal steps
    between the powers of two around it."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def replay(events: Iterable[tuple], config: AllocatorConfig | None = None,
           allocator: CachingAllocator | None = None, release: bool = False) -> CachingAllocator:
    """Run ``events`` - ``("alloc" | "free", what, bytes)`` in order, ``what`` naming the buffer -
    through a caching allocator (a fresh one unless ``allocator`` is given, whose cache then carries
    on); returns it, its ``max_reserved`` and ``max_allocated`` the run's. ``release``: free what is
    still allocated at the end (the run's outputs, dropped by the caller), newest first. A request
    of 0 bytes takes no block, as in CUDA.

    >>> replay([("alloc", "x", 3 << 20), ("free", "x", 3 << 20), ("alloc", "y", 1 << 20)]).max_reserved
    23068672
    """
    a = allocator or CachingAllocator(config)
    live: dict = {}
    for action, what, nbytes, *_ in events:
        if action == "alloc":
            if what in live:
                raise ValueError(f"{what!r} allocated twice")
            live[what] = a.malloc(int(nbytes)) if nbytes > 0 else None
        elif action == "free":
            block = live.pop(what)
            if block is not None:
                a.free(block)
    if release:
        for block in reversed(list(live.values())):
            if block is not None:
                a.free(block)
    return a


def moved_order(storages: list) -> list:
    """The resident storages in the order they reach the device: parameters and buffers as
    ``model.to("cuda")`` moves them (``Module._apply``: a module's children first, then its own
    parameters, then its own buffers), then inputs and other tensors in the recording's order."""
    from ..records import Role
    moved = [s for s in storages if s.step is None and s.role in (Role.PARAMETER, Role.BUFFER)]
    first: dict[tuple, int] = {}  # a module's path -> where it first appears (registration order)
    for k, s in enumerate(moved):
        path = tuple(s.name.split(".")[:-1])
        for depth in range(len(path) + 1):
            first.setdefault(path[:depth], k)

    def key(item: tuple) -> tuple:
        k, s = item
        path = tuple(s.name.split(".")[:-1])
        # post-order: along the path each module's place among its siblings; then, after all of the
        # module's children (whose next entry is a place, smaller than the infinity), its own tensors
        return (*[first[path[:d]] for d in range(1, len(path) + 1)], float("inf"), s.role != Role.PARAMETER, k)

    ordered = [s for _, s in sorted(enumerate(moved), key=key)]
    rest = [s for s in storages if s.step is None and s not in moved and s.role != Role.OPTIMIZER_STATE]
    return ordered + rest


def predicted_reserved(rec, events: list, forward: int, sizes: list, training: bool,
                       config: AllocatorConfig) -> dict:
    """``reserved`` (and ``train_reserved`` for a training step): the most the caching allocator
    reserves in a fresh process that moves the resident tensors to the device (:func:`moved_order`)
    and then runs forwards - or training steps, the first one making the optimizer's state when its
    ``step()`` begins, as torch.optim does - until the cache stops growing (bytes).

    ``events`` are :meth:`~fxmem.accounting.plan.MemoryPlan.trace`'s with ``raw=True`` (requested
    bytes), ``forward`` how many of them the forward made, ``sizes`` each storage's requested bytes.
    """
    from ..records import Phase, Role
    resident = moved_order(rec.storages)
    state = [s for s in rec.storages if s.step is None and s.role == Role.OPTIMIZER_STATE]

    def run(first: list, again: list) -> int:
        a = CachingAllocator(config)
        for s in resident:
            if sizes[s.index] > 0:
                a.malloc(sizes[s.index])
        replay(first, allocator=a, release=True)
        for _ in range(8):  # steady state: a run that reserves nothing new
            before = a.max_reserved
            replay(again, allocator=a, release=True)
            if a.max_reserved == before:
                break
        return a.max_reserved

    out = {"reserved": run(events[:forward], events[:forward])}
    if training:
        steps = rec.steps
        at = next((k for k, e in enumerate(events) if e[3] is not None and steps[e[3]].phase == Phase.STEP),
                  len(events))
        made = [("alloc", ("state", s.index), sizes[s.index], None) for s in state]
        out["train_reserved"] = run(events[:at] + made + events[at:], events)
    return out
