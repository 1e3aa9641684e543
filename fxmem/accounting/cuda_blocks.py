"""How the CUDA caching allocator's blocks can exceed the tensors' own 512-byte blocks (bytes).

fxmem's CUDA numbers count each storage (and each kernel's scratch) as its own block rounded up to
512 B - what ``torch.cuda.max_memory_allocated`` counts when every block is cut to the request.
PyTorch's caching allocator does not always cut: a request over 1 MiB (the large pool) served from a
cached block is split only when *more* than 1 MiB would remain, and a fresh segment of 10 MiB or
more is rounded to 2 MiB and kept whole under the same rule - the allocator then counts the whole
block (``should_split`` in c10/cuda/CUDACachingAllocator.cpp; measured on an H100: 13.5 MiB fresh
counts 14 MiB, 2.5 MiB into a freed 3 MiB block counts 3 MiB, see
``benchmarks/results/cuda_kernels.md``). Which cached block a request meets depends on the
process's history, so fxmem gives the most it can add: ``allocator_slack`` in an evaluation.

``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) changes the rule: ``expandable_segments:True``
always splits (no slack); ``max_split_size_mb:N`` never splits blocks of N MiB or more and may hand a
request a cached block up to 20 MiB larger; ``roundup_power2_divisions`` rounds requests to powers of
two (not to 512 B), which fxmem does not model.

>>> block_slack(3 * 2**20, AllocatorConfig())        # a 3 MiB tensor may count up to 1 MiB more
1048576
>>> block_slack(3 * 2**20, AllocatorConfig(expandable=True))
0
"""
from __future__ import annotations

import dataclasses
import os

from ..errors import DeviceError

SMALL = 1 << 20  # kSmallSize: requests up to 1 MiB use the small pool, split to 512 B
LARGE_BUFFER = 20 << 20  # kLargeBuffer: an oversize block may be this much larger than the request


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) that change what it counts
    and reserves; read once per analysis and handed to what needs it. Bytes throughout."""

    expandable: bool = False
    max_split: int | None = None  # max_split_size_mb, in bytes
    # roundup_power2_divisions: the divisions of each of the 16 power-of-two intervals from 1 MiB
    # (one number given: all of them); None when not set
    power2_divisions: tuple | None = None
    non_split_rounding: int = LARGE_BUFFER  # max_non_split_rounding_mb, in bytes
    unreplayable: str = ""  # a setting the replay of the allocator does not model (why, for the refusal)

    @property
    def power2_rounding(self) -> bool:
        return self.power2_divisions is not None

    @classmethod
    def from_environment(cls) -> "AllocatorConfig":
        """Read ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` (``key:value`` pairs, commas between)."""
        text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
        return cls.parse(text)

    @classmethod
    def parse(cls, text: str) -> "AllocatorConfig":
        """The settings in ``text``, as ``PYTORCH_CUDA_ALLOC_CONF`` spells them."""
        expandable, max_split, divisions, rounding, unreplayable = False, None, None, LARGE_BUFFER, []
        if "[" in text:  # roundup_power2_divisions:[256:1,512:2,>:4] - its commas are not separators
            unreplayable.append("roundup_power2_divisions given as a list of intervals")
            text = text[:text.index("[")] + text[text.rfind("]") + 1:]
        for item in text.split(","):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            try:
                if key == "expandable_segments":
                    expandable = value.lower() == "true"
                elif key == "max_split_size_mb":
                    max_split = int(float(value) * 2**20)
                elif key == "max_non_split_rounding_mb":
                    rounding = int(float(value) * 2**20)
                elif key == "roundup_power2_divisions" and value:
                    divisions = (int(value),) * 16
                elif key == "garbage_collection_threshold":
                    unreplayable.append("garbage_collection_threshold (it acts near a memory fraction's limit)")
            except ValueError:
                unreplayable.append(f"{key}:{value} (not a number)")
        if expandable:
            unreplayable.append("expandable_segments:True (segments that grow by mapping pages)")
        return cls(expandable, max_split, divisions, rounding, "; ".join(unreplayable))

    def check_replayable(self) -> None:
        """Refuse the settings :mod:`~fxmem.accounting.caching_allocator` does not replay."""
        if self.unreplayable:
            raise DeviceError(f"PYTORCH_CUDA_ALLOC_CONF sets {self.unreplayable}: fxmem's replay of the caching "
                              f"allocator does not model it, so it gives no reserved memory; the allocated "
                              f"numbers still hold. Unset it to see the default allocator's reserved memory.")


def block_slack(nbytes: int, config: AllocatorConfig) -> int:
    """The most the allocator can count beyond a ``nbytes`` block (already rounded to 512 B)."""
    if nbytes <= SMALL or config.expandable:
        return 0
    if config.max_split is not None and nbytes >= config.max_split:
        return config.non_split_rounding
    return SMALL


def note(config: AllocatorConfig) -> str:
    """What a CUDA report says about the allocator's blocks (one sentence)."""
    if config.expandable:
        return ("CUDA: numbers are the tensors' 512-byte allocator blocks; with expandable_segments:True the caching "
                "allocator splits every block, so max_memory_allocated counts the same")
    return ("CUDA: numbers are the tensors' 512-byte allocator blocks; the default caching allocator may hand a "
            "request over 1 MiB a cached block up to 1 MiB larger and count all of it, so max_memory_allocated can be "
            "higher by evaluate()'s allocator_slack at most (none with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); evaluate()'s reserved is the allocator's segments in a "
            "fresh process running this model alone (train_reserved: the optimizer's state made as its first step() "
            "begins, as Adam and AdamW make it)")
